"""Reductions, normalization, softmax, attention, embedding and the loss."""
import math

import torch

from autopar.layout import P, R, S, local_shape
from autopar.passes.rules import OpCollective, register_rule
from autopar.passes.rules.helpers import dim_map_options, norm_dim

aten = torch.ops.aten


def _input_flops(ctx):
    return float(ctx.ins[0].numel)


def _reduced_dims(ctx):
    nd = ctx.ins[0].ndim
    dims = ctx.arg(1, "dim", None)
    if dims is None or dims == []:
        return set(range(nd))
    return {norm_dim(d, nd) for d in ([dims] if isinstance(dims, int) else dims)}


def _reduction(ctx, *, sum_like):
    nd = ctx.ins[0].ndim
    dims = _reduced_dims(ctx)
    keep = ctx.outs[0].ndim == nd

    def out_dim(d):
        return d if keep else d - sum(1 for r in dims if r < d)

    opts = dim_map_options(ctx, lambda d: None if d in dims else out_dim(d), partial=sum_like)
    if sum_like:
        # Summing over a sharded dim leaves each rank a partial sum.
        opts += [ctx.option([S(d)], P) for d in sorted(dims) if ctx.ins[0].shape[d] > 1]
    return opts


@register_rule(aten.sum.dim_IntList, aten.sum.default, flops=_input_flops)
def sum_rule(ctx):
    return _reduction(ctx, sum_like=True)


@register_rule(aten.mean.dim, aten.mean.default, aten.amax.default, aten.amin.default,
               aten.var.correction, aten.std.correction, aten.any.dim, aten.all.dim, flops=_input_flops)
def reduction_rule(ctx):
    return _reduction(ctx, sum_like=False)


@register_rule(aten._softmax.default, aten.softmax.int, aten._log_softmax.default, aten.log_softmax.int,
               flops=lambda ctx: 5.0 * ctx.ins[0].numel)
def softmax_rule(ctx):
    dim = norm_dim(ctx.args[1], ctx.ins[0].ndim)
    return dim_map_options(ctx, lambda d: None if d == dim else d, partial=False)


@register_rule(aten.layer_norm.default, aten.rms_norm.default,
               flops=lambda ctx: 8.0 * ctx.ins[0].numel)
def norm_rule(ctx):
    # Only the leading dims are sharded: the normalized ones need every element of a row.
    x = ctx.ins[0]
    normalized = len(ctx.args[1])
    return [ctx.option([S(d)] + [R] * (len(ctx.ins) - 1), S(d))
            for d in range(x.ndim - normalized) if x.shape[d] > 1]


def _sharding_axis(layout, dim):
    """The mesh axis that shards ``dim`` in ``layout``, or None."""
    return next((a for a, p in enumerate(layout) if p.is_shard and p.dim == dim), None)


def _embedding_local_call(ctx, in_layouts, args, kwargs, group_names):
    axis = _sharding_axis(in_layouts[0], 0)
    if axis is None:
        return None
    return "autopar.runtime.sharded_ops.vocab_parallel_embedding", (args[0], args[1], ctx.arg(2, "padding_idx", -1), group_names[axis]), {}


@register_rule(aten.embedding.default, local_call=_embedding_local_call)
def embedding_rule(ctx):
    weight, ids = ctx.ins
    out_nd = ctx.outs[0].ndim
    opts = [ctx.option([R, S(d)], S(d)) for d in range(ids.ndim) if ids.shape[d] > 1]
    if weight.shape[1] > 1:
        opts.append(ctx.option([S(1), R], S(out_nd - 1)))      # split the hidden dim of the table
    if weight.shape[0] > 1 and not ctx.arg(3, "scale_grad_by_freq", False) and not ctx.arg(4, "sparse", False):
        # Megatron's vocab-parallel embedding: each rank looks up the ids in its rows of the table and
        # gives zeros for the others, so the sum over the axis is the lookup.
        opts.append(ctx.option([S(0), R], P))
    return opts


def _sdpa_flops(ctx):
    q, k = ctx.ins[0], ctx.ins[1]
    b_h_sq = math.prod(q.shape[:-1])
    # A causal kernel skips the blocks above the diagonal: half the work.
    return 4.0 * b_h_sq * k.shape[-2] * q.shape[-1] * (0.5 if ctx.arg(5, "is_causal", False) else 1.0)


