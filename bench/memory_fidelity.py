"""Predicted against measured peak memory per device, per architecture x plan kind x budget.

On CPU (gloo, the default) run it under torchrun; each case plans, compiles, trains one warm-up step
and measures the peak of live tensors over two more steps (tests/live_memory.py: MemTracker's
accounting without its module hooks, which hold every gradient until backward ends), optimizer states
included, taking the largest over ranks:

    python -m torch.distributed.run --standalone --nproc-per-node 2 bench/memory_fidelity.py
    python -m torch.distributed.run --standalone --nproc-per-node 4 bench/memory_fidelity.py --kinds 2d
    python -m torch.distributed.run --standalone --nproc-per-node 2 bench/memory_fidelity.py --precision bf16-mixed
    python -m torch.distributed.run --standalone --nproc-per-node 2 bench/memory_fidelity.py --archs gpt,llama \
        --kinds dp-bf16,zero1-bf16,zero2-bf16 --reduce-dtype float32

With ``--gpu`` (one CUDA device, no torchrun needed) it plans for a one-device cluster of the GPU
(``ClusterSpec.from_env()``, or ``--preset``) and measures ``torch.cuda.max_memory_allocated`` over the
same steps, less what cuBLAS's workspaces hold before any model is built (the cluster's reserve is for
them), against ``plan.memory["peak"]``; a case that fails prints its error and the run goes on:

    python bench/memory_fidelity.py --gpu

Budgets: none (the device's usable memory), and 1.05x and 1.5x the smallest feasible budget that
planning reports for that case. Columns: predicted peak, measured peak, measured / predicted, and
measured / budget where a budget was given.
"""
from __future__ import annotations

import argparse
import functools
import os
import sys

# This folder's kernels.py (the Triton kernel bench) would shadow the `kernels` package transformers imports.
sys.path[:] = [p for p in sys.path if p != os.path.dirname(os.path.abspath(__file__))]

import torch
import torch.distributed as dist

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

import autopar  # noqa: E402
from autopar.errors import InfeasiblePlanError  # noqa: E402
from tests.memory_cases import ARCHS, KINDS, build, options  # noqa: E402

BUDGETS = ("none", "1.05", "1.5")


def smallest_budget(model, cluster, args, kwargs, opts) -> float | None:
    try:
        autopar.plan(model, cluster, args, kwargs, memory_budget=1.0, progress=False, kernels="aten", **opts)
    except InfeasiblePlanError as e:
        return e.min_feasible_budget
    return None


def measure_cpu(pm, args, kwargs) -> float:
    from tests.live_memory import step_peak

    opt = torch.optim.AdamW(pm.parameters(), lr=1e-3)
    step = _step(pm, opt, args, kwargs)
    step()
    peak = torch.tensor([float(step_peak(pm, opt, step, inputs=(args, kwargs)))])
    dist.all_reduce(peak, op=dist.ReduceOp.MAX)
    return peak.item()


def cuda_library_bytes() -> int:
    """The bytes cuBLAS's workspaces hold through the caching allocator once a matmul has run forward and
    backward: allocated for the process's life, before any model, and not the plan's (the cluster's
    ``memory_reserve`` covers them)."""
    a = torch.randn(256, 256, device="cuda", requires_grad=True)
    (a @ a).sum().backward()
    del a
    torch.cuda.synchronize()
    return torch.cuda.memory_allocated()


def measure_gpu(pm, args, kwargs, library_bytes: int) -> float:
    opt = torch.optim.AdamW(pm.parameters(), lr=1e-3)
    step = _step(pm, opt, args, kwargs)
    step()
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    for _ in range(2):
        step()
    torch.cuda.synchronize()
    return float(torch.cuda.max_memory_allocated() - library_bytes)


