"""Merging attention results over disjoint key sets. Plain torch (no Triton): a few pointwise
ops on [B, H, S] and [B, H, S, D], differentiable, so it runs wherever the partial results live."""

import torch


def combine_attention(out1, lse1, out2, lse2):
    """Exact attention over the union of two disjoint key sets from the two partial results:
    lse = logaddexp(lse1, lse2), out = exp(lse1 - lse) * out1 + exp(lse2 - lse) * out2.
    Rows empty in both (lse -inf) give out = 0, lse = -inf, as `attention` does."""
    lse = torch.logaddexp(lse1, lse2)
    # exp(-inf - -inf) would be nan; shifting empty rows by 0 makes both weights exp(-inf) = 0.
    shift = torch.where(lse == float("-inf"), torch.zeros_like(lse), lse)
    w1 = torch.exp(lse1 - shift).unsqueeze(-1)
    w2 = torch.exp(lse2 - shift).unsqueeze(-1)
    out = w1 * out1.float() + w2 * out2.float()
    return out.to(out1.dtype), lse
