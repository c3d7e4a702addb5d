"""Flash-attention style attention that also returns the logsumexp.

Forward: one program per (query block, batch x head) walks the key blocks with an online
softmax. Backward: one kernel per key block accumulates dk and dv over the query blocks, and one
per query block accumulates dq over the key blocks; both recompute the probabilities from the
saved lse. Two kernels instead of atomics keep the gradients deterministic.
"""

import torch
import triton
import triton.language as tl

from autopar.runtime.context_parallel import flat_heads

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
def _rows(ptr, offs, offs_d, stride_row, stride_d, n, D):
    """Pointers to a [rows, BLOCK_D] tile of an [n, D] matrix, and where it lies inside."""
    ok = (offs[:, None] < n) & (offs_d[None, :] < D)
    return ptr + offs[:, None] * stride_row + offs_d[None, :] * stride_d, ok


@triton.jit
def _load_rows(ptr, offs, offs_d, stride_row, stride_d, n, D):
    ptrs, ok = _rows(ptr, offs, offs_d, stride_row, stride_d, n, D)
    return tl.load(ptrs, mask=ok, other=0.0)


@triton.jit
def _store_rows(ptr, value, offs, offs_d, stride_row, stride_d, n, D):
    ptrs, ok = _rows(ptr, offs, offs_d, stride_row, stride_d, n, D)
    tl.store(ptrs, value.to(ptr.dtype.element_ty), mask=ok)


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
    bh = tl.program_id(1).to(tl.int64)
    b = bh // H
    h = bh % H
    K += b * sk_b + h * sk_h
    V += b * sv_b + h * sv_h
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, BLOCK_D)
    q = _load_rows(Q + b * sq_b + h * sq_h, offs_m, offs_d, sq_m, sq_d, Sq, D)
    m_i = tl.zeros([BLOCK_M], dtype=tl.float32) + float("-inf")
    l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_D], dtype=tl.float32)
    end = Skv
    if CAUSAL:  # keys past this block's last query are masked for all its rows
        end = tl.minimum(Skv, (pid_m + 1) * BLOCK_M)
    for start_n in range(0, end, BLOCK_N):
        offs_n = start_n + tl.arange(0, BLOCK_N)
        k = _load_rows(K, offs_n, offs_d, sk_n, sk_d, Skv, D)
        s = _scores(
            q, tl.trans(k), Mask, b * sm_b + h * sm_h, sm_m, sm_n, offs_m, offs_n, Sq, Skv, scale,
            CAUSAL, MASK_KIND, UPCAST, PRECISION,
        )
        m_new = tl.maximum(m_i, tl.max(s, 1))
        # While a row has seen only masked keys its max is -inf; shifting by 0 instead keeps
        # exp(-inf - shift) = 0 rather than nan.
        shift = tl.where(m_new == float("-inf"), 0.0, m_new)
        p = tl.exp(s - shift[:, None])
        alpha = tl.exp(m_i - shift)
        l_i = l_i * alpha + tl.sum(p, 1)
        v = _load_rows(V, offs_n, offs_d, sv_n, sv_d, Skv, D)
        acc = acc * alpha[:, None] + _dot(p.to(v.dtype), v, UPCAST, PRECISION)
        m_i = m_new
    empty = l_i == 0.0  # every key masked: out 0, lse -inf
    l_safe = tl.where(empty, 1.0, l_i)
    _store_rows(Out + b * so_b + h * so_h, acc / l_safe[:, None], offs_m, offs_d, so_m, so_d, Sq, D)
    lse = tl.where(empty, float("-inf"), m_i + tl.log(l_safe))
    tl.store(Lse + bh * Sq + offs_m, lse, mask=offs_m < Sq)


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
    bh = tl.program_id(1).to(tl.int64)
    b = bh // H
    h = bh % H
    Q += b * sq_b + h * sq_h
    DO += b * sdo_b + h * sdo_h
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_d = tl.arange(0, BLOCK_D)
    k = _load_rows(K + b * sk_b + h * sk_h, offs_n, offs_d, sk_n, sk_d, Skv, D)
    v = _load_rows(V + b * sv_b + h * sv_h, offs_n, offs_d, sv_n, sv_d, Skv, D)
    dk = tl.zeros([BLOCK_N, BLOCK_D], dtype=tl.float32)
    dv = tl.zeros([BLOCK_N, BLOCK_D], dtype=tl.float32)
    start = 0
    if CAUSAL:  # queries before this key block never attend to it
        start = (pid_n * BLOCK_N // BLOCK_M) * BLOCK_M
    for start_m in range(start, Sq, BLOCK_M):
        offs_m = start_m + tl.arange(0, BLOCK_M)
        q = _load_rows(Q, offs_m, offs_d, sq_m, sq_d, Sq, D)
        do = _load_rows(DO, offs_m, offs_d, sdo_m, sdo_d, Sq, D)
        lse = tl.load(Lse + bh * Sq + offs_m, mask=offs_m < Sq, other=0.0)
        delta = tl.load(Delta + bh * Sq + offs_m, mask=offs_m < Sq, other=0.0)
        s = _scores(
            q, tl.trans(k), Mask, b * sm_b + h * sm_h, sm_m, sm_n, offs_m, offs_n, Sq, Skv, scale,
            CAUSAL, MASK_KIND, UPCAST, PRECISION,
        )
        # Rows with no attended key have lse -inf and scores -inf: shifting by 0 gives p = 0.
        p = tl.exp(s - tl.where(lse == float("-inf"), 0.0, lse)[:, None])
        dv += _dot(tl.trans(p.to(do.dtype)), do, UPCAST, PRECISION)
        ds = p * (_dot(do, tl.trans(v), UPCAST, PRECISION) - delta[:, None])
        dk += _dot(tl.trans(ds.to(q.dtype)), q, UPCAST, PRECISION)
    _store_rows(DK + bh * Skv * D, dk * scale, offs_n, offs_d, D, 1, Skv, D)
    _store_rows(DV + bh * Skv * D, dv, offs_n, offs_d, D, 1, Skv, D)


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
    bh = tl.program_id(1).to(tl.int64)
    b = bh // H
    h = bh % H
    K += b * sk_b + h * sk_h
    V += b * sv_b + h * sv_h
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, BLOCK_D)
    q = _load_rows(Q + b * sq_b + h * sq_h, offs_m, offs_d, sq_m, sq_d, Sq, D)
    do = _load_rows(DO + b * sdo_b + h * sdo_h, offs_m, offs_d, sdo_m, sdo_d, Sq, D)
    lse = tl.load(Lse + bh * Sq + offs_m, mask=offs_m < Sq, other=0.0)
    lse = tl.where(lse == float("-inf"), 0.0, lse)  # as in _attn_bwd_dkdv
    delta = tl.load(Delta + bh * Sq + offs_m, mask=offs_m < Sq, other=0.0)
    dq = tl.zeros([BLOCK_M, BLOCK_D], dtype=tl.float32)
    end = Skv
    if CAUSAL:
        end = tl.minimum(Skv, (pid_m + 1) * BLOCK_M)
    for start_n in range(0, end, BLOCK_N):
        offs_n = start_n + tl.arange(0, BLOCK_N)
        k = _load_rows(K, offs_n, offs_d, sk_n, sk_d, Skv, D)
        v = _load_rows(V, offs_n, offs_d, sv_n, sv_d, Skv, D)
        s = _scores(
            q, tl.trans(k), Mask, b * sm_b + h * sm_h, sm_m, sm_n, offs_m, offs_n, Sq, Skv, scale,
            CAUSAL, MASK_KIND, UPCAST, PRECISION,
        )
        p = tl.exp(s - lse[:, None])
        ds = p * (_dot(do, tl.trans(v), UPCAST, PRECISION) - delta[:, None])
        dq += _dot(ds.to(k.dtype), k, UPCAST, PRECISION)
    _store_rows(DQ + bh * Sq * D, dq * scale, offs_m, offs_d, D, 1, Sq, D)


