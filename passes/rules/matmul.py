"""Matrix products: one einsum spec each. A contracted dim gives Partial.

A Partial input (with the other replicated) would also give a Partial output, but deferring a
reduction past a matmul never pays and doubles the strategies, so those options are not offered.
"""
import torch

from autopar.passes.rules import register_rule
from autopar.passes.rules.helpers import einsum_options, letters

aten = torch.ops.aten


def _contract_flops(ctx):
    # 2 * (output elements) * (contracted length); the contracted length is the first input's last dim.
    return 2.0 * ctx.outs[0].numel * ctx.ins[0].shape[-1]


@register_rule(aten.mm.default, flops=_contract_flops)
def mm_rule(ctx):
    return einsum_options(ctx, "mk,kn->mn")


@register_rule(aten.bmm.default, flops=_contract_flops)
def bmm_rule(ctx):
    return einsum_options(ctx, "bmk,bkn->bmn")


@register_rule(aten.linear.default, flops=_contract_flops)
def linear_rule(ctx):
    lead = letters(ctx.ins[0].ndim - 1, start=3)           # batch-like dims of x: d, e, f, ...
    if len(ctx.ins) == 3:
        # With a bias, a split contracted dim would add the bias once per rank; normalize_pass splits
        # the bias off so that the row split stays available.
        opts = einsum_options(ctx, f"{lead}k,nk,n->{lead}n")
        return [o for o in opts if not o.outputs[0].is_partial]
    return einsum_options(ctx, f"{lead}k,nk->{lead}n")


@register_rule(aten.matmul.default, flops=_contract_flops)
def matmul_rule(ctx):
    a, b = ctx.ins
    if a.ndim < 2 or b.ndim < 2:
        return []
    out_nd = ctx.outs[0].ndim
    batch = letters(out_nd - 2, start=4)
    # Batch dims broadcast from the right; a size-1 batch dim gets a letter of its own (z, y) that the
    # spec never shards, since einsum_options skips size-1 dims.
    a_batch = "".join(batch[i + out_nd - a.ndim] if a.shape[i] == ctx.outs[0].shape[i + out_nd - a.ndim]
                      else "z" for i in range(a.ndim - 2))
    b_batch = "".join(batch[i + out_nd - b.ndim] if b.shape[i] == ctx.outs[0].shape[i + out_nd - b.ndim]
                      else "y" for i in range(b.ndim - 2))
    return einsum_options(ctx, f"{a_batch}mk,{b_batch}kn->{batch}mn")