def _sdpa_saved_on_gpu(ctx):
    """Flash (and memory-efficient) attention keeps q, k, v, an explicit mask (its backward applies it
    again), the output and an fp32 logsumexp; never the s x s scores. ATen makes a boolean mask
    additive in the query's dtype before the kernel, which keeps that copy, not the boolean mask."""
    from autopar.passes.meta import SavedForBackward

    lse = math.prod(ctx.ins[0].shape[:-1]) * 4
    boolean = len(ctx.ins) > 3 and ctx.ins[3].dtype == torch.bool
    inputs = (True,) * 3 + ((not boolean,) if len(ctx.ins) > 3 else ())
    converted = (0, 0, 0, ctx.ins[0].dtype.itemsize) if boolean else ()
    return SavedForBackward(ctx.outs[0].nbytes, inputs, lse, converted=converted)


def _sdpa_reference_on_gpu(ctx) -> float | None:
    """CUDA's fused attention kernels need the mask's last dimension at stride 1; a mask broadcast
    along the keys (stride 0 there, as BERT's per-query mask is) sends the call to the math kernel,
    which keeps the s x s probabilities, and whose backward holds about three s x s buffers of float32
    at its peak (the probabilities' gradient, the softmax backward's and the scores' gradient; float32
    in a bfloat16 call too); both seen on an H200 with torch 2.11 (bench/README.md, "Memory fidelity
    on one GPU")."""
    arg = ctx.arg(3, "attn_mask")
    mask = arg.meta.get("val") if isinstance(arg, torch.fx.Node) else None
    if not (isinstance(mask, torch.Tensor) and mask.ndim > 0 and mask.shape[-1] > 1 and mask.stride(-1) == 0):
        return None
    q, k = ctx.ins[0], ctx.ins[1]
    return 3.0 * math.prod(q.shape[:-1]) * k.shape[-2] * max(q.dtype.itemsize, 4)


def _sdpa_collectives(ctx, in_layouts, mesh_shape):
    """Ring attention (keys split along the sequence): n-1 forward steps, each moving one key/value
    block while the previous one is attended to; backward, the block and its fp32 gradient, the last
    step's gradient (coming home) not hidden. Causal rings also move q, k, v and the output to the
    load-balanced half-chunks and back, and their gradients likewise."""
    axis = _sharding_axis(in_layouts[1], 2)
    if axis is None:
        return []
    n = mesh_shape[axis]
    q, k = ctx.ins[0], ctx.ins[1]
    lq = local_shape(q.shape, in_layouts[0], mesh_shape)
    lk = local_shape(k.shape, in_layouts[1], mesh_shape)
    causal = ctx.arg(5, "is_causal", False)
    kv = 2 * math.prod(lk) * k.dtype.itemsize
    dkv = 2 * math.prod(lk) * 4
    block_flops = 4.0 * math.prod(lq[:-1]) * lk[2] * lq[-1] * (0.5 if causal else 1.0)
    out = [OpCollective(axis, "send_recv", "forward", (n - 1) * kv, steps=n - 1, overlap_flops=block_flops,
                        dtype=q.dtype),
           OpCollective(axis, "send_recv", "backward", (n - 1) * (kv + dkv), steps=n - 1,
                        overlap_flops=2 * block_flops, dtype=q.dtype),
           OpCollective(axis, "send_recv", "backward", dkv)]
    if causal:
        qkvo = (2 * math.prod(lq) + 2 * math.prod(lk)) * q.dtype.itemsize
        out += [OpCollective(axis, "send_recv", "forward", qkvo), OpCollective(axis, "send_recv", "backward", qkvo)]
    return out


def _sdpa_local_call(ctx, in_layouts, args, kwargs, group_names):
    axis = _sharding_axis(in_layouts[1], 2)
    if axis is None:
        return None
    mask = args[3] if len(args) > 3 else kwargs.get("attn_mask")
    causal = args[5] if len(args) > 5 else kwargs.get("is_causal", False)
    return "autopar.runtime.context_parallel.ring_attention", (
        args[0], args[1], args[2], mask, causal, kwargs.get("scale"), group_names[axis]), {}


