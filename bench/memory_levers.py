"""The time-memory frontier of one model on 2 gloo ranks, and which memory levers each plan pulls.

    OMP_NUM_THREADS=1 python bench/memory_levers.py [--layers 4] [--points 6] [--budget-mib 16] [--png frontier.png]

1. The budget sweep: the plan with no budget (its peak is the "free" peak), then budgets from that
   peak down to the smallest feasible one that planning reports (``InfeasiblePlanError``), evenly
   spaced. Each plan is compiled, trained for a warm-up step and ``--steps`` timed steps under
   ``torch.optim.AdamW(pmodel.parameters())``, and its peak of live tensors measured over two more
   steps (tests/live_memory.py: every storage alive, parameters, gradients and optimizer states
   included; the highest rank). Printed per plan: the budget, predicted and measured peak, predicted
   and measured step time (the slowest rank's median), and the levers the plan pulls (ZeRO-1/2/3,
   tensor-parallel layouts, whole-layer and attention-core recompute, offload).
2. Depth under a fixed budget (``--budget-mib`` per rank): the largest number of layers that trains
   within it, with autopar (planned for that budget) against FSDP2 (``fully_shard`` per block and at
   the root) with activation checkpointing on every block, the alternative a user would pick. A depth
   "trains" when the measured peak of every rank stays within the budget; autopar's deepest plan whose
   predicted peak fits is printed too (its measured peak may exceed the budget by up to the memory
   model's 10%).
3. With matplotlib installed (``pip install autopar[plot]``), ``--png`` draws the frontier: measured
   and predicted peak against measured and predicted step time.

On CPU processes host and device are the same memory, so the planner never offloads here (offload is
priced and tested, but frees nothing on CPU). Step times on a loaded machine are noisy: compare the
columns of one run.
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
import torch.distributed as dist


def model_and_batch(args, layers):
    from autopar.models import GPT, GPTConfig

    torch.manual_seed(0)
    cfg = GPTConfig(vocab_size=args.vocab, n_layer=layers, n_head=args.heads, d_model=args.d_model,
                    d_ff=4 * args.d_model, max_seq=args.seq)
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(0, args.vocab, (args.batch, args.seq), generator=g)
    return GPT(cfg), ids, ids.clone()


def levers(plan) -> str:
    """The memory levers a plan pulls, counted over parameters and layer instances."""
    stages = plan.zero_stages()
    out = []
    for k in (1, 2, 3):
        n = sum(1 for s, _ in stages.values() if s == k)
        if n:
            out.append(f"ZeRO-{k} x{n}")
    tp = sum(1 for f, lay in plan.params.items() if any(p != "R" for p in lay) and f not in stages)
    if tp:
        out.append(f"sharded layouts x{tp}")
    for cls, r in plan.recompute["classes"].items():
        out.append(f"recompute {r['count']}/{r['of']}")
    for cls, r in plan.recompute.get("attention", {}).get("classes", {}).items():
        out.append(f"attention recompute {r['count']}/{r['of']}")
    for cls, r in plan.recompute.get("offload", {}).get("classes", {}).items():
        out.append(f"activation offload {r['count']}/{r['of']}")
    if plan.offload:
        out.append(f"optimizer offload x{len(plan.offload)}")
    return ", ".join(out) or "none (plain data parallel)"


def train_and_measure(module, opt, call, steps, inputs):
    """(the slowest rank's median step seconds, the highest rank's peak live bytes).

    Each step holds the model's outputs (the loss and the logits) until it ends, as the memory model
    assumes of the caller: a loop that keeps only the loss frees the logits after forward, and then
    measures below the prediction by their bytes."""
    from tests.live_memory import step_peak

    def step():
        out = call()
        out.loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)

    step()
    times = []
    for _ in range(steps):
        dist.barrier()
        t0 = time.perf_counter()
        step()
        times.append(time.perf_counter() - t0)
    peak = step_peak(module, opt, step, inputs=inputs)
    t = torch.tensor([statistics.median(times), float(peak)], dtype=torch.float64)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return t[0].item(), t[1].item()


def run_autopar(args, layers, cluster, budget):
    """(plan, measured seconds, measured peak) of autopar's plan for ``budget`` (None: no budget)."""
    import autopar

    model, ids, labels = model_and_batch(args, layers)
    pm = autopar.compile(model, cluster, (ids,), {"labels": labels}, memory_budget=budget, progress=False)
    opt = torch.optim.AdamW(pm.parameters(), lr=1e-4)
    held = [pm.local_tensor(f) for f in pm.plan.offload]
    seconds, peak = train_and_measure(pm, opt, lambda: pm(ids, labels=labels), args.steps, (ids, labels, held))
    return pm.plan, seconds, peak


