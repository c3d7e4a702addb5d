"""Vocab-parallel embedding and cross-entropy on real gloo groups, against the unsharded ATen ops:
values and gradients, with ignored targets, a padding row and every reduction."""
import zlib

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.testing import assert_close

from autopar.runtime.sharded_ops import vocab_parallel_cross_entropy, vocab_parallel_embedding
from tests.distributed_utils import run_distributed

ROWS, VOCAB, HIDDEN = 12, 16, 5


def _rand(shape, *seed):
    g = torch.Generator().manual_seed(zlib.crc32(repr(seed).encode()))
    return torch.randn(shape, generator=g)


def _ids(shape, *seed):
    g = torch.Generator().manual_seed(zlib.crc32(repr(seed).encode()))
    return torch.randint(0, VOCAB, shape, generator=g)


def _cross_entropy(rank, world):
    name = dist.group.WORLD.group_name
    block = VOCAB // world
    logits = _rand((ROWS, VOCAB), "logits") * 3
    target = _ids((ROWS,), "target")
    target[::4] = -100
    for reduction, code in (("none", 0), ("mean", 1), ("sum", 2)):
        full = logits.clone().requires_grad_()
        ref = F.cross_entropy(full, target, reduction=reduction)
        weight = _rand(ref.shape, "weight", reduction)
        (ref * weight).sum().backward()

        mine = logits[:, rank * block:(rank + 1) * block].clone().requires_grad_()
        out = vocab_parallel_cross_entropy(mine, target, -100, code, name)
        (out * weight).sum().backward()
        assert_close(out, ref.detach(), msg=lambda m: f"{reduction} loss: {m}")
        assert_close(mine.grad, full.grad[:, rank * block:(rank + 1) * block], msg=lambda m: f"{reduction} grad: {m}")


def _embedding(rank, world):
    name = dist.group.WORLD.group_name
    block = VOCAB // world
    table = _rand((VOCAB, HIDDEN), "table")
    ids = _ids((3, 7), "ids")
    ids[0, :3] = 2                         # the padding row, looked up a few times
    weight = _rand((3, 7, HIDDEN), "weight")
    full = table.clone().requires_grad_()
    ref = F.embedding(ids, full, padding_idx=2)
    (ref * weight).sum().backward()

    mine = table[rank * block:(rank + 1) * block].clone().requires_grad_()
    term = vocab_parallel_embedding(mine, ids, 2, name)
    # The gradient of a Partial value is replicated: every rank's term gets the full gradient.
    (term * weight).sum().backward()
    summed = term.detach().clone()
    dist.all_reduce(summed)
    assert_close(summed, ref.detach())
    assert_close(mine.grad, full.grad[rank * block:(rank + 1) * block])


@pytest.mark.parametrize("world", [2, 4])
def test_vocab_parallel_cross_entropy_matches_the_unsharded_loss(world):
    run_distributed(_cross_entropy, world, timeout=120)


def test_vocab_parallel_embedding_terms_sum_to_the_lookup():
    run_distributed(_embedding, 2, timeout=120)


def test_bad_shapes_are_refused():
    with pytest.raises(ValueError, match=r"logits \[N, V/group\] and target \[N\]"):
        vocab_parallel_cross_entropy(torch.zeros(2, 3, 4), torch.zeros(2, dtype=torch.long), -100, 2, "0")
    with pytest.raises(ValueError, match="reduction must be"):
        vocab_parallel_cross_entropy(torch.zeros(2, 4), torch.zeros(2, dtype=torch.long), -100, 3, "0")
