"""Ops whose sharded form communicates by itself: Megatron's vocab-parallel embedding and
cross-entropy. Generated programs call them where a plan shards the vocabulary (passes/rules/nn.py).
Ring attention, the other op of this kind, has its own module (``runtime.context_parallel``).

Like ``runtime.collectives``, each takes its process group by c10d group name, and rank r of the group
holds the r-th of equal, contiguous vocabulary slices. Their collectives go through
``collectives._all_reduce``, so they are the ones a plan lists (``plan.collectives``).
"""
from __future__ import annotations

import torch

from autopar.runtime import collectives as C

aten = torch.ops.aten

# ATen's reduction codes for losses.
_NONE, _MEAN, _SUM = 0, 1, 2


def vocab_parallel_embedding(weight: torch.Tensor, ids: torch.Tensor, padding_idx: int, group: str) -> torch.Tensor:
    """This rank's term of ``embedding(full_weight, ids)``: the rows of ids that fall in its slice of
    the table, zeros elsewhere. The sum over the group is the lookup (a Partial value); autograd gives
    the local table the gradient of its own rows."""
    rank, _ = C._group(group)
    rows = weight.shape[0]
    offset = rank * rows
    local = ids - offset
    here = (local >= 0) & (local < rows)
    local_pad = padding_idx - offset if padding_idx >= 0 and 0 <= padding_idx - offset < rows else -1
    out = aten.embedding.default(weight, torch.where(here, local, 0), local_pad)
    return out * here.unsqueeze(-1).to(out.dtype)


# The loss works on its [rows, vocabulary] logits a block of rows at a time, so that its temporaries
# are a block's, not the whole logits' (at 128k tokens and a 152k vocabulary, 10 GB per fp32 copy).
CHUNK_BYTES = 64 * 2**20


def row_chunks(n: int, v: int) -> list[tuple[int, int]]:
    """Row ranges of at most ``CHUNK_BYTES`` of fp32 ``[rows, v]`` each."""
    step = max(1, CHUNK_BYTES // (4 * max(v, 1)))
    return [(i, min(n, i + step)) for i in range(0, n, step)]


class _VocabParallelCrossEntropy(torch.autograd.Function):
    """Keeps the logits and per-row statistics for backward. The forward works one block of rows at a
    time in one fp32 buffer; the backward makes the softmax in the one buffer it returns (in place, as
    Megatron's does), so it holds no [rows, vocabulary] temporary beyond its result (and, for
    low-precision logits, the fp32 result before its cast)."""

    @staticmethod
    def forward(ctx, logits, target, ignore_index, reduction, group):
        rank, _ = C._group(group)
        n, v = logits.shape
        wide = torch.promote_types(logits.dtype, torch.float32)
        chunks = row_chunks(n, v)
        top = C._all_reduce(logits.amax(dim=1).to(wide), group, op="max")
        sumexp = torch.empty(n, dtype=wide, device=logits.device)
        block = torch.empty((chunks[0][1] - chunks[0][0], v), dtype=wide, device=logits.device) if n else None
        for a, b in chunks:
            work = torch.sub(logits[a:b], top[a:b].unsqueeze(1), out=block[:b - a])
            sumexp[a:b] = work.exp_().sum(dim=1)
        local = target - rank * v
        here = (target != ignore_index) & (local >= 0) & (local < v)
        local = torch.where(here, local, 0)
        picked = torch.where(here, logits.gather(1, local.unsqueeze(1)).squeeze(1).to(wide), 0.0)
        sums = C._all_reduce(torch.stack([sumexp, picked]), group)
        lse = top + torch.log(sums[0])
        valid = target != ignore_index
        losses = torch.where(valid, lse - sums[1], 0.0)
        ctx.save_for_backward(logits, lse, local, here, valid)
        ctx.reduction = reduction
        if reduction == _NONE:
            return losses.to(logits.dtype)
        total = losses.sum()
        if reduction == _MEAN:
            total = total / valid.sum()
        return total.to(logits.dtype)

    @staticmethod
    def backward(ctx, grad):
        logits, lse, local, here, valid = ctx.saved_tensors
        g = grad.to(lse.dtype)
        if ctx.reduction == _MEAN:
            g = g / valid.sum()
        g = torch.where(valid, g.expand(valid.shape), 0.0)
        d = torch.empty(logits.shape, dtype=lse.dtype, device=logits.device)
        for a, b in row_chunks(*logits.shape):
            torch.sub(logits[a:b], lse[a:b].unsqueeze(1), out=d[a:b]).exp_()
        d.scatter_add_(1, local.unsqueeze(1), -here.to(d.dtype).unsqueeze(1))
        d.mul_(g.unsqueeze(1))
        return d.to(logits.dtype), None, None, None, None


def vocab_parallel_cross_entropy(logits: torch.Tensor, target: torch.Tensor, ignore_index: int, reduction: int,
                                 group: str) -> torch.Tensor:
    """``cross_entropy_loss(full_logits, target, reduction=reduction, ignore_index=ignore_index)`` for
    2-D logits sharded on the vocabulary (dim 1); ``target`` holds global ids and is the same on every
    rank of the group. Every rank gets the whole loss; the backward gives each rank the gradient of its
    own logits and communicates nothing."""
    if logits.dim() != 2 or target.shape != logits.shape[:1]:
        raise ValueError(f"vocab_parallel_cross_entropy wants logits [N, V/group] and target [N], got "
                         f"{tuple(logits.shape)} and {tuple(target.shape)}")
    if reduction not in (_NONE, _MEAN, _SUM):
        raise ValueError(f"reduction must be 0 (none), 1 (mean) or 2 (sum), got {reduction!r}")
    return _VocabParallelCrossEntropy.apply(logits, target, ignore_index, reduction, group)


# (kind, phase) of the collectives each op runs on its group, the last argument of every call.
OP_COLLECTIVES = {
    vocab_parallel_embedding: (),
    vocab_parallel_cross_entropy: (("all_reduce", "forward"), ("all_reduce", "forward")),
}

__all__ = ["OP_COLLECTIVES", "vocab_parallel_cross_entropy", "vocab_parallel_embedding"]
