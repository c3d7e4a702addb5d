import math

import torch
import torch.nn.functional as F
from hypothesis import given, settings
from hypothesis import strategies as st
from torch.testing import assert_close

from autopar.codegen import kernels
from tests.kernels.helpers import BF16, FP32, assert_matches, forward_backward

NEG_INF = float("-inf")


def reference(q, k, v, causal=False, mask=None, scale=None):
    """Eager attention with the kernels' conventions: out 0 and lse -inf for a row with no key."""
    scale = q.shape[-1] ** -0.5 if scale is None else scale
    s = q @ k.transpose(-1, -2) * scale
    keep = torch.ones(s.shape, dtype=torch.bool)
    if causal:
        keep &= torch.ones(s.shape[-2:], dtype=torch.bool).tril()
    if mask is not None and mask.dtype == torch.bool:
        keep &= mask
    elif mask is not None:
        s = s + mask
    s = s.masked_fill(~keep, NEG_INF)
    empty = (s == NEG_INF).all(-1, keepdim=True)
    s = s.masked_fill(empty, 0.0)  # keeps logsumexp and its gradient finite on empty rows
    lse = torch.logsumexp(s, -1, keepdim=True)
    p = torch.exp(s - lse).masked_fill(empty, 0.0)
    return p @ v, lse.masked_fill(empty, NEG_INF).squeeze(-1)


def _qkv(b, h, sq, skv, d, dtype=torch.float32, seed=0):
    g = torch.Generator().manual_seed(seed)
    q, k, v = (torch.randn(b, h, s, d, generator=g).to(dtype) for s in (sq, skv, skv))
    return q, k, v, torch.randn(b, h, sq, d, generator=g), torch.randn(b, h, sq, generator=g)


def _mask(kind, shape, seed):
    """A mask of the given kind broadcastable to shape [B, H, Sq, Skv]."""
    if kind is None:
        return None
    g = torch.Generator().manual_seed(seed)
    b, h, sq, skv = shape
    bshape = [(b, 1, sq, skv), (1, h, 1, skv), (sq, skv)][seed % 3]
    if kind == "bool":
        return torch.rand(bshape, generator=g) > 0.4  # some rows end up with no key
    additive = torch.randn(bshape, generator=g)
    return additive.masked_fill(torch.rand(bshape, generator=g) < 0.2, NEG_INF)


def _compare(q, k, v, dout, dlse, tol, **kw):
    got = forward_backward(lambda q, k, v: kernels.attention(q, k, v, **kw), (q, k, v), (dout, dlse))
    up = [t.float() for t in (q, k, v)]
    want = forward_backward(lambda q, k, v: reference(q, k, v, **kw), up, (dout, dlse))
    assert got[0][0].dtype == q.dtype and got[0][1].dtype == torch.float32
    assert_matches(got[0] + got[1], want[0] + want[1], tol)
    return got


@settings(max_examples=10, deadline=None)
@given(
    b=st.integers(1, 2), h=st.integers(1, 2), sq=st.integers(1, 40), skv=st.integers(1, 40),
    d=st.sampled_from([4, 16, 24, 40]), causal=st.booleans(),
    mask=st.sampled_from([None, "bool", "additive"]), seed=st.integers(0, 2),
)
def test_attention_matches_eager_fp32(b, h, sq, skv, d, causal, mask, seed):
    q, k, v, dout, dlse = _qkv(b, h, sq, skv, d, seed=seed)
    # The gradient also flows through the lse, as it does when partial results are combined.
    _compare(q, k, v, dout, dlse, FP32, causal=causal, mask=_mask(mask, (b, h, sq, skv), seed))


def test_attention_bf16_causal():
    q, k, v, dout, dlse = _qkv(2, 2, 35, 35, 24, torch.bfloat16)
    _compare(q, k, v, dout, dlse, BF16, causal=True)


def test_reference_is_torch_sdpa():
    # Pins the conventions (top-left causal, additive and boolean masks, scale) to PyTorch's.
    q, k, v, _, _ = _qkv(1, 2, 7, 12, 8)
    additive = _mask("additive", (1, 2, 7, 12), 1).clamp(min=-5.0)
    cases = [dict(causal=True), dict(mask=torch.rand(7, 12) > 0.2), dict(mask=additive, scale=0.3)]
    for kw in cases:
        sdpa_kw = dict(is_causal=kw.get("causal", False), attn_mask=kw.get("mask"), scale=kw.get("scale"))
        want = F.scaled_dot_product_attention(q, k, v, **sdpa_kw)
        assert_close(kernels.attention(q, k, v, **kw)[0], want, **FP32)


def test_rows_with_no_key_give_zero_output_and_minus_inf_lse():
    q, k, v, dout, dlse = _qkv(1, 2, 19, 21, 16)
    mask = torch.ones(19, 21, dtype=torch.bool)
    mask[[0, 5, 18]] = False
    (out, lse), (dq, dk, dv) = _compare(q, k, v, dout, dlse, FP32, mask=mask)
    assert (out[:, :, [0, 5, 18]] == 0).all()
    assert (lse[:, :, [0, 5, 18]] == NEG_INF).all()
    assert (dq[:, :, [0, 5, 18]] == 0).all()
    assert all(t.isfinite().all() for t in (dq, dk, dv))


@settings(max_examples=8, deadline=None)
@given(sq=st.integers(1, 40), skv=st.integers(2, 40), split=st.floats(0.05, 0.95), causal=st.booleans())
def test_combining_two_key_halves_equals_full_attention(sq, skv, split, causal):
    q, k, v, dout, dlse = _qkv(2, 2, sq, skv, 16, seed=sq)
    c = min(max(1, math.floor(split * skv)), skv - 1)
    # Causal as an explicit mask, so each half gets its slice; row 0 sees no key of the second
    # half, so the merge of an empty half is exercised too.
    mask = torch.ones(sq, skv, dtype=torch.bool).tril() if causal else torch.rand(sq, skv) > 0.3

    def halves(q, k, v):
        first = kernels.attention(q, k[:, :, :c], v[:, :, :c], mask=mask[:, :c])
        second = kernels.attention(q, k[:, :, c:], v[:, :, c:], mask=mask[:, c:])
        return kernels.combine_attention(*first, *second)

    got = forward_backward(halves, (q, k, v), (dout, dlse))
    want = forward_backward(lambda q, k, v: kernels.attention(q, k, v, mask=mask), (q, k, v), (dout, dlse))
    assert_matches(got[0] + got[1], want[0] + want[1], FP32)
