"""How a tensor goes from one layout to another: the steps, in order, and the collectives they cost.

The cost model and the code generator both call ``transition``, so the collectives a plan predicts
are exactly those the generated program runs.

Gradient convention (runtime/collectives.py): the gradient of a replicated value is replicated, of a
sharded value is its shard, of a Partial value is replicated. A consumer that splits its work along an
axis while reading an input replicated there produces a partial gradient for it; ``grad_partial`` names
those axes, and the transition then reduces the gradient on the way back, fused into the reduce-scatter
of an all-gather when there is one (FSDP, sequence parallel), else as a separate all-reduce (DDP,
Megatron's "f").
"""
from __future__ import annotations

import math

from dataclasses import dataclass, replace
from typing import Sequence

from autopar.layout import Placement

COMM_KINDS = ("all_reduce", "all_gather", "reduce_scatter", "all_to_all")


@dataclass(frozen=True)
class Step:
    op: str            # all_gather, reduce_scatter, all_reduce, all_to_all, local_chunk, grad_all_reduce
    axis: int
    dim: int | None = None
    dst_dim: int | None = None
    grad: str = "none"            # all_gather only: "reduce_scatter" or "slice"
    in_shape: tuple = ()          # local shape before the step
    out_shape: tuple = ()         # local shape after the step
    groups: int = 1               # a strided shard's groups along ``dim`` (S(dim,groups))
    dst_groups: int = 1           # all_to_all only: the groups along ``dst_dim``

    @property
    def makes_storage(self) -> bool:
        """Whether the tensor this step gives is a storage of its own rather than a view of its input,
        as runtime/collectives.py makes it (the function codegen emits for the step): a collective's
        output, or a strided shard's local chunk (its block of every group, copied out). A plain local
        chunk is a narrow view of its input, and ``grad_all_reduce`` is its input in forward. The step
        memory model counts a resharded copy where a step of it makes one (passes/memory.py)."""
        return self.op in COMM_KINDS or (self.op == "local_chunk" and self.groups > 1)

    def staging(self, itemsize: int, cpu: bool) -> int:
        """Bytes the step's function (runtime/collectives.py) holds while it runs beyond its input and
        its output, at its highest: the input's blocks stacked for the c10d op, where stacking copies
        (a dim with larger dims before it, or a strided shard); the stacked blocks an all-gather or
        all-to-all receives, where making them the output copies; on CPU the blocks a reduce-scatter's
        all-to-all receives from every rank (the input's size), summed into the output."""
        nin, nout = math.prod(self.in_shape) * itemsize, math.prod(self.out_shape) * itemsize

        def stacks(dim, groups):
            return dim is not None and (math.prod(self.in_shape[:dim]) > 1 or groups > 1)

        if self.op == "reduce_scatter":
            sent = nin if stacks(self.dim, self.groups) else 0
            return max(sent + nin - nout, nin) if cpu else sent
        if self.op == "all_gather":
            return nout if stacks(self.dim, self.groups) else 0
        if self.op == "all_to_all":
            return nin if stacks(self.dst_dim, self.dst_groups) or stacks(self.dim, self.groups) else 0
        return 0

    def collectives(self, itemsize: int, needs_grad: bool, reduce_itemsize: int | None = None) -> list[tuple[str, str, int]]:
        """(kind, phase, bytes per device) this step runs. Bytes follow REFERENCES.md: the gathered
        output for all-gather, the full input for reduce-scatter, the tensor for all-reduce and
        all-to-all. ``reduce_itemsize``: the bytes an element of the gradient's sums over ranks (a
        backward reduce-scatter or all-reduce) where they are not ``itemsize`` (passes.precision
        ``reduce_dtype_of``)."""
        nin, nout = math.prod(self.in_shape) * itemsize, math.prod(self.out_shape) * itemsize
        fwd = {"all_gather": [("all_gather", nout)], "reduce_scatter": [("reduce_scatter", nin)],
               "all_reduce": [("all_reduce", nin)], "all_to_all": [("all_to_all", nin)]}.get(self.op, [])
        bwd = []
        if needs_grad:
            wide = (reduce_itemsize or itemsize) / itemsize
            bwd = {"all_gather": [("reduce_scatter", int(nout * wide))] if self.grad == "reduce_scatter" else [],
                   "reduce_scatter": [("all_gather", nin)],
                   "all_to_all": [("all_to_all", nout)],
                   "local_chunk": [("all_gather", nin)],
                   "grad_all_reduce": [("all_reduce", int(nin * wide))]}.get(self.op, [])
        return [(k, "forward", b) for k, b in fwd] + [(k, "backward", b) for k, b in bwd]


