"""autopar's plan against hand-tuned Megatron-style grids, under the same cost model.

    python bench/megatron_grid.py              # tensor x data grids
    python bench/megatron_grid.py --pipeline   # pipeline grids for LLaMA-2-70B on 512 and 1024 H100s
    python bench/megatron_grid.py --fused      # a wide GPT-2 (fused qkv) on 8 H100s: ring traffic

For each model, the Megatron layout (tensor parallel inside a node: attention split by heads, MLP
split column then row; data parallel across nodes) is forced with pins and priced by the same cost
model that autopar optimizes; autopar's own plan searches every layout and mesh. Both are training
plans (sharded outputs: the logits are never gathered), the grid has Megatron's vocab-parallel
embedding and LM head, and both may recompute layers where memory is short. Prints predicted step
time, peak memory per device, the recomputed layers, and the ratios.
"""
import logging
import os
import sys

# This folder's kernels.py (the Triton kernel bench) would shadow the `kernels` package transformers imports.
sys.path[:] = [p for p in sys.path if p != os.path.dirname(os.path.abspath(__file__))]

import torch

import autopar
from autopar import zoo

LLAMA_TP = {"*.q_proj.weight": "S(0)", "*.k_proj.weight": "S(0)", "*.v_proj.weight": "S(0)",
            "*.o_proj.weight": "S(1)", "*.gate_proj.weight": "S(0)", "*.up_proj.weight": "S(0)",
            "*.down_proj.weight": "S(1)", "model.embed_tokens.weight": "S(0)", "lm_head.weight": "S(0)"}
CASES = [("llama3-8b", "64xH100", 8, (8, 8)), ("llama3-8b", "16xH100", 8, (2, 8)),
         ("llama2-70b", "512xH100", 64, (64, 8))]


def megatron_pins(mesh):
    dp_rep = ["R"] * (len(mesh) - 1)
    pins = {k: dp_rep + [v] for k, v in LLAMA_TP.items()}
    pins.update({"input_ids": ["S(0)"] + ["R"] * (len(mesh) - 1), "labels": ["S(0)"] + ["R"] * (len(mesh) - 1)})
    return pins


# LLaMA-2-70B, batch 1024 x 4096, bf16-mixed (float32 master weights and Adam states, bfloat16 compute):
# Megatron's pipeline grids (tensor parallel 8 inside a node,
# pipeline across nodes, data parallel over the rest), each with its microbatch counts and schedules.
PIPELINE_CASES = [("llama2-70b", "1024xH100", 1024, (4, 8)), ("llama2-70b", "512xH100", 1024, (4, 8))]


