"""``python -m autopar demo``: compile a small GPT-2 for N local gloo processes, train it, and check
every step's loss against the same model trained in one process.

The command spawns the processes itself. Every rank builds the same seeded model and batch; rank 0
also keeps a deep copy that it trains alone as the reference.
"""
from __future__ import annotations

import argparse
import copy
import datetime
import os
import sys
import time

# fp32 losses of a sharded program differ from one process's only by summation order (sharded
# matmuls, all-reduces), about 1e-7 relative per step; Adam carries that through 20 steps well
# below this bound, while any real layout or collective bug moves the loss by far more.
RTOL = 1e-4
_HOST = "127.0.0.1"
_RESULT_KEY = "autopar-demo/result"


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--ranks", type=int, default=2, help="number of gloo processes (default 2)")
    p.add_argument("--steps", type=int, default=20, help="AdamW steps (default 20)")
    p.add_argument("--model", default="gpt2-tiny", help="a small zoo model (default gpt2-tiny)")
    p.add_argument("--batch", type=int, default=8, help="global batch size (default 8)")
    p.add_argument("--seq", type=int, default=16, help="sequence length (default 16)")


def _worker(rank: int, world: int, port: int, args: argparse.Namespace) -> None:
    import torch
    import torch.distributed as dist

    import autopar
    from autopar import zoo

    torch.set_num_threads(1)
    store = dist.TCPStore(_HOST, port, is_master=False, timeout=datetime.timedelta(seconds=120))
    dist.init_process_group("gloo", store=store, rank=rank, world_size=world,
                            timeout=datetime.timedelta(seconds=120))
    torch.manual_seed(0)
    model, ex_args, ex_kwargs = zoo.build(args.model, batch=args.batch, seq=args.seq, device="cpu")
    ref = copy.deepcopy(model) if rank == 0 else None
    pm = autopar.compile(model, autopar.ClusterSpec.local_cpu(world), ex_args, ex_kwargs)
    say = print if rank == 0 else (lambda *a, **k: None)
    say(pm.plan.summary())
    say(f"\ntraining {args.steps} AdamW steps (lr 1e-3) on one fixed batch {tuple(ex_args[0].shape)}, "
        f"{world} ranks vs one process; tolerance: relative {RTOL:g}")
    say(f"{'step':>4}  {'autopar loss':>14}  {'single-device':>14}  {'rel diff':>9}")
    opt = torch.optim.AdamW(pm.parameters(), lr=1e-3)
    ref_opt = torch.optim.AdamW(ref.parameters(), lr=1e-3) if ref is not None else None
    worst = 0.0
    for step in range(1, args.steps + 1):
        loss = pm.train_step(*ex_args, **ex_kwargs).item()
        opt.step()
        opt.zero_grad()
        if ref is not None:
            ref_loss = ref(*ex_args, **ex_kwargs).loss
            ref_loss.backward()
            ref_opt.step()
            ref_opt.zero_grad()
            rel = abs(loss - ref_loss.item()) / abs(ref_loss.item())
            worst = max(worst, rel)
            flag = "  MISMATCH" if rel > RTOL else ""
            say(f"{step:>4}  {loss:>14.8f}  {ref_loss.item():>14.8f}  {rel:>9.2e}{flag}", flush=True)
    full = pm.full_state_dict()       # a collective: every rank takes part
    if ref is not None:
        ref_state = ref.state_dict()
        param_diff = max((full[k] - ref_state[k]).abs().max().item() for k in full)
        say(f"final parameters: max |autopar - single-device| = {param_diff:.2e} (informational: Adam "
            f"magnifies rounding where a gradient is near zero)")
        if worst <= RTOL:
            say(f"PASS: all {args.steps} losses match the single-device run within relative {RTOL:g} "
                f"(worst {worst:.2e})")
        else:
            say(f"FAIL: the losses differ from the single-device run by up to relative {worst:.2e} "
                f"> tolerance {RTOL:g}")
        store.set(_RESULT_KEY, "pass" if worst <= RTOL else "fail")
    dist.barrier()
    dist.destroy_process_group()
    sys.stdout.flush()
    # Interpreter teardown with torch loaded takes about a second per process and gives nothing here.
    os._exit(0)


def run(args: argparse.Namespace) -> int:
    import torch.distributed as dist
    import torch.multiprocessing as mp
    from torch.multiprocessing.spawn import ProcessException

    if args.ranks < 1 or args.steps < 1:
        print("autopar demo: error: --ranks and --steps must be at least 1", file=sys.stderr)
        return 1
    from autopar.zoo import NAMES

    if args.model not in NAMES and ":" not in args.model:   # fail here, not once per rank
        print(f"autopar demo: error: unknown model {args.model!r}; use a small zoo model such as gpt2-tiny, "
              f"llama-tiny, bert-tiny, gpt-tiny, or 'package.module:function'", file=sys.stderr)
        return 1
    t0 = time.perf_counter()
    # Each rank gets one thread: more would only oversubscribe the cores the ranks share. Set before
    # spawning so the children's OpenMP reads it at start-up.
    os.environ["OMP_NUM_THREADS"] = "1"
    # The parent holds the rendezvous store on a port the OS picks: no race for a "free" port.
    store = dist.TCPStore(_HOST, 0, is_master=True, wait_for_workers=False)
    try:
        mp.start_processes(_worker, args=(args.ranks, store.port, args), nprocs=args.ranks, join=True,
                           start_method="spawn")
    except ProcessException as e:
        print(f"{e}\nautopar demo: error: rank {e.error_index} failed", file=sys.stderr)
        return 1
    ok = store.check([_RESULT_KEY]) and store.get(_RESULT_KEY) == b"pass"
    print(f"demo finished in {time.perf_counter() - t0:.1f} s")
    return 0 if ok else 1
