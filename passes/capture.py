"""Capture a model as an ATen training-IR graph with torch.export.

``torch.fx.symbolic_trace`` cannot trace current Hugging Face models; ``torch.export`` can, and keeps
the parameter FQNs (``graph_signature``) and module provenance (``nn_module_stack``) that later passes
use. The model may live on the meta device: export runs on fake tensors either way.
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from functools import partial
from typing import Any

import torch
import torch.fx as fx
from torch.fx._lazy_graph_module import _LazyGraphModule
from torch.export.graph_signature import InputKind, OutputKind

from autopar.errors import CaptureError
from autopar.passes.meta import Role, set_meta
from autopar.passes.unroll import unrolled_capture


@dataclass
class CapturedProgram:
    """A captured training step's forward, plus what is needed to call it like the model."""

    gm: fx.GraphModule
    in_spec: Any                  # pytree spec of (args, kwargs)
    out_spec: Any                 # pytree spec of the user outputs
    params: dict[str, str]        # placeholder name -> parameter FQN
    buffers: dict[str, str]       # placeholder name -> buffer FQN
    constants: dict[str, str]     # placeholder name -> lifted constant name
    inputs: list[str]             # placeholder names of the user inputs, in flattened order
    constant_values: dict[str, torch.Tensor]
    model_class: str
    input_shapes: tuple           # shapes of the flattened user inputs (None for non-tensors)
    unrolled: str | None = None   # the layer stack built from 2- and 3-layer exports (passes/unroll.py)

    def placeholder(self, name: str) -> fx.Node:
        for n in self.gm.graph.nodes:
            if n.op == "placeholder" and n.name == name:
                return n
        raise KeyError(name)


def _model_device(model: torch.nn.Module) -> torch.device | None:
    return next((t.device for t in (*model.parameters(), *model.buffers())), None)


def capture(model: torch.nn.Module, example_inputs=(), example_kwargs=None, *, unroll: bool = True
            ) -> CapturedProgram:
    """Export ``model(*example_inputs, **example_kwargs)`` to an fx graph with fake values. With
    ``unroll``, a model whose layers are a repeated stack is exported with 2 and 3 of its layers and
    the program of all of them built from those (passes/unroll.py), the same program a whole export
    gives; any other model, or one whose layers differ, is exported whole."""
    example_kwargs = dict(example_kwargs or {})
    if not isinstance(example_inputs, (tuple, list)):
        example_inputs = (example_inputs,)
    example_inputs, example_kwargs = _distinct_inputs(example_inputs, example_kwargs)
    # Example inputs only describe shapes: they follow the model's device (meta included), so a
    # model still on the CPU or the meta device captures with a batch already on the GPU.
    device = torch.device("meta") if any(p.is_meta for p in model.parameters()) else _model_device(model)
    if device is not None:
        example_inputs, example_kwargs = torch.utils._pytree.tree_map_only(
            torch.Tensor, lambda x: x.to(device), (tuple(example_inputs), example_kwargs))
    export = partial(_export, example_inputs=tuple(example_inputs), example_kwargs=example_kwargs)
    captured = (unroll and unrolled_capture(model, export)) or export(model)
    _merge_tied_parameters(model, captured.gm.graph, captured.params)
    return captured


