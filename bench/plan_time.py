"""Planning time, end to end (capture, passes, every candidate mesh, solve, evaluate), split into its
phases, with the solver's optimality gap; with and without repeated-layer folding; and its growth with
depth.

    python bench/plan_time.py                 # all cases
    python bench/plan_time.py --quick         # the cases to run before stopping work on the planner
    python bench/plan_time.py --depth-only    # only the 16- against 32-layer comparison
    python bench/plan_time.py --quick --serial --models llama2-70b   # pipeline meshes one after the other

Columns: capture (torch.export; pipeline meshes capture again at their microbatch shapes), passes
(normalize, layers, saved activations), build (strategies, costs, the solver's problem and the step's
memory events for every candidate mesh), solve (the searches, two meshes at a time, and the pipeline
meshes' solves, with the memory re-solves, less the evaluation of their plans), total wall seconds and
the summed CPU seconds of the process and of the child processes that plan the pipeline meshes (on a
shared machine the CPU seconds vary less than the wall; each phase sums its seconds over the
processes, so the phases may add up to more than the total), the meshes solved of those tried, and
the worst optimality gap the solver proved for a mesh it solved.
"""
from __future__ import annotations

import argparse
import logging
import os
import resource
import sys
import time

# This folder's kernels.py (the Triton kernel bench) would shadow the `kernels` package transformers imports.
sys.path[:] = [p for p in sys.path if p != os.path.dirname(os.path.abspath(__file__))]

import torch

import autopar
from autopar import planner, zoo

# (model, cluster, batch, quick): batch x the zoo's sequence length (4096 for the LLaMAs, 1024 for GPT-2).
CASES = [("gpt2", "8xH100", 8, True), ("llama3-8b", "64xH100", 8, False), ("llama3-8b", "64xH100", 64, True),
         ("llama2-70b", "512xH100", 64, False), ("llama2-70b", "1024xH100", 1024, True)]
DEPTH = ("llama3-8b", "64xH100", 64)


def run(name, cluster, batch, *, dedup=True, layers=None, time_limit=120.0):
    model, args, kwargs = zoo.build(name, batch=batch, dtype=torch.bfloat16)
    if layers is not None:
        model, args, kwargs = _with_layers(name, batch, layers)
    t0, c0 = time.perf_counter(), _cpu_seconds()
    plan = autopar.plan(model, autopar.ClusterSpec.preset(cluster), args, kwargs, progress=False,
                        time_limit=time_limit, skip_passes=() if dedup else ("layers_pass",))
    seconds, cpu = time.perf_counter() - t0, _cpu_seconds() - c0
    cands = plan.solver["candidates"]
    best = next(c for c in cands if c["mesh"] == plan.mesh["shape"])
    # Meshes skipped before a solve (e.g. a pipeline axis longer than the model) carry no solver figures.
    solved = [c for c in cands if c.get("variables")]
    gaps = [c["gap"] for c in solved if c.get("gap") is not None]
    return {"seconds": seconds, "cpu": cpu, **plan.solver["timings"],
            "variables": sum(c["variables"] for c in solved), "constraints": sum(c["constraints"] for c in solved),
            "solved": f"{len(solved)}/{len(cands)}", "gap": max(gaps) if gaps else None,
            "mesh": plan.mesh["shape"], "status": best["status"], "step_time": plan.step_time,
            "peak_gib": plan.memory["peak"] / 2**30}


def _cpu_seconds() -> float:
    """This process's CPU seconds and those of its finished children (the pipeline meshes' planning)."""
    children = resource.getrusage(resource.RUSAGE_CHILDREN)
    return time.process_time() + children.ru_utime + children.ru_stime


def _with_layers(name, batch, layers):
    model, args, kwargs = zoo.build(name, batch=batch, dtype=torch.bfloat16)
    cfg = model.config
    cfg.num_hidden_layers = layers
    with torch.device("meta"):
        model = type(model)(cfg).to(torch.bfloat16)
    return model, args, kwargs


HEADER = (f"{'model':<11} {'cluster':<10} {'batch':>5} {'dedup':<5} {'capture':>7} {'passes':>6} {'build':>6} "
          f"{'solve':>6} {'total':>6} {'cpu':>6} {'solved':>6} {'gap':>8} {'variables':>9} {'mesh':<9} "
          f"{'step (s)':>8} {'peak GiB':>8}")


def row(name, cluster, batch, dedup, r) -> str:
    gap = "-" if r["gap"] is None else f"{r['gap']:.1e}"
    return (f"{name:<11} {cluster:<10} {batch:>5} {str(dedup):<5} {r['capture']:>7.2f} {r['passes']:>6.2f} "
            f"{r['build']:>6.2f} {r['solve']:>6.2f} {r['seconds']:>6.2f} {r['cpu']:>6.2f} {r['solved']:>6} "
            f"{gap:>8} {r['variables']:>9} {str(r['mesh']):<9} {r['step_time']:>8.3f} {r['peak_gib']:>8.2f}"
            f"  ({r['status']})")


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--quick", action="store_true", help="folded runs of the quick cases only (under 2 minutes)")
    ap.add_argument("--depth-only", action="store_true", help="only the 16- against 32-layer comparison")
    ap.add_argument("--serial", action="store_true",
                    help="plan the pipeline meshes in this process, one after the other, not in forked children")
    ap.add_argument("--models", nargs="*", help="only these models' cases")
    opts = ap.parse_args()
    planner.FORK_PIPELINE_MESHES = not opts.serial
    logging.getLogger("autopar.rules").setLevel(logging.ERROR)
    autopar.plan(torch.nn.Linear(8, 8), autopar.ClusterSpec.preset("2xH100"), (torch.randn(4, 8),),
                 progress=False)                                   # warm up imports and export
    print(HEADER)
    for name, cluster, batch, quick in [] if opts.depth_only else CASES:
        if (opts.quick and not quick) or (opts.models and name not in opts.models):
            continue
        for dedup in (True, False):
            if not dedup and (opts.quick or name != "gpt2"):
                continue
            try:
                r = run(name, cluster, batch, dedup=dedup)
            except autopar.AutoparError as e:    # e.g. no layout found within the time limit
                print(f"{name:<11} {cluster:<10} {batch:>5} {str(dedup):<5} no plan: {e}", flush=True)
                continue
            print(row(name, cluster, batch, dedup, r), flush=True)
    if opts.quick:
        return
    name, cluster, batch = DEPTH
    r16 = run(name, cluster, batch, layers=16)
    r32 = run(name, cluster, batch, layers=32)
    print(f"\n{name} on {cluster}, batch {batch}: 16 layers {r16['seconds']:.2f} s ({r16['cpu']:.2f} s CPU), "
          f"32 layers {r32['seconds']:.2f} s ({r32['cpu']:.2f} s CPU), ratio {r32['seconds'] / r16['seconds']:.2f} "
          f"(CPU {r32['cpu'] / r16['cpu']:.2f}; target <= 1.1)")


if __name__ == "__main__":
    main()