def transition(src: Sequence[Placement], dst: Sequence[Placement], local_src_shape: Sequence[int],
               mesh_shape: Sequence[int], *, grad_partial: frozenset = frozenset()) -> list[Step] | None:
    """Steps from ``src`` to ``dst`` starting at the local shape, or None when no resharding can do
    it (only a Partial-producing op makes a Partial)."""
    cur = list(src)
    shape = list(local_src_shape)
    steps: list[Step] = []

    def emit(op, axis, dim=None, dst_dim=None, groups=1, dst_groups=1):
        nonlocal shape
        before = tuple(shape)
        n = mesh_shape[axis]
        if op in ("all_gather",):
            shape[dim] *= n
        elif op in ("reduce_scatter", "local_chunk"):
            shape[dim] //= n
        elif op == "all_to_all":
            shape[dim] *= n
            shape[dst_dim] //= n
        steps.append(Step(op, axis, dim, dst_dim, in_shape=before, out_shape=tuple(shape), groups=groups,
                          dst_groups=dst_groups))

    for a, (s, d) in enumerate(zip(src, dst)):
        if d.is_partial and not s.is_partial:
            return None
    # 1. Remove shards and reductions that the target does not keep; a shard that the target keeps on
    # its dim with other groups is gathered and cut again (step 3).
    for a, (s, d) in enumerate(zip(src, dst)):
        if s == d:
            continue
        if s.is_shard and (d.is_replicate or (d.is_shard and d.dim == s.dim)):
            emit("all_gather", a, s.dim, groups=s.groups)
            cur[a] = Placement("R")
        elif s.is_partial and d.is_replicate:
            emit("all_reduce", a)
            cur[a] = d
    # 2. Move shards between dims; gather first when the target dim is still cut by another axis.
    for a, (s, d) in enumerate(zip(src, dst)):
        if s.is_shard and d.is_shard and s.dim != d.dim:
            if any(p.is_shard and p.dim == d.dim for b, p in enumerate(cur) if b != a):
                emit("all_gather", a, s.dim, groups=s.groups)
                cur[a] = Placement("R")
            else:
                emit("all_to_all", a, s.dim, d.dim, s.groups, d.groups)
                cur[a] = d
    # 3. Add shards: a free local slice of a replicated value, or a reduce-scatter of a partial one.
    for a, d in enumerate(dst):
        if cur[a] == d:
            continue
        if cur[a].is_replicate and d.is_shard:
            emit("local_chunk", a, d.dim, groups=d.groups)
        elif cur[a].is_partial and d.is_shard:
            emit("reduce_scatter", a, d.dim, groups=d.groups)
        else:
            raise AssertionError(f"unhandled resharding {cur[a]} -> {d} on axis {a}")
        cur[a] = d
    # 4. Reduce partial gradients on the way back.
    for a in sorted(grad_partial):
        if not dst[a].is_replicate:
            continue
        gathers = [i for i, st in enumerate(steps) if st.op == "all_gather" and st.axis == a]
        if gathers:
            i = gathers[-1]
            steps[i] = replace(steps[i], grad="reduce_scatter")
        else:
            steps.append(Step("grad_all_reduce", a, in_shape=tuple(shape), out_shape=tuple(shape)))
    return [st if st.op != "all_gather" or st.grad != "none" else replace(st, grad="slice") for st in steps]


def grad_partial_axes(dst: Sequence[Placement], splits_work: Sequence[bool], needs_grad: bool) -> frozenset:
    """The mesh axes along which a consumer leaves the gradient of an input it reads as ``dst`` partial:
    those it reads the input replicated on while splitting its work (the convention above)."""
    if not needs_grad:
        return frozenset()
    return frozenset(a for a, p in enumerate(dst) if p.is_replicate and splits_work[a])


def global_transition(src: Sequence[Placement], dst: Sequence[Placement], shape: Sequence[int],
                      mesh_shape: Sequence[int], *, grad_partial: frozenset = frozenset()) -> list[Step] | None:
    """``transition`` for a tensor of global ``shape``; None also when ``src`` cannot hold it."""
    from autopar.layout import local_shape

    try:
        local = local_shape(shape, src, mesh_shape)
    except Exception:
        return None
    return transition(src, dst, local, mesh_shape, grad_partial=grad_partial)


def collective_seconds(kind: str, nbytes: float, n: int, bandwidth: float, latency: float) -> float:
    """Alpha-beta cost on a ring of ``n`` devices (REFERENCES.md); ``send_recv`` is one point-to-point
    transfer of ``nbytes`` to a neighbor (at the same time as one from the other neighbor)."""
    if n <= 1 or nbytes <= 0:
        return 0.0
    if kind == "send_recv":
        return latency + nbytes / bandwidth
    if kind == "all_reduce":
        return latency + 2.0 * (n - 1) / n * nbytes / bandwidth
    if kind == "all_to_all":
        return latency + (n - 1) / n * nbytes / bandwidth
    return latency + (n - 1) / n * nbytes / bandwidth
