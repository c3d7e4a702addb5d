"""Flash-attention style attention that also returns the logsumexp.

Forward: one program per (query block, batch x head) walks the key blocks with an online
softmax. Backward: one kernel per key block accumulates dk and dv over the query blocks, and one
per query block accumulates dq over the key blocks; both recompute the probabilities from the
saved lse. Two kernels instead of atomics keep the gradients deterministic.
"""

import torch
import triton
import triton.language as tl

from ._util import dot_precision, interpreting


@triton.jit
def _dot(a, b, UPCAST: tl.constexpr, PRECISION: tl.constexpr):
    # The Triton interpreter multiplies bf16 operands as their raw uint16 bits; upcasting there
    # gives the fp32-accumulated product the GPU computes.
    if UPCAST:
        a = a.to(tl.float32)
        b = b.to(tl.float32)
    return tl.dot(a, b, input_precision=PRECISION)


@triton.jit
def _scores(
    q, kt, Mask, mask_base, stride_mm, stride_mn, offs_m, offs_n, Sq, Skv, scale,
    CAUSAL: tl.constexpr, MASK_KIND: tl.constexpr, UPCAST: tl.constexpr, PRECISION: tl.constexpr,
):
    """Scaled, masked scores of a [BLOCK_M, BLOCK_N] tile; -inf where a key is not attended."""
    s = _dot(q, kt, UPCAST, PRECISION) * scale
    keep = (offs_m[:, None] < Sq) & (offs_n[None, :] < Skv)
    if CAUSAL:
        keep = keep & (offs_n[None, :] <= offs_m[:, None])
    if MASK_KIND != 0:
        ptrs = Mask + mask_base + offs_m[:, None] * stride_mm + offs_n[None, :] * stride_mn
        if MASK_KIND == 1:
            keep = keep & (tl.load(ptrs, mask=keep, other=0) != 0)
        else:
            s = s + tl.load(ptrs, mask=keep, other=0.0).to(tl.float32)
    return tl.where(keep, s, float("-inf"))


@triton.jit
def _attn_fwd(
    Q, K, V, Mask, Out, Lse,
    sq_b, sq_h, sq_m, sq_d, sk_b, sk_h, sk_n, sk_d, sv_b, sv_h, sv_n, sv_d,
    sm_b, sm_h, sm_m, sm_n, so_b, so_h, so_m, so_d,
    H, Sq, Skv, D, scale,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr,
    CAUSAL: tl.constexpr, MASK_KIND: tl.constexpr, UPCAST: tl.constexpr, PRECISION: tl.constexpr,
):
    pid_m = tl.program_id(0)
    bh = tl.program_id(1)
    b = (bh // H).to(tl.int64)
    h = (bh % H).to(tl.int64)
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, BLOCK_D)
    d_ok = offs_d < D
    q = tl.load(
        Q + b * sq_b + h * sq_h + offs_m[:, None] * sq_m + offs_d[None, :] * sq_d,
        mask=(offs_m[:, None] < Sq) & d_ok[None, :], other=0.0,
    )
    m_i = tl.zeros([BLOCK_M], dtype=tl.float32) + float("-inf")
    l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_D], dtype=tl.float32)
    end = Skv
    if CAUSAL:  # keys past this block's last query are masked for all its rows
        end = tl.minimum(Skv, (pid_m + 1) * BLOCK_M)
    for start_n in range(0, end, BLOCK_N):
        offs_n = start_n + tl.arange(0, BLOCK_N)
        kt = tl.load(
            K + b * sk_b + h * sk_h + offs_n[None, :] * sk_n + offs_d[:, None] * sk_d,
            mask=(offs_n[None, :] < Skv) & d_ok[:, None], other=0.0,
        )
        s = _scores(
            q, kt, Mask, b * sm_b + h * sm_h, sm_m, sm_n, offs_m, offs_n, Sq, Skv, scale,
            CAUSAL, MASK_KIND, UPCAST, PRECISION,
        )
        m_new = tl.maximum(m_i, tl.max(s, 1))
        # While a row has seen only masked keys its max is -inf; shifting by 0 instead keeps
        # exp(-inf - shift) = 0 rather than nan.
        shift = tl.where(m_new == float("-inf"), 0.0, m_new)
        p = tl.exp(s - shift[:, None])
        alpha = tl.exp(m_i - shift)
        l_i = l_i * alpha + tl.sum(p, 1)
        v = tl.load(
            V + b * sv_b + h * sv_h + offs_n[:, None] * sv_n + offs_d[None, :] * sv_d,
            mask=(offs_n[:, None] < Skv) & d_ok[None, :], other=0.0,
        )
        acc = acc * alpha[:, None] + _dot(p.to(v.dtype), v, UPCAST, PRECISION)
        m_i = m_new
    empty = l_i == 0.0  # every key masked: out 0, lse -inf
    l_safe = tl.where(empty, 1.0, l_i)
    out = acc / l_safe[:, None]
    lse = tl.where(empty, float("-inf"), m_i + tl.log(l_safe))
    row_ok = offs_m < Sq
    tl.store(
        Out + b * so_b + h * so_h + offs_m[:, None] * so_m + offs_d[None, :] * so_d,
        out.to(Out.dtype.element_ty), mask=row_ok[:, None] & d_ok[None, :],
    )
    tl.store(Lse + bh.to(tl.int64) * Sq + offs_m, lse, mask=row_ok)


