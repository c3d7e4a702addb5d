"""Training step time and peak live-tensor memory on 2 gloo ranks, side by side in one run:
autopar's plan, autopar running DDP's layout (pinned), DDP, FSDP2 (fully_shard) and manual tensor
parallel (parallelize_module), on one GPT-2-shaped model; plus a 1-rank autopar plan against plain eager.

    OMP_NUM_THREADS=1 python bench/train_cpu.py [--model gpt|hf-gpt2] [--rounds 3] [--steps 4]
                                                [--layers N] [--d-model N] [--vocab N] [--batch N]
                                                [--budget fsdp2|BYTES|FACTORx] [--bucket-mb MIB]

autopar plans on the profiled cluster (``ClusterSpec.profile()``; ``--no-profile`` keeps local_cpu's
rough figures) with ``sharded_outputs=True``: each rank keeps the logits in the layout they are
computed in, as DDP and FSDP2 keep their own batch's (gathering the whole batch's logits on every rank
is work the others do not do). The table prints, beside each system's measured step, the step time
autopar's cost model predicts for that system's layout (forced through pins: DDP's replicated
parameters and split batch, FSDP2's parameters sharded on dim 0, Megatron's column/row split).
"autopar DP" is autopar's plan on DDP's pins (activations left to the solver), run by its runtime.
Systems are timed in rounds, in turn, each round starting one system later than the last, and each
keeps its fastest round; the script also prints autopar against each other system paired by round
(the median over the rounds of the two systems' ratio in the same round).

``--budget`` plans autopar's own layout under a memory budget per device instead of none: ``fsdp2`` is
the peak autopar's step memory model predicts for FSDP2's layout (the FSDP2 pins), the memory FSDP2
is measured against; on both models it is below the DDP layout's predicted peak (every parameter
replicated with its gradient and optimizer state), so the plan must shard parameters (the script
prints both peaks). ``0.9x`` is a factor of that figure, and a plain number is bytes. The script
prints which parameters the plan shards (ZeRO stage or tensor layout) and autopar's CPU and wall time
against FSDP2's and DDP's.

``--model gpt`` (the default) is autopar's built-in GPT (GPT-2's architecture with nn.Linear
projections, so that parallelize_module's ColwiseParallel/RowwiseParallel apply to it), 4 layers,
d_model 768, vocab 8192, batch 8 x 128. ``--model hf-gpt2`` is Hugging Face's GPT2LMHeadModel, 6 layers,
hidden 512, 8 heads, vocab 2048, batch 16 x 128, no dropout; manual tensor parallel is skipped for it
(parallelize_module's column/row styles split nn.Linear, and GPT-2's projections are Conv1D).
Memory is the peak of live tensors per rank (torch.distributed._tools.mem_tracker.MemTracker) over a
training step, parameters, gradients and optimizer states included.
"""
from __future__ import annotations

import argparse
import copy
import os
import statistics
import sys
import time
from pathlib import Path

# This folder's kernels.py (the Triton kernel bench) would shadow the `kernels` package transformers imports.
sys.path[:] = [p for p in sys.path if p != os.path.dirname(os.path.abspath(__file__))]

import torch
import torch.distributed as dist


# Each model's shape when not given on the command line.
DEFAULTS = {"gpt": {"layers": 4, "d_model": 768, "heads": 12, "vocab": 8192, "batch": 8},
            "hf-gpt2": {"layers": 6, "d_model": 512, "heads": 8, "vocab": 2048, "batch": 16}}


def model_and_batch(args):
    torch.manual_seed(0)
    if args.model == "hf-gpt2":
        import transformers as tf

        cfg = tf.GPT2Config(n_layer=args.layers, n_embd=args.d_model, n_head=args.heads, vocab_size=args.vocab,
                            n_positions=args.seq, use_cache=False, resid_pdrop=0.0, embd_pdrop=0.0,
                            attn_pdrop=0.0, bos_token_id=0, eos_token_id=0)
        model = tf.GPT2LMHeadModel(cfg)
    else:
        from autopar.models import GPT, GPTConfig

        model = GPT(GPTConfig(vocab_size=args.vocab, n_layer=args.layers, n_head=args.heads,
                              d_model=args.d_model, d_ff=4 * args.d_model, max_seq=args.seq))
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(0, args.vocab, (args.batch, args.seq), generator=g)
    return model, ids, ids.clone()


def blocks(model):
    """The model's repeated layers, each wrapped by fully_shard as FSDP2's examples do."""
    return model.transformer.h if hasattr(model, "transformer") else model.blocks


