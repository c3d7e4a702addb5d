"""Context-parallel (ring) attention: query, key and value all split along the sequence over a group.

Each rank keeps its query rows. Key/value blocks travel around the ring (rank r sends to r+1 and
receives from r-1) while every rank attends to the block it holds; partial results merge exactly
through their logsumexps, so the output equals unsplit attention up to rounding. The backward runs the
ring again: key/value blocks circulate with their gradient accumulators, which arrive back at their
owners after a full turn. Only the local q, k, v, mask, output and logsumexp are kept for backward; each
block is freed as soon as its transfer completes (the rule's memory hooks count what the ring holds).

Causal attention is load-balanced as in Llama 3's context parallel: the sequence is cut into 2n
half-chunks and rank i works on half-chunks i and 2n-1-i, so every rank does the same work. The op
takes and returns the plan's contiguous layout (rank r holds chunk r) and moves the half-chunks
there and back itself (one point-to-point exchange of q, k, v and one of the output; the same for the
gradients).

Transfers are point-to-point (``isend``/``irecv`` through ``collectives._p2p``; gloo and NCCL both have
them); each step's transfer is started before that step's block attention and waited after it, so
they overlap. Block attention
is ATen's CPU flash attention, which returns the logsumexp and whose backward takes the merged one
(``AtenBlocks``; ``MathBlocks`` elsewhere); the kernel library passes its Triton flash attention.
"""
from __future__ import annotations

import torch

from autopar.errors import ShardingError
from autopar.runtime import collectives as C

__all__ = ["OP_COLLECTIVES", "AtenBlocks", "MathBlocks", "ring_attention"]


class _Ring:
    """The group, this rank's place in it, and point-to-point transfers addressed by group rank
    (``collectives._p2p``, which the rule tests' simulated mesh replaces)."""

    def __init__(self, name: str):
        self.name = name
        self.rank, self.size = C._group(name)

    def shift(self, xs: list[torch.Tensor]):
        """Start sending each of ``xs`` to the next rank and receiving the previous rank's into new
        buffers. Returns (buffers, requests); the buffers are valid once ``_finish(requests)``."""
        bufs = [torch.empty_like(x, memory_format=torch.contiguous_format) for x in xs]
        dest, src = (self.rank + 1) % self.size, (self.rank - 1) % self.size
        return bufs, C._p2p([(dest, x) for x in xs], [(src, b) for b in bufs], self.name)

    def exchange(self, parts: dict, source_of, dest_of, wanted) -> list[torch.Tensor]:
        """Move half-chunks between ranks: ``parts`` maps the half-chunks this rank holds to their
        tensors; ``dest_of(c)`` is the rank that wants half-chunk c, ``source_of(c)`` the rank that
        holds it now. Returns the tensors of ``wanted`` in order."""
        like = next(iter(parts.values()))
        got = {c: parts[c] if source_of(c) == self.rank else torch.empty_like(like) for c in wanted}
        recvs = [(source_of(c), got[c]) for c in wanted if source_of(c) != self.rank]
        sends = [(dest_of(c), x.contiguous()) for c, x in parts.items() if dest_of(c) != self.rank]
        _finish(C._p2p(sends, recvs, self.name))
        return [got[c] for c in wanted]


def _finish(reqs: list) -> None:
    """Wait for transfers and drop their requests: a send's request holds its tensor until dropped, so
    a block already passed on is freed here rather than when the next step's requests replace it."""
    for r in reqs:
        r.wait()
    reqs.clear()


def _balanced_owner(c: int, n: int) -> int:
    return c if c < n else 2 * n - 1 - c


