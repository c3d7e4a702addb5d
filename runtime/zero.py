"""Optimizer states sharded where a parameter is replicated: ZeRO-1 and ZeRO-2 under the user's own
optimizer.

A parameter the plan keeps replicated along a mesh axis while sharding its state there
(``plan.zero``) lives twice over one storage: the program reads the whole local tensor, and the
module exposes, as the ``nn.Parameter`` the optimizer sees, a view of this rank's block of it along
the state's dim. Any torch optimizer then keeps its states (Adam's moments) at the block's size and
updates the block in place, inside the whole tensor.

- ZeRO-1: the gradient is reduced as in plain data parallelism: the whole tensor's accumulated
  gradient all-reduced in the runtime's buckets (codegen/grad_buckets.py), or, where the program keeps
  the reductions (compile(overlap=False)), each use's; the parameter's ``.grad`` is the view of its
  block of the reduced gradient, made once the buckets are reduced (``expose_grads``), or, unbucketed,
  once backward accumulates it. The program reads the whole tensor through ``whole_of`` too
  (``_ZeroOneRead``), an autograd function of both tensors, only so that ``torch.autograd.grad`` over
  the block reaches autopar's error, which names the parameter, rather than torch's "not used in the
  graph": the reduction happens where backward accumulates the whole tensor's gradient, which
  ``torch.autograd.grad`` does not do.
- ZeRO-2: the program reads the whole tensor through ``whole_of``, just before its first use, as an
  autograd function of the block (``_WholeOf``): its backward, once autograd has summed the gradients
  of every read, reduce-scatters the whole gradient along the axis into the block's gradient, so that
  ``loss.backward()`` and ``torch.autograd.grad`` over the module's parameters both give it, and the
  whole gradient is freed. Autograd runs the ready node made last first, so a read made where the
  program first uses the parameter runs its backward as soon as the gradient is complete; one made
  before the program starts would hold every whole gradient to the end of backward.

Under bf16-mixed a ZeRO-1/2 parameter read only through its bfloat16 copy may have its float32 master
sharded too (``plan.zero[fqn]["sharded_master"]``, Megatron-LM's distributed optimizer): the whole local
tensor is then that copy, which the program reads in place of the cast, and the parameter the
optimizer steps is a float32 tensor of its own, this rank's block of the master. Under ZeRO-1 the
gradient of the copy, reduced in the program, gives the block's gradient in float32 (``_MasterRead``);
under ZeRO-2 the program leaves it partial and the read's backward reduce-scatters it, in the copy's
dtype or, where the plan sums gradients in float32 (``plan.reduce_dtype``), widened first, into the
block's, in float32 (``_WholeOf``, as for any ZeRO-2 parameter). The gather
below moves the updated blocks in the copy's dtype.

After the optimizer steps (a global optimizer step hook, and before any forward whose parameters
changed since the last gather), every rank's updated blocks are all-gathered into the whole tensors,
one collective per bucket of the plan (``plan.zero[fqn]["bucket"]``, split by group and dtype): the
blocks are copied into one flat buffer, gathered, and copied out of the result, which moves the same
bytes as one all-gather per parameter.
"""
from __future__ import annotations

import functools
import weakref
from dataclasses import dataclass

import torch
from torch.optim.optimizer import register_optimizer_step_post_hook
from torch import nn

from autopar.runtime import collectives as C



def after_optimizer_steps(owner, method: str) -> None:
    """Call ``owner.<method>()`` after every step of an optimizer (the user's own) over a parameter whose
    id is in ``owner._ids``. The hook holds ``owner`` weakly and is removed when ``owner`` is collected."""
    me = weakref.ref(owner)

    def after_step(optimizer, _args, _kwargs):
        target = me()
        if target is not None and any(id(p) in target._ids for g in optimizer.param_groups for p in g["params"]):
            getattr(target, method)()

    handle = register_optimizer_step_post_hook(after_step)
    weakref.finalize(owner, handle.remove)

@dataclass
class ShardedState:
    fqn: str
    full: torch.Tensor          # the local tensor under the parameter's layout, as the program reads it
    shard: nn.Parameter         # this rank's block of it, what the optimizer steps
    stage: int
    group: str
    dim: int
    bucket: object              # the parameters of one bucket are gathered together
    reduce_dtype: torch.dtype | None = None     # a sharded master's: what its copy's gradient is summed in
                                                # where not the copy's dtype (the master's, float32)

    @property
    def sharded_master(self) -> bool:
        """The whole tensor is a lower-precision copy; the shard, a master of its own."""
        return self.full.dtype != self.shard.dtype

    def block(self, whole: torch.Tensor) -> torch.Tensor:
        """This rank's block of ``whole`` (the local tensor's shape) along the state's dim."""
        k = self.shard.shape[self.dim]
        return whole.narrow(self.dim, C._group(self.group)[0] * k, k)


