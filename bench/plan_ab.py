"""Is the plan the planner prices faster faster? Two plans of one model, forced with pins or a bucket
size, timed interleaved on the gloo ranks torchrun starts, with the predicted against the measured ratio.

    OMP_NUM_THREADS=1 python -m torch.distributed.run --standalone --nproc-per-node 2 bench/plan_ab.py \\
        A B [--model gpt-b4|probe|train] [--spec local|profile|FILE] [--save-spec FILE] [--rounds 8] [--steps 3]

A and B are ``KIND[+so][@MIB]``:
- ``auto``: the planner's own plan (no pins);
- ``rep``: every parameter pinned replicated, the rest left to the solver (it may split the batch, or
  read the replicated weights in chunks: their features split, the gradient all-gathered);
- ``ddp``: DDP's program, the parameters replicated and the batch split through every linear layer;
- ``+so``: ``sharded_outputs=True`` (bench/train_cpu.py's setting: the logits kept as computed);
- ``@MIB``: ``compile(bucket_mb=MIB)``; without it the planner chooses the bucket size.

``--model``: ``gpt-b4`` is tests/memory_cases.py's ``build("gpt", seq=32, batch=4)`` (2 layers, d_model
128, vocab 512); ``probe`` bench/calibration.py's ``gpt-probe`` at its batch of 8 x 128 (4 layers,
d_model 256, vocab 2048); ``train`` bench/train_cpu.py's built-in GPT (4 layers, d_model 768, vocab 8192,
8 x 128). ``--spec``: ``local`` plans on ``ClusterSpec.local_cpu(world)``'s unprofiled figures,
``profile`` profiles the group first, a file is a spec saved by ``--save-spec`` (``ClusterSpec.to_dict``),
so that several runs plan on one profile.

Each rank compiles both plans, runs three warm-up steps of each, then ``--rounds`` rounds of ``--steps``
steps of each, A then B in even rounds and B then A in odd ones. A round's figure is the slowest rank's
mean step, in wall time and in the process's CPU time (``time.process_time``: all its threads, gloo's
included; not the time other processes take). The script prints each plan's summary (layouts, bucket
size, predicted step and its exposed and hidden communication), each plan's median round, and the ratio
A/B paired by round (median, interquartile range and range) beside the predicted ratio.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
import warnings

# This folder's kernels.py (the Triton kernel bench) would shadow the `kernels` package transformers imports.
sys.path[:] = [p for p in sys.path if p != os.path.dirname(os.path.abspath(__file__))]

import torch
import torch.distributed as dist

MODELS = {  # name -> (vocab, GPTConfig fields, (batch, seq))
    "gpt-b4": (512, {"n_layer": 2, "n_head": 4, "d_model": 128, "d_ff": 256}, (4, 32)),
    "probe": (2048, {"n_layer": 4, "n_head": 8, "d_model": 256, "d_ff": 1024}, (8, 128)),
    "train": (8192, {"n_layer": 4, "n_head": 12, "d_model": 768, "d_ff": 3072}, (8, 128)),
}


def model_and_batch(name):
    from autopar.models import GPT, GPTConfig

    vocab, cfg, (batch, seq) = MODELS[name]
    torch.manual_seed(0)
    model = GPT(GPTConfig(vocab_size=vocab, max_seq=seq, **cfg))
    ids = torch.randint(0, vocab, (batch, seq), generator=torch.Generator().manual_seed(1))
    return model, ids, ids.clone()


def options(model, variant: str) -> dict:
    """compile() options of ``KIND[+so][@MIB]``."""
    kind, _, mib = variant.partition("@")
    sharded_outputs = kind.endswith("+so")
    kind = kind.removesuffix("+so")
    params_r = {name: {"output": ["R"], "zero": 0} for name, _ in model.named_parameters()}
    pins = {"auto": None, "rep": params_r,
            "ddp": {**params_r, "input_ids": ["S(0)"], "labels": ["S(0)"], "linear*": ["S(0)"]}}
    if kind not in pins:
        raise SystemExit(f"unknown plan kind {kind!r}; choose from {', '.join(pins)}")
    opts = {"sharded_outputs": sharded_outputs, "bucket_mb": float(mib) if mib else None}
    if pins[kind] is not None:
        opts.update(mesh_shape=(dist.get_world_size(),), pins=pins[kind], recompute=False)
    return opts


def describe(plan) -> str:
    b = plan.breakdown
    counts: dict = {}
    for c in plan.collectives:
        key = f"{c.kind} {c.phase} ({c.step})"
        counts[key] = counts.get(key, 0) + 1
    split = sum(any(p != "R" for p in lay) for lay in plan.params.values())
    priced = ", ".join(f"{mb} MiB {s * 1e3:.2f}" for mb, s in (plan.solver.get("buckets") or {}).items())
    return (f"predicted {plan.step_time * 1e3:.2f} ms (compute {b['compute'] * 1e3:.2f}, exposed "
            f"{b['exposed'] * 1e3:.2f}, hidden {b['hidden'] * 1e3:.2f}, contention {b.get('contention', 0) * 1e3:.2f}, "
            f"optimizer {b['optimizer'] * 1e3:.2f}); inputs {dict(plan.inputs)}; {split} of {len(plan.params)} "
            f"parameters split; buckets {plan.bucket_mb} MiB (priced: {priced or '-'}); collectives {counts}")


def cluster_spec(args):
    import autopar

    if args.spec not in ("local", "profile"):
        with open(args.spec) as f:
            return autopar.ClusterSpec.from_dict(json.load(f))
    cluster = autopar.ClusterSpec.local_cpu(dist.get_world_size())
    return cluster.profile() if args.spec == "profile" else cluster


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("a")
    ap.add_argument("b")
    ap.add_argument("--model", default="gpt-b4", choices=tuple(MODELS))
    ap.add_argument("--spec", default="local", help="local, profile or a file saved by --save-spec")
    ap.add_argument("--save-spec", default=None, metavar="FILE", help="write the spec planned on (rank 0)")
    ap.add_argument("--rounds", type=int, default=8)
    ap.add_argument("--steps", type=int, default=3)
    args = ap.parse_args()
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    import autopar

    dist.init_process_group("gloo")
    rank = dist.get_rank()
    cluster = cluster_spec(args)
    if rank == 0:
        print(f"{args.model} on {dist.get_world_size()} gloo ranks, OMP_NUM_THREADS={os.environ['OMP_NUM_THREADS']}; "
              f"cluster: {cluster}", flush=True)
        if args.save_spec:
            with open(args.save_spec, "w") as f:
                json.dump(cluster.to_dict(), f, indent=1)
    model, ids, labels = model_and_batch(args.model)
    runs = {}
    for variant in (args.a, args.b):
        with warnings.catch_warnings():      # a replicated plan's idle axis may be the point of it
            warnings.simplefilter("ignore", autopar.AutoparWarning)
            pm = autopar.compile(model, cluster, (ids, labels), **options(model, variant))
        if rank == 0:
            print(f"{variant}: {describe(pm.plan)}", flush=True)
        opt = torch.optim.AdamW(pm.parameters(), lr=1e-4)

        def step(pm=pm, opt=opt):
            pm(ids, labels).loss.backward()
            opt.step()
            opt.zero_grad(set_to_none=True)

        for _ in range(3):
            step()
        runs[variant] = (pm.plan, step, [])
    order = list(runs)
    for r in range(args.rounds):
        for variant in order if r % 2 == 0 else order[::-1]:
            _, step, times = runs[variant]
            dist.barrier()
            t0, c0 = time.perf_counter(), time.process_time()
            for _ in range(args.steps):
                step()
            t = torch.tensor([time.perf_counter() - t0, time.process_time() - c0], dtype=torch.float64) / args.steps
            dist.all_reduce(t, op=dist.ReduceOp.MAX)
            times.append(t.tolist())
    if rank == 0:
        report(runs, args)
    dist.destroy_process_group()


def report(runs, args):
    (plan_a, _, ta), (plan_b, _, tb) = runs[args.a], runs[args.b]
    print(f"\n{args.rounds} rounds x {args.steps} steps, the slowest rank's mean step per round (ms):")
    for variant, (plan, _, times) in runs.items():
        for clock, name in ((0, "wall"), (1, "CPU")):
            ts = [t[clock] * 1e3 for t in times]
            print(f"  {variant:<12} {name:<4} median {statistics.median(ts):9.2f} (min {min(ts):.2f}, max {max(ts):.2f});"
                  f" predicted {plan.step_time * 1e3:.2f}")
    for clock, name in ((0, "wall"), (1, "CPU")):
        ratios = sorted(a[clock] / b[clock] for a, b in zip(ta, tb))
        q = len(ratios) // 4
        print(f"  {args.a} / {args.b} {name:<4}: {statistics.median(ratios):.3f} paired by round (interquartile "
              f"{ratios[q]:.3f}-{ratios[-1 - q]:.3f}, range {ratios[0]:.3f}-{ratios[-1]:.3f}); predicted "
              f"{plan_a.step_time / plan_b.step_time:.3f}")


if __name__ == "__main__":
    main()
