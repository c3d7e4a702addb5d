"""Candidate layouts for every node: products of per-axis rule options over the mesh.

A strategy fixes the layout of each tensor input and each output of a node. Nodes with one tensor
input that can take every layout their producer may give without resharding (views, getitem,
unary pointwise ops) become *followers*: they get no decision of their own, and their strategy is a
function of the producer's. This keeps the solver's problem to the nodes where a choice matters. A
parameter's one follower is its bfloat16 copy, where that cast is its only reader
(``passes.precision.reads_through_copy``): the copy is made at the weight's layout.

Refused strategies (documented in docs/sharding.md): a dim that does not divide by the mesh axes that
shard it, and one tensor dim sharded by two mesh axes.
"""
from __future__ import annotations

import itertools
import operator
from dataclasses import dataclass, replace

import torch
import torch.fx as fx

from autopar.layout import R, S, divides, format_layout, local_shape
from autopar.passes.meta import is_param, meta_of, program_meta, set_meta, set_program_meta
from autopar.passes.precision import reads_through_copy
from autopar.passes.resharding import grad_partial_axes
from autopar.passes.rules import (AxisOption, TensorInfo, axis_options, context_for, output_infos)
from autopar.passes.runner import requires

Layout = tuple  # tuple[Placement, ...]


@dataclass(frozen=True)
class ZeroState:
    """How a parameter replicated along mesh axis ``axis`` keeps its optimizer state there: sharded
    along its dim ``dim`` (ZeRO-1), with its gradient reduce-scattered into that shard too (ZeRO-2)."""

    stage: int
    axis: int
    dim: int

    @property
    def scatters_grad(self) -> bool:
        """ZeRO-2: the runtime reduce-scatters the accumulated gradient into the state's shard, once for
        all the parameter's readers (which then leave it out of their reductions, ``readers_grad_partial``;
        for a weight read through its bfloat16 copy, the copy's readers: ``_try_follow``) and in place of
        a bucketed all-reduce."""
        return self.stage >= 2

    def state_layout(self, layout: Layout) -> Layout:
        """The layout of the optimizer state (and of a ZeRO-2 gradient) for a parameter in ``layout``."""
        return tuple(S(self.dim) if a == self.axis else p for a, p in enumerate(layout))


@dataclass(frozen=True)
class Strategy:
    inputs: tuple[Layout, ...]       # one layout per tensor input
    outputs: tuple[Layout, ...]      # one layout per output tensor
    splits_work: tuple[bool, ...]    # per mesh axis: the op's work is divided along it
    zero: ZeroState | None = None    # a parameter's state sharded where the parameter is replicated
    offload: bool = False            # a parameter's optimizer state kept, and stepped, in host memory

    def __hash__(self):
        # Strategies key the cost tables, looked up millions of times on a large model: hash the
        # layouts once. (The hash is not pickled: another process hashes strings differently.)
        h = self.__dict__.get("_hash")
        if h is None:
            h = hash((self.inputs, self.outputs, self.splits_work, self.zero, self.offload))
            object.__setattr__(self, "_hash", h)
        return h

    def __getstate__(self):
        return {k: v for k, v in self.__dict__.items() if k != "_hash"}

    @property
    def grad_scatter_axis(self) -> int | None:
        """The mesh axis along which a ZeRO-2 parameter's own reduce-scatter reduces its gradient,
        once for all its readers; None for every other value."""
        return self.zero.axis if self.zero is not None and self.zero.scatters_grad else None

    def readers_grad_partial(self, partial_axes: frozenset) -> frozenset:
        """Of the axes along which a reader leaves this value's gradient partial (``grad_partial_axes``),
        those the reader's resharding reduces: all but ``grad_scatter_axis``."""
        axis = self.grad_scatter_axis
        return partial_axes if axis is None else partial_axes - {axis}

    def read_grad_partial(self, value: Value, dst, reader: Strategy | None) -> frozenset:
        """The mesh axes along which the resharding of ``value`` (an output of this strategy) that
        ``reader`` reads as ``dst`` reduces its gradient on the way back: those the reader leaves it
        partial on (``grad_partial_axes``), as ``readers_grad_partial`` keeps them; none for a user
        output (no reader)."""
        if reader is None:
            return frozenset()
        return self.readers_grad_partial(grad_partial_axes(dst, reader.splits_work, requires_grad(value.node)))

    def label(self) -> str:
        outs = ",".join("[" + ",".join(map(str, lay)) + "]" for lay in self.outputs)
        if self.zero is not None:
            outs += f" ZeRO-{self.zero.stage}@{self.zero.axis}"
        if self.offload:
            outs += " offload"
        return outs or "-"