def _export(model: torch.nn.Module, example_inputs: tuple, example_kwargs: dict) -> CapturedProgram:
    """torch.export of the model, its tied parameters not merged yet."""
    try:
        ep = torch.export.export(model, example_inputs, example_kwargs, strict=False)
    except Exception as e:
        hint = ""
        if "DynamicCache" in str(e) or "Cache" in type(e).__name__:
            hint = " Hugging Face causal LMs must not return their KV cache: set config.use_cache=False."
        raise CaptureError(f"torch.export could not capture {type(model).__name__}: {e}.{hint}") from e

    sig = ep.graph_signature
    params, buffers, constants, inputs = {}, {}, {}, []
    placeholders = [n for n in ep.graph.nodes if n.op == "placeholder"]
    for node, spec in zip(placeholders, sig.input_specs):
        if spec.kind == InputKind.PARAMETER:
            params[node.name] = spec.target
            set_meta(node, role=Role("param", spec.target))
        elif spec.kind == InputKind.BUFFER:
            buffers[node.name] = spec.target
            set_meta(node, role=Role("buffer", spec.target))
        elif spec.kind in (InputKind.CONSTANT_TENSOR, InputKind.CUSTOM_OBJ):
            constants[node.name] = spec.target
            set_meta(node, role=Role("constant", spec.target))
        else:
            inputs.append(node.name)
            set_meta(node, role=Role("input", node.name))
    for spec in sig.output_specs:
        if spec.kind != OutputKind.USER_OUTPUT:
            raise CaptureError(f"{type(model).__name__} mutates state in forward ({spec.kind.name} "
                               f"{spec.target}); autopar captures pure training steps only")
    flat_inputs = torch.utils._pytree.tree_leaves((example_inputs, example_kwargs))
    return CapturedProgram(
        gm=ep.graph_module,
        in_spec=ep.call_spec.in_spec,
        out_spec=ep.call_spec.out_spec,
        params=params,
        buffers=buffers,
        constants=constants,
        inputs=inputs,
        constant_values=dict(ep.constants),
        model_class=type(model).__qualname__,
        input_shapes=tuple(tuple(x.shape) if isinstance(x, torch.Tensor) else None for x in flat_inputs),
    )


def _merge_tied_parameters(model, graph, params):
    """Point every use of a tied parameter at one placeholder named by its canonical FQN.

    export lifts ``lm_head.weight`` and ``transformer.wte.weight`` as two placeholders even when they
    are one tensor; two placeholders would get two layouts and two separate gradients.
    """
    canonical = {}
    for fqn, p in model.named_parameters(remove_duplicate=False):
        canonical.setdefault(id(p), fqn)
    fqn_to_canonical = {fqn: canonical[id(p)] for fqn, p in model.named_parameters(remove_duplicate=False)}
    keep = {}
    for node in [n for n in graph.nodes if n.op == "placeholder" and n.name in params]:
        target = fqn_to_canonical.get(params[node.name], params[node.name])
        if target in keep:
            node.replace_all_uses_with(keep[target])
            graph.erase_node(node)
            del params[node.name]
        else:
            keep[target] = node
            params[node.name] = target
            set_meta(node, role=Role("param", target))


def _distinct_inputs(args, kwargs):
    """The example inputs with every repeated tensor object replaced by a copy.

    export folds two arguments that are one tensor object into one placeholder, which would tie
    ``labels`` to ``input_ids`` in the plan; Hugging Face's own examples pass ``labels=input_ids``.
    The examples only describe shapes, so a copy keeps the two arguments apart at no cost to the user."""
    seen = set()

    def distinct(x):
        if isinstance(x, torch.Tensor):
            if id(x) in seen:
                return x.clone()
            seen.add(id(x))
        return x

    return torch.utils._pytree.tree_map(distinct, (tuple(args), kwargs))


class _Differs(Exception):
    """Two captures at different batch sizes are not the same program up to batch-sized integers."""


def batch_of(cap: CapturedProgram) -> int | None:
    """The batch size a program was captured at: dim 0 of its first input, None without one."""
    shape = cap.input_shapes[0] if cap.input_shapes else None
    return shape[0] if shape else None


def copy_program(cap: CapturedProgram) -> CapturedProgram:
    """A copy of ``cap`` whose graph later passes can change without changing ``cap``'s."""
    return dataclasses.replace(cap, gm=_rebatched_module(cap.gm, cap.gm, 1, 1, 1))


