"""Peak bytes of live tensors over training steps on CPU, as the memory model promises to predict them.

Every storage an op allocates is counted from its creation until it is freed, plus what exists before
the steps (parameters, buffers, optimizer states, the inputs), each storage once. This is the accounting
of torch.distributed._tools.mem_tracker.MemTracker without its module hooks: those hold every
parameter gradient until backward ends, which changes what is live (a data-parallel plan keeps each
gradient twice, before and after its all-reduce), so MemTracker over-reports what an unobserved step
holds.
"""
from __future__ import annotations

import weakref

import torch
from torch.utils import _pytree as pytree
from torch.utils._python_dispatch import TorchDispatchMode


class LiveBytes(TorchDispatchMode):
    def __init__(self):
        super().__init__()
        self.live = self.peak = 0
        self._refs: dict = {}

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
        out = func(*args, **(kwargs or {}))
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
