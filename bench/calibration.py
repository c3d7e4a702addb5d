"""Does the cost model rank plans as they run? Predicted against measured step time of several plans of
one model, forced with pins, on a profiled cluster, and the Spearman rank correlation between them.

    OMP_NUM_THREADS=1 python bench/calibration.py [--arch gpt-probe] [--world 2] [--rounds 8] [--steps 3]
                                                  [--op-overhead SECONDS] [--contention FRACTION]
                                                  [--peer-wait SECONDS]

On CPU it runs ``--world`` gloo processes; under torchrun on GPUs (``--gpu``) it measures there. Every
rank profiles the cluster (``ClusterSpec.profile()``: matmul FLOP/s, copy bandwidth, op overhead,
all-reduce latency and bandwidth, communication contention, peer wait), plans each kind with that spec, compiles and
trains it. Kinds whose pins give the same plan (``auto`` is often Megatron's) are measured once, under
the first kind's name. The plans' steps are timed round-robin (``--rounds`` rounds of ``--steps`` steps
each, after two warm-up steps per plan), so that drift in the machine's load falls on every plan alike;
each round gives the slowest rank's mean step, in wall time and in the process's CPU time (all its
threads: compute, and gloo's copies; not the time it waits). A plan's figure is its fastest round (the
one other processes disturbed least). On a machine shared with other work the CPU time is the steadier
figure: the wall time of a rank also counts the time the scheduler gives to other processes.

What the script reports, so that one run's ranking can be judged:
- Spearman's rank correlation of predicted against measured (fastest round), wall and CPU time;
- the same for each round alone (lowest and median over the rounds): a ranking that only the
  fastest rounds give is noise;
- each plan's spread (median round over fastest round);
- the pairs of plans the model prices at least ``--clear`` apart (default 10%) and how many of them
  measure in the predicted order: plans priced closer than that are ties the model does not claim
  to order, and their measured order is the noise of the run.

The model is one of tests/memory_cases.py's (default ``gpt-probe``: the built-in GPT, 4 layers, d_model
256, vocab 2048), and the plan kinds are that file's, plus one that keeps the whole batch on every rank
(no parallelism: twice the compute), data parallel with half the layers recomputed, and Megatron with
every layer recomputed. Two more kinds, asked for by name (``--kinds zero1,zero1-unbucketed``), time
ZeRO-1's gradients reduced in the runtime's buckets against the same plan's program without
``grad_buckets_pass`` (one all-reduce per use, as before ZeRO-1 gradients were bucketed), round by
round in one run.
"""
from __future__ import annotations

import argparse
import dataclasses
import os
import statistics
import sys
import time
import warnings
from pathlib import Path

# This folder's kernels.py (the Triton kernel bench) would shadow the `kernels` package transformers imports.
sys.path[:] = [p for p in sys.path if p != os.path.dirname(os.path.abspath(__file__))]

import torch
import torch.distributed as dist

# Each kind forces a different plan of the same model (tests/memory_cases.py's options).
KINDS = ("dp", "megatron", "zero3", "vocab", "recompute-half", "recompute", "auto", "replicated",
         "megatron-recompute")


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
    scale = (sum((a - mx) ** 2 for a in rx) * sum((b - my) ** 2 for b in ry)) ** 0.5
    return cov / scale if scale else float("nan")       # all tied: no ranking


