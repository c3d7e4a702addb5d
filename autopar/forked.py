"""A call run in a forked child process, its result handed back to the parent: planning runs
independent pieces of work (the pipeline meshes) on the machine's other cores. A forked child starts
with the parent's memory (the captured program, the model), so nothing but the result is pickled."""
from __future__ import annotations

import multiprocessing
import pickle

from autopar.errors import AutoparError


def fork_available() -> bool:
    """Whether a child can be forked here: on a platform with fork, in a process that has not
    initialized CUDA (a forked child cannot use the parent's CUDA context, and capturing a model on
    a GPU touches it)."""
    import torch

    return "fork" in multiprocessing.get_all_start_methods() and not torch.cuda.is_initialized()


class Forked:
    """``fn(*args)`` running in a forked child; ``result()`` waits for it and returns its value or
    raises its exception."""

    def __init__(self, fn, *args):
        ctx = multiprocessing.get_context("fork")
        self._recv, send = ctx.Pipe(duplex=False)
        self._proc = ctx.Process(target=_run, args=(send, fn, args))
        self._proc.start()
        send.close()
        self._name = getattr(fn, "__qualname__", repr(fn))

    def result(self):
        try:
            data = self._recv.recv_bytes()
        except EOFError:
            self._proc.join()
            raise AutoparError(f"the process running {self._name} exited with code {self._proc.exitcode} "
                               f"before handing back its result") from None
        finally:
            self._recv.close()
        self._proc.join()
        ok, payload, message = pickle.loads(data)
        if ok:
            return payload
        try:
            error = pickle.loads(payload)
        except Exception:       # an exception whose class cannot be rebuilt from its pickle
            error = AutoparError(message)
        raise error

    def cancel(self):
        """Stops the child if it still runs (its result is no longer wanted)."""
        self._recv.close()
        if self._proc.is_alive():
            self._proc.terminate()
        self._proc.join()


def _run(send, fn, args):
    try:
        out = (True, fn(*args), None)
    except BaseException as e:  # handed to the parent, which raises it
        try:
            out = (False, pickle.dumps(e), f"{type(e).__name__}: {e}")
        except Exception:
            out = (False, None, f"{type(e).__name__}: {e}")
    send.send_bytes(pickle.dumps(out))
    send.close()
