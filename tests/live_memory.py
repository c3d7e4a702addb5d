"""Peak bytes of live tensors over training steps on CPU, as the memory model promises to predict them.

Every storage an op allocates is counted from its creation until it is freed, plus what exists before
the steps (parameters, buffers, optimizer states, the inputs), each storage once. This is the accounting
of torch.distributed._tools.mem_tracker.MemTracker without its module hooks: those hold every
parameter gradient until backward ends, which changes what is live (a data-parallel plan keeps each
gradient twice, before and after its all-reduce), so MemTracker over-reports what an unobserved step
holds.

A collective's c10d Work holds its input and output until the backend's thread drops it, some time
after the wait returns; a storage freed on that thread is freed only once it takes the interpreter
lock, which this thread holds while it runs ops. So that the peak does not depend on how the threads
happen to be scheduled (on a loaded machine, several layers later), each wait lets the backend's
thread drop the Work before the step goes on: the collective's buffers are counted until their wait
or their last use, whichever is later.
"""
from __future__ import annotations

import time
import weakref

import torch
from torch.utils import _pytree as pytree
from torch.utils._python_dispatch import TorchDispatchMode


_WAIT = torch.ops._c10d_functional.wait_tensor.default


def _tensors(tree) -> list:
    return [t for t in pytree.tree_leaves(tree) if isinstance(t, torch.Tensor)]


def _storage_key(t: torch.Tensor):
    return t.untyped_storage()._cdata


class LiveBytes(TorchDispatchMode):
    def __init__(self):
        super().__init__()
        self.live = self.peak = 0
        self._refs: dict = {}
        self._works: dict = {}      # output storage of an issued collective -> [(tensor, references its Work holds)]

    def hold(self, *tensors) -> None:
        """Count tensors that exist before the steps."""
        for t in pytree.tree_leaves(tensors):
            if isinstance(t, torch.Tensor):
                self._track(t)
        self.peak = max(self.peak, self.live)

    def _track(self, t: torch.Tensor) -> None:
        if hasattr(t, "to_local"):
            t = t.to_local()
        st = t.untyped_storage()
        key = st._cdata
        if key in self._refs:
            return
        n = st.nbytes()
        self.live += n

        def free(_ref, key=key, n=n):
            self.live -= n
            self._refs.pop(key, None)

        self._refs[key] = weakref.ref(st, free)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func is _WAIT:
            # The tensors the Work holds, and their counts of references once it is dropped.
            floors = [(t, t._use_count() - n) for t, n in self._works.pop(_storage_key(args[0]), ())]
        elif func.namespace == "_c10d_functional":
            before = {id(t): t._use_count() for t in _tensors((args, kwargs))}
        out = func(*args, **(kwargs or {}))
        if func is _WAIT:
            deadline = time.monotonic() + 1.0
            for t, floor in floors:
                while t._use_count() > floor and time.monotonic() < deadline:
                    time.sleep(1e-4)
            del floors
        elif func.namespace == "_c10d_functional":
            held = [(t, t._use_count() - before.get(id(t), 1)) for t in _tensors((args, kwargs, out))]
            for t in _tensors(out):
                self._works[_storage_key(t)] = [(u, n) for u, n in held if n > 0]
        for t in pytree.tree_leaves(out):
            if isinstance(t, torch.Tensor):
                self._track(t)
        self.peak = max(self.peak, self.live)
        return out


def step_peak(module, optimizer, step, steps: int = 2, inputs=()) -> int:
    """Run ``step()`` ``steps`` times (after at least one step made the optimizer's states) and return
    the peak of live tensor bytes."""
    mode = LiveBytes()
    with mode:
        mode.hold(list(module.parameters()), list(module.buffers()), inputs,
                  [v for s in optimizer.state.values() for v in s.values()])
        for _ in range(steps):
            step()
    return mode.peak


def step_peak_over_ranks(module, optimizer, step, inputs=()) -> float:
    """``step_peak`` on every rank of the default group: the highest of them."""
    import torch.distributed as dist

    peak = torch.tensor([float(step_peak(module, optimizer, step, inputs=inputs))])
    dist.all_reduce(peak, op=dist.ReduceOp.MAX)
    return peak.item()
