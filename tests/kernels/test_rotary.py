import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from autopar.codegen import kernels
from tests.kernels.helpers import BF16, FP32, assert_matches, forward_backward


def rotate_half(x):
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((-x2, x1), dim=-1)


def eager_rotary(x, cos, sin):
    return x * cos + rotate_half(x) * sin


def _inputs(b, h, s, d, cos_shape, seq_major, dtype=torch.float32):
    g = torch.Generator().manual_seed(b * 1000 + s * 10 + d)
    # Sequence-major storage ([B, S, H, D] viewed as [B, H, S, D]) is how attention layers
    # usually hand x over: the kernel reads it through its strides.
    x = torch.randn(b, s, h, d, generator=g).transpose(1, 2)
    x = x if seq_major else x.contiguous()
    angles = torch.randn({"sd": (s, d), "11sd": (1, 1, s, d), "b1sd": (b, 1, s, d)}[cos_shape], generator=g)
    return x.to(dtype), angles.cos().to(dtype), angles.sin().to(dtype), torch.randn(b, h, s, d, generator=g)


@settings(max_examples=10, deadline=None)
@given(
    b=st.integers(1, 3), h=st.integers(1, 3), s=st.integers(1, 20), half=st.integers(1, 20),
    cos_shape=st.sampled_from(["sd", "11sd", "b1sd"]), seq_major=st.booleans(),
)
def test_rotary_matches_eager_fp32(b, h, s, half, cos_shape, seq_major):
    x, cos, sin, grad = _inputs(b, h, s, 2 * half, cos_shape, seq_major)
    got = forward_backward(lambda x: kernels.rotary_embedding(x, cos, sin), (x,), (grad,))
    want = forward_backward(lambda x: eager_rotary(x, cos, sin), (x,), (grad,))
    assert_matches(got[0] + got[1], want[0] + want[1], FP32)


def test_rotary_bf16():
    x, cos, sin, grad = _inputs(2, 3, 13, 18, "b1sd", True, torch.bfloat16)
    got = forward_backward(lambda x: kernels.rotary_embedding(x, cos, sin), (x,), (grad,))
    want = forward_backward(lambda x: eager_rotary(x, cos.float(), sin.float()), (x.float(),), (grad,))
    assert got[0][0].dtype == torch.bfloat16
    assert_matches(got[0] + got[1], want[0] + want[1], BF16)
