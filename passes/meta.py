"""Typed, namespaced metadata the passes write on fx nodes: ``node.meta["autopar"]``.

Each entry is a frozen dataclass; ``AutoparMeta`` only groups them so a pass can set its own entry
without touching the others'.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

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
    is what the op's backward holds at its peak beyond the input gradients it returns.
    """

    outputs: int
    inputs: tuple[bool, ...]
    internal: int
    held: tuple[bool, ...] = ()
    backward: int = 0


@dataclass
class AutoparMeta:
    role: Role | None = None
    layer: LayerTag | None = None
    saved: SavedForBackward | None = None
    strategies: Any = None         # passes.strategies.StrategySet
    extra: dict = field(default_factory=dict)


def op_name(node: fx.Node) -> str:
    """How plans name a node's op: ``mm.default``, ``scaled_dot_product_attention.default``."""
    t = node.target
    return str(t).replace("aten.", "") if hasattr(t, "_schema") else getattr(t, "__name__", str(t))


def meta_of(node: fx.Node) -> AutoparMeta:
    m = node.meta.get(KEY)
    if m is None:
        m = node.meta[KEY] = AutoparMeta()
    return m