@dataclass(frozen=True)
class StrategySet:
    """A node's candidate strategies, indexed by strategy index (``sset[i]``, ``len(sset)``)."""

    candidates: tuple[Strategy, ...]
    follows: fx.Node | None = None           # the node whose choice fixes this one's
    follow_map: tuple[int, ...] = ()         # producer strategy index -> own strategy index

    def __getitem__(self, index: int) -> Strategy:
        return self.candidates[index]

    def __len__(self) -> int:
        return len(self.candidates)

    def __iter__(self):
        return iter(self.candidates)


@dataclass(frozen=True)
class MeshStrategies:
    """The ``StrategySet`` of every placeholder and call_function node on one mesh, in graph order: a
    value ``strategies_pass`` makes per candidate mesh (``strategies_on``), so no mesh's overwrite
    another's."""

    mesh_shape: tuple
    sets: dict                               # node -> its StrategySet

    def __getitem__(self, node: fx.Node) -> StrategySet:
        return self.sets[node]

    def __contains__(self, node) -> bool:
        return node in self.sets

    def __iter__(self):
        return iter(self.sets)

    def root_of(self, node: fx.Node) -> fx.Node:
        """The node whose decision fixes ``node``'s strategy (``node`` itself unless it follows one)."""
        while self.sets[node].follows is not None:
            node = self.sets[node].follows
        return node

    def strategy_under_root(self, node: fx.Node, root_option: int) -> int:
        """The strategy index ``node`` takes when its root's decision takes option ``root_option``."""
        chain = []
        while self.sets[node].follows is not None:
            chain.append(node)
            node = self.sets[node].follows
        idx = root_option
        for n in reversed(chain):
            idx = self.sets[n].follow_map[idx]
        return idx

    def strategy_of(self, node: fx.Node, root_option: int) -> Strategy:
        """The strategy ``node`` takes when its root's decision takes option ``root_option``."""
        return self.sets[node][self.strategy_under_root(node, root_option)]


def strategies_on(gm: fx.GraphModule, mesh_shape) -> MeshStrategies:
    """The strategies ``strategies_pass`` made for ``mesh_shape`` on ``gm``."""
    found = program_meta(gm).strategies.get(tuple(mesh_shape))
    if found is None:
        from autopar.errors import AutoparError

        raise AutoparError(f"no strategies for mesh {tuple(mesh_shape)} on this graph (meshes with strategies: "
                           f"{sorted(program_meta(gm).strategies)}); run strategies_pass for it first, and do not "
                           f"skip it")
    return found


@dataclass(frozen=True)
class Value:
    """A tensor in the graph: output ``index`` of ``node``."""

    node: fx.Node
    index: int = 0


def input_values(node: fx.Node) -> list[Value]:
    """The node's tensor inputs as values; ``getitem`` reads one output of a multi-output node."""
    if node.target is operator.getitem:
        return [Value(node.args[0], node.args[1])]
    from autopar.passes.rules import tensor_inputs

    return [Value(a, 0) for a in tensor_inputs(node)]


def value_info(v: Value) -> TensorInfo:
    return output_infos(v.node)[v.index]


def requires_grad(node: fx.Node) -> bool:
    return meta_of(node).requires_grad


def mark_requires_grad_pass(gm: fx.GraphModule) -> fx.GraphModule:
    """Which values carry a gradient: floating values computed from parameters, outside no-grad regions."""
    for node in gm.graph.nodes:
        role = meta_of(node).role
        vals = [v for v in torch.utils._pytree.tree_leaves(node.meta.get("val")) if isinstance(v, torch.Tensor)]
        floating = any(v.dtype.is_floating_point for v in vals)
        grad = False
        if node.op == "placeholder":
            grad = role is not None and role.kind == "param"
        elif node.op == "call_function":
            no_grad = "set_grad_enabled" in str(node.target) and node.args and node.args[0] is False
            grad = floating and not no_grad and any(requires_grad(a) for a in node.all_input_nodes)
        set_meta(node, requires_grad=bool(grad))
    return gm


