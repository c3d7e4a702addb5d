"""Capture a model whose layers are a repeated stack without exporting every layer.

torch.export's time grows with the number of layers (about 3.5 s for LLaMA-3-8B's 32, 10 s for
LLaMA-2-70B's 80 on a 2-core machine). A stack of same-class layers (an ``nn.ModuleList``, as every
Hugging Face decoder and encoder has) runs the same ops in every layer, so the model is exported with
its stack cut to 2 and to 3 layers, and the whole program is the 2-layer one with its second layer's
block repeated: each copy's parameters, buffers, node names and module paths renamed as export names
them (a run of digits that differs between the first two layers, a layer index or a name's counter,
advances by that difference per layer; the nodes after the stack move their name counters on by
what one layer adds). The rule is checked first: repeated once, it must give the 3-layer export
exactly (nodes, names, targets, arguments, shapes and strides, module stacks, stack traces and the
signature), and the full model's parameters must come out in the order export lifts them.

A model where the rule may not hold is exported whole, and the log says why: no stack of 4 or more
same-class layers, layers whose parameter shapes or plain attributes differ (a sliding-window layer
among global ones, per-layer sizes, ``config.layer_types`` that vary), or a 3-layer export that is
not the 2-layer one with one more block (behaviour that depends on the layer index, state carried
from one layer to the next). Attributes equal to their layer's index (``layer_idx``) are allowed:
what a layer computes from its index shows in the 3-layer check. What that check cannot see is a
layer that branches on its index with a period longer than 3 without storing the outcome in an
attribute; such a model must be captured with ``unroll=False``.
"""
from __future__ import annotations

import contextlib
import dataclasses
import logging
import re
import weakref
from typing import Callable

import torch
import torch.fx as fx
from torch.fx._lazy_graph_module import _LazyGraphModule

from autopar.errors import CaptureError
from autopar.passes.meta import Role, meta_of, set_meta

log = logging.getLogger("autopar.capture")

MIN_LAYERS = 4            # a shorter stack is exported whole: cutting it saves nothing
_DIGITS = re.compile(r"(\d+)")
_COUNTER = re.compile(r"^(.*)_(\d+)$")
_PLAIN = (int, float, str, bool, type(None))


class _Differs(Exception):
    """The 3-layer export is not the 2-layer one with one more layer block."""


def stack_of(model: torch.nn.Module) -> tuple[str | None, str]:
    """The FQN of the model's repeated stack to unroll (the largest ``nn.ModuleList`` of
    ``MIN_LAYERS`` or more layers of one class whose parameters, buffers and plain attributes agree),
    or None and why not."""
    best, why = None, f"no nn.ModuleList of {MIN_LAYERS} or more layers of one class"
    for fqn, mod in model.named_modules():
        if not isinstance(mod, torch.nn.ModuleList) or len(mod) < MIN_LAYERS:
            continue
        layers = list(mod)
        if len({type(m) for m in layers}) != 1:
            continue
        differs = next((d for i, m in enumerate(layers[1:], 1) if (d := _layer_difference(layers[0], m, i))), None)
        if differs:
            why = f"the layers of {fqn} differ: {differs}"
            continue
        if best is None or _size(mod) > _size(best[1]):
            best = (fqn, mod)
    if best is None:
        return None, why
    varying = _varying_config(model, len(best[1]))
    if varying:
        return None, f"config.{varying} differs between the layers of {best[0]}"
    return best[0], ""


def _size(mod) -> int:
    return sum(p.numel() for p in mod.parameters())


def _layer_difference(first: torch.nn.Module, other: torch.nn.Module, index: int) -> str | None:
    """How layer ``index`` differs from layer 0 in what the graph check cannot see, or None."""
    a, b = dict(first.named_modules()), dict(other.named_modules())
    if a.keys() != b.keys():
        return f"layer {index} has other submodules"
    for name, m in a.items():
        o = b[name]
        if type(m) is not type(o):
            return f"{name or 'the layer'} is a {type(o).__name__} in layer {index}"
        for kind in ("_parameters", "_buffers"):
            mine, theirs = getattr(m, kind), getattr(o, kind)
            if mine.keys() != theirs.keys() or any(
                    (x is None) != (y is None) or (x is not None and (x.shape != y.shape or x.dtype != y.dtype))
                    for x, y in zip(mine.values(), theirs.values())):
                return f"{name or 'the layer'}'s {kind[1:]} differ in layer {index}"
        for attr, v in vars(m).items():
            w = vars(o).get(attr)
            if attr.startswith("_") or not _is_plain(v):
                continue
            if v != w and not (type(v) is int and v == 0 and w == index):   # a layer index: the graph check sees its use
                return f"{name + '.' if name else ''}{attr} is {v!r} in layer 0 and {w!r} in layer {index}"
    return None