def measure(step, steps, warmup=2):
    """Median seconds of ``step()`` (which runs one full training step) over ``steps`` steps, wall-clock,
    the process's CPU time (all its threads; not the time it waits, nor the time other processes run)
    and the CPU time of its other threads than the one running the step (gloo's, which move the
    collectives' bytes), all taken over the same steps."""
    for _ in range(warmup):
        step()
    wall, cpu, others = [], [], []
    for _ in range(steps):
        dist.barrier() if dist.is_initialized() else None
        t0, c0, m0 = time.perf_counter(), time.process_time(), time.thread_time()
        step()
        wall.append(time.perf_counter() - t0)
        cpu.append(time.process_time() - c0)
        others.append(cpu[-1] - (time.thread_time() - m0))
    return statistics.median(wall), statistics.median(cpu), statistics.median(others)


def peak_memory(model, opt, step):
    from torch.distributed._tools.mem_tracker import MemTracker

    mt = MemTracker()
    mt.track_external(model, opt)
    with mt:
        for _ in range(2):
            step()
            mt.reset_mod_stats()
    return mt.get_tracker_snapshot("peak")[torch.device("cpu")]["Total"]


def trainer(model, opt, call):
    def step():
        loss = call()
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
    return step


def like_pins(model, world, manual_tp: bool) -> dict:
    """Pins that make autopar's plan lay the model out as each other system does: DDP (every parameter
    replicated with its optimizer state, the batch split), FSDP2 (every parameter sharded on dim 0) and,
    with ``manual_tp``, Megatron's tensor parallel split (column then row, attention by heads)."""
    plain = {"output": ["R"], "zero": 0}
    batch = {"input_ids": ["S(0)"], "labels": ["S(0)"]}
    pins = {"DDP": {**{name: plain for name, _ in model.named_parameters()}, **batch},
            "FSDP2": {**{name: ["S(0)"] if p.shape[0] % world == 0 else plain for name, p in model.named_parameters()},
                      **batch}}
    if manual_tp:
        pins["manual TP"] = {"*.q.weight": ["S(0)"], "*.k.weight": ["S(0)"], "*.v.weight": ["S(0)"],
                             "*.o.weight": ["S(1)"], "*.fc1.weight": ["S(0)"], "*.fc2.weight": ["S(1)"]}
    return pins


def memory_budget(spec: str | None, fsdp2_peak: float) -> float | None:
    """Bytes per device from ``--budget``: None, "fsdp2" (FSDP2's layout's predicted peak), "0.9x" (a
    factor of it) or a number of bytes."""
    if spec is None:
        return None
    if spec == "fsdp2":
        return fsdp2_peak
    if spec.endswith("x"):
        return float(spec[:-1]) * fsdp2_peak
    return float(spec)


