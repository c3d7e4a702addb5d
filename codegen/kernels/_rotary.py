"""Rotary position embedding, rotate_half convention: with x = [x1, x2] split in halves,
y1 = x1 * cos1 - x2 * sin1 and y2 = x2 * cos2 + x1 * sin2. The backward is the transposed
rotation, dx1 = dy1 * cos1 + dy2 * sin2 and dx2 = dy2 * cos2 - dy1 * sin1, so one kernel serves
both. cos and sin are read through broadcast strides, never materialized at x's shape."""

import torch
import triton
import triton.language as tl

from ._util import interpreting


@triton.jit
def _rotary(
    X, Cos, Sin, Y,
    sx_b, sx_h, sx_s, sx_d, sc_b, sc_h, sc_s, sc_d, ss_b, ss_h, ss_s, ss_d, sy_b, sy_h, sy_s, sy_d,
    H, S, HALF, BLOCK_S: tl.constexpr, BLOCK_HALF: tl.constexpr, BACKWARD: tl.constexpr,
):
    bh = tl.program_id(1)
    b = (bh // H).to(tl.int64)
    h = (bh % H).to(tl.int64)
    offs_s = tl.program_id(0) * BLOCK_S + tl.arange(0, BLOCK_S)
    offs_d = tl.arange(0, BLOCK_HALF)
    ok = (offs_s[:, None] < S) & (offs_d[None, :] < HALF)
    x = X + b * sx_b + h * sx_h + offs_s[:, None] * sx_s + offs_d[None, :] * sx_d
    c = Cos + b * sc_b + h * sc_h + offs_s[:, None] * sc_s + offs_d[None, :] * sc_d
    s = Sin + b * ss_b + h * ss_h + offs_s[:, None] * ss_s + offs_d[None, :] * ss_d
    x1 = tl.load(x, mask=ok, other=0.0).to(tl.float32)
    x2 = tl.load(x + HALF * sx_d, mask=ok, other=0.0).to(tl.float32)
    c1 = tl.load(c, mask=ok, other=0.0).to(tl.float32)
    c2 = tl.load(c + HALF * sc_d, mask=ok, other=0.0).to(tl.float32)
    s1 = tl.load(s, mask=ok, other=0.0).to(tl.float32)
    s2 = tl.load(s + HALF * ss_d, mask=ok, other=0.0).to(tl.float32)
    if BACKWARD:
        y1 = x1 * c1 + x2 * s2
        y2 = x2 * c2 - x1 * s1
    else:
        y1 = x1 * c1 - x2 * s1
        y2 = x2 * c2 + x1 * s2
    y = Y + b * sy_b + h * sy_h + offs_s[:, None] * sy_s + offs_d[None, :] * sy_d
    tl.store(y, y1.to(Y.dtype.element_ty), mask=ok)
    tl.store(y + HALF * sy_d, y2.to(Y.dtype.element_ty), mask=ok)


def _block_s(half: int) -> int:
    # Under the interpreter, small row blocks make small test sequences span several blocks.
    return 4 if interpreting() else max(1, min(64, 4096 // half))


def _apply(x, cos, sin, backward):
    B, H, S, D = x.shape
    y = torch.empty_like(x, memory_format=torch.contiguous_format)
    half = triton.next_power_of_2(D // 2)
    block_s = _block_s(half)
    _rotary[(triton.cdiv(S, block_s), B * H)](
        x, cos, sin, y, *x.stride(), *cos.stride(), *sin.stride(), *y.stride(),
        H, S, D // 2, BLOCK_S=block_s, BLOCK_HALF=half, BACKWARD=backward,
    )
    return y


class _Rotary(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, cos, sin):
        if x.dim() != 4 or x.shape[-1] % 2:
            raise ValueError(f"rotary_embedding wants x [B, H, S, D] with D even, got {tuple(x.shape)}")
        cos = torch.broadcast_to(cos, x.shape)
        sin = torch.broadcast_to(sin, x.shape)
        ctx.save_for_backward(cos, sin)
        return _apply(x, cos, sin, backward=False)

    @staticmethod
    def backward(ctx, dy):
        cos, sin = ctx.saved_tensors
        return _apply(dy, cos, sin, backward=True), None, None


def rotary_embedding(x, cos, sin):
    return _Rotary.apply(x, cos, sin)