def _is_plain(v) -> bool:
    return isinstance(v, _PLAIN) or (isinstance(v, (tuple, list)) and all(isinstance(x, _PLAIN) for x in v))


def _varying_config(model, n: int) -> str | None:
    """A per-layer list in the model's config (Hugging Face's ``layer_types``) whose entries differ."""
    config = getattr(model, "config", None)
    for attr, v in (vars(config).items() if config is not None and hasattr(config, "__dict__") else ()):
        if isinstance(v, (list, tuple)) and len(v) == n and any(x != v[0] for x in v):
            return attr
    return None


@contextlib.contextmanager
def _cut(model: torch.nn.Module, fqn: str, k: int):
    """The model with the stack at ``fqn`` holding only its first ``k`` layers."""
    parent_name, _, name = fqn.rpartition(".")
    parent = model.get_submodule(parent_name)
    whole = parent._modules[name]
    parent._modules[name] = torch.nn.ModuleList(list(whole)[:k])
    try:
        yield
    finally:
        parent._modules[name] = whole


def unrolled_capture(model: torch.nn.Module, export: Callable[[torch.nn.Module], "CapturedProgram"]):
    """The capture of ``model`` built from ``export`` of it with its stack cut to 2 and 3 layers, or
    None (with the reason logged) when the model must be exported whole. ``export`` returns a
    ``CapturedProgram`` whose tied parameters are not merged yet."""
    fqn, why = stack_of(model)
    if fqn is None:
        log.info("capture: exporting every layer of %s (%s)", type(model).__name__, why)
        return None
    n = len(model.get_submodule(fqn))
    checked = _CHECKED.get(model)
    try:
        with _cut(model, fqn, 2):
            two = export(model)
        if checked is not None and checked[0] == fqn:
            # Checked at an earlier capture (other input shapes): what a layer adds does not change.
            with contextlib.suppress(_Differs):
                whole = _unroll(two, fqn, n, checked[1])
                if _lifted_as_export(whole, model):
                    log.info("capture: %s's %d layers of %s unrolled from an export of 2 (checked before)",
                             type(model).__name__, n, fqn)
                    return dataclasses.replace(whole, unrolled=fqn)
        with _cut(model, fqn, 3):
            three = export(model)
    except CaptureError as e:            # the whole export reports the model's own error
        log.info("capture: exporting every layer of %s: a cut stack does not export (%s)", type(model).__name__, e)
        return None
    try:
        fn_steps = _suffix_fn_steps(two, three, fqn)
        diff = same_program(_unroll(two, fqn, 3, fn_steps), three)
        if diff is None:
            whole = _unroll(two, fqn, n, fn_steps)
            if not _lifted_as_export(whole, model):
                diff = "the parameters and buffers would not come out as export lifts them"
    except _Differs as e:
        diff = str(e) or "the 2-layer export's layers cannot be told apart"
    if diff is not None:
        log.info("capture: exporting every layer of %s: the 3-layer export is not the 2-layer one with one "
                 "more layer of %s (%s)", type(model).__name__, fqn, diff)
        return None
    _CHECKED[model] = (fqn, fn_steps)
    log.info("capture: %s's %d layers of %s unrolled from exports of 2 and 3", type(model).__name__, n, fqn)
    return dataclasses.replace(whole, unrolled=fqn)


# model -> (its stack, how far a layer moves export's torch_fn counters after it) once the rule held.
_CHECKED: "weakref.WeakKeyDictionary[torch.nn.Module, tuple]" = weakref.WeakKeyDictionary()


def _lifted_as_export(program: "CapturedProgram", model: torch.nn.Module) -> bool:
    """Whether the program's parameters and buffers are the model's, in the order export lifts them."""
    return (list(program.params.values()) == [name for name, _ in model.named_parameters(remove_duplicate=False)]
            and list(program.buffers.values()) == [name for name, _ in model.named_buffers(remove_duplicate=False)])


