"""Run a test body on real gloo processes; any failing or hanging rank fails the calling test."""
from __future__ import annotations

import datetime
import faulthandler
import multiprocessing
import os
import signal
import sys
import tempfile
import time
import traceback

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch.multiprocessing.spawn import ProcessException

_HOST = "127.0.0.1"
_ERROR_KEY = "run_distributed/error/"

# Ranks are forked from one server process that has imported these once per test session: a spawned
# rank spends seconds of CPU importing torch, torch.export, transformers and autopar, which on two cores
# made up most of a small parity test's time. A module missing here is skipped by the server.
_RANK_PRELOAD = [
    "torch", "torch._dynamo", "torch._inductor", "torch.export", "torch.distributed.tensor",
    "torch.distributed.pipelining", "torch.distributed.checkpoint", "torch.utils.checkpoint",
    "networkx", "highspy", "autopar.compiler", "autopar.checkpoint", "autopar.pass_pipeline", "autopar.planner",
    "pytest", "transformers", "transformers.models.gpt2.modeling_gpt2", "transformers.models.llama.modeling_llama",
    "transformers.models.bert.modeling_bert",
]
START_METHOD = "forkserver"
multiprocessing.get_context(START_METHOD).set_forkserver_preload(_RANK_PRELOAD)


def _worker(rank, fn, world_size, port, timeout, args, environ, fault_dir):
    # The fork server was started with the environment of the first launch; a rank sees the caller's.
    os.environ.clear()
    os.environ.update(environ)
    # A rank killed by a signal leaves no Python exception; its stacks at the signal go to a file the
    # parent reads back, since a forked rank's stderr is the fork server's, not the test's. SIGUSR1 writes
    # them too: the parent asks a rank that is still running at the timeout where it is.
    fault_file = open(os.path.join(fault_dir, f"rank{rank}"), "w")
    faulthandler.enable(file=fault_file, all_threads=True)
    faulthandler.register(signal.SIGUSR1, file=fault_file, all_threads=True)
    # The ranks share a few CPU cores; more threads per rank only oversubscribe them.
    torch.set_num_threads(1)
    store = dist.TCPStore(_HOST, port, is_master=False, timeout=datetime.timedelta(seconds=timeout))
    # A stuck collective times out in the child, with a traceback naming it, before the parent
    # gives up on the whole run.
    dist.init_process_group(
        "gloo", store=store, rank=rank, world_size=world_size, timeout=datetime.timedelta(seconds=0.75 * timeout)
    )
    try:
        fn(rank, world_size, *args)
    except BaseException:
        # The peers of a failed rank fail too ("Connection closed by peer"), and any of them may
        # exit first; the time stamp lets the parent report the rank that failed first.
        store.set(f"{_ERROR_KEY}{rank}", f"{time.time()!r}\n{traceback.format_exc()}")
        raise
    dist.destroy_process_group()
    sys.stdout.flush()
    sys.stderr.flush()
    # Skip interpreter teardown: with torch loaded it takes about a second per rank, and a test
    # needs nothing from it.
    os._exit(0)


def _first_failure(store, fn, world_size, cause, fault_dir) -> RuntimeError:
    """An error that shows the traceback of the rank that failed first and lists the others. A rank
    killed by a signal comes first, with its stacks at the signal: its peers then fail too ("Connection
    reset by peer"), and may say so before the parent learns of the signal."""
    errors = []
    for rank in range(world_size):
        if store.check([f"{_ERROR_KEY}{rank}"]):
            stamp, tb = store.get(f"{_ERROR_KEY}{rank}").decode().split("\n", 1)
            errors.append((float(stamp), rank, tb))
    errors.sort()
    head = f"run_distributed({fn.__name__}, world_size={world_size}): "
    signalled = _stacks(fault_dir, range(world_size), "at the signal")
    if signalled or not errors:     # not errors: a rank ended with no Python exception (os._exit)
        later = "".join(f"\nrank {r} failed too: {t.strip().splitlines()[-1]}" for _, r, t in errors)
        return RuntimeError(f"{head}{cause}{signalled}{later}")
    _, rank, tb = errors[0]
    later = "".join(f"\nrank {r} failed later: {t.strip().splitlines()[-1]}" for _, r, t in errors[1:])
    return RuntimeError(f"{head}rank {rank} failed first:\n{tb}{later}")


def run_distributed(fn, world_size: int, *args, timeout: float = 120.0) -> None:
    """Run ``fn(rank, world_size, *args)`` on ``world_size`` spawned processes in one gloo group.

    ``fn`` must be a module-level function, and ``args`` picklable. Raises ``RuntimeError`` with
    the traceback of the first rank that failed (the Python stacks of one killed by a signal), or
    ``TimeoutError`` naming the ranks still running after ``timeout`` seconds, with their stacks;
    either way the other ranks are stopped.
    """
    # The parent holds the rendezvous store on a port the OS picks, so no other process can take
    # the port between choosing it and binding it.
    store = dist.TCPStore(_HOST, 0, is_master=True, wait_for_workers=False)
    with tempfile.TemporaryDirectory(prefix="autopar-ranks-") as fault_dir:
        _run(fn, world_size, args, timeout, store, fault_dir)


def _stacks(fault_dir: str, ranks, when: str) -> str:
    """The Python stacks the ranks ``ranks`` wrote to their fault files, one paragraph each."""
    out = []
    for rank in ranks:
        try:
            with open(os.path.join(fault_dir, f"rank{rank}")) as f:
                text = f.read()
        except FileNotFoundError:
            continue
        if text:
            out.append(f"\nrank {rank} {when}:\n{text}")
    return "".join(out)


def _run(fn, world_size, args, timeout, store, fault_dir) -> None:
    ctx = mp.start_processes(
        _worker,
        args=(fn, world_size, store.port, timeout, args, dict(os.environ), fault_dir),
        nprocs=world_size,
        join=False,
        start_method=START_METHOD,
    )
    deadline = time.monotonic() + timeout
    try:
        while not ctx.join(timeout=max(deadline - time.monotonic(), 0.0)):
            if time.monotonic() >= deadline:
                running = [rank for rank, p in enumerate(ctx.processes) if p.is_alive()]
                for rank in running:
                    os.kill(ctx.processes[rank].pid, signal.SIGUSR1)
                time.sleep(1.0)         # for faulthandler to write their stacks
                for p in ctx.processes:
                    p.kill()
                    p.join()
                raise TimeoutError(
                    f"run_distributed({fn.__name__}, world_size={world_size}): ranks {running} still "
                    f"running after {timeout:g} s; a collective is probably mismatched across ranks"
                    f"{_stacks(fault_dir, running, 'at the timeout')}"
                )
    except ProcessException as e:
        raise _first_failure(store, fn, world_size, e, fault_dir) from e


def resumes_alike(path, pm, opt, other, other_opt, ids, labels, steps=2):
    """Save ``pm`` and ``opt`` at ``path`` and load them into ``other`` and ``other_opt`` (another plan);
    both then train ``steps`` steps with the same losses."""
    import autopar.checkpoint as ckpt

    ckpt.save(path, pm, opt)
    ckpt.load(path, other, other_opt)
    for _ in range(steps):
        a, b = pm.train_step(ids, labels=labels), other.train_step(ids, labels=labels)
        assert torch.allclose(a, b, rtol=1e-5, atol=0), (a.item(), b.item())
        opt.step(), other_opt.step()
        opt.zero_grad(), other_opt.zero_grad()