def pipeline_grid():
    """Each row is printed as soon as it is planned: autopar's plan first (the ratios are to it), then
    the grid points. Planning seconds are wall and CPU (this process and its forked children)."""
    import resource
    import time

    def cpu_seconds():
        own, kids = resource.getrusage(resource.RUSAGE_SELF), resource.getrusage(resource.RUSAGE_CHILDREN)
        return own.ru_utime + own.ru_stime + kids.ru_utime + kids.ru_stime

    print(f"\n{'model':<11} {'cluster':<10} {'plan':<34} {'mesh':<12} {'step (ms)':>10} {'peak GiB':>9} "
          f"{'bubble (ms)':>11} {'step ratio':>11} {'planning wall/CPU (s)':>22}", flush=True)
    for name, cluster_name, batch, pps in PIPELINE_CASES:
        model, args, kwargs = zoo.build(name, batch=batch, dtype=torch.float32, device="meta")
        cluster = autopar.ClusterSpec.preset(cluster_name)

        def row(label, grid, t, peak, bubble, seconds=None):
            if t is None:
                print(f"{name:<11} {cluster_name:<10} {label:<34} {str(grid):<12} {'-':>10}", flush=True)
                return
            spent = f"{seconds[0]:.1f}/{seconds[1]:.1f}" if seconds else ""
            print(f"{name:<11} {cluster_name:<10} {label:<34} {str(grid):<12} {t * 1e3:>10.1f} "
                  f"{(peak or 0) / 2**30:>9.2f} {(bubble or 0) * 1e3:>11.1f} {t / auto.step_time:>10.2f}x "
                  f"{spent:>22}", flush=True)

        t0, c0 = time.perf_counter(), cpu_seconds()
        auto = autopar.plan(model, cluster, args, kwargs, progress=False, sharded_outputs=True,
                            precision="bf16-mixed")
        spent = (time.perf_counter() - t0, cpu_seconds() - c0)
        pipe = auto.pipeline
        label = f"autopar ({pipe['schedule']} m={pipe['microbatches']})" if pipe else "autopar (no pipeline)"
        row(label, tuple(auto.mesh["shape"]), auto.step_time, auto.memory["peak"],
            pipe["bubble_seconds"] if pipe else 0.0, spent)
        if auto.zero:
            print(f"{'':<22} autopar's plan shards the optimizer states of {len(auto.zero)} of "
                  f"{len(auto.params)} parameters (ZeRO-1)", flush=True)
        for pp in pps:
            tp = cluster.devices_per_node
            grid = (pp, cluster.num_devices // (pp * tp), tp)
            pins = {k: ["R", "R", v] for k, v in LLAMA_TP.items()}
            pins.update({"input_ids": ["R", "S(0)", "R"], "labels": ["R", "S(0)", "R"]})
            for m in (4 * pp, 8 * pp):
                try:
                    p = autopar.plan(model, cluster, args, kwargs, mesh_shape=grid, axis_names=("pp", "dp", "tp"),
                                     pins=pins, microbatches=m, progress=False, sharded_outputs=True,
                                     precision="bf16-mixed")
                except autopar.InfeasiblePlanError:
                    row(f"Megatron pp={pp} m={m}: does not fit", grid, None, None, None)
                    continue
                except autopar.AutoparError:
                    # The solver's node limit ran out before any layout within the budget was found.
                    row(f"Megatron pp={pp} m={m}: none found", grid, None, None, None)
                    continue
                for sched, t in p.solver["candidates"][0]["pipeline"]["schedules"].items():
                    row(f"Megatron pp={pp} m={m} {sched}", grid, t,
                        p.memory["peak"] if t is not None and sched == p.pipeline["schedule"] else None, None)


# GPT-2's Megatron layout on one tensor-parallel axis: c_attn strided in q, k, v (S(1,3)), then the
# row-split projection; the MLP column then row; the vocab-parallel embedding, tied to the LM head; the
# position embedding replicated and looked up whole on every rank (its output, node embedding_1).
GPT2_TP = {"*.attn.c_attn.weight": ["S(1,3)"], "*.attn.c_attn.bias": ["S(0,3)"], "*.attn.c_proj.weight": ["S(0)"],
           "*.mlp.c_fc.weight": ["S(1)"], "*.mlp.c_fc.bias": ["S(0)"], "*.mlp.c_proj.weight": ["S(0)"],
           "transformer.wte.weight": ["S(0)"], "transformer.wpe.weight": ["R"], "embedding_1": ["R"],
           "input_ids": ["R"], "labels": ["R"]}


def ring_traffic(plan, phase=None) -> float:
    """Bytes a plan's collectives put on each device's ring link: an all-reduce moves its tensor twice
    (a reduce-scatter and an all-gather), the others once; only ``phase`` (forward, backward) if given."""
    return sum(c["bytes"] * (2 if c["kind"] == "all_reduce" else 1) for c in plan.collectives
               if phase is None or c["phase"] == phase)


def fused_projections():
    """A wide GPT-2 (hidden 8192, 64 heads, 2 layers, batch 1 x 2048, bf16, vocabulary padded to
    50304) planned offline for 8 H100s on one tensor-parallel axis: autopar, autopar without strided
    layouts (its fused q, k, v split by a plain shard) and Megatron's layout, side by side."""
    import time

    make = zoo._gpt2(8192, 2, 64, vocab_size=50304, n_positions=2048)
    with torch.device("meta"):
        model = make().to(torch.bfloat16)
    ids = torch.randint(0, 50304, (1, 2048), generator=torch.Generator().manual_seed(0)).to("meta")
    cluster = autopar.ClusterSpec.preset("8xH100")
    common = dict(mesh_shape=(8,), progress=False, sharded_outputs=True)
    rows = []
    for label, options in (("autopar", {}), ("autopar, no strided layouts", {"skip_passes": ("strided_hints_pass",)}),
                           ("Megatron (pinned)", {"pins": GPT2_TP})):
        t0 = time.perf_counter()
        p = autopar.plan(model, cluster, (ids,), {"labels": ids.clone()}, **common, **options)
        rows.append((label, p, time.perf_counter() - t0))
    meg = rows[-1][1]
    print(f"{'plan':<28} {'fwd MB':>8} {'fwd ratio':>10} {'step MB':>8} {'all-to-alls':>11} {'step (ms)':>10} "
          f"{'c_attn.weight':>14} {'planning (s)':>12}")
    for label, p, seconds in rows:
        a2a = sum(c["kind"] == "all_to_all" for c in p.collectives)
        print(f"{label:<28} {ring_traffic(p, 'forward') / 1e6:>8.1f} "
              f"{ring_traffic(p, 'forward') / ring_traffic(meg, 'forward'):>9.3f}x {ring_traffic(p) / 1e6:>8.1f} "
              f"{a2a:>11} {p.step_time * 1e3:>10.2f} {str(p.params['transformer.h.0.attn.c_attn.weight']):>14} "
              f"{seconds:>12.1f}", flush=True)


def main():
    import sys

    logging.getLogger("autopar.rules").setLevel(logging.ERROR)
    if "--pipeline" in sys.argv:
        pipeline_grid()
        return
    if "--fused" in sys.argv:
        fused_projections()
        return
    print(f"{'model':<11} {'cluster':<9} {'plan':<22} {'mesh':<8} {'step (ms)':>10} {'peak GiB':>9} "
          f"{'recomputed':>10} {'step ratio':>11} {'memory ratio':>13}")
    for name, cluster_name, batch, grid in CASES:
        model, args, kwargs = zoo.build(name, batch=batch, dtype=torch.bfloat16)
        cluster = autopar.ClusterSpec.preset(cluster_name)
        label = f"Megatron tp={grid[-1]} dp={grid[0]}"
        auto = autopar.plan(model, cluster, args, kwargs, progress=False, sharded_outputs=True)
        try:
            meg = autopar.plan(model, cluster, args, kwargs, mesh_shape=grid, pins=megatron_pins(grid),
                               progress=False, sharded_outputs=True)
        except autopar.InfeasiblePlanError as e:
            print(f"{name:<11} {cluster_name:<9} {label:<22} {str(grid):<8} does not fit: needs "
                  f"{e.min_feasible_budget / 2**30:.1f} GiB per device of {cluster.usable_memory / 2**30:.1f}")
            meg = None
        for label, p in ((label, meg), ("autopar", auto)):
            if p is None:
                continue
            print(f"{name:<11} {cluster_name:<9} {label:<22} {str(tuple(p.mesh['shape'])):<8} "
                  f"{p.step_time * 1e3:>10.1f} {p.memory['peak'] / 2**30:>9.2f} "
                  f"{len(p.recompute['layers']):>10} "
                  f"{p.step_time / auto.step_time:>10.2f}x {p.memory['peak'] / auto.memory['peak']:>12.2f}x",
                  flush=True)


if __name__ == "__main__":
    main()
