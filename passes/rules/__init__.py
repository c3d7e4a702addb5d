"""Sharding rules: per-op knowledge of which dims a mesh axis may shard.

A rule describes ONE mesh axis at a time: it lists ``AxisOption``s, each giving the placement of every
tensor input and every output along that axis. Strategies for a whole mesh are products of per-axis
options (``passes.strategies``), so a rule never enumerates the product itself and any mesh of 1 to 4
axes works. The all-replicated option is always added by the registry.

Register a rule next to its op::

    @register_rule(aten.mm.default, flops=mm_flops)
    def mm_rule(ctx):
        return einsum_options(ctx, "mk,kn->mn")

An op with no rule is replicated, with one warning naming it; the compiler never crashes on it.

Strided shards (``S(d,k)``, autopar.layout) are offered only where they can pay: a rule that reads
one without being asked (``reads_strided``: split and chunk, which turn it into a plain shard of each
part) seeds a hint, and ``passes.strided.strided_hints_pass`` carries hints back to the producers,
which see them as ``ctx.strided`` (output dim -> groups) and offer the strided option there.
"""
from __future__ import annotations

import logging
import math
import weakref
from dataclasses import dataclass, field
from typing import Callable, Sequence

import torch
import torch.fx as fx
from torch.utils import _pytree as pytree

from autopar.layout import P, Placement, R, S
from autopar.passes.meta import meta_of

log = logging.getLogger("autopar.rules")


@dataclass(frozen=True)
class TensorInfo:
    shape: tuple[int, ...]
    dtype: torch.dtype

    @property
    def ndim(self) -> int:
        return len(self.shape)

    @property
    def numel(self) -> int:
        return math.prod(self.shape)

    @property
    def nbytes(self) -> int:
        return self.numel * self.dtype.itemsize


@dataclass(frozen=True)
class AxisOption:
    """Placements along one mesh axis: one per tensor input, one per output."""

    inputs: tuple[Placement, ...]
    outputs: tuple[Placement, ...]
    # Sizes the option needs beyond the usual "a sharded dim divides by its axes": (tensor input,
    # dim, factor, why) asks the input's local size of that dim to divide by ``factor`` (ring
    # attention's causal half-chunks). A strategy that misses one is refused, and the reason kept for
    # the pin errors (``passes.strategies``).
    requires: tuple[tuple[int, int, int, str], ...] = ()

    @property
    def trivial(self) -> bool:
        return all(p.is_replicate for p in self.inputs + self.outputs)


@dataclass
class OpContext:
    """What a rule sees of a node: its args and the global shapes of its tensors."""

    node: fx.Node
    ins: list[TensorInfo]            # one per tensor input, in ``tensor_inputs`` order
    outs: list[TensorInfo]           # one per output tensor (a single output is a list of one)
    input_nodes: list[fx.Node] = field(default_factory=list)

    @property
    def args(self):
        return self.node.args

    @property
    def kwargs(self):
        return self.node.kwargs

    @property
    def strided(self) -> dict[int, int]:
        """Output dim -> groups of the strided shards a consumer can use here (passes/strided.py)."""
        return dict(meta_of(self.node).strided)

    def arg(self, index: int, name: str, default=None):
        if len(self.node.args) > index:
            return self.node.args[index]
        return self.node.kwargs.get(name, default)

    def option(self, inputs: Sequence[Placement], outputs: Sequence[Placement] | Placement,
               requires=()) -> AxisOption:
        if isinstance(outputs, Placement):
            outputs = (outputs,) * len(self.outs)
        return AxisOption(tuple(inputs), tuple(outputs), tuple(requires))


@dataclass(frozen=True)
class OpRule:
    options: Callable[[OpContext], list[AxisOption]]
    flops: Callable[[OpContext], float] | None = None
    # Rewrites a node's (already local) args for local shapes:
    # (ctx, args, kwargs, local input shapes, local output shapes) -> (args, kwargs).
    local_args: Callable | None = None
    # What the target GPU kernel saves for backward (a passes.meta.SavedForBackward), when it differs
    # from what the planning machine's kernel saves.
    saved_on_gpu: Callable[[OpContext], object] | None = None
    # For an op with ``saved_on_gpu``: None where the target GPU runs the fused kernel that describes,
    # else the GPU runs the reference kernel after all (its fused kernels refuse these inputs), so what
    # the planning machine's reference kernel saves holds there too, and this is the bytes (full size)
    # its backward holds there at its peak beyond the gradients it returns.
    reference_on_gpu: Callable[[OpContext], float | None] | None = None
    replicate_only: bool = False
    # For an op whose sharded form communicates by itself (Megatron's vocab-parallel loss): the
    # collectives it runs under a strategy, (ctx, input layouts, mesh shape) -> list[OpCollective],
    # and the function the local program calls instead of the op, (ctx, input layouts, args, kwargs,
    # group names per axis) -> (dotted path of the function, args, kwargs), or None where the
    # strategy needs no such function. Naming the function by its path keeps rules free of runtime
    # imports; codegen imports it.
    collectives: Callable | None = None
    local_call: Callable | None = None
    # What that function keeps for backward (a passes.meta.SavedForBackward at full size) under a
    # strategy, (ctx, input layouts, mesh shape) -> SavedForBackward or None, where it differs from the ATen op's
    # (ring attention keeps q, k, v, the output and a logsumexp on every device, never the scores).
    saved_sharded: Callable | None = None
    # Bytes per device that function holds while it runs, beyond its inputs and output (ring
    # attention's blocks in flight and accumulators), (ctx, input layouts, mesh shape) -> bytes.
    workspace: Callable | None = None
    # Bytes per device that function's backward holds at its peak beyond the input gradients it
    # returns, (ctx, input layouts, mesh shape) -> bytes, or None where the ATen op's measured figure
    # (SavedForBackward.backward) holds.
    backward_workspace: Callable | None = None
    # Whether the rule offers strided inputs without a hint on its output (split and chunk): the seeds
    # of passes.strided.strided_hints_pass.
    reads_strided: bool = False


