"""Planning time, end to end (capture, passes, every candidate mesh, solve, evaluate), with and
without repeated-layer folding, and its growth with depth.

    python bench/plan_time.py                 # all cases
    python bench/plan_time.py --quick         # skip the runs without layer folding on the big models
"""
from __future__ import annotations

import argparse
import logging
import time

import torch

import autopar
from autopar import zoo

CASES = [("gpt2", "8xH100", 8), ("llama3-8b", "64xH100", 8), ("llama2-70b", "512xH100", 64)]


def run(name, cluster, batch, *, dedup=True, layers=None, time_limit=120.0):
    model, args, kwargs = zoo.build(name, batch=batch, dtype=torch.bfloat16)
    if layers is not None:
        model, args, kwargs = _with_layers(name, batch, layers)
    t0 = time.perf_counter()
    plan = autopar.plan(model, autopar.ClusterSpec.preset(cluster), args, kwargs, progress=False,
                        time_limit=time_limit, skip_passes=() if dedup else ("layers_pass",))
    seconds = time.perf_counter() - t0
    best = next(c for c in plan.solver["candidates"] if c["mesh"] == plan.mesh["shape"])
    return {"seconds": seconds, "variables": sum(c["variables"] for c in plan.solver["candidates"]),
            "constraints": sum(c["constraints"] for c in plan.solver["candidates"]),
            "best_variables": best["variables"], "mesh": plan.mesh["shape"], "status": best["status"],
            "step_time": plan.step_time, "peak_gib": plan.memory["peak"] / 2**30}


def _with_layers(name, batch, layers):

    model, args, kwargs = zoo.build(name, batch=batch, dtype=torch.bfloat16)
    cfg = model.config
    cfg.num_hidden_layers = layers
    with torch.device("meta"):
        model = type(model)(cfg).to(torch.bfloat16)
    return model, args, kwargs


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--depth-only", action="store_true", help="only the 16- against 32-layer comparison")
    opts = ap.parse_args()
    logging.getLogger("autopar.rules").setLevel(logging.ERROR)
    autopar.plan(torch.nn.Linear(8, 8), autopar.ClusterSpec.preset("2xH100"), (torch.randn(4, 8),),
                 progress=False)                                   # warm up imports and export
    print(f"{'model':<12} {'cluster':<10} {'dedup':<6} {'seconds':>8} {'variables':>10} {'constraints':>11}"
          f" {'mesh':<10} {'step (s)':>9} {'peak GiB':>9}")
    for name, cluster, batch in [] if opts.depth_only else CASES:
        for dedup in (True, False):
            if not dedup and opts.quick and name != "gpt2":
                continue
            try:
                r = run(name, cluster, batch, dedup=dedup)
            except autopar.AutoparError as e:    # e.g. no layout found within the time limit
                print(f"{name:<12} {cluster:<10} {str(dedup):<6} no plan: {e}", flush=True)
                continue
            print(f"{name:<12} {cluster:<10} {str(dedup):<6} {r['seconds']:>8.2f} {r['variables']:>10} "
                  f"{r['constraints']:>11} {str(r['mesh']):<10} {r['step_time']:>9.3f} {r['peak_gib']:>9.2f}"
                  f"  ({r['status']})", flush=True)
    r16 = run("llama3-8b", "64xH100", 8, layers=16)
    r32 = run("llama3-8b", "64xH100", 8, layers=32)
    print(f"\nllama3-8b on 64xH100: 16 layers {r16['seconds']:.2f} s, 32 layers {r32['seconds']:.2f} s, "
          f"ratio {r32['seconds'] / r16['seconds']:.2f} (target <= 1.3)")


if __name__ == "__main__":
    main()
