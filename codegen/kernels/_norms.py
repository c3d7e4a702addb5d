"""RMSNorm and LayerNorm over the last dim. One kernel pair serves both (RMS is a constexpr):
they differ only in subtracting the mean. Each row fits one block; statistics are fp32."""

import torch
import triton
import triton.language as tl

from ._util import persistent_programs

MAX_N = 65536  # one row per block: longer rows would spill registers


@triton.jit
def _norm_fwd(
    X, W, B, Y, Mean, Rstd, stride_x, stride_y, N, eps,
    BLOCK: tl.constexpr, RMS: tl.constexpr, HAS_W: tl.constexpr, HAS_B: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK)
    valid = cols < N
    x = tl.load(X + row * stride_x + cols, mask=valid, other=0.0).to(tl.float32)
    if RMS:
        xc = x
    else:
        mean = tl.sum(x, 0) / N
        xc = tl.where(valid, x - mean, 0.0)
        tl.store(Mean + row, mean)
    rstd = 1.0 / tl.sqrt(tl.sum(xc * xc, 0) / N + eps)
    tl.store(Rstd + row, rstd)
    y = xc * rstd
    if HAS_W:
        y = y * tl.load(W + cols, mask=valid, other=0.0).to(tl.float32)
    if HAS_B:
        y = y + tl.load(B + cols, mask=valid, other=0.0).to(tl.float32)
    tl.store(Y + row * stride_y + cols, y.to(Y.dtype.element_ty), mask=valid)


@triton.jit
def _norm_bwd(
    X, W, DY, DX, Mean, Rstd, DW, DB, M, N, stride_x, stride_dy, stride_dx,
    BLOCK: tl.constexpr, RMS: tl.constexpr, HAS_W: tl.constexpr, HAS_B: tl.constexpr,
):
    # Each program loops over rows pid, pid + G, ... and keeps fp32 partial sums of the weight
    # and bias gradients, written as row `pid` of DW / DB and summed over programs by the caller.
    pid = tl.program_id(0)
    cols = tl.arange(0, BLOCK)
    valid = cols < N
    if HAS_W:
        w = tl.load(W + cols, mask=valid, other=0.0).to(tl.float32)
    dw = tl.zeros([BLOCK], dtype=tl.float32)
    db = tl.zeros([BLOCK], dtype=tl.float32)
    # An int64 row index keeps row * stride from overflowing on large inputs.
    for row in range(pid.to(tl.int64), M, tl.num_programs(0)):
        x = tl.load(X + row * stride_x + cols, mask=valid, other=0.0).to(tl.float32)
        dy = tl.load(DY + row * stride_dy + cols, mask=valid, other=0.0).to(tl.float32)
        rstd = tl.load(Rstd + row)
        if RMS:
            xhat = x * rstd
        else:
            xhat = tl.where(valid, (x - tl.load(Mean + row)) * rstd, 0.0)
        g = dy
        if HAS_W:
            g = dy * w
        # d(xhat)/dx projects out the directions the statistics depend on: xhat (both norms)
        # and the constant vector (LayerNorm's mean).
        dx = g - xhat * (tl.sum(g * xhat, 0) / N)
        if not RMS:
            dx = dx - tl.sum(g, 0) / N
        tl.store(DX + row * stride_dx + cols, (dx * rstd).to(DX.dtype.element_ty), mask=valid)
        dw += dy * xhat
        db += dy
    if HAS_W:
        tl.store(DW + pid * N + cols, dw, mask=valid)
    if HAS_B:
        tl.store(DB + pid * N + cols, db, mask=valid)


def _rows(t: torch.Tensor, n: int) -> torch.Tensor:
    t = t.reshape(-1, n)  # a view whenever the leading dims allow it
    return t if t.stride(-1) == 1 else t.contiguous()


def _launch(block: int, backward: bool) -> dict:
    """num_warps and num_stages of the forward or backward kernel for rows of `block` elements."""
    return dict(num_warps=min(max(block // 256, 1), 16 if backward else 8), num_stages=1)


# Backward programs per SM: each keeps fp32 partial weight and bias gradients of one row's width.
# One program of 16 warps per SM was the fastest backward of `python bench/kernels.py --tune-memory`
# (H100, 8192 x 8192 bf16): fewer registers per thread than 8 warps, and fewer partial rows to sum.
_BWD_PROGRAMS_PER_SM = 1


class _Norm(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, weight, bias, eps, rms):
        n = x.shape[-1]
        if n > MAX_N:
            raise ValueError(f"norm kernels support rows of at most {MAX_N} elements, got {n}")
        x2 = _rows(x, n)
        weight, bias = (None if t is None else t.contiguous() for t in (weight, bias))
        m = x2.shape[0]
        y = torch.empty((m, n), dtype=x.dtype, device=x.device)
        rstd = torch.empty(m, dtype=torch.float32, device=x.device)
        mean = rstd if rms else torch.empty_like(rstd)  # unused by the RMS kernel
        block = triton.next_power_of_2(n)
        _norm_fwd[(m,)](
            x2, x2 if weight is None else weight, x2 if bias is None else bias, y, mean, rstd,
            x2.stride(0), y.stride(0), n, eps,
            BLOCK=block, RMS=rms, HAS_W=weight is not None, HAS_B=bias is not None,
            **_launch(block, backward=False),
        )
        ctx.save_for_backward(x2, weight, bias, mean, rstd)
        ctx.rms = rms
        return y.view(x.shape)

    @staticmethod
    def backward(ctx, dy):
        x2, weight, bias, mean, rstd = ctx.saved_tensors
        m, n = x2.shape
        dy2 = _rows(dy, n)
        dx = torch.empty_like(x2)
        programs = persistent_programs(x2.device, m, per_sm=_BWD_PROGRAMS_PER_SM)
        dw = torch.empty((programs, n), dtype=torch.float32, device=x2.device)
        db = torch.empty_like(dw) if bias is not None else dw
        block = triton.next_power_of_2(n)
        _norm_bwd[(programs,)](
            x2, x2 if weight is None else weight, dy2, dx, mean, rstd, dw, db, m, n,
            x2.stride(0), dy2.stride(0), dx.stride(0),
            BLOCK=block, RMS=ctx.rms, HAS_W=weight is not None, HAS_B=bias is not None,
            **_launch(block, backward=True),
        )
        dweight = dw.sum(0).to(weight.dtype) if weight is not None else None
        dbias = db.sum(0).to(bias.dtype) if bias is not None else None
        return dx.view(dy.shape), dweight, dbias, None, None


def rms_norm(x, weight, eps):
    return _Norm.apply(x, weight, None, eps, True)


def layer_norm(x, weight, bias, eps):
    return _Norm.apply(x, weight, bias, eps, False)