def _layer_index(path: str, stack: str) -> int | None:
    """The layer of the stack a parameter's or module's path lies in."""
    if path.startswith(stack + "."):
        rest = path[len(stack) + 1:].split(".", 1)[0]
        if rest.isdigit():
            return int(rest)
    return None


def _op_layer(node: fx.Node, stack: str) -> int | None:
    """The layer of the stack an op runs in, from the module path export records."""
    for path, _ in (node.meta.get("nn_module_stack") or {}).values():
        index = _layer_index(path or "", stack)
        if index is not None and path == f"{stack}.{index}":
            return index
    return None


class _Series:
    """A string at every layer from its values at two consecutive layers: every run of digits that
    differs between ``first`` (layer i) and ``second`` (layer i + 1), a layer index or a name's
    counter, advances by that difference per layer."""

    __slots__ = ("parts", "moving")

    def __init__(self, first: str, second: str):
        self.parts, self.moving = [second], []
        if first == second:
            return
        a, b = _DIGITS.split(first), _DIGITS.split(second)
        if len(a) != len(b):
            # A name's first use carries no counter ("mul"), its later uses do ("mul_5").
            a, b = _DIGITS.split(_counted(first)), _DIGITS.split(_counted(second))
        if len(a) != len(b) or a[0::2] != b[0::2]:
            raise _Differs(f"{first!r} and {second!r} are not one name at two layers")
        self.parts = b
        self.moving = [(i, int(y), int(y) - int(x)) for i, (x, y) in enumerate(zip(a, b)) if i % 2 and x != y]

    def at(self, steps: int) -> str:
        """The string ``steps`` layers after ``second``'s."""
        if not self.moving:
            return self.parts[0]
        parts = list(self.parts)
        for i, value, step in self.moving:
            parts[i] = str(value + steps * step)
        return "".join(parts)


def _meta_series(first: dict, second: dict):
    """``second``'s node meta as a function of how many layers on (``first`` is the layer before)."""
    if first.keys() != second.keys():
        raise _Differs("two layers' nodes carry different metadata")
    moving = []
    for key, v in second.items():
        u = first[key]
        if key == "nn_module_stack":
            if len(u) != len(v):
                raise _Differs("two layers' nodes have different module stacks")
            stack = [(_Series(ku, kv), *(_Series(x, y) for x, y in zip(tu, tv)))
                     for (ku, tu), (kv, tv) in zip(u.items(), v.items())]
            moving.append((key, lambda k, stack=stack: {s[0].at(k): tuple(x.at(k) for x in s[1:]) for s in stack}))
        elif isinstance(v, str) and u != v:
            moving.append((key, _Series(u, v).at))
        elif key == "torch_fn" and v and u != v:
            moving.append((key, lambda k, name=_Series(u[0], v[0]), fn=v[1]: (name.at(k), fn)))

    def at(steps: int) -> dict:
        meta = dict(second)
        for key, f in moving:
            meta[key] = f(steps)
        return meta
    return at


def _counted(name: str) -> str:
    return name if _COUNTER.match(name) else name + "_0"


def _base(name: str) -> str:
    m = _COUNTER.match(name)
    return m.group(1) if m else name


def _counter(name: str) -> int:
    m = _COUNTER.match(name)
    return int(m.group(2)) if m else 0


def _steps(pairs) -> dict[str, int]:
    """How far one layer moves each name counter on: (layer-1 name, layer-0 name) pairs -> base -> step."""
    steps: dict[str, int] = {}
    for second, first in pairs:
        base = _base(second)
        if _base(first) == base and steps.setdefault(base, _counter(second) - _counter(first)) != \
                _counter(second) - _counter(first):
            raise _Differs(f"the counter of {base!r} does not move on evenly from layer 0 to layer 1")
    return steps


def _shifted(name: str, per_layer: dict[str, int], layers: int) -> str:
    """A name after the stack, its counter moved on by what ``layers`` more layers add to it."""
    base = _base(name)
    if not per_layer.get(base):
        return name
    return f"{base}_{_counter(name) + layers * per_layer[base]}"


