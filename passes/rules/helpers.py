"""Declarative building blocks for rules: einsum dim maps, broadcasting, dim permutations."""
from __future__ import annotations

from typing import Callable, Iterable, Sequence

from autopar.layout import P, R, S
from autopar.passes.rules import AxisOption, OpContext


def einsum_options(ctx: OpContext, spec: str, *, linear: Iterable[int] = ()) -> list[AxisOption]:
    """Options from an einsum-like spec over the tensor inputs, e.g. ``"mk,kn->mn"``.

    A letter kept in the output shards that dim everywhere it appears; a contracted letter shards it in
    the inputs and leaves the output ``Partial``. ``linear`` lists inputs the op is linear in: a
    ``Partial`` there, with the others replicated, gives a ``Partial`` output. A kept letter whose
    output dim a consumer reads strided (``ctx.strided``) is also offered strided everywhere.
    """
    lhs, out = spec.split("->")
    operands = lhs.split(",")
    if len(operands) != len(ctx.ins):
        raise ValueError(f"{ctx.node.name}: spec {spec!r} has {len(operands)} operands for {len(ctx.ins)} tensors")
    options = []
    for letter in dict.fromkeys("".join(operands)):
        ins = []
        for op, info in zip(operands, ctx.ins):
            pos = op.find(letter)
            ins.append(S(pos) if pos >= 0 and info.shape[pos] > 1 else R)
        if all(p.is_replicate for p in ins):
            continue
        pos = out.find(letter)
        if pos >= 0:
            if ctx.outs[0].shape[pos] <= 1:
                continue
            options.append(ctx.option(ins, S(pos)))
            groups = ctx.strided.get(pos)
            if groups:
                options.append(ctx.option([S(p.dim, groups) if p.is_shard else p for p in ins], S(pos, groups)))
        else:
            options.append(ctx.option(ins, P))
    options += linear_options(ctx, linear)
    return options


def linear_options(ctx: OpContext, linear: Iterable[int]) -> list[AxisOption]:
    return [ctx.option([P if j == i else R for j in range(len(ctx.ins))], P) for i in linear]


def letters(n: int, start: int = 0) -> str:
    return "".join(chr(ord("a") + start + i) for i in range(n))


def broadcast_options(ctx: OpContext, *, linear: Iterable[int] = (), all_partial: bool = False) -> list[AxisOption]:
    """Pointwise ops with numpy broadcasting: an output dim is sharded in every input that has it at
    full size; inputs that broadcast along it stay replicated. A dim a consumer reads strided is also
    offered strided."""
    out_shape = ctx.outs[0].shape
    nd = len(out_shape)
    strided = ctx.strided
    options = []
    for d in range(nd):
        if out_shape[d] <= 1:
            continue
        for groups in (1, strided.get(d)) if d in strided else (1,):
            ins = []
            for info in ctx.ins:
                k = d - (nd - info.ndim)
                ins.append(S(k, groups) if k >= 0 and info.shape[k] == out_shape[d] else R)
            options.append(ctx.option(ins, S(d, groups)))
    options += linear_options(ctx, linear)
    if all_partial and ctx.ins:
        options.append(ctx.option([P] * len(ctx.ins), P))
    return options


def dim_map_options(ctx: OpContext, mapping: Callable[[int], int | None], *, input_index: int = 0,
                    partial: bool = True, strided_mapping: Callable[[int], int | None] | None = None
                    ) -> list[AxisOption]:
    """Ops whose output dims are a relabelling of one input's dims (transpose, squeeze, slice, ...).

    ``mapping(in_dim)`` gives the output dim, or None where that dim cannot be sharded. Other tensor
    inputs stay replicated. With ``partial`` a ``Partial`` input passes through (the op is linear).
    An output dim a consumer reads strided is also offered strided where ``strided_mapping`` (by
    default ``mapping``) carries the whole input dim to it, so its groups stay whole.
    """
    info = ctx.ins[input_index]
    strided, strided_mapping = ctx.strided, strided_mapping or mapping
    options = []
    for d in range(info.ndim):
        o = mapping(d)
        if o is None or info.shape[d] <= 1:
            continue
        ins = [R] * len(ctx.ins)
        ins[input_index] = S(d)
        options.append(ctx.option(ins, S(o)))
        if o in strided and strided_mapping(d) == o:
            ins[input_index] = S(d, strided[o])
            options.append(ctx.option(ins, S(o, strided[o])))
    if partial and len(ctx.ins) == 1:
        options.append(ctx.option([P], P))
    return options


def norm_dim(d: int, ndim: int) -> int:
    return d + ndim if d < 0 else d


def view_groups(src: Sequence[int], dst: Sequence[int]) -> list[tuple[list[int], list[int]]]:
    """Pair runs of source dims with runs of target dims whose sizes multiply to the same number."""
    groups, i, j = [], 0, 0
    while i < len(src) or j < len(dst):
        gi, gj, pi, pj = [], [], 1, 1
        while True:
            if pi <= pj and i < len(src) and (not gi or pi != pj or src[i] == 1):
                gi.append(i); pi *= src[i]; i += 1
            elif j < len(dst) and (not gj or pi != pj or dst[j] == 1):
                gj.append(j); pj *= dst[j]; j += 1
            else:
                break
        if pi != pj:
            raise ValueError(f"cannot pair view shapes {tuple(src)} -> {tuple(dst)}")
        groups.append((gi, gj))
    return groups


def whole_dim_mapping(src: Sequence[int], dst: Sequence[int]) -> dict[int, int]:
    """Source dim -> target dim for the dims a view keeps whole (the only non-unit dim of its group on
    both sides): the dims along which a strided shard's groups survive the view."""
    out = {}
    for gi, gj in view_groups(src, dst):
        si = [d for d in gi if src[d] > 1]
        sj = [d for d in gj if dst[d] > 1]
        if len(si) == 1 and len(sj) == 1:
            out[si[0]] = sj[0]
    return out


def view_mapping(src: Sequence[int], dst: Sequence[int]) -> dict[int, int]:
    """Source dim -> target dim along which a shard survives a view: the first non-unit dim of each
    group on both sides, so that a rank's shard stays one contiguous run of elements."""
    out = {}
    for gi, gj in view_groups(src, dst):
        si = [d for d in gi if src[d] > 1]
        sj = [d for d in gj if dst[d] > 1]
        if si and sj:
            out[si[0]] = sj[0]
    return out