# GPU tiles (BLOCK_M, BLOCK_N, num_warps, num_stages) per kernel, for 2-byte and 4-byte inputs.
# The program's own block is the large side: queries in the forward and dq kernels, keys in the
# dk/dv kernel, with the loop streaming tiles of the other side. The 2-byte tiles are the fastest
# of `python bench/kernels.py --tune-attention` on an H100 (B=4, H=32, S=4096, D=128, causal);
# the 4-byte ones are untuned.
_GPU_TILES = {
    "fwd": {2: (64, 64, 4, 3), 4: (64, 64, 8, 2)},
    "dkdv": {2: (64, 64, 4, 2), 4: (32, 64, 8, 2)},
    "dq": {2: (64, 16, 4, 3), 4: (64, 32, 8, 2)},
}

_INTERPRETER_TILES = {"fwd": (32, 16), "dkdv": (16, 32), "dq": (32, 16)}


def _config(q, kernel):
    """Tile sizes and launch flags for one of the three kernels."""
    if interpreting():
        # Small unequal tiles make small test shapes span several blocks with partial tails,
        # and exercise the causal loop bounds when query and key tiles differ, as on a GPU.
        block_m, block_n = _INTERPRETER_TILES[kernel]
        warps, stages = 4, 1
    else:
        block_m, block_n, warps, stages = _GPU_TILES[kernel][min(q.element_size(), 4)]
    return dict(
        BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_D=max(16, triton.next_power_of_2(q.shape[-1])),
        UPCAST=interpreting(), PRECISION=dot_precision(q.dtype), num_warps=warps, num_stages=stages,
    )


