"""Layouts: one placement per mesh axis, written ``R``, ``S(d)``, ``S(d,k)`` or ``P``.

``S(d,k)`` is a strided (interleaved) shard: dim ``d`` is cut into ``k`` equal groups and each group is
sharded along the axis, so a rank holds its block of every group, in group order. A fused projection
whose output is split into ``k`` equal parts right after (GPT-2's query-key-value ``c_attn``, a fused
gate-up) keeps every part split by heads or columns this way, as Megatron lays out its fused weights;
a plain ``S(d)`` would put whole parts on some ranks. It is DTensor's ``_StridedShard(d, split_factor=k)``.

Placements are immutable values that validate themselves. They convert to DTensor's own
``Shard``/``_StridedShard``/``Replicate``/``Partial`` types, which are imported lazily.
"""
from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Sequence

from autopar.errors import ShardingError

_SHARD_RE = re.compile(r"^S\((-?\d+)(?:,\s*(-?\d+))?\)$")


@dataclass(frozen=True, order=True)
class Placement:
    """``kind`` is ``"R"``, ``"S"`` or ``"P"``; ``dim`` is set only for ``"S"``, and ``groups`` above 1
    only for a strided ``"S"`` (the number of interleaved groups of dim ``dim``)."""

    kind: str
    dim: int | None = None
    groups: int = 1

    def __post_init__(self):
        if self.kind not in ("R", "S", "P"):
            raise ShardingError(f"unknown placement kind {self.kind!r}; use 'R', 'S' or 'P'")
        if (self.kind == "S") != (self.dim is not None):
            raise ShardingError(f"placement {self.kind!r} with dim={self.dim}: only 'S' takes a dim")
        if self.dim is not None and self.dim < 0:
            raise ShardingError(f"S({self.dim}): normalize the dim to be non-negative first")
        if not isinstance(self.groups, int) or self.groups < 1:
            raise ShardingError(f"placement {self.kind!r} with groups={self.groups!r}: groups is a positive int")
        if self.groups > 1 and self.kind != "S":
            raise ShardingError(f"placement {self.kind!r} with groups={self.groups}: only 'S' is strided")

    @staticmethod
    def parse(text: str) -> "Placement":
        text = text.strip()
        if text in ("R", "P"):
            return Placement(text)
        m = _SHARD_RE.match(text)
        if not m:
            raise ShardingError(f"cannot parse placement {text!r}; expected 'R', 'P', 'S(<dim>)' or "
                                f"'S(<dim>,<groups>)'")
        groups = 1 if m.group(2) is None else int(m.group(2))
        if groups < 2 and m.group(2) is not None:
            raise ShardingError(f"placement {text!r}: a strided shard has 2 or more groups; write S({m.group(1)}) "
                                f"for a plain shard")
        return Placement("S", int(m.group(1)), groups)

    def __str__(self) -> str:
        if self.kind != "S":
            return self.kind
        return f"S({self.dim},{self.groups})" if self.groups > 1 else f"S({self.dim})"

    def __repr__(self) -> str:
        return str(self)

    @property
    def is_shard(self) -> bool:
        return self.kind == "S"

    @property
    def is_strided(self) -> bool:
        return self.groups > 1

    @property
    def is_replicate(self) -> bool:
        return self.kind == "R"

    @property
    def is_partial(self) -> bool:
        return self.kind == "P"

    def to_dtensor(self):
        from torch.distributed.tensor import Partial, Replicate, Shard

        if self.is_strided:
            from torch.distributed.tensor.placement_types import _StridedShard

            return _StridedShard(self.dim, split_factor=self.groups)
        if self.kind == "S":
            return Shard(self.dim)
        return Replicate() if self.kind == "R" else Partial()


R = Placement("R")
P = Placement("P")


def S(dim: int, groups: int = 1) -> Placement:
    return Placement("S", dim, groups)


Layout = tuple  # tuple[Placement, ...], one per mesh axis


def parse_layout(items: Sequence[str]) -> tuple[Placement, ...]:
    return tuple(Placement.parse(s) for s in items)


def format_layout(layout: Sequence[Placement]) -> list[str]:
    return [str(p) for p in layout]


def local_shape(shape: Sequence[int], layout: Sequence[Placement], mesh_shape: Sequence[int],
                *, what: str = "tensor") -> tuple[int, ...]:
    """The per-rank shape of a tensor of global ``shape``. Uneven splits are refused."""
    out = list(shape)
    for axis, (p, n) in enumerate(zip(layout, mesh_shape)):
        if p.kind != "S":
            continue
        if p.dim >= len(shape):
            raise ShardingError(f"{what}: S({p.dim}) on mesh axis {axis} but the tensor has only "
                                f"{len(shape)} dims (shape {tuple(shape)})")
        if out[p.dim] % (n * p.groups):
            groups = f" in {p.groups} groups ({p})" if p.is_strided else ""
            raise ShardingError(f"{what}: dim {p.dim} of size {out[p.dim]} (global shape {tuple(shape)}) "
                                f"does not divide by mesh axis {axis} of size {n}{groups}; choose a size that "
                                f"divides, or leave that dim unsharded on this axis")
        out[p.dim] //= n
    return tuple(out)


def block_runs(size: int, placement: Placement, n: int, coord: int) -> list[tuple[int, int]]:
    """(start, length) of the runs of a dim of ``size`` that coordinate ``coord`` of an axis of ``n``
    devices holds under ``placement`` (a shard of that dim): one run, or one per group of a strided
    shard, in order."""
    groups = placement.groups
    group = size // groups
    block = group // n
    return [(g * group + coord * block, block) for g in range(groups)]


def global_shape(local: Sequence[int], layout: Sequence[Placement], mesh_shape: Sequence[int]) -> tuple[int, ...]:
    """The full shape of a tensor whose per-rank block has shape ``local`` (the inverse of local_shape)."""
    out = list(local)
    for p, n in zip(layout, mesh_shape):
        if p.kind == "S":
            out[p.dim] *= n
    return tuple(out)


def divides(shape: Sequence[int], layout: Sequence[Placement], mesh_shape: Sequence[int]) -> bool:
    sizes = list(shape)
    for p, n in zip(layout, mesh_shape):
        if p.kind == "S":
            if p.dim >= len(sizes) or sizes[p.dim] % (n * p.groups):
                return False
            sizes[p.dim] //= n
    return True


def local_fraction(layout: Sequence[Placement], mesh_shape: Sequence[int]) -> float:
    """Fraction of a tensor's elements held by one rank."""
    f = 1
    for p, n in zip(layout, mesh_shape):
        if p.kind == "S":
            f *= n
    return 1.0 / f
