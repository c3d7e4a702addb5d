"""Does the cost model rank plans as they run? Predicted against measured step time of several plans of
one model, forced with pins, on a profiled cluster, and the Spearman rank correlation between them.

    OMP_NUM_THREADS=1 python bench/calibration.py [--arch gpt-probe] [--world 2] [--rounds 5] [--steps 2]

On CPU it runs ``--world`` gloo processes; under torchrun on GPUs (``--gpu``) it measures there. Every
rank profiles the cluster (``ClusterSpec.profile()``: matmul FLOP/s, copy bandwidth, op overhead,
all-reduce latency and bandwidth), plans each kind with that spec, compiles and trains it. The plans'
steps are timed round-robin (``--rounds`` rounds of ``--steps`` steps each, after two warm-up steps per
plan), so that drift in the machine's load falls on every plan alike; a plan's figure is its fastest
round (the one other processes disturbed least), each round the slowest rank's mean step, in wall time
and in the process's CPU time (all its threads: compute, and gloo's copies; not the time it waits). On a
machine shared with other work the CPU time is the steadier figure: the wall time of a rank also counts
the time the scheduler gives to other processes. The model is
one of tests/memory_cases.py's (default ``gpt-probe``: the built-in GPT, 4 layers, d_model 256, vocab
2048), and the plan kinds are that file's, plus one that keeps the whole batch on every rank (no
parallelism: twice the compute) and Megatron with every layer recomputed.
"""
from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
import warnings
from pathlib import Path

import torch
import torch.distributed as dist

# Each kind forces a different plan of the same model (tests/memory_cases.py's options).
KINDS = ("dp", "megatron", "zero3", "vocab", "recompute", "auto", "replicated", "megatron-recompute")


def spearman(xs, ys) -> float:
    """Spearman's rank correlation (average ranks for ties)."""
    def ranks(v):
        order = sorted(range(len(v)), key=v.__getitem__)
        r = [0.0] * len(v)
        i = 0
        while i < len(order):
            j = i
            while j + 1 < len(order) and v[order[j + 1]] == v[order[i]]:
                j += 1
            for k in range(i, j + 1):
                r[order[k]] = (i + j) / 2
            i = j + 1
        return r

    rx, ry = ranks(xs), ranks(ys)
    mx, my = statistics.fmean(rx), statistics.fmean(ry)
    cov = sum((a - mx) * (b - my) for a, b in zip(rx, ry))
    return cov / (sum((a - mx) ** 2 for a in rx) * sum((b - my) ** 2 for b in ry)) ** 0.5


def plan_options(kind: str, world: int, model) -> dict:
    from tests.memory_cases import options

    if kind == "replicated":       # every rank computes the whole step: nothing split, nothing reduced
        return {"mesh_shape": (world,), "recompute": False, "pins": {"*": ["R"]}}
    if kind == "megatron-recompute":
        return {**options("gpt", "megatron", world, model), "recompute": {"*": "all"}}
    return options("gpt", kind, world, model)


def _run(rank, world, args):
    import autopar
    from tests.memory_cases import build

    device = torch.device("cuda", rank) if args.gpu else torch.device("cpu")
    model, (ids, labels), _ = build(args.arch, args.seq, args.batch, device)
    cluster = autopar.ClusterSpec.from_env() if args.gpu else autopar.ClusterSpec.local_cpu(world)
    if not args.no_profile:
        cluster = cluster.profile()
    if rank == 0:
        print(f"cluster: {cluster}", flush=True)
    sync = torch.cuda.synchronize if args.gpu else (lambda: None)
    runs = {}
    for kind in args.kinds:
        opts = plan_options(kind, world, model)
        with warnings.catch_warnings():       # the replicated plan's idle axis is the point of it
            warnings.simplefilter("ignore", autopar.AutoparWarning)
            pm = autopar.compile(model, cluster, (ids,), {"labels": labels}, **opts)
        opt = torch.optim.AdamW(pm.parameters(), lr=1e-4)

        def step(pm=pm, opt=opt):
            loss = pm(ids, labels=labels).loss
            loss.backward()
            opt.step()
            opt.zero_grad(set_to_none=True)

        for _ in range(2):
            step()
        runs[kind] = (pm.plan, step, [])
    for _ in range(args.rounds):
        for kind, (_, step, times) in runs.items():
            sync()
            dist.barrier()
            t0, c0 = time.perf_counter(), time.process_time()
            for _ in range(args.steps):
                step()
            sync()
            t = torch.tensor([time.perf_counter() - t0, time.process_time() - c0], dtype=torch.float64,
                             device=device) / args.steps
            dist.all_reduce(t, op=dist.ReduceOp.MAX)
            times.append(t.tolist())
    if rank != 0:
        return
    print(f"\n{'plan':<20} {'predicted ms':>12} {'wall ms':>9} {'wall/pred':>9} {'CPU ms':>8} {'CPU/pred':>8}  "
          f"{'exposed comm ms':>15} {'hidden comm ms':>14}")
    predicted, wall, cpu = [], [], []
    for kind, (plan, _, times) in runs.items():
        w, c = min(t[0] for t in times), min(t[1] for t in times)
        predicted.append(plan.step_time)
        wall.append(w)
        cpu.append(c)
        b = plan.breakdown
        print(f"{kind:<20} {plan.step_time * 1e3:>12.1f} {w * 1e3:>9.1f} {w / plan.step_time:>9.2f} {c * 1e3:>8.1f} "
              f"{c / plan.step_time:>8.2f}  {b.get('exposed', 0.0) * 1e3:>15.1f} {b.get('hidden', 0.0) * 1e3:>14.1f}")
    print(f"\nSpearman rank correlation of predicted step time over {len(runs)} plans (target >= 0.9): "
          f"with wall time {spearman(predicted, wall):.3f}, with CPU time {spearman(predicted, cpu):.3f}")


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--world", type=int, default=2)
    ap.add_argument("--arch", default="gpt-probe", choices=("gpt", "gpt-probe"))
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--steps", type=int, default=2)
    ap.add_argument("--seq", type=int, default=128)
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--kinds", default=",".join(KINDS))
    ap.add_argument("--no-profile", action="store_true", help="plan with ClusterSpec's default figures")
    ap.add_argument("--gpu", action="store_true", help="under torchrun, one GPU per rank (NCCL)")
    args = ap.parse_args()
    args.kinds = args.kinds.split(",")
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))     # the repository's test helpers
    print(f"built-in GPT (tests/memory_cases.py {args.arch!r}), batch {args.batch} x seq {args.seq}, "
          f"OMP_NUM_THREADS={os.environ['OMP_NUM_THREADS']}", flush=True)
    if args.gpu:
        _init_gpu_group()
        _run(dist.get_rank(), dist.get_world_size(), args)
        return
    from tests.distributed_utils import run_distributed

    run_distributed(_run, args.world, args, timeout=3600)


def _init_gpu_group():
    import autopar

    autopar.ClusterSpec.from_env()      # initializes the process group from torchrun's environment
    torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", 0)))


if __name__ == "__main__":
    main()
