"""Times the Triton kernel library (autopar.codegen.kernels) against eager PyTorch and
torch.compile on a GPU, forward and forward+backward, at LLaMA-3-8B-like sizes in bf16.

    python bench/kernels.py [--only rms_norm,layer_norm,cross_entropy,attention,rotary]
    python bench/kernels.py --tune-attention    # sweep the attention kernels' GPU tiles

Memory-bound kernels report GB/s of compulsory traffic (each input read once, each output
written once), attention reports TFLOP/s of model FLOPs (causal half of 4*B*H*S^2*D forward,
2.5x that backward); both also as a fraction of this device's peaks, measured at the start of the
run (a device-to-device copy counting bytes read and written, and an 8192^3 bf16 matmul). The last
column is each implementation's time over the Triton kernel's (above 1: Triton is faster). The
columns are given twice: wall-clock time per call (Triton's do_bench: what a lone call costs, host
launch and autograd overhead included) and GPU kernel time per call (torch.profiler's device times:
what the call costs inside a training step, where the host runs ahead of the GPU). Before
timing, each kernel's output and input gradients are checked against eager in fp32 on the same
bf16 inputs. Without a GPU it says so and exits 0.
"""

import argparse
import math
import sys

import torch
import torch.nn.functional as F



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


def _errors(impls, inputs, reference):
    """(what, max abs error, max abs reference) of the Triton kernel's output and input gradients
    against eager run in fp32 on the same (bf16-valued) inputs."""
    torch.manual_seed(0)

    def run(fn, cast):
        leaves = [t.detach().to(cast).requires_grad_() if t.is_floating_point() else t for t in inputs]
        out = fn(*leaves)
        out.float().mul(grad).sum().backward()
        return [("out", out.detach())] + [(f"d{i}", t.grad) for i, t in enumerate(leaves)
                                          if t.is_floating_point() and t.grad is not None]

    grad = torch.randn(impls["eager"](*inputs).shape, device="cuda")
    got, want = run(impls["triton"], torch.bfloat16), run(reference, torch.float32)
    want = dict(want)
    return [(what, (g.float() - want[what]).abs().max().item(), want[what].abs().max().item())
            for what, g in got if what in want]


def tune_attention(kernels, do_bench):
    """Times every candidate tile for each of the three attention kernels at the benchmark's
    shape (causal, bf16), the other two kernels at their current tiles, and prints the best."""
    import itertools

    from autopar.codegen.kernels import _attention

    b, h, s, d = 4, 32, 4096, 128
    q, k, v = (torch.randn(b, h, s, d, device="cuda", dtype=torch.bfloat16, requires_grad=True) for _ in range(3))
    grad = torch.randn_like(q)
    grids = {
        "fwd": (False, itertools.product((64, 128), (32, 64, 128), (4, 8), (2, 3, 4))),
        "dkdv": (True, itertools.product((16, 32, 64), (64, 128), (4, 8), (1, 2, 3))),
        "dq": (True, itertools.product((64, 128), (16, 32, 64), (4, 8), (1, 2, 3))),
    }
    for kernel, (backward, candidates) in grids.items():
        chosen = _attention._GPU_TILES[kernel][2]
        results = []
        for tile in candidates:
            _attention._GPU_TILES[kernel][2] = tile
            try:
                if backward:
                    ms = do_bench(lambda: kernels.attention(q, k, v, causal=True)[0].backward(grad),
                                  grad_to_none=[q, k, v], return_mode="median")
                else:
                    with torch.no_grad():
                        ms = do_bench(lambda: kernels.attention(q, k, v, causal=True), return_mode="median")
            except Exception as exc:  # a tile that needs more shared memory than the device has
                print(f"  {kernel} {tile}: {type(exc).__name__}")
                continue
            results.append((ms, tile))
        _attention._GPU_TILES[kernel][2] = chosen
        results.sort()
        what = "fwd+bwd" if backward else "fwd"
        print(f"{kernel}: current {chosen}; best {what} ms: " +
              ", ".join(f"{tile} {ms:.3f}" for ms, tile in results[:5]))