def _step(pm, opt, args, kwargs):
    def step():
        out = pm(*args, **kwargs)
        loss = out if isinstance(out, torch.Tensor) else out.loss
        if hasattr(loss, "to_local"):
            loss = loss.to_local()
        loss.backward()
        opt.step()
        opt.zero_grad()
    return step


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--archs", default="gpt2,llama,bert,gpt,qwen2", help=f"comma-separated, from {', '.join(ARCHS)}")
    ap.add_argument("--kinds", default="auto,dp,megatron,zero3,vocab,recompute,sharded-outputs",
                    help=f"comma-separated plan kinds, from {', '.join(KINDS)} (2d needs 4 ranks)")
    ap.add_argument("--budgets", default=",".join(BUDGETS),
                    help="comma-separated: none, or a factor of the smallest feasible budget")
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--seq", type=int, default=64)
    ap.add_argument("--precision", default=None, choices=("32-true", "bf16-mixed", "bf16-true"),
                    help="training precision (default: the model's own, 32-true)")
    ap.add_argument("--reduce-dtype", default=None, choices=("float32", "bfloat16"),
                    help="what bf16-mixed sums gradients over ranks in (default: bfloat16)")
    ap.add_argument("--gpu", action="store_true", help="one CUDA device: torch.cuda.max_memory_allocated "
                                                       "against the one-device plan")
    ap.add_argument("--preset", default=None,
                    help="the cluster preset in --gpu mode (default: the GPU's own, ClusterSpec.from_env())")
    a = ap.parse_args()

    if a.gpu:
        if not torch.cuda.is_available():
            raise SystemExit("--gpu needs a CUDA device")
        os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
        os.environ.setdefault("MASTER_PORT", "29533")
        dist.init_process_group("nccl", rank=0, world_size=1)
        torch.cuda.set_device(0)
        cluster = autopar.ClusterSpec.preset(a.preset) if a.preset else autopar.ClusterSpec.from_env()
        library = cuda_library_bytes()
        print(f"{torch.cuda.get_device_name()}, torch {torch.__version__}; cluster {cluster.name}; "
              f"cuBLAS workspaces {library / 2**20:.1f} MiB (left out of the measured peaks)", flush=True)
        device, measure = torch.device("cuda", 0), functools.partial(measure_gpu, library_bytes=library)
    else:
        dist.init_process_group("gloo")
        cluster = autopar.ClusterSpec.local_cpu(dist.get_world_size())
        device, measure = torch.device("cpu"), measure_cpu
    ranks = dist.get_world_size()
    rank0 = dist.get_rank() == 0
    if rank0:
        print(f"{'arch':<10} {'kind':<16} {'budget':>10} {'predicted':>10} {'measured':>10} {'meas/pred':>9} "
              f"{'meas/budget':>11}  mesh", flush=True)
    worst = 0.0
    factors = [b for b in a.budgets.split(",") if b != "none"]
    for arch in a.archs.split(","):
        for kind in a.kinds.split(","):
            try:
                model, args, kwargs = build(arch, a.seq, a.batch, device)
            except ImportError as e:          # the Hugging Face models need transformers
                if rank0:
                    print(f"{arch:<10} skipped: {e}", flush=True)
                break
            opts = options(arch, kind, ranks, model)
            if opts is None or (a.gpu and kind not in ("auto", "recompute")):
                continue
            if a.precision:
                opts = {**opts, "precision": a.precision}
            if a.reduce_dtype:
                opts = {**opts, "reduce_dtype": a.reduce_dtype}
            if a.gpu:
                opts = {k: v for k, v in opts.items() if k not in ("mesh_shape", "pins")}
            smallest = [None]
            if rank0 and factors:       # the search is only needed for a budget given as a factor
                smallest = [smallest_budget(model, cluster, args, kwargs, opts)]
            dist.broadcast_object_list(smallest, src=0)
            for b in a.budgets.split(","):
                budget = None if b == "none" else (None if smallest[0] is None else float(b) * smallest[0])
                if b != "none" and budget is None:
                    continue
                model, args, kwargs = build(arch, a.seq, a.batch, device)
                try:
                    pm = autopar.compile(model, cluster, args, kwargs, memory_budget=budget, kernels="aten", **opts)
                    measured = measure(pm, args, kwargs)
                except InfeasiblePlanError as e:
                    if rank0:
                        print(f"{arch:<10} {kind:<16} {b:>10} no plan: {e}", flush=True)
                    continue
                except Exception as e:      # on one GPU a failing case must not hide the others' figures
                    if not a.gpu:
                        raise
                    print(f"{arch:<10} {kind:<16} {b:>10} failed: {type(e).__name__}: {str(e)[:300]}", flush=True)
                    continue
                pred = pm.plan.memory["peak"]
                worst = max(worst, abs(measured / pred - 1))
                if rank0:
                    mib = 2 ** 20
                    shown = "none" if budget is None else f"{budget / mib:.1f}M"
                    over = "" if budget is None else f"{measured / budget:.3f}"
                    print(f"{arch:<10} {kind:<16} {shown:>10} {pred / mib:>9.2f}M {measured / mib:>9.2f}M "
                          f"{measured / pred:>9.3f} {over:>11}  {pm.plan.mesh['shape']}", flush=True)
                del pm
    if rank0:
        print(f"largest |measured/predicted - 1|: {worst:.3f}", flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