@dataclass(frozen=True)
class OpCollective:
    """A collective that an op's local computation runs itself, on one mesh axis."""

    axis: int
    kind: str          # all_reduce, all_gather, reduce_scatter, all_to_all or send_recv
    phase: str         # forward or backward
    nbytes: float      # per device, as in passes.resharding.Step.collectives; all steps together
    # A transfer repeated ``steps`` times, each step overlapped with ``overlap_flops`` of the op's
    # own compute (ring attention: one key/value block moves while the previous one is attended
    # to); a step costs max(compute, transfer), so only the transfer beyond the compute is charged.
    steps: int = 1
    overlap_flops: float = 0.0
    dtype: torch.dtype = torch.float32


_RULES: dict = {}
_warned: set = set()


def register_rule(*targets, flops=None, local_args=None, saved_on_gpu=None, reference_on_gpu=None, collectives=None,
                  local_call=None, saved_sharded=None, workspace=None, backward_workspace=None, reads_strided=False):
    def deco(fn):
        rule = OpRule(fn, flops, local_args, saved_on_gpu, reference_on_gpu, collectives=collectives, local_call=local_call,
                      saved_sharded=saved_sharded, workspace=workspace, backward_workspace=backward_workspace,
                      reads_strided=reads_strided)
        for t in targets:
            _RULES[t] = rule
        return fn
    return deco


def register_replicated(*targets, flops=None):
    """Ops that must see whole tensors (factories, index arithmetic): replicated, without a warning."""
    rule = OpRule(lambda ctx: [], flops, None, None, replicate_only=True)
    for t in targets:
        _RULES[t] = rule


def get_rule(target) -> OpRule | None:
    _load_builtin_rules()
    return _RULES.get(target)


def rule_for(node: fx.Node) -> OpRule:
    rule = get_rule(node.target)
    if rule is None:
        name = getattr(node.target, "__name__", str(node.target))
        if name not in _warned:
            _warned.add(name)
            log.warning("autopar has no sharding rule for %s (first seen at node %r); it runs replicated. "
                        "Register one with autopar.passes.rules.register_rule.", name, node.name)
        return _REPLICATED
    return rule


_REPLICATED = OpRule(lambda ctx: [], replicate_only=True)


def tensor_inputs(node: fx.Node) -> list[fx.Node]:
    """The node's tensor-valued inputs in a fixed order, duplicates kept."""
    seen = _TENSOR_INPUTS.get(node)
    if seen is not None and seen[0] is node.args and seen[1] is node.kwargs:   # changed args are new tuples
        return list(seen[2])
    leaves = pytree.tree_leaves((node.args, dict(node.kwargs)))
    ins = [a for a in leaves if isinstance(a, fx.Node) and isinstance(a.meta.get("val"), torch.Tensor)]
    _TENSOR_INPUTS[node] = (node.args, node.kwargs, ins)
    return list(ins)


def output_infos(node: fx.Node) -> list[TensorInfo]:
    val = node.meta.get("val")
    seen = _OUTPUT_INFOS.get(node)
    if seen is not None and seen[0] is val:        # a pass that changes a value stores a new one
        return list(seen[1])
    infos = [TensorInfo(tuple(int(s) for s in v.shape), v.dtype) for v in pytree.tree_leaves(val)
             if isinstance(v, torch.Tensor)]
    _OUTPUT_INFOS[node] = (val, infos)
    return list(infos)


# node -> (its value, output_infos of it) and node -> (its args, kwargs, tensor_inputs of them):
# planning asks for the same node's many times.
_OUTPUT_INFOS: "weakref.WeakKeyDictionary[fx.Node, tuple]" = weakref.WeakKeyDictionary()
_TENSOR_INPUTS: "weakref.WeakKeyDictionary[fx.Node, tuple]" = weakref.WeakKeyDictionary()


def context_for(node: fx.Node) -> OpContext:
    ins = tensor_inputs(node)
    infos = [TensorInfo(tuple(int(s) for s in a.meta["val"].shape), a.meta["val"].dtype) for a in ins]
    return OpContext(node, infos, output_infos(node), ins)


def axis_options(ctx: OpContext) -> list[AxisOption]:
    """All options of one mesh axis for ``ctx``'s node: replicated first, no duplicates."""
    rule = rule_for(ctx.node)
    rep = ctx.option([R] * len(ctx.ins), R)
    out = [rep]
    if not rule.replicate_only:
        for opt in rule.options(ctx):
            if opt not in out:
                out.append(opt)
    return out


_loaded = False


def _load_builtin_rules():
    global _loaded
    if not _loaded:
        _loaded = True
        from autopar.passes.rules import matmul, nn, pointwise, shape  # noqa: F401  (register on import)


__all__ = ["AxisOption", "OpCollective", "OpContext", "OpRule", "TensorInfo", "register_rule", "register_replicated",
           "get_rule", "rule_for", "axis_options", "context_for", "tensor_inputs", "output_infos",
           "P", "R", "S"]