def _mask_args(mask, shape):
    """(pointer, strides, kind) for a mask broadcast to `shape` without copying."""
    if mask is None:
        return None, (0, 0, 0, 0), 0
    mask = torch.broadcast_to(mask, shape)
    return mask, mask.stride(), 1 if mask.dtype == torch.bool else 2


def _launch_forward(q, k, v, causal, mask, scale):
    """(out, lse, mask tensor, mask strides, mask kind) of attention over q [B, H, Sq, D], k, v
    [B, H, Skv, D]."""
    same_bhd = q.shape[:2] == k.shape[:2] and q.shape[3:] == k.shape[3:]
    if q.dim() != 4 or k.shape != v.shape or not same_bhd or not q.dtype == k.dtype == v.dtype:
        raise ValueError(
            "attention wants q [B, H, Sq, D] and k, v [B, H, Skv, D] of one dtype, got "
            f"{tuple(q.shape)} {q.dtype}, {tuple(k.shape)} {k.dtype}, {tuple(v.shape)} {v.dtype}"
        )
    B, H, Sq, D = q.shape
    Skv = k.shape[2]
    mask_t, mask_strides, mask_kind = _mask_args(mask, (B, H, Sq, Skv))
    out = torch.empty_like(q, memory_format=torch.contiguous_format)
    lse = torch.empty((B, H, Sq), dtype=torch.float32, device=q.device)
    cfg = _config(q, "fwd")
    grid = (triton.cdiv(Sq, cfg["BLOCK_M"]), B * H)
    _attn_fwd[grid](
        q, k, v, q if mask_t is None else mask_t, out, lse,
        *q.stride(), *k.stride(), *v.stride(), *mask_strides, *out.stride(),
        H, Sq, Skv, D, scale, CAUSAL=causal, MASK_KIND=mask_kind, **cfg,
    )
    return out, lse, mask_t, mask_strides, mask_kind