def zero_dim(shape, layout, mesh_shape, axis: int) -> int | None:
    """The dim along which a parameter in ``layout``, replicated along ``axis``, shards its state over
    that axis: the first dim no other axis shards whose local size divides by the axis's size (the
    first one keeps the shard a contiguous block of the local tensor where it can). None if none does."""
    n = mesh_shape[axis]
    if n < 2 or not layout[axis].is_replicate:
        return None
    local = local_shape(shape, layout, mesh_shape)
    for d, size in enumerate(local):
        if size >= n and size % n == 0 and not any(p.is_shard and p.dim == d for p in layout):
            return d
    return None


def zero_variants(shape, layout, mesh_shape, zero: int = 2) -> list[ZeroState]:
    """ZeRO-1 up to ZeRO-``zero`` along every axis a parameter in ``layout`` is replicated on."""
    out = []
    for a in range(len(mesh_shape)):
        d = zero_dim(shape, layout, mesh_shape, a)
        if d is not None:
            out += [ZeroState(stage, a, d) for stage in range(1, zero + 1)]
    return out


def _placeholder_strategies(node: fx.Node, mesh_shape, zero: int = 0, offload: bool = False) -> list[Strategy]:
    role = meta_of(node).role
    val = node.meta.get("val")
    if not isinstance(val, torch.Tensor):
        return [Strategy((), (), (False,) * len(mesh_shape))]
    shape = tuple(val.shape)
    if role is None or role.kind in ("buffer", "constant"):
        per_axis = [[R]]
    else:
        # A weight a fused projection reads strided (passes/strided.py) may also be laid out so.
        per_axis = [[R] + [S(d) for d in range(len(shape)) if shape[d] > 1]
                    + [S(d, groups) for d, groups in meta_of(node).strided if shape[d] > 1]]
    out = []
    for combo in itertools.product(*[per_axis[0] if n > 1 else [R] for n in mesh_shape]):
        if _distinct_dims(combo) and divides(shape, combo, mesh_shape):
            out.append(Strategy((), (tuple(combo),), (False,) * len(mesh_shape)))
            trained = role is not None and role.kind == "param" and requires_grad(node)
            if zero and trained:
                out += [Strategy((), (tuple(combo),), (False,) * len(mesh_shape), z)
                        for z in zero_variants(shape, combo, mesh_shape, zero)]
            if offload and trained:
                # The local tensor's optimizer state in host memory (with its own layout: ZeRO-3 offloads
                # this rank's shard); not combined with ZeRO-1/2.
                out.append(Strategy((), (tuple(combo),), (False,) * len(mesh_shape), None, True))
    return out


def _distinct_dims(layout) -> bool:
    dims = [p.dim for p in layout if p.is_shard]
    return len(dims) == len(set(dims))


def _combine(options: list[AxisOption], ins: list[TensorInfo], outs: list[TensorInfo], mesh_shape,
             refused: list | None = None):
    """One strategy per mesh axis option tuple, when every tensor stays valid under it. An option's
    own size requirement that fails is described in ``refused``."""
    in_layouts = tuple(tuple(o.inputs[i] for o in options) for i in range(len(ins)))
    out_layouts = tuple(tuple(o.outputs[i] for o in options) for i in range(len(outs)))
    for k, (lay, info) in enumerate(zip(in_layouts + out_layouts, ins + outs)):
        if not _distinct_dims(lay):
            return None
        if not divides(info.shape, lay, mesh_shape):
            if refused is not None:
                what = f"input {k}" if k < len(ins) else f"output {k - len(ins)}"
                refused.append(f"{what} of shape {info.shape} cannot take {format_layout(lay)} on mesh "
                               f"{tuple(mesh_shape)}: a sharded dim does not divide by its mesh axes")
            return None
    for axis, o in enumerate(options):
        for i, dim, factor, why in o.requires:
            size = local_shape(ins[i].shape, in_layouts[i], mesh_shape)[dim]
            if size % factor:
                if refused is not None:
                    refused.append(f"{why}: on mesh axis {axis} ({mesh_shape[axis]} devices) each rank's dim {dim} "
                                   f"of input {i} has {size} elements, which does not divide by {factor} "
                                   f"(global shape {ins[i].shape})")
                return None
    return Strategy(in_layouts, out_layouts, tuple(not o.trivial for o in options))