def systems(args, rank, world, predicted: dict):
    """(name, module, optimizer, step) for each system, built fresh from the same weights; ``predicted``
    gets each one's step time as autopar's cost model prices its layout."""
    import autopar
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor.parallel import (ColwiseParallel, RowwiseParallel,
                                                   parallelize_module)
    from torch.nn.parallel import DistributedDataParallel as DDP

    base, ids, labels = model_and_batch(args)
    out = []

    cluster = autopar.ClusterSpec.local_cpu(world)
    if not args.no_profile:
        cluster = cluster.profile()
    # Each other system's layout, priced by the same cost model through pins.
    manual_tp = args.model == "gpt"
    like = {name: autopar.plan(base, cluster, (ids,), {"labels": labels}, pins=pins, progress=False,
                               sharded_outputs=True) for name, pins in like_pins(base, world, manual_tp).items()}
    predicted.update({name: p.step_time for name, p in like.items()})
    budget = memory_budget(args.budget, like["FSDP2"].memory.peak)
    pm = autopar.compile(copy.deepcopy(base), cluster, (ids,), {"labels": labels}, sharded_outputs=True,
                         memory_budget=budget, bucket_mb=args.bucket_mb)
    if rank == 0:
        print(f"cluster: {cluster}")
        summary = pm.plan.summary().splitlines()
        print(summary[0], "|", next(line for line in summary if line.startswith("step time:")))
        print(next((line for line in summary if line.startswith("gradient buckets:")), "no gradient buckets"))
        if budget is not None:
            print(f"memory budget {budget / 2**20:.1f} MiB per rank ({args.budget}; FSDP2's layout predicted "
                  f"{like['FSDP2'].memory.peak / 2**20:.1f} MiB, DDP's {like['DDP'].memory.peak / 2**20:.1f} MiB)")
        # The summary's parameter block: which parameters are sharded and how, and the predicted peak.
        first = next(i for i, line in enumerate(summary) if line.startswith("parameters:"))
        last = next(i for i, line in enumerate(summary) if line.startswith("step time:"))
        print("\n".join(summary[first:last]))
    predicted["autopar"] = pm.plan.step_time
    opt = torch.optim.AdamW(pm.parameters(), lr=1e-4)
    out.append(("autopar", pm, opt, trainer(pm, opt, lambda: pm(ids, labels=labels).loss)))
    # DDP's layout run by autopar's runtime: what the generated program costs against DDP's on one layout.
    dp = autopar.compile(copy.deepcopy(base), cluster, (ids,), {"labels": labels},
                         pins=like_pins(base, world, False)["DDP"], sharded_outputs=True, bucket_mb=args.bucket_mb)
    predicted["autopar DP"] = dp.plan.step_time
    opt = torch.optim.AdamW(dp.parameters(), lr=1e-4)
    out.append(("autopar DP", dp, opt, trainer(dp, opt, lambda: dp(ids, labels=labels).loss)))

    ddp = DDP(copy.deepcopy(base))
    opt = torch.optim.AdamW(ddp.parameters(), lr=1e-4)
    local = slice(rank * args.batch // world, (rank + 1) * args.batch // world)
    out.append(("DDP", ddp, opt, trainer(ddp, opt, lambda: ddp(ids[local], labels=labels[local]).loss)))

    fsdp = copy.deepcopy(base)
    for block in blocks(fsdp):
        fully_shard(block)
    fully_shard(fsdp)
    opt = torch.optim.AdamW(fsdp.parameters(), lr=1e-4)
    out.append(("FSDP2", fsdp, opt, trainer(fsdp, opt, lambda: fsdp(ids[local], labels=labels[local]).loss)))
    if not manual_tp:
        return out

    tp = copy.deepcopy(base)
    mesh = init_device_mesh("cpu", (world,))
    plan = {}
    for i in range(args.layers):
        plan.update({f"blocks.{i}.attn.q": ColwiseParallel(), f"blocks.{i}.attn.k": ColwiseParallel(),
                     f"blocks.{i}.attn.v": ColwiseParallel(), f"blocks.{i}.attn.o": RowwiseParallel(),
                     f"blocks.{i}.mlp.fc1": ColwiseParallel(), f"blocks.{i}.mlp.fc2": RowwiseParallel()})
    parallelize_module(tp, mesh, plan)
    for block in tp.blocks:         # each rank now holds n_head / world heads
        block.attn.n_head //= world
    opt = torch.optim.AdamW(tp.parameters(), lr=1e-4)
    out.append(("manual TP", tp, opt, trainer(tp, opt, lambda: tp(ids, labels=labels).loss)))
    return out


def two_ranks(rank, world, args):
    results, predicted = {}, {}
    built = systems(args, rank, world, predicted)
    for name, module, opt, step in built:
        peak = torch.tensor([peak_memory(module, opt, step)], dtype=torch.float64)
        dist.all_reduce(peak, op=dist.ReduceOp.MAX)       # the fullest rank
        results[name] = [peak.item()]
    # Rounds over the systems in turn, so that drift in the machine's load falls on all alike; each
    # round starts one system later than the one before, so that no system always follows the same
    # one (the allocator and caches it leaves) or always opens the round. A system's figure is its
    # fastest round (the median step of the round, the slower rank's).
    cpu = {name: [] for name in results}
    for r in range(args.rounds):
        for name, _, _, step in built[r % len(built):] + built[:r % len(built)]:
            t = torch.tensor(measure(step, args.steps, warmup=1), dtype=torch.float64)
            dist.all_reduce(t, op=dist.ReduceOp.MAX)
            results[name].append(t[0].item())
            cpu[name].append((t[1].item(), t[2].item()))
    # autopar against each other system round by round, the median over rounds: a round's systems run
    # back to back, so a pair shares most of the drift that moves the fastest rounds apart.
    by_round = {name: ([a / b for a, b in zip(results["autopar"][1:], r[1:])],
                       [a[0] / b[0] for a, b in zip(cpu["autopar"], cpu[name])])
                for name, r in results.items()}
    paired = {name: (statistics.median(w), statistics.median(c)) for name, (w, c) in by_round.items()}
    results = {name: (min(r[1:]), r[0]) for name, r in results.items()}
    cpu, comm_cpu = {name: min(c)[0] for name, c in cpu.items()}, {name: min(c)[1] for name, c in cpu.items()}
    if rank == 0:
        a_time, a_mem = results["autopar"]
        print(f"\n{'system':<10} {'step (ms)':>10} {'vs autopar':>11} {'CPU (ms)':>9} {'vs autopar':>11} "
              f"{'gloo CPU (ms)':>14} {'peak MiB/rank':>14} {'vs autopar':>11} {'predicted (ms)':>15} "
              f"{'measured/predicted':>19}")
        for name, (s, m) in results.items():
            print(f"{name:<10} {s * 1e3:>10.1f} {s / a_time:>10.2f}x {cpu[name] * 1e3:>9.1f} "
                  f"{cpu[name] / cpu['autopar']:>10.2f}x {comm_cpu[name] * 1e3:>14.1f} {m / 2**20:>14.1f} "
                  f"{m / a_mem:>10.2f}x {predicted[name] * 1e3:>15.1f} {s / predicted[name]:>19.2f}")
        print("gloo CPU: the CPU time of the threads other than the training loop's (gloo's, moving the "
              "collectives' bytes), in the round of the least CPU time")
        print("autopar / system, paired by round (median over the rounds): " + ", ".join(
            f"{name} {w:.3f}x wall ({c:.3f}x CPU)" for name, (w, c) in paired.items() if name != "autopar"))
        # The spread says whether a median below 1.0x holds round by round or is the run's noise.
        print("paired by round, each round (lowest-highest): " + ", ".join(
            f"{name} {min(w):.3f}-{max(w):.3f}x wall ({min(c):.3f}-{max(c):.3f}x CPU)"
            for name, (w, c) in by_round.items() if name != "autopar"))
        if args.budget is not None:
            print(f"autopar under the budget ({args.budget}): CPU time {cpu['autopar'] / cpu['FSDP2']:.3f}x "
                  f"FSDP2's, {cpu['autopar'] / cpu['DDP']:.3f}x DDP's; wall time {a_time / results['FSDP2'][0]:.3f}x "
                  f"FSDP2's, {a_time / results['DDP'][0]:.3f}x DDP's")
        if "manual TP" not in results:
            print("manual TP: skipped (parallelize_module's column/row styles split nn.Linear; GPT-2's "
                  "projections are Conv1D)")


def one_rank(rank, world, args):
    import autopar

    base, ids, labels = model_and_batch(args)
    eager = copy.deepcopy(base)
    opt = torch.optim.AdamW(eager.parameters(), lr=1e-4)
    eager_step = trainer(eager, opt, lambda: eager(ids, labels=labels).loss)
    pm = autopar.compile(copy.deepcopy(base), autopar.ClusterSpec.local_cpu(1), (ids,), {"labels": labels})
    popt = torch.optim.AdamW(pm.parameters(), lr=1e-4)
    plan_step = trainer(pm, popt, lambda: pm(ids, labels=labels).loss)
    # Interleave the two so that drift in machine load hits both alike.
    e, p = [], []
    for _ in range(3):
        e.append(measure(eager_step, args.steps)[0])
        p.append(measure(plan_step, args.steps)[0])
    e, p = min(e), min(p)
    print(f"\n1 rank: eager {e * 1e3:.1f} ms, autopar {p * 1e3:.1f} ms, overhead {100 * (p / e - 1):+.1f}% "
          f"(target within 5%)")


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=4, help="timed steps per round")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--model", choices=tuple(DEFAULTS), default="gpt")
    ap.add_argument("--layers", type=int)
    ap.add_argument("--d-model", type=int)
    ap.add_argument("--heads", type=int)
    ap.add_argument("--vocab", type=int)
    ap.add_argument("--seq", type=int, default=128)
    ap.add_argument("--batch", type=int)
    ap.add_argument("--no-profile", action="store_true",
                    help="plan with ClusterSpec.local_cpu's rough figures instead of profiled ones")
    ap.add_argument("--budget", help="plan autopar under a memory budget per rank: 'fsdp2' (the peak the step "
                    "memory model predicts for FSDP2's layout, below the DDP layout's on both models), "
                    "'0.9x' (a factor of that peak) or a number of bytes; default: no budget")
    ap.add_argument("--bucket-mb", type=float, default=None,
                    help="fix autopar's gradient bucket size in MiB (compile(bucket_mb=), which the plan is priced "
                    "at); default: the planner chooses it (plan.bucket_mb)")
    ap.add_argument("--no-one-rank", action="store_true", help="skip the 1-rank comparison with eager")
    args = ap.parse_args()
    for key, value in DEFAULTS[args.model].items():
        if getattr(args, key) is None:
            setattr(args, key, value)
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))     # the repository's test helpers
    from tests.distributed_utils import run_distributed

    name = "HF GPT-2 (GPT2LMHeadModel)" if args.model == "hf-gpt2" else "built-in GPT"
    print(f"{name}: {args.layers} layers, d_model {args.d_model}, {args.heads} heads, vocab {args.vocab}, "
          f"batch {args.batch} x seq {args.seq}; {args.steps} timed steps; OMP_NUM_THREADS="
          f"{os.environ['OMP_NUM_THREADS']}")
    run_distributed(two_ranks, 2, args, timeout=3600)
    if not args.no_one_rank:
        run_distributed(one_rank, 1, args, timeout=1800)


if __name__ == "__main__":
    main()