def split(full: torch.Tensor, group: str, dim: int, requires_grad: bool,
          copy_dtype: torch.dtype | None = None) -> tuple[torch.Tensor, nn.Parameter]:
    """(the whole local tensor as an autograd leaf, the parameter that is this rank's block of it). The
    whole tensor is a Parameter too: a pipeline stage's module holds it, and the zero-bubble schedules
    compute the gradients of its parameters. With ``copy_dtype`` (a sharded master) the whole tensor is
    a copy in that dtype, not a leaf, and the block a float32 tensor of its own."""
    r, n = C._group(group)
    k = full.shape[dim] // n
    if copy_dtype is not None:
        block = full.detach().narrow(dim, r * k, k).clone()
        return full.detach().to(copy_dtype), nn.Parameter(block, requires_grad=requires_grad)
    whole = nn.Parameter(full.detach().clone(), requires_grad=requires_grad)
    return whole, nn.Parameter(whole.detach().narrow(dim, r * k, k), requires_grad=requires_grad)


class _WholeOf(torch.autograd.Function):
    """A ZeRO-2 parameter's whole local tensor, read by the program, as a function of this rank's block
    (for a sharded master, the whole copy: its reduced block is widened to the master's dtype)."""

    @staticmethod
    def forward(ctx, shard, states, s):
        ctx.states, ctx.s = states, s
        return s.full.detach()

    @staticmethod
    def backward(ctx, g):
        s = ctx.s
        if s.reduce_dtype is not None:
            g = g.to(s.reduce_dtype)
        if ctx.states.defer and C.deferrable(s.shard):
            C.defer_reduce_scatter(s.shard, g, s.dim, s.group)
            return None, None, None
        return C._reduce_scatter(g, s.dim, C._group(s.group)[1], s.group).to(s.shard.dtype), None, None


class _ZeroOneRead(torch.autograd.Function):
    """A ZeRO-1 parameter's whole local tensor, read by the program: its gradient goes to the whole
    tensor, whose accumulation the program's buckets reduce."""

    @staticmethod
    def forward(ctx, shard, full, s):
        ctx.s = s
        return full.detach()

    @staticmethod
    def backward(ctx, g):
        s = ctx.s
        if C.asked(s.shard) and not C.accumulates(s.full):
            raise NotImplementedError(
                f"the gradient of ZeRO-1 parameter {s.fqn!r} was asked for without accumulating it "
                f"(torch.autograd.grad, or backward(inputs=...) naming it): its gradient is reduced over "
                f"the data-parallel ranks only where backward accumulates it, so call loss.backward() and read "
                f"{s.fqn!r}'s .grad (this rank's block of the reduced gradient), or plan it as ZeRO-2 "
                f"(a pin {{\"zero\": 2}}), whose gradient torch.autograd.grad returns")
        return None, g, None


class _MasterRead(torch.autograd.Function):
    """The whole copy of a ZeRO-1 parameter whose float32 master is sharded, read by the program: the
    copy's gradient, which the program reduced, gives the master block's, in the block's dtype."""

    @staticmethod
    def forward(ctx, shard, s):
        ctx.s = s
        return s.full.detach()

    @staticmethod
    def backward(ctx, g):
        s = ctx.s
        return s.block(g).to(s.shard.dtype), None


def whole_of(full: torch.Tensor) -> torch.Tensor:
    """What the program reads for a ZeRO-1 or ZeRO-2 parameter whose whole local tensor is ``full``
    (code generation emits the call before the parameter's first use): the tensor as a function of this
    rank's block, or ``full`` itself where no ``ShardedStates`` owns it (a program run on example
    inputs)."""
    read = getattr(full, "_autopar_whole_of", None)
    return full if read is None else read()