def plan_options(kind: str, world: int, model) -> dict:
    from tests.memory_cases import options

    if kind == "replicated":       # every rank computes the whole step: nothing split, nothing reduced
        return {"mesh_shape": (world,), "recompute": False, "pins": {"*": ["R"]}}
    if kind == "recompute-half":   # data parallel, half the layers recomputed: between dp and recompute
        return {**options("gpt", "dp", world, model), "recompute": {"*": len(model.blocks) // 2}}
    if kind == "megatron-recompute":
        return {**options("gpt", "megatron", world, model), "recompute": {"*": "all"}}
    if kind == "zero1-unbucketed":
        return {**options("gpt", "zero1", world, model), "skip_passes": ("grad_buckets_pass",)}
    return options("gpt", kind, world, model)


def _run(rank, world, args):
    import autopar
    from tests.memory_cases import build

    device = torch.device("cuda", rank) if args.gpu else torch.device("cpu")
    model, (ids, labels), _ = build(args.arch, args.seq, args.batch, device)
    cluster = autopar.ClusterSpec.from_env() if args.gpu else autopar.ClusterSpec.local_cpu(world)
    if not args.no_profile:
        cluster = cluster.profile()
    if args.op_overhead is not None:
        cluster = dataclasses.replace(cluster, device=dataclasses.replace(cluster.device, op_overhead=args.op_overhead))
    if args.contention is not None:
        cluster = dataclasses.replace(cluster, device=dataclasses.replace(cluster.device,
                                                                          comm_contention=args.contention))
    if args.peer_wait is not None:
        cluster = dataclasses.replace(cluster, device=dataclasses.replace(cluster.device, peer_wait=args.peer_wait))
    if rank == 0:
        print(f"cluster: {cluster}", flush=True)
    sync = torch.cuda.synchronize if args.gpu else (lambda: None)
    runs, seen = {}, {}
    for kind in args.kinds:
        opts = plan_options(kind, world, model)
        with warnings.catch_warnings():       # the replicated plan's idle axis is the point of it
            warnings.simplefilter("ignore", autopar.AutoparWarning)
            pm = autopar.compile(model, cluster, (ids,), {"labels": labels}, **opts)
        key = (layout_key(pm.plan), opts.get("skip_passes"))        # the same plan, another program
        if key in seen:
            if rank == 0:
                print(f"{kind}: the same plan as {seen[key]}, measured once", flush=True)
            continue
        seen[key] = kind
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
    if rank == 0:
        report({kind: (plan, times) for kind, (plan, _, times) in runs.items()}, args.clear)


def layout_key(plan) -> str:
    """What makes two plans run the same program: layouts, recompute, ZeRO and offload."""
    d = plan.to_dict()
    return repr([d[k] for k in ("mesh", "params", "inputs", "nodes", "recompute", "zero", "offload")])


def report(runs: dict, clear: float) -> None:
    """``runs``: kind -> (plan, [(wall, cpu) seconds per round])."""
    kinds = list(runs)
    predicted = [runs[k][0].step_time for k in kinds]
    per_round = {clock: [[t[clock] for t in runs[k][1]] for k in kinds] for clock in (0, 1)}
    fastest = {clock: [min(ts) for ts in per_round[clock]] for clock in (0, 1)}
    print(f"\n{'plan':<20} {'predicted ms':>12} {'wall ms':>9} {'wall/pred':>9} {'spread':>7} {'CPU ms':>8} "
          f"{'CPU/pred':>8} {'spread':>7}  {'exposed comm ms':>15} {'hidden comm ms':>14}")
    for i, kind in enumerate(kinds):
        plan = runs[kind][0]
        w, c = fastest[0][i], fastest[1][i]
        sw, sc = (statistics.median(per_round[clock][i]) / fastest[clock][i] for clock in (0, 1))
        b = plan.breakdown
        print(f"{kind:<20} {plan.step_time * 1e3:>12.1f} {w * 1e3:>9.1f} {w / plan.step_time:>9.2f} {sw:>6.2f}x "
              f"{c * 1e3:>8.1f} {c / plan.step_time:>8.2f} {sc:>6.2f}x  {b.get('exposed', 0.0) * 1e3:>15.1f} "
              f"{b.get('hidden', 0.0) * 1e3:>14.1f}")
    if len(kinds) < 3:
        print("\nfewer than 3 different plans: no ranking to compare")
        return
    rounds = len(runs[kinds[0]][1])
    print(f"\nSpearman rank correlation of predicted step time over {len(kinds)} different plans (target >= 0.9):")
    for clock, name in ((1, "CPU time"), (0, "wall time")):
        each = sorted(spearman(predicted, [ts[r] for ts in per_round[clock]]) for r in range(rounds))
        print(f"  {name:<9}: fastest round {spearman(predicted, fastest[clock]):.3f}; each of the {rounds} rounds "
              f"alone: lowest {each[0]:.3f}, median {statistics.median(each):.3f}")
    pairs = [(i, j) for i in range(len(kinds)) for j in range(i + 1, len(kinds))
             if max(predicted[i], predicted[j]) >= (1 + clear) * min(predicted[i], predicted[j])]
    for clock, name in ((1, "CPU time"), (0, "wall time")):
        agree = sum((predicted[i] < predicted[j]) == (fastest[clock][i] < fastest[clock][j]) for i, j in pairs)
        print(f"  pairs priced at least {clear:.0%} apart, measured in the predicted order ({name}): "
              f"{agree} of {len(pairs)}")
    close = [(kinds[i], kinds[j]) for i in range(len(kinds)) for j in range(i + 1, len(kinds))
             if max(predicted[i], predicted[j]) < (1 + clear) * min(predicted[i], predicted[j])]
    if close:
        print(f"  priced within {clear:.0%} of each other (their order is not a prediction): "
              + ", ".join(f"{a}/{b}" for a, b in close))


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--world", type=int, default=2)
    ap.add_argument("--arch", default="gpt-probe", choices=("gpt", "gpt-probe"))
    ap.add_argument("--rounds", type=int, default=8)
    ap.add_argument("--steps", type=int, default=3)
    ap.add_argument("--seq", type=int, default=128)
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--kinds", default=",".join(KINDS))
    ap.add_argument("--clear", type=float, default=0.1,
                    help="plans priced at least this fraction apart are the pairs whose order is checked")
    ap.add_argument("--no-profile", action="store_true", help="plan with ClusterSpec's default figures")
    ap.add_argument("--op-overhead", type=float, default=None, metavar="SECONDS",
                    help="price this per-op overhead instead of the profiled one (0: the model without the term)")
    ap.add_argument("--contention", type=float, default=None, metavar="FRACTION",
                    help="price this communication contention instead of the profiled one (0: hiding is free)")
    ap.add_argument("--peer-wait", type=float, default=None, metavar="SECONDS",
                    help="price this wait per collective instead of the profiled one (0: the model without the term)")
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