def signature(node: fx.Node) -> tuple:
    """What a node's strategies and costs depend on: its op, its non-tensor args and its tensors'
    shapes. Copies of a layer share signatures, so their work is done once."""
    sig = meta_of(node).signature
    if sig is None:
        def arg(a):
            if isinstance(a, fx.Node):
                v = a.meta.get("val")
                return ("T", tuple(v.shape), str(v.dtype)) if isinstance(v, torch.Tensor) else ("N", a.name)
            if isinstance(a, (list, tuple)):
                return tuple(arg(x) for x in a)
            return repr(a)

        role = meta_of(node).role
        sig = (node.op, str(node.target), arg(node.args), tuple((k, arg(v)) for k, v in node.kwargs.items()),
               role.kind if role else None, _val_sig(node.meta.get("val")), meta_of(node).strided)
        set_meta(node, signature=sig)
    return sig


def _val_sig(v):
    if isinstance(v, torch.Tensor):
        return (tuple(v.shape), str(v.dtype))
    if isinstance(v, (list, tuple)):
        return tuple(_val_sig(x) for x in v)
    return None


def node_strategies(node: fx.Node, mesh_shape, cache: dict | None = None, zero: int = 0,
                    offload: bool = False) -> list[Strategy]:
    """``zero``: parameters also offer their ZeRO-1 up to ZeRO-``zero`` variants (``ZeroState``); ``offload``:
    their optimizer state in host memory (``Strategy.offload``)."""
    if cache is not None:
        key = (_placeholder_key(node) if node.op == "placeholder" else signature(node), zero, offload)
        if key not in cache:
            cache[key] = _node_strategies(node, mesh_shape, zero, offload), meta_of(node).refused
        strategies, refused = cache[key]
        set_meta(node, refused=refused)
        return strategies
    return _node_strategies(node, mesh_shape, zero, offload)


def _placeholder_key(node: fx.Node) -> tuple:
    """What a placeholder's strategies depend on (``_placeholder_strategies``), its name aside: the
    parameters of every copy of a layer share them."""
    role = meta_of(node).role
    return ("placeholder", role.kind if role else None, _val_sig(node.meta.get("val")), meta_of(node).strided,
            requires_grad(node), role is not None and role.kind == "param" and reads_through_copy(node))


def _node_strategies(node: fx.Node, mesh_shape, zero: int = 0, offload: bool = False) -> list[Strategy]:
    if node.op == "placeholder":
        return _placeholder_strategies(node, mesh_shape, zero, offload)
    ctx = context_for(node)
    opts = axis_options(ctx)
    rep_only = [opts[0]]
    per_axis = [opts if n > 1 else rep_only for n in mesh_shape]
    out, refused = [], []
    for combo in itertools.product(*per_axis):
        s = _combine(list(combo), ctx.ins, ctx.outs, mesh_shape, refused)
        if s is not None and s not in out:
            out.append(s)
    set_meta(node, refused=tuple(dict.fromkeys(refused)))
    return out


def _getitem_strategies(node: fx.Node, producer: StrategySet) -> StrategySet:
    idx = node.args[1]
    strategies, follow = [], []
    for s in producer:
        lay = s.outputs[idx]
        st = Strategy((lay,), (lay,), (False,) * len(lay))
        if st not in strategies:
            strategies.append(st)
        follow.append(strategies.index(st))
    return StrategySet(tuple(strategies), node.args[0], tuple(follow))


def _try_follow(node: fx.Node, own: list[Strategy], producer_set: StrategySet, v: Value):
    """A weight read through its bfloat16 copy under ZeRO-2 has the copy's gradient reduce-scattered,
    once summed over the copy's readers, into the block of its float32 master
    (``passes.precision.sharded_master_copy``): the copy's strategy carries the weight's ZeroState, so
    that its readers leave its gradient partial along that axis (``Strategy.readers_grad_partial``)."""
    own, follow = list(own), []
    for s in producer_set:
        lay = s.outputs[v.index] if s.outputs else None
        match = next((j for j, t in enumerate(own) if t.inputs[0] == lay), None)
        if match is None:
            return None
        if s.grad_scatter_axis is not None and is_param(v.node):
            scattered = replace(own[match], zero=s.zero)
            if scattered not in own:
                own.append(scattered)
            match = own.index(scattered)
        follow.append(match)
    return StrategySet(tuple(own), v.node, tuple(follow))