class ShardedStates:
    def __init__(self, states: list[ShardedState], defer: bool = False, bucketed: frozenset = frozenset()):
        """``defer``: a ZeRO-2 gradient's reduce-scatter is waited at the next one's issue or when
        backward ends (runtime/collectives.py's ``defer_reduce_scatter``), not at once. ``bucketed``: the
        ZeRO-1 parameters whose whole gradient the runtime's buckets reduce, whose blocks' gradients
        ``expose_grads`` gives once they are reduced (a view made before would hold the unreduced
        gradient, which the bucket's copy frees)."""
        self.states = states
        self.defer = defer
        self.bucketed = bucketed
        self._ids = {id(s.shard) for s in states}
        self._seen: dict = {}
        for s in states:
            if s.sharded_master and s.stage == 1:
                s.full._autopar_whole_of = functools.partial(_MasterRead.apply, s.shard, s)
                continue
            if s.stage == 1 and s.full.requires_grad:
                if s.fqn not in bucketed:
                    s.full.register_post_accumulate_grad_hook(self._ready_hook(s))
                s.full._autopar_whole_of = functools.partial(_ZeroOneRead.apply, s.shard, s.full, s)
            if s.stage == 2:
                s.full._autopar_whole_of = functools.partial(_WholeOf.apply, s.shard, self, s)
        self.mark_gathered()
        after_optimizer_steps(self, "gather")

    def _ready_hook(self, s: ShardedState):
        def ready(full):
            # The program's own reductions have summed this gradient.
            if full.grad is not None:
                self._expose(s)
        return ready

    def _expose(self, s: ShardedState) -> None:
        """A ZeRO-1 parameter's gradient: the view of its block of the whole tensor's gradient, made again
        for a bucketed one (its whole gradient is a new tensor at each backward: the bucket's). Any other
        keeps the gradient it was given: a pipeline's reduce-scattered block is not a view of the whole."""
        if s.full.grad is not None and (s.shard.grad is None or s.fqn in self.bucketed):
            s.shard.grad = s.block(s.full.grad)

    def expose_grads(self) -> None:
        """Give every ZeRO-1 parameter its gradient's block, where no accumulation hook did: the
        runtime's buckets reduce it after accumulation, and a pipeline's zero-bubble schedules assign the
        weights' gradients rather than accumulate them."""
        for s in self.states:
            if s.stage == 1:
                self._expose(s)

    def before_forward(self) -> None:
        """Free a ZeRO-1 gradient the optimizer has let go of (``zero_grad``), and gather parameters
        changed since the last gather (an optimizer that ran without step hooks, a manual edit)."""
        for s in self.states:
            if s.stage == 1 and s.shard.grad is None:
                s.full.grad = None
        self.sync()

    def buckets(self) -> dict:
        """(bucket, group name, dtype) -> the states gathered by one collective, in a fixed order."""
        out: dict = {}
        for s in self.states:
            out.setdefault((s.bucket, s.group, s.full.dtype), []).append(s)
        return out

    def gather(self) -> None:
        """All-gather every rank's updated blocks into the whole local tensors, a bucket at a time."""
        with torch.no_grad():
            for (_, group, dtype), members in self.buckets().items():
                n = C._group(group)[1]
                flat = torch.empty(sum(s.shard.numel() for s in members), dtype=dtype, device=members[0].full.device)
                offset = 0
                for s in members:
                    flat[offset:offset + s.shard.numel()].view(s.shard.shape).copy_(s.shard.detach())
                    offset += s.shard.numel()
                got = torch.ops._c10d_functional.wait_tensor(C._start_gather(flat, n, group)).view(n, -1)
                del flat
                offset = 0
                for s in members:
                    k = s.shard.numel()
                    s.full.detach().unflatten(s.dim, (n, -1)).movedim(s.dim, 0).copy_(
                        got[:, offset:offset + k].view(n, *s.shard.shape))
                    offset += k
                del got             # before the next collective's buffers
        self.mark_gathered()

    def sync(self) -> None:
        """Gather if any block changed since the last gather (before the whole tensors are read)."""
        if any(s.shard._version != self._seen[id(s.shard)] for s in self.states):
            self.gather()

    def mark_gathered(self) -> None:
        """Every rank holds the same whole tensors (gathered, or loaded whole)."""
        self._seen = {id(s.shard): s.shard._version for s in self.states}

    def after_load(self) -> None:
        """After weights were loaded: the whole copies of sharded masters are gathered from the loaded
        blocks (a checkpoint holds the masters, not the copies); every other whole tensor was loaded."""
        if any(s.sharded_master for s in self.states):
            self.gather()
        else:
            self.mark_gathered()