def rebatch(base: CapturedProgram, other: CapturedProgram, example_inputs=(), example_kwargs=None
            ) -> CapturedProgram | None:
    """The program ``capture`` would give at ``example_inputs``'s batch, derived from two captures of
    the same model at other batch sizes (``base`` and ``other``, their batches dim 0 of their first
    input) instead of exporting again; None when the two captures are not one program whose integers
    are proportional to the batch (a model that branches on its batch size), or when a batch is 1, so
    the caller captures.

    Every node, name, op and argument must agree between the two; an integer that differs must be the
    same multiple of the batch in both (a view's ``batch * seq``, an ``arange(batch)``), and is that
    multiple of the new batch here. The values' shapes are then propagated again with fake tensors, so
    a derived program is checked by the ops' own meta functions."""
    example_kwargs = dict(example_kwargs or {})
    if not isinstance(example_inputs, (tuple, list)):
        example_inputs = (example_inputs,)
    flat = torch.utils._pytree.tree_leaves((tuple(example_inputs), example_kwargs))
    shapes = tuple(tuple(x.shape) if isinstance(x, torch.Tensor) else None for x in flat)
    batches = [batch_of(base), batch_of(other), shapes[0][0] if shapes and shapes[0] else None]
    # export specializes sizes of 1 (a batch of one captures without some expands and copies), as
    # torch's symbolic shapes do: only batches of 2 or more are one program.
    if None in batches or min(batches) < 2 or batches[0] == batches[1] or len(shapes) != len(base.input_shapes) \
            or base.in_spec != other.in_spec or base.out_spec != other.out_spec:
        return None
    for b, o, s in zip(base.input_shapes, other.input_shapes, shapes):
        if b is None or s is None:
            if b != s or o != s:
                return None
        elif len(b) != len(s) or len(o) != len(s) or b[1:] != s[1:] or o[1:] != s[1:]:
            return None
    try:
        gm = _rebatched_module(base.gm, other.gm, *batches)
    except _Differs:
        return None
    inputs = dict(zip(base.inputs, shapes))
    vals = []
    for n in gm.graph.nodes:
        if n.op != "placeholder":
            continue
        v = n.meta["val"]
        if n.name in inputs and isinstance(v, torch.Tensor):
            with v.fake_mode:
                v = torch.empty(inputs[n.name], dtype=v.dtype, device=v.device)
        vals.append(v)
    fake_mode = next(v.fake_mode for v in vals if isinstance(v, torch.Tensor))
    try:
        from torch.fx.passes.fake_tensor_prop import FakeTensorProp

        FakeTensorProp(gm, fake_mode).propagate_dont_convert_inputs(*vals)
    except Exception:          # the integers were not all the batch's: capture at this batch instead
        return None
    return dataclasses.replace(base, gm=gm, input_shapes=shapes)


def _rebatched_module(base: fx.GraphModule, other: fx.GraphModule, b0: int, b1: int, b: int) -> fx.GraphModule:
    base_nodes, other_nodes = list(base.graph.nodes), list(other.graph.nodes)
    if len(base_nodes) != len(other_nodes):
        raise _Differs
    graph, env, attrs = fx.Graph(), {}, {}

    def same(x, y):
        if isinstance(x, fx.Node):
            if not isinstance(y, fx.Node) or x.name != y.name:
                raise _Differs
            return env[x]
        if type(x) is not type(y):
            raise _Differs
        if isinstance(x, (list, tuple)):
            if len(x) != len(y):
                raise _Differs
            out = [same(a, c) for a, c in zip(x, y)]
            return type(x)(out) if not hasattr(x, "_fields") else type(x)(*out)
        if isinstance(x, dict):
            if x.keys() != y.keys():
                raise _Differs
            return {k: same(x[k], y[k]) for k in x}
        if isinstance(x, int) and not isinstance(x, bool) and x != y:
            # The same multiple of the batch in both captures, and a whole one of the new batch.
            if x * b1 != y * b0 or (x * b) % b0:
                raise _Differs
            return x * b // b0
        if x != y:
            raise _Differs
        return x

    for n, o in zip(base_nodes, other_nodes):
        if n.op != o.op or n.name != o.name or n.target != o.target:
            raise _Differs
        if n.op == "get_attr":
            sub, sub_o = getattr(base, n.target), getattr(other, o.target)
            attrs[n.target] = (_rebatched_module(sub, sub_o, b0, b1, b) if isinstance(sub, fx.GraphModule)
                               else sub)
        new = graph.node_copy(n, lambda x: env[x])
        new.args, new.kwargs = same(n.args, o.args), same(n.kwargs, o.kwargs)
        env[n] = new
    graph._codegen = base.graph._codegen
    # Lazy: the planner reads the graph and never runs it; the code is generated at the first call.
    gm = _LazyGraphModule(attrs, graph, class_name=type(base).__name__)
    gm.meta.update(base.meta)
    return gm
