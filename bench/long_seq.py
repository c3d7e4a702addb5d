"""Long sequences with and without splitting them, side by side.

    python bench/long_seq.py --offline            # Qwen2-7B's shape on 8xH100, 32k to 128k tokens
    OMP_NUM_THREADS=1 python bench/long_seq.py --cpu [--world 2] [--budget-mb 48]

--offline plans `gqa-7b-128k` (28 heads, 4 KV heads, hidden 3584, 28 layers) at batch 1 in bf16-mixed
precision (fp32 master weights and Adam states, bf16 compute) with sharded outputs on one 8xH100 node (mesh (8,)), once free and once with every attention call pinned
whole (`R`: with 4 KV heads and batch 1 there is no other split on 8 devices that is not along the
sequence), and prints the predicted step time and peak, or the smallest budget that would fit.

--cpu trains autopar's built-in GPT (causal attention) on gloo ranks under a fixed memory budget per
rank at growing sequence lengths, one sequence per step: with every attention call whole, with every
attention call a ring (the sequence split), and the solver's free plan, which may split the sequence
(ring attention, Megatron-SP) or the heads; and, for the step
time of the same tokens per rank, plain data parallel with one sequence per rank. It prints, per
length, whether a plan fits, its predicted and measured (live tensors) peak, the attention form
chosen and the measured median step time; peaks are the highest over the ranks. The
longest length that fits is the figure of merit; times on a shared CPU are only relative.
"""
from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from pathlib import Path

# This folder's kernels.py (the Triton kernel bench) would shadow the `kernels` package transformers imports.
sys.path[:] = [p for p in sys.path if p != os.path.dirname(os.path.abspath(__file__))]

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))


def _attention_form(plan) -> str:
    forms = set()
    for n in plan.nodes:
        if n["op"] != "scaled_dot_product_attention.default":
            continue
        q, k = n["inputs"][0], n["inputs"][1]
        form = []
        for a, (pq, pk) in enumerate(zip(q, k)):
            if pq == "S(2)":
                form.append("ring" if pk == "S(2)" else "rows+allgather-kv")
            elif pq == "S(1)":
                form.append("heads")
            elif pq == "S(0)":
                form.append("batch")
        forms.add("x".join(form) or "whole")
    return ",".join(sorted(forms))


def offline(args):
    import autopar
    from autopar import zoo

    cluster = autopar.ClusterSpec.preset("8xH100")
    print("| tokens | attention | step (s) | peak (GiB) | form | planning (s) |")
    print("|---|---|---|---|---|---|")
    for seq in args.seqs or (32768, 65536, 131072):
        for label, pins in (("free", None), ("whole", {"scaled_dot_product_attention*": ["R"]})):
            model, a, kw = zoo.build("gqa-7b-128k", batch=1, seq=seq)
            t0 = time.perf_counter()
            try:
                p = autopar.plan(model, cluster, a, kw, mesh_shape=(8,), pins=pins, progress=False,
                                 precision="bf16-mixed", sharded_outputs=True)
                row = f"{p.step_time:.3f} | {p.memory['peak'] / 2**30:.1f} | {_attention_form(p)}"
            except autopar.InfeasiblePlanError as e:
                need = getattr(e, "min_feasible_budget", None)
                row = f"(no plan) | needs {need / 2**30:.1f} | -" if need else "(no plan) | - | -"
            print(f"| {seq} | {label} | {row} | {time.perf_counter() - t0:.0f} |", flush=True)


def _cpu_worker(rank, world, args, results):
    import torch.distributed as dist

    import autopar
    from autopar.models import GPT, GPTConfig

    for seq in args.seqs or (1024, 2048, 4096):
        torch.manual_seed(0)
        model = GPT(GPTConfig(vocab_size=256, n_layer=2, n_head=4, d_model=64, d_ff=256, max_seq=seq))
        cluster = autopar.ClusterSpec.local_cpu(world)
        one = torch.randint(0, 256, (1, seq), generator=torch.Generator().manual_seed(1))
        batch = torch.randint(0, 256, (world, seq), generator=torch.Generator().manual_seed(1))
        data = {"input_ids": ["S(0)"], "labels": ["S(0)"], "*.weight": ["R"], "*.bias": ["R"],
                "scaled_dot_product_attention*": ["S(0)"]}
        plans = (("attention whole, batch 1", one, {"scaled_dot_product_attention*": ["R"]}),
                 ("ring, batch 1", one, {"scaled_dot_product_attention*": {"inputs": [["S(2)"]] * 3}}),
                 ("free, batch 1", one, None),
                 (f"data parallel, batch {world}", batch, data))
        for label, ids, pins in plans:
            try:
                pm = autopar.compile(model, cluster, (ids,), {"labels": ids.clone()}, mesh_shape=(world,),
                                     pins=pins, memory_budget=args.budget_mb * 2**20)
            except autopar.InfeasiblePlanError:
                if rank == 0:
                    results.append((seq, label, "(no plan)", "-", "-", "-"))
                continue
            # AdamW: the optimizer the plan counts states for (autopar.plan's default, two per parameter).
            opt = torch.optim.AdamW(pm.parameters(), lr=1e-3)
            times = []
            for step in range(args.steps + 1):
                dist.barrier()
                t0 = time.perf_counter()
                pm.train_step(ids, labels=ids.clone())
                opt.step()
                opt.zero_grad()
                if step:
                    times.append(time.perf_counter() - t0)
            peak = _measured_peak(pm, opt, ids)
            if rank == 0:
                results.append((seq, label, f"{statistics.median(times) * 1e3:.0f}",
                                f"{pm.plan.memory['peak'] / 2**20:.2f}", f"{peak / 2**20:.2f}",
                                _attention_form(pm.plan)))
    if rank == 0:
        print(f"world {world}, budget {args.budget_mb} MiB per rank")
        print("| tokens | plan | step (ms) | predicted peak (MiB) | measured peak (MiB) | attention |")
        print("|---|---|---|---|---|---|")
        for r in results:
            print("| " + " | ".join(map(str, r)) + " |", flush=True)


def _measured_peak(pm, opt, ids):
    """Peak live-tensor bytes over two training steps, the highest over the ranks (tests/live_memory.py:
    the accounting the memory model is held to, which MemTracker's module hooks would change)."""
    from tests.live_memory import step_peak_over_ranks

    def step():
        pm.train_step(ids, labels=ids.clone())
        opt.step()
        opt.zero_grad()

    return step_peak_over_ranks(pm, opt, step, inputs=(ids,))


def cpu(args):
    from tests.distributed_utils import run_distributed

    run_distributed(_cpu_worker, args.world, args, [], timeout=3000)


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--offline", action="store_true")
    ap.add_argument("--cpu", action="store_true")
    ap.add_argument("--world", type=int, default=2)
    ap.add_argument("--budget-mb", type=float, default=24.0)
    ap.add_argument("--steps", type=int, default=3)
    ap.add_argument("--seqs", type=lambda s: [int(x) for x in s.split(",")], default=None)
    args = ap.parse_args()
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    if args.offline:
        offline(args)
    if args.cpu:
        cpu(args)
    if not (args.offline or args.cpu):
        ap.error("give --offline and/or --cpu")


if __name__ == "__main__":
    main()
