"""Softmax cross-entropy over the last dim, plain and vocab-parallel.

Both use the same two kernels on a [N, V] block of logits that starts at global vocab id
`offset`. The forward reads each row once, keeping a running max and sum-exp (online softmax),
and returns the row's logsumexp and target logit. The vocab-parallel loss combines the per-rank
logsumexps with one MAX and one SUM all-reduce (the SUM carries the target logits too); that is
Megatron's max / sum-exp / target-logit reduction, with the sum-exp taken in the same pass as the
max. The backward writes (softmax - onehot) * dloss for the block and needs no communication.
"""

import torch
import torch.distributed as dist
import triton
import triton.language as tl

from ._util import interpreting


@triton.jit
def _ce_fwd(Logits, Target, Lse, TargetLogit, stride, V, offset, ignore_index, BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    base = Logits + row * stride
    # The running max starts finite so that a block of -inf logits (a masked vocab) adds
    # exp(-inf) = 0 rather than exp(-inf - -inf) = nan; real logits are far above it.
    m = -1e30
    s = 0.0
    for start in range(0, V, BLOCK):
        cols = start + tl.arange(0, BLOCK)
        x = tl.load(base + cols, mask=cols < V, other=float("-inf")).to(tl.float32)
        m_new = tl.maximum(m, tl.max(x, 0))
        s = s * tl.exp(m - m_new) + tl.sum(tl.exp(x - m_new), 0)
        m = m_new
    tl.store(Lse + row, m + tl.log(s))
    t = tl.load(Target + row)
    local = t - offset
    here = (t != ignore_index) & (local >= 0) & (local < V)
    tl.store(TargetLogit + row, tl.load(base + local, mask=here, other=0.0).to(tl.float32))


@triton.jit
def _ce_bwd(
    Logits, Target, Lse, DLoss, DLogits, stride, stride_d, stride_dloss, V, offset, ignore_index,
    BLOCK: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    t = tl.load(Target + row)
    lse = tl.load(Lse + row)
    g = tl.where(t == ignore_index, 0.0, tl.load(DLoss + row * stride_dloss))
    local = t - offset
    for start in range(0, V, BLOCK):
        cols = start + tl.arange(0, BLOCK)
        valid = cols < V
        x = tl.load(Logits + row * stride + cols, mask=valid, other=0.0).to(tl.float32)
        d = (tl.exp(x - lse) - tl.where(cols == local, 1.0, 0.0)) * g
        tl.store(DLogits + row * stride_d + cols, d.to(DLogits.dtype.element_ty), mask=valid)


def _block(v: int) -> int:
    # Small blocks under the interpreter make small test vocabularies span several blocks. On a GPU,
    # 16384 with 8 warps was the fastest of `python bench/kernels.py --tune-memory` (H100, V=128256).
    return min(triton.next_power_of_2(v), 64 if interpreting() else 16384)


def _warps(block: int) -> int:
    return min(max(block // 256, 1), 8)


def _group(group):
    if isinstance(group, str):
        return dist.distributed_c10d._resolve_process_group(group)
    return group if group is not None else dist.group.WORLD


class _CrossEntropy(torch.autograd.Function):
    @staticmethod
    def forward(ctx, logits, target, ignore_index, reduction, group):
        if logits.dim() != 2 or target.shape != logits.shape[:1]:
            raise ValueError(
                f"cross_entropy wants logits [N, V] and target [N], got {tuple(logits.shape)} "
                f"and {tuple(target.shape)}"
            )
        if reduction not in ("mean", "sum", "none"):
            raise ValueError(f"reduction must be 'mean', 'sum' or 'none', got {reduction!r}")
        if logits.stride(1) != 1:
            logits = logits.contiguous()
        target = target.contiguous()
        n, v = logits.shape
        offset = 0 if group is None else dist.get_rank(group) * v
        lse = torch.empty(n, dtype=torch.float32, device=logits.device)
        target_logit = torch.empty_like(lse)
        block = _block(v)
        _ce_fwd[(n,)](
            logits, target, lse, target_logit, logits.stride(0), v, offset, ignore_index,
            BLOCK=block, num_warps=_warps(block),
        )
        if group is not None:
            top = lse.clone()
            dist.all_reduce(top, dist.ReduceOp.MAX, group=group)
            # Rescaling by the global max keeps every rank's sum-exp term in (0, 1].
            sums = torch.stack([torch.exp(lse - top), target_logit])
            dist.all_reduce(sums, dist.ReduceOp.SUM, group=group)
            lse = top + torch.log(sums[0])
            target_logit = sums[1]
        valid = target != ignore_index
        losses = torch.where(valid, lse - target_logit, torch.zeros_like(lse))
        count = valid.sum()
        ctx.save_for_backward(logits, target, lse, count)
        ctx.ignore_index, ctx.reduction, ctx.offset = ignore_index, reduction, offset
        if reduction == "none":
            return losses.to(logits.dtype)
        total = losses.sum()
        return (total / count if reduction == "mean" else total).to(logits.dtype)

    @staticmethod
    def backward(ctx, grad):
        logits, target, lse, count = ctx.saved_tensors
        n, v = logits.shape
        grad = grad.float()
        if ctx.reduction == "mean":
            grad = grad / count
        dloss = grad.expand(n)  # a scalar gradient becomes a stride-0 row vector, not a copy
        dlogits = torch.empty_like(logits)
        block = _block(v)
        _ce_bwd[(n,)](
            logits, target, lse, dloss, dlogits, logits.stride(0), dlogits.stride(0),
            dloss.stride(0), v, ctx.offset, ctx.ignore_index,
            BLOCK=block, num_warps=_warps(block),
        )
        return dlogits, None, None, None, None


def cross_entropy(logits, target, ignore_index, reduction):
    return _CrossEntropy.apply(logits, target, ignore_index, reduction, None)


def vocab_parallel_cross_entropy(logits_shard, target, group, ignore_index, reduction):
    return _CrossEntropy.apply(logits_shard, target, ignore_index, reduction, _group(group))
