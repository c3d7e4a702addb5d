"""Ring attention on real gloo groups against unsplit scaled_dot_product_attention: values and the
gradients of q, k and v, causal (load-balanced), with boolean and additive masks, with GQA and MQA."""
import zlib

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.testing import assert_close

from autopar.errors import ShardingError
from autopar.runtime.context_parallel import ring_attention
from tests.distributed_utils import run_distributed

B, H, S, D = 2, 4, 16, 8


def _rand(shape, *seed):
    g = torch.Generator().manual_seed(zlib.crc32(repr(seed).encode()))
    return torch.randn(shape, generator=g)


def _masks():
    keep = _rand((B, 1, S, S), "mask") > -0.5
    keep[..., 0] = True                      # every row keeps a key: sdpa gives nan for empty rows
    yield "bool", keep
    yield "additive", _rand((1, H, S, S), "bias")


CASES = [("plain", H, None), ("causal", H, None), ("causal gqa", 2, None), ("causal mqa", 1, None),
         ("mask bool", H, "bool"), ("mask additive gqa", 2, "additive")]


def _ring(rank, world):
    name = dist.group.WORLD.group_name
    chunk = S // world
    rows = slice(rank * chunk, (rank + 1) * chunk)
    masks = dict(_masks())
    for label, hkv, mask_kind in CASES:
        causal = "causal" in label
        mask = masks[mask_kind] if mask_kind else None
        q, k, v = _rand((B, H, S, D), label, "q"), _rand((B, hkv, S, D), label, "k"), _rand((B, hkv, S, D), label, "v")
        full = [t.clone().requires_grad_() for t in (q, k, v)]
        ref = F.scaled_dot_product_attention(*full, attn_mask=mask, is_causal=causal, enable_gqa=hkv != H)
        weight = _rand(ref.shape, label, "w")
        (ref * weight).sum().backward()

        mine = [t[:, :, rows].clone().requires_grad_() for t in (q, k, v)]
        local_mask = None if mask is None else mask[..., rows, :]
        out = ring_attention(*mine, local_mask, causal, None, name)
        (out * weight[:, :, rows]).sum().backward()
        assert_close(out, ref.detach()[:, :, rows], msg=lambda m: f"{label} output: {m}")
        for t, ref_t, what in zip(mine, full, "qkv"):
            assert_close(t.grad, ref_t.grad[:, :, rows], msg=lambda m: f"{label} d{what}: {m}")


@pytest.mark.parametrize("world", [2, 4])
def test_ring_attention_matches_unsplit_attention(world):
    run_distributed(_ring, world)


def _odd_causal(rank, world):
    q = torch.randn(1, 2, 3, 4)
    with pytest.raises(ShardingError, match=r"sequence \(6\) must divide by twice the ring size \(4\)"):
        ring_attention(q, q, q, None, True, None, dist.group.WORLD.group_name)


def test_causal_ring_needs_two_halves_per_rank():
    run_distributed(_odd_causal, 2)


def _ring_bf16(rank, world):
    name = dist.group.WORLD.group_name
    rows = slice(rank * S // world, (rank + 1) * S // world)
    q, k, v = (_rand((B, h, S, D), "bf16", w).to(torch.bfloat16) for h, w in ((H, "q"), (2, "k"), (2, "v")))
    full = [t.float().requires_grad_() for t in (q, k, v)]
    ref = F.scaled_dot_product_attention(*full, is_causal=True, enable_gqa=True)
    ref.sum().backward()
    mine = [t[:, :, rows].clone().requires_grad_() for t in (q, k, v)]
    out = ring_attention(*mine, None, True, None, name)
    out.float().sum().backward()
    assert out.dtype == torch.bfloat16
    tol = dict(rtol=2e-2, atol=2e-2)             # bf16 inputs, outputs and gradients; fp32 merging
    assert_close(out.float(), ref.detach()[:, :, rows], **tol)
    for t, ref_t in zip(mine, full):
        assert_close(t.grad.float(), ref_t.grad[:, :, rows], **tol)


def test_ring_attention_in_bf16():
    run_distributed(_ring_bf16, 2)
