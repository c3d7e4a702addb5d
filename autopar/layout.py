"""Layouts: one placement per mesh axis, written ``R``, ``S(d)`` or ``P``.

Placements are immutable values that validate themselves. They convert to and from DTensor's own
``Shard``/``Replicate``/``Partial`` types, which are imported lazily.
"""
from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Sequence

from autopar.errors import ShardingError

_SHARD_RE = re.compile(r"^S\((-?\d+)\)$")


@dataclass(frozen=True, order=True)
class Placement:
    """``kind`` is ``"R"``, ``"S"`` or ``"P"``; ``dim`` is set only for ``"S"``."""

    kind: str
    dim: int | None = None

    def __post_init__(self):
        if self.kind not in ("R", "S", "P"):
            raise ShardingError(f"unknown placement kind {self.kind!r}; use 'R', 'S' or 'P'")
        if (self.kind == "S") != (self.dim is not None):
            raise ShardingError(f"placement {self.kind!r} with dim={self.dim}: only 'S' takes a dim")
        if self.dim is not None and self.dim < 0:
            raise ShardingError(f"S({self.dim}): normalize the dim to be non-negative first")

    @staticmethod
    def parse(text: str) -> "Placement":
        text = text.strip()
        if text in ("R", "P"):
            return Placement(text)
        m = _SHARD_RE.match(text)
        if not m:
            raise ShardingError(f"cannot parse placement {text!r}; expected 'R', 'P' or 'S(<dim>)'")
        return Placement("S", int(m.group(1)))

    def __str__(self) -> str:
        return f"S({self.dim})" if self.kind == "S" else self.kind

    def __repr__(self) -> str:
        return str(self)

    @property
    def is_shard(self) -> bool:
        return self.kind == "S"

    @property
    def is_replicate(self) -> bool:
        return self.kind == "R"

    @property
    def is_partial(self) -> bool:
        return self.kind == "P"

    def to_dtensor(self):
        from torch.distributed.tensor import Partial, Replicate, Shard

        if self.kind == "S":
            return Shard(self.dim)
        return Replicate() if self.kind == "R" else Partial()


R = Placement("R")
P = Placement("P")


def S(dim: int) -> Placement:
    return Placement("S", dim)


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
        if out[p.dim] % n:
            raise ShardingError(f"{what}: dim {p.dim} of size {out[p.dim]} (global shape {tuple(shape)}) "
                                f"does not divide by mesh axis {axis} of size {n}; choose a size that "
                                f"divides, or leave that dim unsharded on this axis")
        out[p.dim] //= n
    return tuple(out)


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
            if p.dim >= len(sizes) or sizes[p.dim] % n:
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
