"""Capture a model as an ATen training-IR graph with torch.export.

``torch.fx.symbolic_trace`` cannot trace current Hugging Face models; ``torch.export`` can, and keeps
the parameter FQNs (``graph_signature``) and module provenance (``nn_module_stack``) that later passes
use. The model may live on the meta device: export runs on fake tensors either way.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
import torch.fx as fx
from torch.export.graph_signature import InputKind, OutputKind

from autopar.errors import CaptureError
from autopar.passes.meta import Role, set_meta


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

    def placeholder(self, name: str) -> fx.Node:
        for n in self.gm.graph.nodes:
            if n.op == "placeholder" and n.name == name:
                return n
        raise KeyError(name)


def _model_device(model: torch.nn.Module) -> torch.device | None:
    return next((t.device for t in (*model.parameters(), *model.buffers())), None)


def capture(model: torch.nn.Module, example_inputs=(), example_kwargs=None) -> CapturedProgram:
    """Export ``model(*example_inputs, **example_kwargs)`` to an fx graph with fake values."""
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
    try:
        ep = torch.export.export(model, tuple(example_inputs), example_kwargs, strict=False)
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
    _merge_tied_parameters(model, ep.graph, params)
    for spec in sig.output_specs:
        if spec.kind != OutputKind.USER_OUTPUT:
            raise CaptureError(f"{type(model).__name__} mutates state in forward ({spec.kind.name} "
                               f"{spec.target}); autopar captures pure training steps only")
    flat_inputs = torch.utils._pytree.tree_leaves((tuple(example_inputs), example_kwargs))
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
