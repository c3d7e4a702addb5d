"""Gradient all-reduces in buckets, launched during backward (DDP's scheme).

The program lists the parameters whose accumulated gradient is summed over a group
(``Program.grad_reductions``, in the order backward makes them ready). They are packed into buckets of
about ``bucket_bytes`` of the dtype they are reduced in (one group and dtype per bucket, one bucket
open per group and dtype: ``autopar.plan.pack_buckets``); a bucket's all-reduce starts, asynchronously,
once every gradient in it is accumulated, and buckets start in index order so that every rank issues
the same collectives in the same order. The end of backward waits for them.
A gradient ``torch.autograd.grad`` returns is all-reduced alone, at once.

A bucket's launch copies its gradients into one flat buffer and makes each parameter's ``.grad`` a
view into it (DDP's ``gradient_as_bucket_view``): the all-reduce sums in place and nothing is copied
back. The gradients then hold the buffer, so it lives as long as they do and ``zero_grad`` frees it:
the step memory model's gradients (passes/memory.py), made in backward and held until then, stay
true. Each backward makes new buffers, as the gradients of the one before may still be held.

A gradient reduced in a narrower dtype than its parameter's (a bf16-mixed weight's, whose float32
gradient is its bfloat16 copy's, widened: codegen/grad_buckets.py) is copied into a bucket of that
dtype, exactly, and the float32 gradient let go; once the bucket's all-reduce ends the gradient is
the bucket's sum widened again, one bucket at a time, so that the float32 gradients and one bucket's
buffer are the most held at once. The all-reduce sums what the copy's would have: the same bits as
one reduction per copy where each copy has one reader.

A gradient already held from an earlier backward (accumulation without ``zero_grad``) is set aside at
forward and added back after the reduction, so only this backward's gradient is summed.
"""
from __future__ import annotations

import torch

from autopar.plan import pack_buckets
from autopar.runtime import collectives as C


class GradBuckets:
    def __init__(self, params: list, bucket_bytes: int, reduced=None):
        """``params``: (parameter, group name, the dtype its gradient is reduced in, None for its own) in
        the order their gradients become ready. ``reduced``: called once a backward's buckets are reduced
        and the gradients set aside added back (a ZeRO-1 block's gradient is then a view of its whole
        tensor's: runtime/zero.py)."""
        self.reduced = reduced
        entries = [(p, group, dtype or p.dtype) for p, group, dtype in params if p.requires_grad]
        packed = pack_buckets(entries, lambda e: e[0].numel() * e[2].itemsize, bucket_bytes,
                              key=lambda e: (e[1], e[2]))
        self.buckets: list[list] = [[p for p, _, _ in b] for b in packed]
        self.groups: list[str] = [b[0][1] for b in packed]
        self.dtypes: list[torch.dtype] = [b[0][2] for b in packed]
        self.bucket_of = {p: i for i, b in enumerate(self.buckets) for p in b}
        for p, i in self.bucket_of.items():
            p.register_post_accumulate_grad_hook(self._ready)
            p.register_hook(self._returned(p, self.groups[i], self.dtypes[i]))
        self._reset()
        self.saved: dict = {}

    def _reset(self):
        self.pending = [len(b) for b in self.buckets]
        self.next = 0                 # the next bucket to launch
        self.works: list = []
        self.narrowed: dict = {}      # bucket -> (parameter, its view in the bucket) of narrowed gradients
        self.queued = False

    def set_aside(self):
        """Before a forward: hold gradients from an earlier backward apart from this one's."""
        self.restore()
        for p in self.bucket_of:
            if p.grad is not None:
                self.saved[p] = p.grad
                p.grad = None

    def restore(self):
        """Give back gradients set aside for a backward that did not run."""
        for p, g in self.saved.items():
            p.grad = g if p.grad is None else p.grad.add_(g)      # in place: a bucket's view stays one
        self.saved = {}

    def _returned(self, p, group: str, dtype: torch.dtype):
        """A gradient ``torch.autograd.grad`` returns, rather than accumulates (no post-accumulate hook
        runs for it), all-reduced at once; the gradients set aside at forward come back when it ends."""
        def hook(g):
            if C.accumulates(p):
                return None
            torch.autograd.Variable._execution_engine.queue_callback(self.restore)
            return C._all_reduce(g.to(dtype), group).to(g.dtype)
        return hook

    def _ready(self, p):
        if not self.queued:
            torch.autograd.Variable._execution_engine.queue_callback(self._finish)
            self.queued = True
        i = self.bucket_of[p]
        self.pending[i] -= 1
        while self.next < len(self.buckets) and self.pending[self.next] == 0:
            self._launch(self.next)

    def _launch(self, i):
        members, dtype = self.buckets[i], self.dtypes[i]
        flat = torch.empty(sum(p.numel() for p in members), dtype=dtype, device=members[0].device)
        offset = 0
        for p in members:
            view = flat[offset:offset + p.numel()].view(p.shape)
            offset += p.numel()
            if p.grad is None:
                view.zero_()
            elif p.dtype == dtype:
                view.copy_(p.grad)
                p.grad = view
            else:
                view.copy_(p.grad)
                p.grad = None
                self.narrowed.setdefault(i, []).append((p, view))
        self.works.append((i, C._start_all_reduce_(flat, self.groups[i])))
        self.next = i + 1

    def _finish(self):
        while self.next < len(self.buckets):     # buckets with parameters this backward did not reach
            self._launch(self.next)
        works, self.works = self.works, []
        works.reverse()
        while works:
            self._wait(*works.pop())
        self._reset()
        self.restore()
        if self.reduced is not None:
            self.reduced()

    def _wait(self, i, issued):
        """Wait for bucket ``i``'s all-reduce, summed in place into its gradients' views; a narrowed
        gradient is then widened into a tensor of its own, and the bucket freed with the last of them."""
        torch.ops._c10d_functional.wait_tensor(issued)
        for p, view in self.narrowed.pop(i, ()):
            p.grad = view.to(p.dtype)