@requires("mark_requires_grad_pass")
def strategies_pass(gm: fx.GraphModule, mesh_shape, zero: int = 2, offload: bool = False) -> fx.GraphModule:
    """Make the ``StrategySet`` of every placeholder and call_function node on mesh ``mesh_shape``, kept
    under that mesh in the graph's program meta (``strategies_on``) beside other meshes'. With ``zero``
    (the highest ZeRO stage offered, 0 for none), a parameter replicated along an axis may also shard its
    optimizer state there (ZeRO-1) and its gradient (ZeRO-2): one more option per stage and axis
    (``ZeroState``). With ``offload``, a parameter
    may also keep its optimizer state in host memory: one more option per layout.

    The copies of a repeated layer share one decision per position, so they must offer the same
    strategies. They can differ where a strategy is reachable from one copy's outside input and not
    from another's (the first layer reads the embedding, the others a residual add): such strategies
    are dropped from every copy, and the pass runs again until the copies agree."""
    mesh_shape = tuple(mesh_shape)
    drop: dict = {}
    while True:
        sets = _assign_strategies(gm, mesh_shape, drop, zero, offload)
        extra = _disagreeing_copies(gm, sets)
        if not extra:
            set_program_meta(gm, strategies={**program_meta(gm).strategies,
                                             mesh_shape: MeshStrategies(mesh_shape, sets)})
            return gm
        for key, bad in extra.items():
            drop.setdefault(key, set()).update(bad)


def _assign_strategies(gm, mesh_shape, drop: dict, zero: int, offload: bool = False) -> dict:
    cache: dict = {}
    sets: dict = {}
    partial_axes: dict = {}     # value -> the mesh axes along which some strategy of its producer leaves it Partial
    reached: dict = {}          # (strategies, those axes of each input) -> _reachable's answer
    for node in gm.graph.nodes:
        if node.op not in ("placeholder", "call_function"):
            continue
        if node.target is operator.getitem:
            sets[node] = _getitem_strategies(node, sets[node.args[0]])
            continue
        ins = input_values(node) if node.op == "call_function" else []
        own = _reachable(node_strategies(node, mesh_shape, cache, zero, offload), ins, sets, partial_axes, reached)
        tag = meta_of(node).layer
        bad = drop.get((tag.cls, tag.index)) if tag is not None else None
        if bad:
            own = [s for s in own if s not in bad]
        sset = None
        if len(ins) == 1 and (_same_layer(node, ins[0].node) if ins[0].node.op != "placeholder"
                              else is_param(ins[0].node) and reads_through_copy(ins[0].node)):
            sset = _try_follow(node, own, sets[ins[0].node], ins[0])
        sets[node] = sset or StrategySet(tuple(own))
    return sets


def _disagreeing_copies(gm, sets: dict) -> dict:
    """(layer class, position) -> the strategies some copies offer there and others do not."""
    offered: dict = {}
    for node, sset in sets.items():
        tag = meta_of(node).layer
        if tag is not None:
            offered.setdefault((tag.cls, tag.index), []).append(sset.candidates)
    out = {}
    for key, lists in offered.items():
        if any(lst != lists[0] for lst in lists):
            bad = set().union(*lists) - set(lists[0]).intersection(*lists[1:])
            if bad:
                out[key] = bad
    return out


def _same_layer(a: fx.Node, b: fx.Node) -> bool:
    """Followers stay inside their layer instance, so every copy of a layer has the same decisions."""
    ta, tb = meta_of(a).layer, meta_of(b).layer
    return (ta.layer if ta else None) == (tb.layer if tb else None)


def _reachable(strategies: list[Strategy], ins: list[Value], sets: dict, partial_axes: dict, reached: dict
               ) -> list[Strategy]:
    """Drop strategies that need a Partial input its producer can never give: no resharding makes a
    Partial out of anything else. Copies of a layer share their strategies (``node_strategies``'s cache)
    and their inputs' Partial axes, so the answer is found once for them all."""
    partial_ok = []
    for v in ins:
        if v not in partial_axes:
            partial_axes[v] = frozenset(a for s in sets[v.node] for a, p in enumerate(s.outputs[v.index])
                                        if p.is_partial)
        partial_ok.append(partial_axes[v])
    key = (id(strategies), tuple(partial_ok))
    if key not in reached:      # the list is kept with its answer, so its id is not reused
        reached[key] = (strategies, [s for s in strategies if all(not p.is_partial or a in partial_ok[k]
                                                                  for k, lay in enumerate(s.inputs)
                                                                  for a, p in enumerate(lay))])
    return list(reached[key][1])
