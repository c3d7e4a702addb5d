"""Gradient all-reduces in buckets, launched during backward (DDP's scheme).

The program lists the parameters whose accumulated gradient is summed over a group
(``Program.grad_reductions``, in the order backward makes them ready). They are packed into buckets of
about ``bucket_bytes`` (one group and dtype per bucket); a bucket's all-reduce starts, asynchronously,
once every gradient in it is accumulated, and buckets start in index order so that every rank issues
the same collectives in the same order. The end of backward waits for them and writes the sums back.
A gradient ``torch.autograd.grad`` returns is all-reduced alone, at once.

A gradient already held from an earlier backward (accumulation without ``zero_grad``) is set aside at
forward and added back after the reduction, so only this backward's gradient is summed.
"""
from __future__ import annotations

import torch

from autopar.plan import pack_buckets
from autopar.runtime import collectives as C


class GradBuckets:
    def __init__(self, params: list, bucket_bytes: int):
        """``params``: (parameter, group name) in the order their gradients become ready."""
        packed = pack_buckets([(p, group) for p, group in params if p.requires_grad],
                              lambda e: e[0].numel() * e[0].element_size(), bucket_bytes,
                              key=lambda e: (e[1], e[0].dtype))
        self.buckets: list[list] = [[p for p, _ in b] for b in packed]
        self.groups: list[str] = [b[0][1] for b in packed]
        self.bucket_of = {p: i for i, b in enumerate(self.buckets) for p in b}
        for p, i in self.bucket_of.items():
            p.register_post_accumulate_grad_hook(self._ready)
            p.register_hook(self._returned(p, self.groups[i]))
        self._reset()
        self.saved: dict = {}

    def _reset(self):
        self.pending = [len(b) for b in self.buckets]
        self.next = 0                 # the next bucket to launch
        self.works: list = []
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
            p.grad = g if p.grad is None else g.add_(p.grad)
        self.saved = {}

    def _returned(self, p, group: str):
        """A gradient ``torch.autograd.grad`` returns, rather than accumulates (no post-accumulate hook
        runs for it), all-reduced at once; the gradients set aside at forward come back when it ends."""
        def hook(g):
            if C.accumulates(p):
                return None
            torch.autograd.Variable._execution_engine.queue_callback(self.restore)
            return C._all_reduce(g, group)
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
        grads = [p.grad if p.grad is not None else torch.zeros_like(p) for p in self.buckets[i]]
        flat = torch.cat([g.reshape(-1) for g in grads])
        # In place: the bucket is a fresh tensor, so the functional all-reduce's copy of it is not needed.
        self.works.append((i, C._start_all_reduce_(flat, self.groups[i])))
        self.next = i + 1

    def _finish(self):
        while self.next < len(self.buckets):     # buckets with parameters this backward did not reach
            self._launch(self.next)
        for i, issued in self.works:
            flat = torch.ops._c10d_functional.wait_tensor(issued)
            offset = 0
            for p in self.buckets[i]:
                n = p.numel()
                if p.grad is not None:
                    p.grad.copy_(flat[offset:offset + n].view_as(p.grad))
                offset += n
        self._reset()
        self.restore()
