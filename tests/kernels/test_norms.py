import pytest
import torch
import torch.nn.functional as F
from hypothesis import given, settings
from hypothesis import strategies as st

from autopar.codegen import kernels
from tests.kernels.helpers import BF16, FP32, assert_matches, forward_backward

leading = st.lists(st.integers(1, 5), min_size=0, max_size=2)
widths = st.integers(1, 200)


def _to(t, dtype):
    return None if t is None else t.to(dtype)


def _inputs(lead, n, dtype, affine):
    torch.manual_seed(len(lead) * 1000 + n)
    x = torch.randn(*lead, n) * 2 + 0.5
    weight = torch.randn(n) if affine else None
    bias = torch.randn(n) if affine else None
    return _to(x, dtype), _to(weight, dtype), _to(bias, dtype), torch.randn(*lead, n)


def _check(kernel_fn, eager_fn, x, weight, bias, grad, tol):
    got = forward_backward(kernel_fn, (x, weight, bias), (grad,))
    fp32 = [_to(t, torch.float32) for t in (x, weight, bias)]
    want = forward_backward(eager_fn, fp32, (grad,))
    assert_matches(got[0] + got[1], want[0] + want[1], tol)


def _rms(x, w, b):
    return kernels.rms_norm(x, w, 1e-6)


def _rms_eager(x, w, b):
    return F.rms_norm(x, x.shape[-1:], w, 1e-6)


def _ln(x, w, b):
    return kernels.layer_norm(x, w, b, 1e-5)


def _ln_eager(x, w, b):
    return F.layer_norm(x, x.shape[-1:], w, b, 1e-5)


@settings(max_examples=10, deadline=None)
@given(lead=leading, n=widths, affine=st.booleans())
def test_rms_norm_matches_eager_fp32(lead, n, affine):
    x, w, _, grad = _inputs(lead, n, torch.float32, affine)
    _check(_rms, _rms_eager, x, w, None, grad, FP32)


# Width 1 is left out: x - mean is exactly 0 and so is the true dx, which eager returns as
# rstd (~316 for eps 1e-5) times a rounding error.
@settings(max_examples=10, deadline=None)
@given(lead=leading, n=st.integers(2, 200), affine=st.booleans())
def test_layer_norm_matches_eager_fp32(lead, n, affine):
    x, w, b, grad = _inputs(lead, n, torch.float32, affine)
    _check(_ln, _ln_eager, x, w, b, grad, FP32)


@pytest.mark.parametrize("fns", [(_rms, _rms_eager), (_ln, _ln_eager)], ids=["rms", "layer"])
def test_norms_bf16_outputs_in_input_dtype(fns):
    x, w, b, grad = _inputs([3, 5], 67, torch.bfloat16, True)
    assert fns[0](x, w, b).dtype == torch.bfloat16
    _check(*fns, x, w, b, grad, BF16)


@pytest.mark.parametrize("fns", [(_rms, _rms_eager), (_ln, _ln_eager)], ids=["rms", "layer"])
def test_norms_non_contiguous_input(fns):
    x = torch.randn(33, 6).t()  # rows are strided: the kernel gets a contiguous copy
    w, b, grad = torch.randn(33), torch.randn(33), torch.randn(6, 33)
    _check(*fns, x, w, b, grad, FP32)
