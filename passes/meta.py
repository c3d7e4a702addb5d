"""Typed, namespaced metadata: ``node.meta["autopar"]`` on nodes and ``gm.meta["autopar"]`` on a
rank's local program, both frozen dataclasses. Nothing else of autopar's lives in ``meta``.
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any, Mapping

import torch.fx as fx

KEY = "autopar"


@dataclass(frozen=True)
class Role:
    """What a placeholder stands for. ``kind`` is ``param``, ``buffer``, ``constant`` or ``input``."""

    kind: str
    target: str            # parameter/buffer FQN, or the user input's name


@dataclass(frozen=True)
class LayerTag:
    """Which repeated layer a node belongs to, and its position inside the layer."""

    layer: str             # module path of the layer instance, e.g. "model.layers.3"
    cls: str               # equivalence class shared by identical layers
    index: int             # position of the node inside its layer


@dataclass(frozen=True)
class SavedForBackward:
    """Bytes this node keeps alive for backward, at full (unsharded) size.

    ``outputs`` are bytes of its own outputs that backward needs; ``inputs`` maps an input's position
    among the node's tensor inputs to whether backward keeps it; ``internal`` is what the op saves that
    is no graph value (norm statistics, dropout masks, logsumexp). ``held`` says which of its own
    outputs those bytes are (empty: the first outputs, as far as ``outputs`` bytes go). ``backward``
    is what the op's backward holds at its peak beyond the input gradients it returns. ``converted``
    maps an input's position to the item size of a copy of it in another dtype that backward keeps
    (ATen's attention makes a boolean mask additive in the query's dtype), 0 where there is none; the
    copy is at the layout the op reads the input in. ``passed`` says which inputs backward hands the
    output's gradient tensor itself or a view of all of it (an add's inputs of its shape and dtype, a
    reshape's input): no gradient is made for them.
    """

    outputs: int
    inputs: tuple[bool, ...]
    internal: int
    held: tuple[bool, ...] = ()
    backward: int = 0
    converted: tuple[int, ...] = ()
    passed: tuple[bool, ...] = ()


@dataclass(frozen=True)
class AutoparMeta:
    """Everything autopar records on one node, under ``node.meta["autopar"]``. Immutable: a pass sets
    its fields with ``set_meta``, which stores a new record, so a node copied by ``Graph.node_copy``
    (which copies ``node.meta``) keeps the record it was copied with, whatever later passes do."""

    role: Role | None = None
    layer: LayerTag | None = None
    saved: SavedForBackward | None = None
    saved_by: int = 1                     # how many nodes keep this value for backward (shared)
    requires_grad: bool = False           # whether a gradient flows through this value
    copies: bool = False                  # a view op (reshape of a non-contiguous tensor) that copies
    copies_from: tuple | None = None      # a view op that copies on CPU at full size: (input shape, strides)
    signature: tuple | None = None        # what strategies and costs depend on (passes.strategies)
    refused: tuple[str, ...] = ()         # why rule options were refused here (named in pin errors)
    strided: tuple[tuple[int, int], ...] = ()   # (output dim, groups): strided shards a consumer can
                                          # use (passes/strided.py)
    reduce_dtype: Any = None              # a parameter's lower-precision copy whose gradient is summed over
                                          # ranks in this dtype, not its own (passes/precision.py)
    # In a rank's local program (codegen):
    source: str | None = None             # the planned node this node computes
    step: Any = None                      # the resharding step (passes.resharding.Step) it runs
    reader: str | None = None             # a resharding step's: the planned node it was emitted for
    fused: tuple[str, ...] = ()           # the local nodes a generated kernel replaced


@dataclass(frozen=True)
class ProgramMeta:
    """What codegen records on a rank's local program, under ``gm.meta["autopar"]``, and the planner's
    per-mesh strategies on the graph it plans."""

    placeholders: tuple = ()              # (kind, target) per placeholder, in call order
    output_layouts: tuple = ()            # per returned tensor: its layout (all-R unless kept sharded)
    kernels: tuple[tuple[str, str], ...] = ()   # (name, source) of every generated kernel it calls
    grad_reductions: tuple = ()           # (parameter, group name, uses, reduce dtype or None for its
                                          # own) whose gradient the runtime reduces in buckets
                                          # (codegen/grad_buckets.py), in backward order, in place of
                                          # one reduction per use
    sharded_states: tuple = ()            # (parameter, ZeRO stage, group name, dim, gather bucket, the whole
                                          # copy's dtype where the float32 master is sharded too, else None,
                                          # the dtype its gradient is reduce-scattered in where not the
                                          # copy's, else None) of
                                          # every parameter whose optimizer state the runtime shards
                                          # (runtime/zero.py)
    offloaded: tuple = ()                 # parameters whose gradient the runtime copies to host memory
                                          # once complete (runtime/offload.py)
    # On the graph the planner searches: mesh shape -> passes.strategies.MeshStrategies, one per
    # candidate mesh strategies_pass ran for
    strategies: Mapping[tuple, Any] = dataclasses.field(default_factory=dict)


_EMPTY = AutoparMeta()


def meta_of(node: fx.Node) -> AutoparMeta:
    return node.meta.get(KEY, _EMPTY)


def set_meta(node: fx.Node, **fields) -> AutoparMeta:
    m = node.meta[KEY] = dataclasses.replace(meta_of(node), **fields)
    return m


def is_param(node: fx.Node) -> bool:
    """Whether ``node`` is a model parameter's placeholder."""
    role = meta_of(node).role
    return node.op == "placeholder" and role is not None and role.kind == "param"


def program_meta(gm: fx.GraphModule) -> ProgramMeta:
    return gm.meta.get(KEY, ProgramMeta())


def set_program_meta(gm: fx.GraphModule, **fields) -> ProgramMeta:
    m = gm.meta[KEY] = dataclasses.replace(program_meta(gm), **fields)
    return m


def op_name(node: fx.Node) -> str:
    """How plans name a node's op: ``mm.default``, ``scaled_dot_product_attention.default``."""
    t = node.target
    return str(t).replace("aten.", "") if hasattr(t, "_schema") else getattr(t, "__name__", str(t))