@triton.jit
def _attn_bwd_dkdv(
    Q, K, V, Mask, DO, Lse, Delta, DK, DV,
    sq_b, sq_h, sq_m, sq_d, sk_b, sk_h, sk_n, sk_d, sv_b, sv_h, sv_n, sv_d,
    sm_b, sm_h, sm_m, sm_n, sdo_b, sdo_h, sdo_m, sdo_d,
    H, Sq, Skv, D, scale,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr,
    CAUSAL: tl.constexpr, MASK_KIND: tl.constexpr, UPCAST: tl.constexpr, PRECISION: tl.constexpr,
):
    pid_n = tl.program_id(0)
    bh = tl.program_id(1)
    b = (bh // H).to(tl.int64)
    h = (bh % H).to(tl.int64)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_d = tl.arange(0, BLOCK_D)
    d_ok = offs_d < D
    kv_ok = (offs_n[:, None] < Skv) & d_ok[None, :]
    k = tl.load(K + b * sk_b + h * sk_h + offs_n[:, None] * sk_n + offs_d[None, :] * sk_d, mask=kv_ok, other=0.0)
    v = tl.load(V + b * sv_b + h * sv_h + offs_n[:, None] * sv_n + offs_d[None, :] * sv_d, mask=kv_ok, other=0.0)
    kt = tl.trans(k)
    vt = tl.trans(v)
    dk = tl.zeros([BLOCK_N, BLOCK_D], dtype=tl.float32)
    dv = tl.zeros([BLOCK_N, BLOCK_D], dtype=tl.float32)
    start = 0
    if CAUSAL:  # queries before this key block never attend to it
        start = (pid_n * BLOCK_N // BLOCK_M) * BLOCK_M
    for start_m in range(start, Sq, BLOCK_M):
        offs_m = start_m + tl.arange(0, BLOCK_M)
        m_ok = offs_m < Sq
        rows_ok = m_ok[:, None] & d_ok[None, :]
        q = tl.load(Q + b * sq_b + h * sq_h + offs_m[:, None] * sq_m + offs_d[None, :] * sq_d, mask=rows_ok, other=0.0)
        do = tl.load(DO + b * sdo_b + h * sdo_h + offs_m[:, None] * sdo_m + offs_d[None, :] * sdo_d, mask=rows_ok, other=0.0)
        lse = tl.load(Lse + bh.to(tl.int64) * Sq + offs_m, mask=m_ok, other=0.0)
        delta = tl.load(Delta + bh.to(tl.int64) * Sq + offs_m, mask=m_ok, other=0.0)
        s = _scores(
            q, kt, Mask, b * sm_b + h * sm_h, sm_m, sm_n, offs_m, offs_n, Sq, Skv, scale,
            CAUSAL, MASK_KIND, UPCAST, PRECISION,
        )
        # Rows with no attended key have lse -inf and scores -inf: shifting by 0 gives p = 0.
        p = tl.exp(s - tl.where(lse == float("-inf"), 0.0, lse)[:, None])
        dv += _dot(tl.trans(p.to(do.dtype)), do, UPCAST, PRECISION)
        ds = p * (_dot(do, vt, UPCAST, PRECISION) - delta[:, None])
        dk += _dot(tl.trans(ds.to(q.dtype)), q, UPCAST, PRECISION)
    tl.store(DK + bh.to(tl.int64) * Skv * D + offs_n[:, None] * D + offs_d[None, :], (dk * scale).to(DK.dtype.element_ty), mask=kv_ok)
    tl.store(DV + bh.to(tl.int64) * Skv * D + offs_n[:, None] * D + offs_d[None, :], dv.to(DV.dtype.element_ty), mask=kv_ok)


@triton.jit
def _attn_bwd_dq(
    Q, K, V, Mask, DO, Lse, Delta, DQ,
    sq_b, sq_h, sq_m, sq_d, sk_b, sk_h, sk_n, sk_d, sv_b, sv_h, sv_n, sv_d,
    sm_b, sm_h, sm_m, sm_n, sdo_b, sdo_h, sdo_m, sdo_d,
    H, Sq, Skv, D, scale,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr,
    CAUSAL: tl.constexpr, MASK_KIND: tl.constexpr, UPCAST: tl.constexpr, PRECISION: tl.constexpr,
):
    pid_m = tl.program_id(0)
    bh = tl.program_id(1)
    b = (bh // H).to(tl.int64)
    h = (bh % H).to(tl.int64)
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, BLOCK_D)
    d_ok = offs_d < D
    m_ok = offs_m < Sq
    rows_ok = m_ok[:, None] & d_ok[None, :]
    q = tl.load(Q + b * sq_b + h * sq_h + offs_m[:, None] * sq_m + offs_d[None, :] * sq_d, mask=rows_ok, other=0.0)
    do = tl.load(DO + b * sdo_b + h * sdo_h + offs_m[:, None] * sdo_m + offs_d[None, :] * sdo_d, mask=rows_ok, other=0.0)
    lse = tl.load(Lse + bh.to(tl.int64) * Sq + offs_m, mask=m_ok, other=0.0)
    lse = tl.where(lse == float("-inf"), 0.0, lse)
    delta = tl.load(Delta + bh.to(tl.int64) * Sq + offs_m, mask=m_ok, other=0.0)
    dq = tl.zeros([BLOCK_M, BLOCK_D], dtype=tl.float32)
    end = Skv
    if CAUSAL:
        end = tl.minimum(Skv, (pid_m + 1) * BLOCK_M)
    for start_n in range(0, end, BLOCK_N):
        offs_n = start_n + tl.arange(0, BLOCK_N)
        kv_ok = (offs_n[:, None] < Skv) & d_ok[None, :]
        k = tl.load(K + b * sk_b + h * sk_h + offs_n[:, None] * sk_n + offs_d[None, :] * sk_d, mask=kv_ok, other=0.0)
        vt = tl.load(V + b * sv_b + h * sv_h + offs_n[None, :] * sv_n + offs_d[:, None] * sv_d, mask=(offs_n[None, :] < Skv) & d_ok[:, None], other=0.0)
        s = _scores(
            q, tl.trans(k), Mask, b * sm_b + h * sm_h, sm_m, sm_n, offs_m, offs_n, Sq, Skv, scale,
            CAUSAL, MASK_KIND, UPCAST, PRECISION,
        )
        p = tl.exp(s - lse[:, None])
        ds = p * (_dot(do, vt, UPCAST, PRECISION) - delta[:, None])
        dq += _dot(ds.to(k.dtype), k, UPCAST, PRECISION)
    tl.store(
        DQ + bh.to(tl.int64) * Sq * D + offs_m[:, None] * D + offs_d[None, :],
        (dq * scale).to(DQ.dtype.element_ty), mask=rows_ok,
    )


def _config(q):
    """Tile sizes and launch flags shared by the three kernels."""
    d = q.shape[-1]
    if interpreting():
        # Small tiles make small test shapes span several blocks, with partial tails.
        block_m, block_n, warps, stages = 16, 16, 4, 1
    else:
        block_m, block_n, warps, stages = (128 if q.element_size() == 2 else 64), 64, 8, 2
    return dict(
        BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_D=max(16, triton.next_power_of_2(d)),
        UPCAST=interpreting(), PRECISION=dot_precision(q.dtype), num_warps=warps, num_stages=stages,
    )


def _mask_args(mask, shape):
    """(pointer, strides, kind) for a mask broadcast to `shape` without copying."""
    if mask is None:
        return None, (0, 0, 0, 0), 0
    mask = torch.broadcast_to(mask, shape)
    return mask, mask.stride(), 1 if mask.dtype == torch.bool else 2


class _Attention(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, causal, mask, scale):
        if q.dim() != 4 or k.shape != v.shape or q.shape[:2] != k.shape[:2] or q.shape[3] != k.shape[3]:
            raise ValueError(
                "attention wants q [B, H, Sq, D] and k, v [B, H, Skv, D], got "
                f"{tuple(q.shape)}, {tuple(k.shape)}, {tuple(v.shape)}"
            )
        B, H, Sq, D = q.shape
        Skv = k.shape[2]
        mask_t, mask_strides, mask_kind = _mask_args(mask, (B, H, Sq, Skv))
        out = torch.empty_like(q, memory_format=torch.contiguous_format)
        lse = torch.empty((B, H, Sq), dtype=torch.float32, device=q.device)
        cfg = _config(q)
        grid = (triton.cdiv(Sq, cfg["BLOCK_M"]), B * H)
        _attn_fwd[grid](
            q, k, v, q if mask_t is None else mask_t, out, lse,
            *q.stride(), *k.stride(), *v.stride(), *mask_strides, *out.stride(),
            H, Sq, Skv, D, scale, CAUSAL=causal, MASK_KIND=mask_kind, **cfg,
        )
        ctx.save_for_backward(q, k, v, mask_t, out, lse)
        ctx.causal, ctx.scale, ctx.mask_strides, ctx.mask_kind = causal, scale, mask_strides, mask_kind
        ctx.set_materialize_grads(False)  # an unused output's gradient stays None, not zeros
        return out, lse

    @staticmethod
    def backward(ctx, dout, dlse):
        q, k, v, mask_t, out, lse = ctx.saved_tensors
        B, H, Sq, D = q.shape
        Skv = k.shape[2]
        if dout is None:
            dout = torch.zeros_like(out)
        # dL/ds = p * (dp - delta) with delta = rowsum(dout * out); a gradient on lse adds
        # p * dlse, i.e. subtracts dlse from delta. Rows with lse -inf depend on nothing, and
        # a merge upstream may hand them a nan gradient.
        delta = (dout.float() * out.float()).sum(-1)
        if dlse is not None:
            delta = delta - torch.where(lse == float("-inf"), torch.zeros_like(dlse), dlse)
        dq = torch.empty_like(q, memory_format=torch.contiguous_format)
        dk = torch.empty_like(k, memory_format=torch.contiguous_format)
        dv = torch.empty_like(v, memory_format=torch.contiguous_format)
        cfg = _config(q)
        common = (
            *q.stride(), *k.stride(), *v.stride(), *ctx.mask_strides, *dout.stride(),
            H, Sq, Skv, D, ctx.scale,
        )
        mask_arg = q if mask_t is None else mask_t
        flags = dict(CAUSAL=ctx.causal, MASK_KIND=ctx.mask_kind, **cfg)
        _attn_bwd_dkdv[(triton.cdiv(Skv, cfg["BLOCK_N"]), B * H)](
            q, k, v, mask_arg, dout, lse, delta, dk, dv, *common, **flags
        )
        _attn_bwd_dq[(triton.cdiv(Sq, cfg["BLOCK_M"]), B * H)](
            q, k, v, mask_arg, dout, lse, delta, dq, *common, **flags
        )
        return dq, dk, dv, None, None, None


def attention(q, k, v, *, causal, mask, scale):
    if scale is None:
        scale = q.shape[-1] ** -0.5
    return _Attention.apply(q, k, v, causal, mask, scale)
