"""Times the Triton kernel library (autopar.codegen.kernels) against eager PyTorch and
torch.compile on a GPU, forward and forward+backward, at LLaMA-3-8B-like sizes in bf16.

    python bench/kernels.py [--only rms_norm,layer_norm,cross_entropy,attention,rotary]

Memory-bound kernels report GB/s of compulsory traffic (each input read once, each output
written once), attention reports TFLOP/s of model FLOPs (causal half of 4*B*H*S^2*D forward,
2.5x that backward); both also as a fraction of the H200's peak. The last column is each
implementation's time over the Triton kernel's (above 1: Triton is faster). Before timing, each
kernel's output is checked against eager. Without a GPU it says so and exits 0.
"""

import argparse
import math
import sys

import torch
import torch.nn.functional as F

H200_COPY_BYTES_PER_S = 4.3e12  # measured device-to-device copy bandwidth
H200_BF16_FLOPS = 790e12  # dense bf16 matmul


def _rotate_half(x):
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((-x2, x1), dim=-1)


def _cases(kernels):
    """name -> (make inputs, {implementation: fn}, fwd work, fwd+bwd work, unit).
    Work is bytes for memory-bound kernels and FLOPs for attention."""
    bf16 = dict(device="cuda", dtype=torch.bfloat16)
    m, n = 8192, 8192
    tokens, vocab = 8192, 128256
    b, h, s, d = 4, 32, 4096, 128

    def norm_inputs():
        return torch.randn(m, n, **bf16), torch.randn(n, **bf16), torch.randn(n, **bf16)

    def ce_inputs():
        return torch.randn(tokens, vocab, **bf16), torch.randint(0, vocab, (tokens,), device="cuda")

    def attention_inputs():
        return tuple(torch.randn(b, h, s, d, **bf16) for _ in range(3))

    def rotary_inputs():
        angles = torch.randn(s, d, device="cuda")
        x = torch.randn(b, h, s, d, **bf16)
        return x, angles.cos().to(torch.bfloat16), angles.sin().to(torch.bfloat16)

    def sdpa_flash(q, k, v):
        with torch.nn.attention.sdpa_kernel(torch.nn.attention.SDPBackend.FLASH_ATTENTION):
            return F.scaled_dot_product_attention(q, k, v, is_causal=True)

    norm_bytes = m * n * 2
    ce_bytes = tokens * vocab * 2
    attn_flops = 4 * b * h * s * s * d / 2
    rope_bytes = b * h * s * d * 2
    return {
        "rms_norm": (
            norm_inputs,
            {
                "triton": lambda x, w, _: kernels.rms_norm(x, w, 1e-6),
                "eager": lambda x, w, _: F.rms_norm(x, (n,), w, 1e-6),
            },
            2 * norm_bytes, 5 * norm_bytes, "B",  # fwd: x, y; bwd: x, dy, dx
        ),
        "layer_norm": (
            norm_inputs,
            {
                "triton": lambda x, w, bias: kernels.layer_norm(x, w, bias, 1e-5),
                "eager": lambda x, w, bias: F.layer_norm(x, (n,), w, bias, 1e-5),
            },
            2 * norm_bytes, 5 * norm_bytes, "B",
        ),
        "cross_entropy": (
            ce_inputs,
            {
                "triton": lambda x, t: kernels.cross_entropy(x, t),
                "eager": lambda x, t: F.cross_entropy(x, t),
            },
            ce_bytes, 3 * ce_bytes, "B",  # fwd: logits; bwd: logits, dlogits
        ),
        "attention": (
            attention_inputs,
            {
                "triton": lambda q, k, v: kernels.attention(q, k, v, causal=True)[0],
                "eager": sdpa_flash,
            },
            attn_flops, 3.5 * attn_flops, "FLOP",
        ),
        "rotary": (
            rotary_inputs,
            {
                "triton": kernels.rotary_embedding,
                "eager": lambda x, cos, sin: x * cos + _rotate_half(x) * sin,
            },
            2 * rope_bytes, 4 * rope_bytes, "B",  # fwd: x, y; bwd: dy, dx
        ),
    }


def _timed(fn, inputs, backward, do_bench):
    """Median milliseconds of fn(*inputs), with a backward from a fixed gradient if asked."""
    if not backward:
        with torch.no_grad():
            return do_bench(lambda: fn(*inputs), return_mode="median")
    leaves = [t for t in inputs if t.is_floating_point() and t.requires_grad]
    grad = torch.randn_like(fn(*inputs))
    return do_bench(lambda: fn(*inputs).backward(grad), grad_to_none=leaves, return_mode="median")


def _rate(work, ms, unit):
    per_s = work / (ms * 1e-3)
    peak = H200_COPY_BYTES_PER_S if unit == "B" else H200_BF16_FLOPS
    shown = f"{per_s / 1e9:8.0f} GB/s" if unit == "B" else f"{per_s / 1e12:8.1f} TFLOP/s"
    return shown, per_s / peak


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--only", default="", help="comma-separated kernel names (default: all)")
    args = parser.parse_args()
    if not torch.cuda.is_available():
        print("bench/kernels.py times Triton kernels and needs a CUDA GPU; none is available here.")
        return 0

    from triton.testing import do_bench

    from autopar.codegen import kernels

    ok, reason = kernels.available()
    if not ok:
        print(f"Triton kernels unavailable: {reason}")
        return 0
    print(f"device: {torch.cuda.get_device_name()}, torch {torch.__version__}; peaks are the H200's")
    cases = _cases(kernels)
    only = [name for name in args.only.split(",") if name] or list(cases)
    header = f"{'kernel':14} {'pass':8} {'impl':8} {'ms':>9} {'rate':>16} {'of peak':>8} {'x triton':>9}"
    print(header)
    print("-" * len(header))
    for name in only:
        make, impls, fwd_work, fwdbwd_work, unit = cases[name]
        impls = dict(impls, compile=torch.compile(impls["eager"], dynamic=False))
        inputs = make()
        ref = impls["eager"](*inputs).float()
        err = (impls["triton"](*inputs).float() - ref).abs().max().item()
        print(f"{name}: max |triton - eager| = {err:.3g} (output scale {ref.abs().max().item():.3g})")
        for backward, work in ((False, fwd_work), (True, fwdbwd_work)):
            grad_inputs = [t.detach().requires_grad_(t.is_floating_point()) for t in inputs]
            times = {}
            for impl, fn in impls.items():
                try:
                    times[impl] = _timed(fn, grad_inputs, backward, do_bench)
                except Exception as exc:  # one failing baseline (e.g. a compile error) must not stop the run
                    print(f"  {impl} {'fwd+bwd' if backward else 'fwd'} failed: {type(exc).__name__}: {exc}")
            for impl, ms in times.items():
                shown, frac = _rate(work, ms, unit)
                ratio = ms / times["triton"] if "triton" in times else math.nan
                print(
                    f"{name:14} {'fwd+bwd' if backward else 'fwd':8} {impl:8} {ms:9.3f} {shown:>16} "
                    f"{frac:8.1%} {ratio:9.2f}"
                )
        del inputs, grad_inputs
        torch.cuda.empty_cache()
    return 0


if __name__ == "__main__":
    sys.exit(main())