def _to_balanced(x: torch.Tensor, ring: _Ring) -> torch.Tensor:
    """Contiguous layout (rank r: half-chunks 2r, 2r+1 along dim 2) -> balanced (rank i: i, 2n-1-i)."""
    r, n = ring.rank, ring.size
    lo, hi = x.chunk(2, dim=2)
    got = ring.exchange({2 * r: lo.contiguous(), 2 * r + 1: hi.contiguous()},
                        lambda c: c // 2, lambda c: _balanced_owner(c, n), [r, 2 * n - 1 - r])
    return torch.cat(got, dim=2)


def _from_balanced(x: torch.Tensor, ring: _Ring) -> torch.Tensor:
    r, n = ring.rank, ring.size
    first, second = x.chunk(2, dim=2)
    got = ring.exchange({r: first.contiguous(), 2 * n - 1 - r: second.contiguous()},
                        lambda c: _balanced_owner(c, n), lambda c: c // 2, [2 * r, 2 * r + 1])
    return torch.cat(got, dim=2)


def _segments(rank: int, n: int, length: int, balanced: bool):
    """(global chunk index, local offset, length) of the sequence pieces a rank holds. Chunks are the
    n contiguous chunks, or the 2n half-chunks when balanced; equal indices mean equal positions."""
    if not balanced:
        return [(rank, 0, length)]
    half = length // 2
    return [(rank, 0, half), (2 * n - 1 - rank, half, half)]


def _pair_kind(qc: int, kc: int, causal: bool) -> str:
    if not causal or kc < qc:
        return "full"
    return "diagonal" if kc == qc else "skip"


def _scores(q, k, mask, kind, scale):
    """Scaled scores [B, Hkv, G, Lq, Lk] in fp32 with the mask and causal diagonal applied."""
    s = torch.matmul(q, k.transpose(-1, -2)) * scale
    if mask is not None:
        s = s.masked_fill(~mask, float("-inf")) if mask.dtype == torch.bool else s + mask
    if kind == "diagonal":
        lq, lk = s.shape[-2:]
        keep = torch.ones(lq, lk, dtype=torch.bool, device=s.device).tril()
        s = s.masked_fill(~keep, float("-inf"))
    return s


def _acc(x):
    """The dtype block results are computed and merged in: at least fp32."""
    return torch.promote_types(x.dtype, torch.float32)


def _finite(lse):
    return torch.where(torch.isinf(lse), torch.zeros_like(lse), lse)


class MathBlocks:
    """Block attention in ATen math, in fp32 or wider: the reference, and the path off the CPU without
    Triton. It materializes one block's scores.

    A block implementation gives ``forward(q, k, v, mask, kind, scale) -> (out, lse)`` for query rows
    q [B, Hkv, G, Lq, D] (G query heads per key/value head) over one key/value block k, v
    [B, Hkv, 1, Lk, D], with ``kind`` "full" or "diagonal" (causal within the block, top-left
    aligned), and ``backward(q, k, v, mask, kind, scale, dout, out, lse, delta) -> (dq, dk, dv)``,
    the block's share of the gradients given the rows' merged output ``out``, ``lse`` and
    ``delta = rowsum(dout * out)`` of the whole attention (flash attention's backward, block-wise). A
    row with no key left has out 0 and lse -inf. ``AtenBlocks`` (the default) and the kernel
    library's Triton blocks are the others."""

    @staticmethod
    def forward(q, k, v, mask, kind, scale):
        acc = _acc(q)
        s = _scores(q.to(acc), k.to(acc), mask, kind, scale)
        lse = torch.logsumexp(s, dim=-1)
        p = torch.exp(s - _finite(lse).unsqueeze(-1))
        return torch.matmul(p, v.to(acc)), lse

    @staticmethod
    def backward(q, k, v, mask, kind, scale, dout, out, lse, delta):
        acc = _acc(q)
        q, k, v, dout = q.to(acc), k.to(acc), v.to(acc), dout.to(acc)
        s = _scores(q, k, mask, kind, scale)
        p = torch.exp(s - _finite(lse).unsqueeze(-1))
        p = torch.where(torch.isinf(lse).unsqueeze(-1), torch.zeros_like(p), p)
        dv = torch.matmul(p.transpose(-1, -2), dout).sum(2, keepdim=True)
        ds = p * (torch.matmul(dout, v.transpose(-1, -2)) - delta.unsqueeze(-1))
        dq = torch.matmul(ds, k) * scale
        dk = torch.matmul(ds.transpose(-1, -2), q).sum(2, keepdim=True) * scale
        return dq, dk, dv


def flat_heads(q, k, v, mask):
    """Grouped block operands as [B, H, L, D] (the key/value heads repeated for their query heads)
    and the mask as [B, H or 1, Lq, Lk]."""
    b, hkv, g, lq, d = q.shape
    lk = k.shape[3]
    q4 = q.reshape(b, hkv * g, lq, d)
    k4 = k.expand(b, hkv, g, lk, d).reshape(b, hkv * g, lk, d)
    v4 = v.expand(b, hkv, g, lk, d).reshape(b, hkv * g, lk, d)
    m4 = None if mask is None else mask.reshape(mask.shape[0], mask.shape[1] * mask.shape[2], *mask.shape[3:])
    return q4, k4, v4, m4


class AtenBlocks:
    """Block attention on ATen's CPU flash attention (``_scaled_dot_product_flash_attention_for_cpu``,
    which returns the logsumexp, and its backward, which takes the merged output and logsumexp), so no
    block's scores are ever materialized; ``MathBlocks`` on other devices."""

    @staticmethod
    def _additive(mask, q):
        if mask is None or mask.dtype != torch.bool:
            return None if mask is None else mask.to(q.dtype)
        return torch.zeros((), dtype=q.dtype, device=q.device).masked_fill(~mask, float("-inf"))

    @staticmethod
    def forward(q, k, v, mask, kind, scale):
        if q.device.type != "cpu":
            return MathBlocks.forward(q, k, v, mask, kind, scale)
        q4, k4, v4, m4 = flat_heads(q, k, v, mask)
        m4 = AtenBlocks._additive(m4, q4)
        out, lse = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(
            q4, k4, v4, 0.0, kind == "diagonal", attn_mask=m4, scale=scale)
        if m4 is not None:
            # The kernel gives a row with every key masked lse 0; it attends to nothing: -inf.
            empty = torch.broadcast_to(m4 == float("-inf"), (*q4.shape[:-1], k4.shape[2])).all(-1)
            lse = lse.masked_fill(empty, float("-inf"))
        return out.view(q.shape), lse.view(q.shape[:-1])

    @staticmethod
    def backward(q, k, v, mask, kind, scale, dout, out, lse, delta):
        if q.device.type != "cpu":
            return MathBlocks.backward(q, k, v, mask, kind, scale, dout, out, lse, delta)
        q4, k4, v4, m4 = flat_heads(q, k, v, mask)
        m4 = AtenBlocks._additive(m4, q4)
        b, h, lq, d = q4.shape
        # Rows with no key anywhere (lse -inf) get +inf, so that their probabilities are exp(-inf) = 0.
        lse4 = lse.masked_fill(torch.isinf(lse), float("inf")).reshape(b, h, lq).to(
            torch.promote_types(q.dtype, torch.float32)).contiguous()
        dq, dk, dv = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward(
            dout.reshape(q4.shape).contiguous(), q4.contiguous(), k4, v4, out.reshape(q4.shape).contiguous(), lse4,
            0.0, kind == "diagonal", attn_mask=m4, scale=scale)
        grouped = (b, k.shape[1], q.shape[2], k4.shape[2], d)
        return dq.view(q.shape), dk.view(grouped).sum(2, keepdim=True), dv.view(grouped).sum(2, keepdim=True)


def _merge(out, lse, o, lo):
    new = torch.logaddexp(lse, lo)
    shift = _finite(new)
    return (torch.exp(lse - shift).unsqueeze(-1) * out + torch.exp(lo - shift).unsqueeze(-1) * o), new


def _mask_block(mask, q_off, q_len, k_start, k_len):
    """The mask's part for local query rows [q_off, q_off+q_len) and global keys [k_start, ...)."""
    if mask is None:
        return None
    if mask.shape[-2] > 1:
        mask = mask[..., q_off:q_off + q_len, :]
    if mask.shape[-1] > 1:
        mask = mask[..., k_start:k_start + k_len]
    return mask


def _grouped(x, hkv):
    """[B, H, L, D] -> [B, Hkv, H/Hkv, L, D]: the query heads that share one key/value head."""
    b, h, l, d = x.shape
    return x.reshape(b, hkv, h // hkv, l, d)


def _grouped_mask(mask, hkv):
    if mask is None:
        return None
    while mask.dim() < 4:
        mask = mask.unsqueeze(0)
    b, h, lq, lk = mask.shape
    return mask.reshape(b, hkv, h // hkv, lq, lk) if h > 1 else mask.unsqueeze(1)


def _pairs(ring, src, length, causal, balanced):
    """(query piece, key piece, kind) for the block held at this step, skipping masked-out pairs."""
    for qc, qo, ql in _segments(ring.rank, ring.size, length, balanced):
        for kc, ko, kl in _segments(src, ring.size, length, balanced):
            kind = _pair_kind(qc, kc, causal)
            if kind != "skip":
                yield (qo, ql), (kc * kl, ko, kl), kind


def _attend(blocks, ring, qg, kv, gmask, out, lse, src, length, causal, balanced, scale):
    """Attend this rank's query rows to the key/value block of rank ``src`` and merge the result into
    ``out`` and ``lse`` in place."""
    kb, vb = kv[0].unsqueeze(2), kv[1].unsqueeze(2)
    for (qo, ql), (ks, ko, kl), kind in _pairs(ring, src, length, causal, balanced):
        o, lo = blocks.forward(qg[..., qo:qo + ql, :], kb[..., ko:ko + kl, :], vb[..., ko:ko + kl, :],
                               _mask_block(gmask, qo, ql, ks, kl), kind, scale)
        rows = slice(qo, qo + ql)
        out[..., rows, :], lse[..., rows] = _merge(out[..., rows, :], lse[..., rows], o.to(out.dtype), lo.to(lse.dtype))


def _attend_backward(blocks, ring, saved, kv, dq, dkv, src, length, causal, balanced, scale):
    """Add the gradients of rank ``src``'s key/value block (into ``dkv``) and of this rank's query rows
    against it (into ``dq``). ``saved`` holds the grouped q, mask, output gradient, output, logsumexp
    and delta."""
    qg, gmask, dog, outg, lse, delta = saved
    kb, vb = kv[0].unsqueeze(2), kv[1].unsqueeze(2)
    for (qo, ql), (ks, ko, kl), kind in _pairs(ring, src, length, causal, balanced):
        rows = slice(qo, qo + ql)
        gq, gk, gv = blocks.backward(qg[..., rows, :], kb[..., ko:ko + kl, :], vb[..., ko:ko + kl, :],
                                     _mask_block(gmask, qo, ql, ks, kl), kind, scale, dog[..., rows, :],
                                     outg[..., rows, :], lse[..., rows], delta[..., rows])
        dq[..., rows, :] += gq
        dkv[0][..., ko:ko + kl, :] += gk.squeeze(2)
        dkv[1][..., ko:ko + kl, :] += gv.squeeze(2)
        del gq, gk, gv          # before the next block's gradients are made


class _RingAttention(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, mask, causal, scale, name, blocks):
        ring = _Ring(name)
        balanced = causal and ring.size > 1
        if balanced:
            q, k, v = (_to_balanced(x, ring) for x in (q, k, v))
        hkv, length, acc = k.shape[1], k.shape[2], _acc(q)
        qg, gmask = _grouped(q, hkv), _grouped_mask(mask, hkv)
        out = torch.zeros(qg.shape, dtype=acc, device=q.device)
        lse = torch.full(qg.shape[:-1], float("-inf"), dtype=acc, device=q.device)
        kv = [k, v]
        for t in range(ring.size):
            # The next block arrives while this one is attended to.
            nxt, reqs = ring.shift(kv) if t < ring.size - 1 else (None, [])
            _attend(blocks, ring, qg, kv, gmask, out, lse, (ring.rank - t) % ring.size, length, causal, balanced,
                    scale)
            _finish(reqs)
            kv = nxt
        out = out.reshape(q.shape).to(q.dtype)
        ctx.save_for_backward(q, k, v, mask, out, lse)
        ctx.args = causal, scale, name, balanced, blocks
        if balanced:
            out = _from_balanced(out, ring)
        return out

    @staticmethod
    def backward(ctx, dout):
        q, k, v, mask, out, lse = ctx.saved_tensors
        causal, scale, name, balanced, blocks = ctx.args
        ring = _Ring(name)
        if balanced:
            dout = _to_balanced(dout, ring)
        hkv, length, acc = k.shape[1], k.shape[2], _acc(q)
        qg, dog, outg = _grouped(q, hkv), _grouped(dout.contiguous(), hkv), _grouped(out, hkv)
        delta = (dog.to(acc) * outg.to(acc)).sum(-1)
        saved = qg, _grouped_mask(mask, hkv), dog, outg, lse, delta
        dq = torch.zeros(qg.shape, dtype=acc, device=q.device)
        kv = [k, v]
        dkv = [torch.zeros(k.shape, dtype=acc, device=k.device), torch.zeros(v.shape, dtype=acc, device=v.device)]
        for t in range(ring.size):
            nxt, reqs = ring.shift(kv) if t < ring.size - 1 else (None, [])
            _attend_backward(blocks, ring, saved, kv, dq, dkv, (ring.rank - t) % ring.size, length, causal,
                             balanced, scale)
            # The block's gradient goes on with it; after the last step it reaches the block's owner.
            dnxt, dreqs = ring.shift(dkv) if ring.size > 1 else (dkv, [])
            _finish(reqs)
            _finish(dreqs)
            kv, dkv = nxt, dnxt
        grads = [dq.reshape(q.shape).to(q.dtype), dkv[0].to(k.dtype), dkv[1].to(v.dtype)]
        del dq, dkv, saved, qg, dog, outg, delta, dout
        if balanced:            # one at a time, each freed as its balanced copy is replaced
            for i in range(3):
                grads[i] = _from_balanced(grads[i], ring)
        return (*grads, None, None, None, None, None)


def ring_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | None, is_causal: bool,
                   scale: float | None, group: str, blocks=AtenBlocks) -> torch.Tensor:
    """``scaled_dot_product_attention(q, k, v, mask, is_causal=is_causal, scale=scale)`` with q, k and v
    split along the sequence (dim 2) over the group called ``group``: rank r holds the r-th of equal,
    contiguous chunks, and gets the r-th chunk of the output.

    k and v may have fewer heads than q (GQA/MQA: each key/value head serves H/Hkv query heads).
    ``mask`` (boolean, True = attend, or additive) holds this rank's query rows and every key:
    broadcastable to [B, H, S/n, S]. Causal attention needs the local length to be even (the
    load-balanced half-chunks). ``blocks`` computes attention over one block (``AtenBlocks``)."""
    _, n = C._group(group)
    if q.dim() != 4 or k.shape != v.shape or q.shape[2] != k.shape[2] or q.shape[1] % k.shape[1]:
        raise ShardingError(f"ring_attention wants q [B, H, L, D] and k, v [B, Hkv, L, D] with H a multiple of Hkv "
                            f"and one local length L, got q {tuple(q.shape)}, k {tuple(k.shape)}, v {tuple(v.shape)}")
    if is_causal and mask is not None:
        raise ShardingError("ring_attention: give is_causal or a mask, not both (as scaled_dot_product_attention)")
    if is_causal and n > 1 and q.shape[2] % 2:
        raise ShardingError(f"causal ring attention splits each rank's {q.shape[2]} positions into two load-balanced "
                            f"halves; the sequence ({q.shape[2] * n}) must divide by twice the ring size ({2 * n})")
    if mask is not None and mask.shape[-1] not in (1, q.shape[2] * n):
        raise ShardingError(f"ring_attention: the mask's last dim ({mask.shape[-1]}) must cover every key "
                            f"({q.shape[2] * n}) or broadcast (1)")
    scale = q.shape[-1] ** -0.5 if scale is None else scale
    return _RingAttention.apply(q, k, v, mask, bool(is_causal), float(scale), group, blocks)


# (kind, phase) of the transfers the op runs on its group (the last argument of every call): per ring
# step one send/receive of the key/value block forward; backward, the block and its gradient.
OP_COLLECTIVES = {ring_attention: (("send_recv", "forward"), ("send_recv", "backward"))}