def _blocks(two: "CapturedProgram", stack: str) -> tuple[list, list, list]:
    """The 2-layer program's ops, and those of its two layers: from a layer's first op up to the
    next layer's first op (ops of the parent module run between two layers belong to the first); the
    last block is as long as the first."""
    ops = _ops(two)
    if any(x.op == "get_attr" for x in ops):
        raise _Differs("the program holds submodules (get_attr)")
    tags = [_op_layer(x, stack) for x in ops]
    if 0 not in tags or 1 not in tags:
        raise _Differs(f"no ops are recorded inside {stack}.0 and {stack}.1")
    first0, first1 = tags.index(0), tags.index(1)
    length = first1 - first0
    block0, block1 = ops[first0:first1], ops[first1:first1 + length]
    rest = tags[first1 + length:]
    if len(block1) != length or 1 in rest or 0 in rest or any(t not in (0, None) for t in tags[first0:first1]) \
            or any(t not in (1, None) for t in tags[first1:first1 + length]):
        raise _Differs(f"the ops of {stack}.0 and {stack}.1 are not two blocks of one length")
    return ops, block0, block1


def _suffix_fn_steps(two: "CapturedProgram", three: "CapturedProgram", stack: str) -> dict[str, int]:
    """How far one layer moves on export's ``torch_fn`` counters of the ops after the stack. Those
    count torch calls that leave no node (a ``contiguous()`` of a contiguous tensor), so they are read
    from the 3-layer export against the 2-layer one, not from the nodes of a layer."""
    ops, _, block1 = _blocks(two, stack)
    after = len(ops) - ops.index(block1[-1]) - 1
    later = _ops(three)
    return _steps((t.meta["torch_fn"][0], r.meta["torch_fn"][0]) for t, r in
                  zip(later[len(later) - after:], ops[len(ops) - after:])
                  if t.meta.get("torch_fn") and r.meta.get("torch_fn"))


def _unroll(two: "CapturedProgram", stack: str, n: int, fn_steps: dict[str, int]) -> "CapturedProgram":
    """The program of ``n`` layers from the 2-layer one: its second layer's nodes repeated
    (``fn_steps``: ``_suffix_fn_steps``)."""
    gm = two.gm
    roles = {**two.params, **two.buffers}
    nodes = list(gm.graph.nodes)
    ops, block0, block1 = _blocks(two, stack)
    # Placeholders by layer, in runs (parameters, then buffers): layer 0's, then layer 1's.
    placeholders = [x for x in nodes if x.op == "placeholder"]
    template = dict(zip(block1, block0))          # layer-1 node -> its layer-0 counterpart
    run_ends: dict[fx.Node, list[fx.Node]] = {}   # a run's last placeholder -> its layer-1 members
    run: list[fx.Node] = []
    for x in placeholders + [None]:
        if x is not None and x.name in roles and _layer_index(roles[x.name], stack) is not None:
            run.append(x)
            continue
        if run:
            half = len(run) // 2
            if [_layer_index(roles[r.name], stack) for r in run] != [0] * half + [1] * half or len(run) != 2 * half:
                raise _Differs(f"the parameters and buffers of {stack}.0 and {stack}.1 do not pair up")
            template.update(zip(run[half:], run[:half]))
            run_ends[run[-1]] = run[half:]
            run = []
    layer0 = {v: k for k, v in template.items()}        # layer-0 node -> layer-1 node
    per_layer_names = _steps((t.name, r.name) for t, r in template.items())

    graph = fx.Graph()
    env: dict[fx.Node, fx.Node] = {}
    copies: dict[fx.Node, list] = {t: [None] * n for t in template}     # layer-1 node -> its node per layer

    def arg_of(a: fx.Node, j: int) -> fx.Node:
        """Template argument ``a`` as read by a node of layer ``j``."""
        if a in copies:
            return copies[a][j]
        if a in layer0:
            return copies[layer0[a]][j - 1]
        return env[a]

    def emit(src: fx.Node, name: str, j: int | None, meta: dict) -> fx.Node:
        lookup = (lambda a: env[a]) if j is None else (lambda a: arg_of(a, j))
        args, kwargs = fx.node.map_arg((src.args, src.kwargs), lookup)
        target = name if src.op == "placeholder" else src.target
        new = graph.create_node(src.op, target, args, kwargs, name=name, type_expr=src.type)
        if new.name != name:
            raise _Differs(f"node name {name!r} is taken")
        new.meta = meta
        return new

    def emit_layers(members: list[fx.Node], in_block: bool):
        series = [(t, _Series(template[t].name, t.name), _meta_series(template[t].meta, t.meta),
                   _Series(roles[template[t].name], roles[t.name]) if t.op == "placeholder" else None)
                  for t in members]
        for j in range(2, n):
            for t, name, meta, fqn in series:
                new = emit(t, name.at(j - 1), j if in_block else None, meta(j - 1))
                if fqn is not None:
                    set_meta(new, role=Role("param" if t.name in two.params else "buffer", fqn.at(j - 1)))
                copies[t][j] = new

    position = {x: i for i, x in enumerate(ops)}
    end = position[block1[-1]]
    for x in nodes:
        if x.op == "output" or (x.op != "placeholder" and position[x] > end):
            # After the stack: reads the last layer; its name counters move on by the added layers.
            meta = dict(x.meta)
            if meta.get("torch_fn"):
                meta["torch_fn"] = (_shifted(meta["torch_fn"][0], fn_steps, n - 2), meta["torch_fn"][1])
            name = x.name if x.op == "output" else _shifted(x.name, per_layer_names, n - 2)
            env[x] = emit(x, name, n - 1, meta)
        else:
            env[x] = emit(x, x.name, None, dict(x.meta))
            if x in copies:
                copies[x][1] = env[x]
            elif x in layer0:
                copies[layer0[x]][0] = env[x]
        if x in run_ends:
            emit_layers(run_ends[x], False)
        if x is block1[-1]:
            emit_layers(block1, True)
    graph._codegen = gm.graph._codegen
    # Lazy: the planner reads the graph and never runs it; the code is generated at the first call.
    out = _LazyGraphModule(gm, graph, class_name=type(gm).__name__)
    out.meta.update(gm.meta)
    params, buffers = {}, {}
    for x in graph.nodes:
        role = meta_of(x).role if x.op == "placeholder" else None
        if role is not None and role.kind in ("param", "buffer"):
            (params if role.kind == "param" else buffers)[x.name] = role.target
    return dataclasses.replace(two, gm=out, params=params, buffers=buffers)