def tune_memory_bound(cases, only):
    """Times the memory-bound kernels' launch choices (warps, blocks) at the benchmark's shapes,
    forward and forward+backward, in GPU kernel time, and prints the fastest few of each."""
    import itertools

    from autopar.codegen.kernels import _cross_entropy, _norms, _rotary

    sweeps = {
        "rms_norm": (_norms, {
            "_launch": [lambda block, backward, b=b, st=st: dict(num_warps=b if backward else 8,
                                                               num_stages=st if backward else 1)
                        for b, st in itertools.product((8, 16, 32), (1, 2, 3))],
            "_BWD_PROGRAMS_PER_SM": (1, 2, 4, 8)}),
        "cross_entropy": (_cross_entropy, {"_block": [lambda v, k=k: k for k in (1024, 2048, 4096, 8192, 16384)],
                                           "_warps": [lambda block, w=w: w for w in (4, 8, 16, 32)]}),
        "rotary": (_rotary, {"_block_s": [lambda half, k=k: k for k in (1, 2, 4, 8, 16, 32, 64, 128)]}),
    }
    sweeps["layer_norm"] = sweeps["rms_norm"]
    for name, (module, choices) in sweeps.items():
        if only and name not in only:
            continue
        make, impls, *_ = cases[name]
        inputs = [t.detach().requires_grad_(t.is_floating_point()) for t in make()]
        saved = {attr: getattr(module, attr) for attr in choices}
        results = []
        for combo in itertools.product(*choices.values()):
            for attr, fn in zip(choices, combo):
                setattr(module, attr, fn)
            label = ", ".join(_describe(attr, fn) for attr, fn in zip(choices, combo))
            try:
                fwd = _gpu_ms(impls["triton"], inputs, False)
                both = _gpu_ms(impls["triton"], inputs, True)
            except Exception as exc:  # a launch the device cannot run
                print(f"  {name} {label}: {type(exc).__name__}")
                continue
            results.append((both, fwd, label))
        for attr, fn in saved.items():
            setattr(module, attr, fn)
        results.sort()
        print(f"{name}: fastest fwd+bwd (ms fwd+bwd / fwd): " +
              "; ".join(f"[{label}] {both:.3f} / {fwd:.3f}" for both, fwd, label in results[:4]))
        print(f"{name}: fastest fwd: " + "; ".join(
            f"[{label}] {fwd:.3f}" for _, fwd, label in sorted(results, key=lambda r: r[1])[:3]))


def _describe(attr, choice):
    """A swept launch choice as text: the value a choice function returns at the benchmark's shape."""
    if not callable(choice):
        return f"{attr}={choice}"
    if attr == "_launch":
        return f"fwd {choice(8192, False)} bwd {choice(8192, True)}"
    return f"{attr}={choice(*{'_warps': (8192,), '_block': (128256,), '_block_s': (64,)}[attr])}"


def profile(cases, name):
    """torch.profiler's CUDA kernel table for the Triton kernel's forward+backward."""
    from torch.profiler import ProfilerActivity, profile as torch_profile

    make, impls, *_ = cases[name]
    inputs = [t.detach().requires_grad_(t.is_floating_point()) for t in make()]
    out = impls["triton"](*inputs)
    grad = torch.randn_like(out)
    for _ in range(3):
        impls["triton"](*inputs).backward(grad)
    torch.cuda.synchronize()
    with torch_profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(5):
            impls["triton"](*inputs).backward(grad)
        torch.cuda.synchronize()
    print(f"{name} fwd+bwd x5:")
    print(prof.key_averages().table(sort_by="cuda_time_total", row_limit=12))


def _timed(fn, inputs, backward, do_bench):
    """Median milliseconds of fn(*inputs), with a backward from a fixed gradient if asked."""
    if not backward:
        with torch.no_grad():
            return do_bench(lambda: fn(*inputs), return_mode="median")
    leaves = [t for t in inputs if t.is_floating_point() and t.requires_grad]
    grad = torch.randn_like(fn(*inputs))
    return do_bench(lambda: fn(*inputs).backward(grad), grad_to_none=leaves, return_mode="median")


def measure_peaks(do_bench):
    """(copy bytes/s, bf16 matmul FLOP/s) of this device: a 2 GiB device-to-device copy counting
    bytes read and written, and an 8192^3 bf16 product on random data."""
    src = torch.empty(2**30, dtype=torch.bfloat16, device="cuda").normal_()
    dst = torch.empty_like(src)
    copy_ms = do_bench(lambda: dst.copy_(src), return_mode="median")
    del src, dst
    a, b = (torch.randn(8192, 8192, dtype=torch.bfloat16, device="cuda") for _ in range(2))
    mm_ms = do_bench(lambda: a @ b, return_mode="median")
    return 2 * 2**31 / (copy_ms * 1e-3), 2 * 8192**3 / (mm_ms * 1e-3)


