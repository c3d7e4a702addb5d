from functools import partial

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from hypothesis import given, settings
from hypothesis import strategies as st
from torch.testing import assert_close

from autopar.codegen import kernels
from tests.distributed_utils import run_distributed
from tests.kernels.helpers import BF16, FP32, assert_matches, forward_backward

REDUCTIONS = ["mean", "sum", "none"]


def _problem(n, v, ignore_index, ignored, seed=0):
    g = torch.Generator().manual_seed(seed)
    logits = torch.randn(n, v, generator=g) * 3
    target = torch.randint(0, v, (n,), generator=g)
    target[torch.rand(n, generator=g) < ignored] = ignore_index
    return logits, target


def _check(logits, target, ignore_index, reduction, tol):
    grad = torch.randn(logits.shape[0]) if reduction == "none" else torch.tensor(1.7)
    got = forward_backward(
        lambda x: kernels.cross_entropy(x, target, ignore_index, reduction), (logits,), (grad,)
    )
    want = forward_backward(
        lambda x: F.cross_entropy(x, target, ignore_index=ignore_index, reduction=reduction),
        (logits.float(),), (grad,),
    )
    assert got[0][0].dtype == logits.dtype
    assert_matches(got[0] + got[1], want[0] + want[1], tol)


@settings(max_examples=10, deadline=None)
@given(
    n=st.integers(1, 20),
    v=st.integers(1, 300),
    reduction=st.sampled_from(REDUCTIONS),
    ignore_index=st.sampled_from([-100, 0]),
    ignored=st.sampled_from([0.0, 0.3]),
)
def test_cross_entropy_matches_eager_fp32(n, v, reduction, ignore_index, ignored):
    logits, target = _problem(n, v, ignore_index, ignored, seed=n * 1000 + v)
    _check(logits, target, ignore_index, reduction, FP32)


@pytest.mark.parametrize("reduction", REDUCTIONS)
def test_cross_entropy_bf16(reduction):
    logits, target = _problem(9, 157, -100, 0.2)
    _check(logits.bfloat16(), target, -100, reduction, BF16)


def test_cross_entropy_vocab_block_of_minus_inf():
    # Under the interpreter a block is 64 logits: the first block holds only -inf.
    logits, target = _problem(5, 150, -100, 0.0)
    logits[:, :70] = float("-inf")
    target.clamp_(min=70)
    _check(logits, target, -100, "mean", FP32)


def test_cross_entropy_mean_over_no_target_is_nan_like_torch():
    logits = torch.randn(3, 10)
    target = torch.full((3,), -100)
    assert kernels.cross_entropy(logits, target).isnan()
    assert F.cross_entropy(logits, target).isnan()


def _vocab_parallel(rank, world_size, dtype):
    n, v = 11, 2 * 37
    shard = slice(rank * v // world_size, (rank + 1) * v // world_size)
    for seed, reduction in enumerate(REDUCTIONS):
        logits, target = _problem(n, v, -100, 0.25, seed=seed)
        target[0], target[1] = 0, v - 1  # targets on both ranks' shards (same on every rank)
        logits = logits.to(dtype)
        grad = torch.randn(n) if reduction == "none" else torch.tensor(0.7)
        # The group as an object for one call, by name for the others.
        group = dist.group.WORLD if seed == 0 else dist.group.WORLD.group_name
        sharded = partial(kernels.vocab_parallel_cross_entropy, target=target, group_name_or_group=group)
        got = forward_backward(partial(sharded, reduction=reduction), (logits[:, shard],), (grad,))
        full = partial(F.cross_entropy, target=target, reduction=reduction)
        want = forward_backward(full, (logits.float(),), (grad,))
        tol = FP32 if dtype == torch.float32 else BF16
        assert_close(got[0][0].float(), want[0][0], **tol)
        assert_close(got[1][0].float(), want[1][0][:, shard], **tol)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_vocab_parallel_cross_entropy_on_two_gloo_ranks(dtype):
    run_distributed(_vocab_parallel, 2, dtype)