def _ops(program: "CapturedProgram") -> list[fx.Node]:
    return [x for x in program.gm.graph.nodes if x.op not in ("placeholder", "output")]


def same_program(a: "CapturedProgram", b: "CapturedProgram") -> str | None:
    """The first difference between two captures, None when they are the same program: nodes in
    order (op, name, target, arguments, fake values' shapes, strides and dtypes, module stacks, stack
    traces, export's other node metadata and autopar's), the signature, the specs and the input shapes."""
    for field in ("params", "buffers", "constants", "inputs", "in_spec", "out_spec", "input_shapes", "model_class"):
        if getattr(a, field) != getattr(b, field):
            return f"their {field} differ"
    if a.constant_values.keys() != b.constant_values.keys():
        return "their lifted constants differ"
    na, nb = list(a.gm.graph.nodes), list(b.gm.graph.nodes)
    if len(na) != len(nb):
        return f"{len(na)} nodes against {len(nb)}"
    for x, y in zip(na, nb):
        if (x.op, x.name, x.target) != (y.op, y.name, y.target):
            return f"node {x.name} ({x.op} {x.target}) against {y.name} ({y.op} {y.target})"
        if _names(x.args) != _names(y.args) or _names(x.kwargs) != _names(y.kwargs):
            return f"node {x.name}'s arguments differ: {_names(x.args)} against {_names(y.args)}"
        if x.meta.keys() != y.meta.keys():
            return f"node {x.name}'s metadata keys differ: {sorted(x.meta)} against {sorted(y.meta)}"
        for key in x.meta:
            if not _same_value(x.meta[key], y.meta[key]):
                return f"node {x.name}'s {key} differs: {x.meta[key]} against {y.meta[key]}"
    return None


def _names(args):
    return fx.node.map_arg(args, lambda n: ("node", n.name))


def _same_value(u, v) -> bool:
    if isinstance(u, torch.Tensor) or isinstance(v, torch.Tensor):
        return (isinstance(u, torch.Tensor) and isinstance(v, torch.Tensor) and u.shape == v.shape
                and u.dtype == v.dtype and u.device == v.device and u.stride() == v.stride()
                and u.requires_grad == v.requires_grad)
    if isinstance(u, (list, tuple)) and isinstance(v, (list, tuple)):
        return type(u) is type(v) and len(u) == len(v) and all(_same_value(p, q) for p, q in zip(u, v))
    if isinstance(u, dict) and isinstance(v, dict):
        return u.keys() == v.keys() and all(_same_value(u[k], v[k]) for k in u)
    return u == v