def _launch_backward(q, k, v, mask_t, mask_strides, mask_kind, causal, scale, dout, lse, delta):
    """(dq, dk, dv) given the rows' lse and delta = rowsum(dout * out), both fp32 and contiguous."""
    B, H, Sq, D = q.shape
    Skv = k.shape[2]
    dq = torch.empty_like(q, memory_format=torch.contiguous_format)
    dk = torch.empty_like(k, memory_format=torch.contiguous_format)
    dv = torch.empty_like(v, memory_format=torch.contiguous_format)
    common = (
        *q.stride(), *k.stride(), *v.stride(), *mask_strides, *dout.stride(),
        H, Sq, Skv, D, scale,
    )
    mask_arg = q if mask_t is None else mask_t
    cfg = _config(q, "dkdv")
    _attn_bwd_dkdv[(triton.cdiv(Skv, cfg["BLOCK_N"]), B * H)](
        q, k, v, mask_arg, dout, lse, delta, dk, dv, *common,
        CAUSAL=causal, MASK_KIND=mask_kind, **cfg,
    )
    cfg = _config(q, "dq")
    _attn_bwd_dq[(triton.cdiv(Sq, cfg["BLOCK_M"]), B * H)](
        q, k, v, mask_arg, dout, lse, delta, dq, *common,
        CAUSAL=causal, MASK_KIND=mask_kind, **cfg,
    )
    return dq, dk, dv


class _Attention(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, causal, mask, scale):
        out, lse, mask_t, mask_strides, mask_kind = _launch_forward(q, k, v, causal, mask, scale)
        ctx.save_for_backward(q, k, v, mask_t, out, lse)
        ctx.causal, ctx.scale, ctx.mask_strides, ctx.mask_kind = causal, scale, mask_strides, mask_kind
        ctx.set_materialize_grads(False)  # an unused output's gradient stays None, not zeros
        return out, lse

    @staticmethod
    def backward(ctx, dout, dlse):
        q, k, v, mask_t, out, lse = ctx.saved_tensors
        if dout is None:
            dout = torch.zeros_like(out)
        # dL/ds = p * (dp - delta) with delta = rowsum(dout * out); a gradient on lse adds
        # p * dlse, i.e. subtracts dlse from delta. Rows with lse -inf depend on nothing, and
        # a merge upstream may hand them a nan gradient.
        delta = (dout.float() * out.float()).sum(-1)
        if dlse is not None:
            delta = delta - torch.where(lse == float("-inf"), torch.zeros_like(dlse), dlse)
        dq, dk, dv = _launch_backward(q, k, v, mask_t, ctx.mask_strides, ctx.mask_kind, ctx.causal, ctx.scale,
                                      dout, lse, delta)
        return dq, dk, dv, None, None, None


class RingBlocks:
    """Block attention for ``runtime.context_parallel.ring_attention`` on these kernels (its
    ``MathBlocks`` interface): grouped q [B, Hkv, G, Lq, D] against one key/value block
    [B, Hkv, 1, Lk, D]; the key/value heads are expanded to the query heads for the kernels, and their
    gradients summed back."""

    @staticmethod
    def forward(q, k, v, mask, kind, scale):
        q4, k4, v4, m4 = flat_heads(q, k, v, mask)
        out, lse, *_ = _launch_forward(q4, k4, v4, kind == "diagonal", m4, scale)
        return out.view(q.shape), lse.view(q.shape[:-1])

    @staticmethod
    def backward(q, k, v, mask, kind, scale, dout, out, lse, delta):
        q4, k4, v4, m4 = flat_heads(q, k, v, mask)
        b, h, lq, d = q4.shape
        mask_t, mask_strides, mask_kind = _mask_args(m4, (b, h, lq, k4.shape[2]))
        rows = (b, h, lq)
        dq, dk, dv = _launch_backward(
            q4, k4, v4, mask_t, mask_strides, mask_kind, kind == "diagonal", scale, dout.reshape(q4.shape),
            lse.reshape(rows).float().contiguous(), delta.reshape(rows).float().contiguous())
        grouped = (b, k.shape[1], q.shape[2], k4.shape[2], d)
        return (dq.view(q.shape), dk.view(grouped).sum(2, keepdim=True, dtype=torch.float32),
                dv.view(grouped).sum(2, keepdim=True, dtype=torch.float32))


def attention(q, k, v, *, causal, mask, scale):
    if scale is None:
        scale = q.shape[-1] ** -0.5
    return _Attention.apply(q, k, v, causal, mask, scale)
