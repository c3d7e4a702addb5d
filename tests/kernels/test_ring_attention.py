"""Ring attention with every block on the library's flash attention (Triton, under the interpreter
here) on 2 gloo ranks, against unsplit scaled_dot_product_attention: values and gradients, causal
with GQA and an additive mask."""
import zlib

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.testing import assert_close

from tests.distributed_utils import run_distributed

B, H, S, D = 1, 4, 16, 16


def _rand(shape, *seed):
    g = torch.Generator().manual_seed(zlib.crc32(repr(seed).encode()))
    return torch.randn(shape, generator=g)


def _ring(rank, world):
    from autopar.codegen import kernels

    name = dist.group.WORLD.group_name
    rows = slice(rank * S // world, (rank + 1) * S // world)
    for label, hkv, mask in (("causal gqa", 2, None), ("additive mask", H, _rand((1, 1, S, S), "bias"))):
        causal = mask is None
        q, k, v = _rand((B, H, S, D), label, "q"), _rand((B, hkv, S, D), label, "k"), _rand((B, hkv, S, D), label, "v")
        full = [t.clone().requires_grad_() for t in (q, k, v)]
        ref = F.scaled_dot_product_attention(*full, attn_mask=mask, is_causal=causal, enable_gqa=hkv != H)
        weight = _rand(ref.shape, label, "w")
        (ref * weight).sum().backward()

        mine = [t[:, :, rows].clone().requires_grad_() for t in (q, k, v)]
        out = kernels.ring_attention(*mine, None if mask is None else mask[..., rows, :], causal, None, name)
        (out * weight[:, :, rows]).sum().backward()
        tol = dict(rtol=1e-4, atol=1e-4)
        assert_close(out, ref.detach()[:, :, rows], **tol, msg=lambda m: f"{label} output: {m}")
        for t, ref_t, what in zip(mine, full, "qkv"):
            assert_close(t.grad, ref_t.grad[:, :, rows], **tol, msg=lambda m: f"{label} d{what}: {m}")


def test_ring_attention_on_the_flash_kernels_matches_unsplit_attention():
    run_distributed(_ring, 2, timeout=300)


def test_fusion_pass_puts_ring_attention_on_the_kernels():
    import torch.fx as fx

    from autopar.codegen import kernels
    from autopar.codegen.triton.fuse import fuse_pass
    from autopar.runtime.context_parallel import ring_attention

    g = fx.Graph()
    q, k, v = (g.placeholder(n) for n in "qkv")
    for n in (q, k, v):
        n.meta["val"] = torch.empty(B, H, S, D)
    out = g.call_function(ring_attention, (q, k, v, None, True, None, "group"))
    out.meta["val"] = torch.empty(B, H, S, D)
    g.output(out)
    gm = fuse_pass(fx.GraphModule(torch.nn.Module(), g))
    targets = [n.target for n in gm.graph.nodes if n.op == "call_function"]
    assert targets == [kernels.ring_attention]


def test_triton_blocks_match_math_blocks():
    """One ring step's block, forward and backward with a given merged lse and delta: the kernels'
    blocks against the ATen math ones, for a full and a diagonal block, GQA and an additive mask."""
    from autopar.codegen.kernels import _impl
    from autopar.runtime.context_parallel import MathBlocks

    triton_blocks = _impl("_attention").RingBlocks
    device = "cuda" if torch.cuda.is_available() else "cpu"
    b, hkv, g, lq, lk, d = 1, 2, 2, 24, 24, 16

    def r(*shape, seed):
        return _rand(shape, "blocks", seed).to(device)

    for kind, mask in (("full", r(b, 1, 1, lq, lk, seed="m")), ("diagonal", None)):
        q, k, v = r(b, hkv, g, lq, d, seed="q"), r(b, hkv, 1, lk, d, seed="k"), r(b, hkv, 1, lk, d, seed="v")
        dout = r(b, hkv, g, lq, d, seed="do")
        lse, delta = r(b, hkv, g, lq, seed="lse").abs() + 3.0, r(b, hkv, g, lq, seed="delta")
        got = triton_blocks.forward(q, k, v, mask, kind, 0.25)
        want = MathBlocks.forward(q, k, v, mask, kind, 0.25)
        tol = dict(rtol=2e-3, atol=2e-3) if device == "cuda" else dict(rtol=1e-4, atol=1e-4)   # TF32 dots on a GPU
        for x, y, what in zip(got, want, ("out", "lse")):
            assert_close(x.float(), y, **tol, msg=lambda m: f"{kind} {what}: {m}")
        got = triton_blocks.backward(q, k, v, mask, kind, 0.25, dout, None, lse, delta)
        want = MathBlocks.backward(q, k, v, mask, kind, 0.25, dout, None, lse, delta)
        for x, y, what in zip(got, want, ("dq", "dk", "dv")):
            assert_close(x.float(), y, **tol, msg=lambda m: f"{kind} {what}: {m}")