def _ring_peaks(ctx, in_layouts, mesh_shape):
    """(forward, backward) bytes ring attention (``runtime.context_parallel``) holds at its highest point
    beyond its inputs, what it keeps for backward and the incoming gradient; None where the strategy
    is not a ring.

    Forward: a causal ring's load-balanced q, k, v (each made from two contiguous halves and a received
    one); the fp32 output and logsumexp accumulators; the key/value blocks in flight; one block's
    attention (its output, the key/value heads repeated for their query heads under GQA, the block of
    an explicit mask made additive, and the exact merge's three temporaries); and at the end, the
    output moved back from the balanced layout. Backward: the output gradient made contiguous (or
    balanced), the fp32 gradient accumulators of q and of the key/value block, the next block and the
    previous one's accumulators in flight, one block's backward (the contiguous copies of its query
    rows, output and output gradient, the gradients it returns at the query heads and their sums over
    each group); and at the end each gradient cast to the input's dtype and moved back."""
    axis = _sharding_axis(in_layouts[1], 2)
    if axis is None:
        return None
    n = mesh_shape[axis]
    q, k = ctx.ins[0], ctx.ins[1]
    lq = local_shape(q.shape, in_layouts[0], mesh_shape)
    lk = local_shape(k.shape, in_layouts[1], mesh_shape)
    item = q.dtype.itemsize
    wide = max(item, 4) / item                          # accumulators are at least fp32
    qb, kb = math.prod(lq) * item, math.prod(lk) * item
    qa, ka, rows = qb * wide, kb * wide, math.prod(lq[:-1]) * 4.0
    balanced = bool(ctx.arg(5, "is_causal", False)) and n > 1
    piece = 0.5 if balanced else 1.0                     # a block works on half-chunks when balanced
    groups = lq[1] // lk[1]

    def moved(x, heads):
        """A balanced move of x: its halves made contiguous (they are not where more than one row of
        [B, H] precedes them), the half-chunks received (one on each end rank, two in the middle of
        three or more) and their concatenation."""
        return (x if lq[0] * heads > 1 else 0.0) + (x / 2 if n == 2 else x) + x

    mask_block = mask_temp = 0.0
    if len(ctx.ins) > 3 and ctx.ins[3] is not None and ctx.ins[3].ndim:
        m = ctx.ins[3]
        ls = local_shape(m.shape, in_layouts[3], mesh_shape)
        elems = math.prod(ls[:-2]) * (lq[2] * piece if ls[-2] > 1 else 1) * (lk[2] * piece if ls[-1] > 1 else 1)
        mask_block = 0.0 if m.dtype == q.dtype else elems * item     # made additive in q's dtype
        mask_temp = elems                                             # a boolean over it (rows with no key)
    repeated = 2 * piece * groups * kb if groups > 1 and lk[1] > 1 else 0.0    # MQA broadcasts without a copy
    out_piece, lse_piece = piece * qb, piece * rows
    balanced_qkv = qb + 2 * kb if balanced else 0.0
    # Key/value blocks in flight: the next one, and the one attended to where it is a received buffer
    # (from the second step of three or more) or the contiguous copy of an input sent first (a
    # transposed projection is not contiguous unless it has one head).
    in_flight = 2 * kb + (2 * kb if n > 2 or (not balanced and lk[1] > 1) else 0.0)

    block_forward = max(mask_block + mask_temp + repeated + out_piece + lse_piece,
                        out_piece + piece * qa * (3.0 + (1.0 if wide > 1 else 0.0)) + lse_piece)
    forward = max(
        (qb + kb + moved(kb, lk[1])) if balanced else 0.0,
        balanced_qkv + qa + rows + in_flight + block_forward,
        balanced_qkv + rows + max(qa + (qb if wide > 1 else 0.0), qb + moved(qb, lq[1]) if balanced else 0.0))
    grads = piece * qb + 2 * piece * groups * kb
    copies = piece * qb * (3 if lq[0] * lq[1] > 1 else 0) if balanced else qb    # q given with any strides
    block_backward = mask_block + repeated + lse_piece + max(copies + grads, grads + 2 * piece * kb)
    loop = qb + rows + qa + 2 * ka + in_flight + max(block_backward, 2 * ka)
    tail = max(qb + rows + qa + 2 * ka + (qb + 2 * kb if wide > 1 else 0.0),
               qb + 2 * kb + (moved(qb, lq[1]) if balanced else 0.0))
    backward = max(moved(qb, lq[1]) if balanced else 0.0, loop, tail)
    return forward, backward


def _sdpa_workspace(ctx, in_layouts, mesh_shape):
    """Ring attention's forward peak beyond the output and logsumexp the timeline counts there."""
    peaks = _ring_peaks(ctx, in_layouts, mesh_shape)
    if peaks is None:
        return 0.0
    lq = local_shape(ctx.ins[0].shape, in_layouts[0], mesh_shape)
    return max(0.0, peaks[0] - math.prod(lq) * ctx.ins[0].dtype.itemsize - math.prod(lq[:-1]) * 4.0)