def run_fsdp2(args, layers, rank, world):
    """(measured seconds, measured peak) of FSDP2 with every block checkpointed."""
    from torch.distributed._composable import checkpoint
    from torch.distributed.fsdp import fully_shard

    model, ids, labels = model_and_batch(args, layers)
    for block in model.blocks:
        checkpoint(block)
        fully_shard(block)
    fully_shard(model)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    local = slice(rank * args.batch // world, (rank + 1) * args.batch // world)
    return train_and_measure(model, opt, lambda: model(ids[local], labels=labels[local]), args.steps,
                             (ids, labels))


def smallest_budget(args, cluster) -> float:
    import autopar
    from autopar.errors import InfeasiblePlanError

    model, ids, labels = model_and_batch(args, args.layers)
    try:
        autopar.plan(model, cluster, (ids,), {"labels": labels}, memory_budget=1.0, progress=False)
    except InfeasiblePlanError as e:
        return e.min_feasible_budget
    raise RuntimeError("a 1-byte budget was feasible")


def sweep(rank, world, args):
    import autopar

    cluster = autopar.ClusterSpec.local_cpu(world)
    mib = 2 ** 20
    if args.points > 0:
        rows = []
        plan, s, peak = run_autopar(args, args.layers, cluster, None)
        rows.append(("none", plan, s, peak))
        least = smallest_budget(args, cluster)
        top = plan.memory["peak"]
        for k in range(1, args.points):
            budget = top - (top - least) * k / (args.points - 1)
            plan, s, peak = run_autopar(args, args.layers, cluster, budget)
            rows.append((f"{budget / mib:.2f}", plan, s, peak))
        if rank == 0:
            print(f"\nbudget sweep: {args.layers} layers, free peak {top / mib:.2f} MiB, smallest feasible "
                  f"budget {least / mib:.2f} MiB")
            print(f"{'budget MiB':>10} {'pred MiB':>9} {'meas MiB':>9} {'meas/pred':>9} {'pred ms':>8} {'meas ms':>8}  levers")
            for b, plan, s, peak in rows:
                print(f"{b:>10} {plan.memory['peak'] / mib:>9.2f} {peak / mib:>9.2f} {peak / plan.memory['peak']:>9.3f} "
                      f"{plan.step_time * 1e3:>8.2f} {s * 1e3:>8.1f}  {levers(plan)}", flush=True)
        if rank == 0 and args.png:
            draw(rows, args.png)

    budget = args.budget_mib * mib
    results, planned = {}, 0
    for system in ("autopar", "FSDP2 + AC"):
        best = 0
        for layers in range(1, args.max_layers + 1):
            try:
                if system == "autopar":
                    plan, _s, peak = run_autopar(args, layers, cluster, budget)
                    what = f"predicted {plan.memory['peak'] / mib:.2f} MiB, measured {peak / mib:.2f} MiB ({levers(plan)})"
                else:
                    _s, peak = run_fsdp2(args, layers, rank, world)
                    what = f"measured {peak / mib:.2f} MiB"
            except autopar.InfeasiblePlanError as e:
                if rank == 0:
                    print(f"  {system}, {layers} layers: no plan within the budget (smallest feasible "
                          f"{(e.min_feasible_budget or 0) / mib:.2f} MiB)", flush=True)
                break
            if rank == 0:
                print(f"  {system}, {layers} layers: {what}", flush=True)
            if system == "autopar":
                planned = layers          # a plan within the budget exists: go on even if its measured peak is over
            elif peak > budget:           # FSDP2's peak grows with depth
                break
            if peak <= budget:
                best = layers
        results[system] = best
    if rank == 0:
        print(f"\nlargest depth that trains within {args.budget_mib:g} MiB per rank on {world} ranks "
              f"(up to {args.max_layers}): " + ", ".join(f"{k} {v}" for k, v in results.items())
              + f"; autopar plans up to {planned} layers within it (predicted peak)", flush=True)


def draw(rows, path):
    try:
        import matplotlib
    except ImportError:
        print("matplotlib is not installed (pip install autopar[plot]): no PNG written")
        return
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    mib = 2 ** 20
    fig, ax = plt.subplots(figsize=(6, 4))
    ax.plot([r[3] / mib for r in rows], [r[2] * 1e3 for r in rows], "o-", label="measured")
    ax.plot([r[1].memory["peak"] / mib for r in rows], [r[1].step_time * 1e3 for r in rows], "s--", label="predicted")
    ax.set_xlabel("peak memory per rank (MiB)")
    ax.set_ylabel("step time (ms)")
    ax.set_title("time-memory frontier, 2 gloo ranks")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path)
    print(f"wrote {path}")


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--layers", type=int, default=4, help="depth of the model the budget sweep plans")
    ap.add_argument("--points", type=int, default=6, help="budgets in the sweep, the free peak included (0: no sweep)")
    ap.add_argument("--steps", type=int, default=3, help="timed steps per plan")
    ap.add_argument("--budget-mib", type=float, default=16.0, help="the fixed budget per rank of the depth search")
    ap.add_argument("--max-layers", type=int, default=16, help="the deepest model the depth search tries")
    ap.add_argument("--d-model", type=int, default=128)
    ap.add_argument("--heads", type=int, default=4)
    ap.add_argument("--vocab", type=int, default=512)
    ap.add_argument("--seq", type=int, default=128)
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--png", default=None, help="write the frontier here (needs matplotlib)")
    args = ap.parse_args()
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))     # the repository's test helpers
    from tests.distributed_utils import run_distributed

    print(f"built-in GPT: d_model {args.d_model}, {args.heads} heads, vocab {args.vocab}, batch {args.batch} x seq "
          f"{args.seq}, fp32, AdamW; OMP_NUM_THREADS={os.environ['OMP_NUM_THREADS']}")
    run_distributed(sweep, 2, args, timeout=3600)


if __name__ == "__main__":
    main()