def _gpu_ms(fn, inputs, backward, iters=10):
    """Milliseconds the GPU spends in kernels per call (torch.profiler's device times), which leaves
    out the host's launch and autograd overhead that a wall-clock timing of small kernels includes."""
    from torch.profiler import ProfilerActivity, profile as torch_profile

    leaves = [t for t in inputs if t.is_floating_point() and t.requires_grad]
    grad = torch.randn_like(fn(*inputs)) if backward else None

    def call():
        for t in leaves:
            t.grad = None
        if backward:
            fn(*inputs).backward(grad)
        else:
            with torch.no_grad():
                fn(*inputs)

    call()
    torch.cuda.synchronize()
    with torch_profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(iters):
            call()
        torch.cuda.synchronize()
    total_us = sum(getattr(e, "self_device_time_total", 0) for e in prof.key_averages())
    return total_us / 1e3 / iters


def _rate(work, ms, unit, peaks):
    per_s = work / (ms * 1e-3)
    peak = peaks[0] if unit == "B" else peaks[1]
    shown = f"{per_s / 1e9:8.0f} GB/s" if unit == "B" else f"{per_s / 1e12:8.1f} TFLOP/s"
    return shown, per_s / peak


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--only", default="", help="comma-separated kernel names (default: all)")
    parser.add_argument("--tune-attention", action="store_true", help="sweep the attention kernels' tiles")
    parser.add_argument("--tune-memory", action="store_true",
                        help="sweep the norms', cross-entropy's and rotary's warps and blocks")
    parser.add_argument("--profile", default="", help="comma-separated kernels to profile forward+backward")
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
    import triton

    peaks = measure_peaks(do_bench)
    print(f"device: {torch.cuda.get_device_name()}, torch {torch.__version__}, triton {triton.__version__}")
    print(f"measured peaks: copy {peaks[0] / 1e12:.2f} TB/s (read + write), bf16 matmul "
          f"{peaks[1] / 1e12:.0f} TFLOP/s; 'of peak' below is against these")
    if args.tune_attention:
        tune_attention(kernels, do_bench)
        return 0
    cases = _cases(kernels)
    if args.tune_memory or args.profile:
        for name in [n for n in args.profile.split(",") if n]:
            profile(cases, name)
        if args.tune_memory:
            tune_memory_bound(cases, [name for name in args.only.split(",") if name])
        return 0
    # The flash backend takes no fp32: the fp32 reference lets SDPA pick its backend.
    references = {"attention": lambda q, k, v: F.scaled_dot_product_attention(q, k, v, is_causal=True)}
    only = [name for name in args.only.split(",") if name] or list(cases)
    header = (f"{'kernel':14} {'pass':8} {'impl':8} {'ms':>9} {'rate':>16} {'of peak':>8} {'x triton':>9} "
              f"{'gpu ms':>9} {'gpu rate':>16} {'of peak':>8} {'x triton':>9}")
    print(header)
    print("-" * len(header))
    for name in only:
        make, impls, fwd_work, fwdbwd_work, unit = cases[name]
        impls = dict(impls, compile=torch.compile(impls["eager"], dynamic=False))
        inputs = make()
        print(f"{name}: " + ", ".join(f"{what} max |triton - eager fp32| = {err:.3g} (scale {scale:.3g})"
                                      for what, err, scale in _errors(impls, inputs, references.get(name, impls["eager"]))))
        for backward, work in ((False, fwd_work), (True, fwdbwd_work)):
            grad_inputs = [t.detach().requires_grad_(t.is_floating_point()) for t in inputs]
            times = {}
            _timed(impls["triton"], grad_inputs, backward, do_bench)  # warm-up: clocks and caches settle
            for impl, fn in impls.items():
                try:
                    times[impl] = _timed(fn, grad_inputs, backward, do_bench), _gpu_ms(fn, grad_inputs, backward)
                except Exception as exc:  # one failing baseline (e.g. a compile error) must not stop the run
                    print(f"  {impl} {'fwd+bwd' if backward else 'fwd'} failed: {type(exc).__name__}: {exc}")
            for impl, (ms, gpu_ms) in times.items():
                shown, frac = _rate(work, ms, unit, peaks)
                gpu_shown, gpu_frac = _rate(work, gpu_ms, unit, peaks)
                ratio = ms / times["triton"][0] if "triton" in times else math.nan
                gpu_ratio = gpu_ms / times["triton"][1] if "triton" in times else math.nan
                print(
                    f"{name:14} {'fwd+bwd' if backward else 'fwd':8} {impl:8} {ms:9.3f} {shown:>16} "
                    f"{frac:8.1%} {ratio:9.2f} {gpu_ms:9.3f} {gpu_shown:>16} {gpu_frac:8.1%} {gpu_ratio:9.2f}"
                )
        del inputs, grad_inputs
        torch.cuda.empty_cache()
    return 0


if __name__ == "__main__":
    sys.exit(main())