def _sdpa_backward_workspace(ctx, in_layouts, mesh_shape):
    """Ring attention's backward peak beyond the input gradients the timeline counts there; None for
    the other forms (ATen's attention backward allocates nothing else the step sees)."""
    peaks = _ring_peaks(ctx, in_layouts, mesh_shape)
    if peaks is None:
        return None
    returned = sum(math.prod(local_shape(x.shape, lay, mesh_shape)) * x.dtype.itemsize
                   for x, lay in zip(ctx.ins[:3], in_layouts[:3]))
    return max(0.0, peaks[1] - returned)


def _sdpa_saved_sharded(ctx, in_layouts, mesh_shape):
    """Ring attention keeps what flash attention keeps, whatever the device, but an explicit mask as it
    is given (each block of it is made additive while it is attended to). Causal, it keeps the query,
    key, value and output in the load-balanced order (runtime.context_parallel), and returns the output
    in the sequence's order, a second copy of it."""
    import dataclasses

    axis = _sharding_axis(in_layouts[1], 2)
    if axis is None:
        return None
    saved = _sdpa_saved_on_gpu(ctx)
    balanced = bool(ctx.arg(5, "is_causal", False)) and mesh_shape[axis] > 1
    return dataclasses.replace(saved, inputs=(True,) * len(ctx.ins), converted=(),
                               internal=saved.internal + (ctx.outs[0].nbytes if balanced else 0))


@register_rule(aten.scaled_dot_product_attention.default, flops=_sdpa_flops, saved_on_gpu=_sdpa_saved_on_gpu,
               reference_on_gpu=_sdpa_reference_on_gpu, collectives=_sdpa_collectives, local_call=_sdpa_local_call, saved_sharded=_sdpa_saved_sharded,
               workspace=_sdpa_workspace, backward_workspace=_sdpa_backward_workspace)
def sdpa_rule(ctx):
    """Batch, heads (Ulysses is a head split between sequence-split neighbors: the resharding is the
    all-to-all), query rows against whole keys (all-gathered keys and values), and ring attention."""
    q, k, v = ctx.ins[:3]
    mask = ctx.ins[3] if len(ctx.ins) > 3 else None
    is_causal = ctx.arg(5, "is_causal", False)
    dropout = ctx.arg(4, "dropout_p", 0.0)

    def with_mask(qkv, out, mask_dim, size, requires=()):
        ins = list(qkv)
        if mask is not None:
            md = mask_dim - (4 - mask.ndim)
            ins.append(S(md) if md >= 0 and mask.shape[md] == size else R)
        return ctx.option(ins, out, requires)

    opts = []
    if q.shape[0] > 1:                                                  # batch
        opts.append(with_mask([S(0)] * 3, S(0), 0, q.shape[0]))
    if q.shape[1] > 1 and k.shape[1] > 1:                               # heads (GQA groups stay whole)
        opts.append(with_mask([S(1)] * 3, S(1), 1, q.shape[1]))
    if q.shape[2] > 1 and not is_causal:                                # query rows, keys whole
        opts.append(with_mask([S(2), R, R], S(2), 2, q.shape[2]))
    if q.shape[2] > 1 and q.shape[2] == k.shape[2] and not dropout:    # ring: keys split too
        why = "causal ring attention holds two load-balanced half-chunks per rank"
        opts.append(with_mask([S(2)] * 3, S(2), 2, q.shape[2], ((0, 2, 2, why),) if is_causal else ()))
    return opts


def _vocab_parallel_loss(ctx) -> bool:
    logits, target = ctx.ins[:2]
    return (ctx.node.target is aten.cross_entropy_loss.default and logits.ndim == 2 and target.ndim == 1
            and logits.shape[1] > 1 and not ctx.arg(5, "label_smoothing", 0.0))


def _cross_entropy_collectives(ctx, in_layouts, mesh_shape):
    """Vocab-parallel: one MAX all-reduce of the row maxima, one SUM all-reduce of the rows' sum-exp
    and target logit, both fp32, on the axis that shards the vocabulary; none in the backward."""
    axis = _sharding_axis(in_layouts[0], 1)
    if axis is None:
        return []
    rows = local_shape(ctx.ins[1].shape, in_layouts[1], mesh_shape)[0]
    return [OpCollective(axis, "all_reduce", "forward", 4 * rows),
            OpCollective(axis, "all_reduce", "forward", 8 * rows)]


def _cross_entropy_local_call(ctx, in_layouts, args, kwargs, group_names):
    axis = _sharding_axis(in_layouts[0], 1)
    if axis is None:
        return None
    return "autopar.runtime.sharded_ops.vocab_parallel_cross_entropy", (
        args[0], args[1], ctx.arg(4, "ignore_index", -100), ctx.arg(3, "reduction", 1), group_names[axis]), {}


# The vocab-parallel loss works a block of rows at a time (runtime.sharded_ops.CHUNK_BYTES).
LOSS_CHUNK_BYTES = 64 * 2**20


def _vocab_parallel_rows(ctx, in_layouts, mesh_shape):
    """(local rows, local vocabulary, rows per block) of the vocab-parallel loss, or None."""
    if _sharding_axis(in_layouts[0], 1) is None:
        return None
    n, v = local_shape(ctx.ins[0].shape, in_layouts[0], mesh_shape)
    return n, v, min(n, max(1, LOSS_CHUNK_BYTES // (4 * v)))


def _cross_entropy_workspace(ctx, in_layouts, mesh_shape):
    """Vocab-parallel forward: one fp32 block of rows, where each block's exponentials are made, and
    per row, beyond what it keeps, seven fp32 values at its peak (the row maxima, the sums of
    exponentials, the target logits, the two all-reduced sums, the log-sum-exp less the target logit
    and the losses)."""
    rows = _vocab_parallel_rows(ctx, in_layouts, mesh_shape)
    if rows is None:
        return 0.0
    n, v, block = rows
    return 4.0 * block * v + 7.0 * _wide(ctx) * n


def _cross_entropy_backward_workspace(ctx, in_layouts, mesh_shape):
    """Vocab-parallel backward: it makes the softmax in place in the gradient it returns, so it holds
    beyond it only three fp32 values a row (the upstream gradient and the target's one-hot term, made
    and negated) for fp32 logits; for low-precision ones, the fp32 result before its cast too."""
    rows = _vocab_parallel_rows(ctx, in_layouts, mesh_shape)
    if rows is None:
        return None
    n, v, _ = rows
    return 3.0 * _wide(ctx) * n + (0.0 if ctx.ins[0].dtype.itemsize >= 4 else 4.0 * n * v)


def _wide(ctx) -> int:
    """Bytes of the loss's per-row statistics: the logits' dtype, at least fp32."""
    return torch.promote_types(ctx.ins[0].dtype, torch.float32).itemsize


def _cross_entropy_saved_sharded(ctx, in_layouts, mesh_shape):
    """Vocab-parallel: the logits it reads (no log-softmax) and per row an fp32 logsumexp, the local
    target (int64) and two masks, on every rank of the axis that shards the vocabulary. Private buffers
    are counted as a share of the work (divided by the work split, which counts that axis): the rows'
    figure is scaled up by it."""
    from autopar.passes.meta import SavedForBackward

    axis = _sharding_axis(in_layouts[0], 1)
    if axis is None:
        return None
    rows = ctx.ins[1].shape[0]
    return SavedForBackward(0, tuple(k == 0 for k in range(len(ctx.ins))),
                            rows * (_wide(ctx) + 8 + 2) * mesh_shape[axis])


@register_rule(aten.cross_entropy_loss.default, aten.nll_loss.default,
               flops=lambda ctx: 5.0 * ctx.ins[0].numel,
               collectives=_cross_entropy_collectives, local_call=_cross_entropy_local_call,
               saved_sharded=_cross_entropy_saved_sharded, workspace=_cross_entropy_workspace,
               backward_workspace=_cross_entropy_backward_workspace)
def cross_entropy_rule(ctx):
    logits, target = ctx.ins[:2]
    reduction = ctx.arg(3, "reduction", 1)
    if len(ctx.ins) > 2:            # class weights make the mean's denominator global: keep it whole
        return []
    opts = []
    for d in range(target.ndim):
        ld = 0 if d == 0 else d + 1                                     # logits: [N, C, d1, ...]
        if target.shape[d] <= 1:
            continue
        if reduction == 0:
            opts.append(ctx.option([S(ld), S(d)], S(d)))
        elif reduction == 2:
            opts.append(ctx.option([S(ld), S(d)], P))
    if _vocab_parallel_loss(ctx):
        # Megatron's vocab-parallel cross-entropy: the logits stay sharded on the vocabulary, and the
        # row max, sum-exp and target logit are reduced across the axis; every rank gets the loss.
        opts.append(ctx.option([S(1), R], R))
    return opts
