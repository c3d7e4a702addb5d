"""Autograd-aware collectives: every resharding in a generated per-rank program is one call here.

Each function is a plain module-level ``call_function`` target that takes its process group by
c10d group *name* (``pg.group_name``), so generated code can print the call as a literal. The
forward runs the non-autograd ``_c10d_functional`` ops; each ``torch.autograd.Function`` below
defines the backward from the gradient convention:

- the gradient of a Replicate value is replicated (every rank holds the full, identical gradient);
- the gradient of a Shard(d) value is this rank's shard of the gradient;
- the gradient of a Partial value is replicated (each partial term gets the full gradient).

Shards are equal, contiguous blocks in rank order, so a sharded dim must divide by the group size.
A strided shard (``groups=k``, autopar.layout's ``S(d,k)``) cuts the dim into ``k`` equal groups first:
a rank's shard is its block of every group, the groups one after another.
The group is resolved on every call rather than cached: the lookup costs about a microsecond, and
c10d reuses group names after ``destroy_process_group``, so a cache keyed by name could go stale.
"""
from __future__ import annotations

import torch
import torch.distributed as dist
from torch.distributed.distributed_c10d import _resolve_process_group

from autopar.errors import ShardingError

__all__ = [
    "COLLECTIVE_KIND",
    "IndivisibleDimError",
    "SPLIT",
    "all_gather",
    "all_gather_start",
    "all_gather_wait",
    "all_reduce",
    "all_reduce_start",
    "all_reduce_wait",
    "all_to_all",
    "all_to_all_start",
    "all_to_all_wait",
    "column_linears",
    "grad_all_reduce",
    "local_chunk",
    "param_chunk",
    "param_gather_start",
    "param_gather_wait",
    "reduce_scatter",
    "reduce_scatter_start",
    "reduce_scatter_wait",
    "same_on_all_ranks",
]

_ops = torch.ops._c10d_functional


class IndivisibleDimError(ShardingError, ValueError):
    """A tensor dim to shard or scatter does not divide by the group size."""


def _group(name: str) -> tuple[int, int]:
    """(rank in the group, group size) of the group called ``name``."""
    group = _resolve_process_group(name)
    return dist.get_rank(group), dist.get_world_size(group)


def _dim(x: torch.Tensor, dim: int) -> int:
    if not -x.dim() <= dim < x.dim():
        raise IndexError(f"dim {dim} is out of range for a tensor of shape {tuple(x.shape)}")
    return dim % x.dim()


def _check_divisible(op: str, x: torch.Tensor, dim: int, size: int, name: str, groups: int = 1) -> None:
    if x.size(dim) % (size * groups):
        strided = f" in {groups} groups" if groups > 1 else ""
        raise IndivisibleDimError(
            f"{op}: dim {dim} of a tensor of shape {tuple(x.shape)} has size {x.size(dim)}, "
            f"which does not divide by the group size {size}{strided} (group {name!r}); "
            f"pad that dim or choose a layout that does not shard it"
        )


def _check_groups(op: str, groups: int) -> None:
    if not isinstance(groups, int) or groups < 1:
        raise ValueError(f"{op}: groups={groups!r}; a strided shard has a positive int number of groups")


def _blocks(x: torch.Tensor, dim: int, size: int, groups: int = 1) -> torch.Tensor:
    """``x`` split along ``dim`` into ``size`` blocks stacked on a new, contiguous dim 0:
    the layout in which the c10d ops send block r to rank r. With ``groups`` block r is the r-th
    block of each of the dim's ``groups`` groups, in group order (a strided shard)."""
    if groups == 1:
        return x.unflatten(dim, (size, -1)).movedim(dim, 0).contiguous()
    return x.unflatten(dim, (groups, size, -1)).movedim(dim + 1, 0).flatten(dim + 1, dim + 2).contiguous()


def _unblocks(y: torch.Tensor, dim: int, groups: int = 1) -> torch.Tensor:
    """Inverse of ``_blocks``: concatenate the blocks on dim 0 of ``y`` along ``dim``."""
    if groups == 1:
        return y.movedim(0, dim).flatten(dim, dim + 1)
    return y.unflatten(dim + 1, (groups, -1)).movedim(0, dim + 1).flatten(dim, dim + 2)


def _start_gather(x: torch.Tensor, size: int, name: str) -> torch.Tensor:
    """Issue an all-gather of ``x``; the result (every rank's ``x`` along dim 0) is valid once waited."""
    return _ops.all_gather_into_tensor(x.contiguous(), size, name)


def _start_reduce_scatter(x: torch.Tensor, dim: int, size: int, name: str, *, groups: int = 1) -> torch.Tensor:
    """Issue a sum reduce-scatter of ``x``'s blocks along ``dim``; ``_scattered`` of the waited result is
    this rank's block with a leading dim of 1.

    On CPU (gloo) the blocks go by an all-to-all and are summed on arrival: gloo's reduce-scatter
    all-reduces the whole tensor (measured on 2 ranks: as long as an all-reduce of it, twice what the
    all-to-all takes), while the all-to-all moves what a ring reduce-scatter moves."""
    blocks = _blocks(x, dim, size, groups)
    if x.is_cpu:
        return _ops.all_to_all_single(blocks, [1] * size, [1] * size, name)
    return _ops.reduce_scatter_tensor(blocks, "sum", size, name)


def _scattered(y: torch.Tensor) -> torch.Tensor:
    """A waited reduce-scatter's result (``_start_reduce_scatter``) as this rank's summed block, with a
    leading dim of 1: the blocks an all-to-all received from every rank are summed in rank order."""
    return y if y.size(0) == 1 else y.sum(0, keepdim=True)


def _start_all_reduce(x: torch.Tensor, name: str, *, op: str = "sum") -> torch.Tensor:
    return _ops.all_reduce(x.contiguous(), op, name)


def _start_all_reduce_(x: torch.Tensor, name: str) -> torch.Tensor:
    """Issue a sum all-reduce of the contiguous ``x`` into ``x`` itself (its handle is ``x``)."""
    return _ops.all_reduce_(x, "sum", name)


def _start_all_to_all(x: torch.Tensor, dst_dim: int, size: int, name: str, *, dst_groups: int = 1) -> torch.Tensor:
    """Issue an all-to-all sending block r of ``x`` along ``dst_dim`` to rank r; the result stacks the
    received blocks on a new dim 0."""
    splits = [1] * size
    return _ops.all_to_all_single(_blocks(x, dst_dim, size, dst_groups), splits, splits, name)


def _gather(x: torch.Tensor, dim: int, size: int, name: str, groups: int = 1) -> torch.Tensor:
    y = _ops.wait_tensor(_start_gather(x, size, name))
    return y if dim == 0 and groups == 1 else _unblocks(y.view(size, *x.shape), dim, groups)


def _reduce_scatter(x: torch.Tensor, dim: int, size: int, name: str, groups: int = 1) -> torch.Tensor:
    return _scattered(_ops.wait_tensor(_start_reduce_scatter(x, dim, size, name, groups=groups))).squeeze(0)


def _all_reduce(x: torch.Tensor, name: str, *, op: str = "sum") -> torch.Tensor:
    return _ops.wait_tensor(_start_all_reduce(x, name, op=op))


def _p2p(sends, recvs, name: str) -> list:
    """Start point-to-point transfers in the group called ``name``: ``sends`` and ``recvs`` are
    (rank in the group, tensor) pairs, a received tensor being filled in place. Returns the requests,
    to ``wait()`` before reading what was received."""
    group = _resolve_process_group(name)
    reqs = [dist.irecv(t, dist.get_global_rank(group, r), group=group) for r, t in recvs]
    return reqs + [dist.isend(t.contiguous(), dist.get_global_rank(group, r), group=group) for r, t in sends]


def _released(y: torch.Tensor) -> torch.Tensor:
    """A new tensor on the storage of ``y``, a collective's result that its c10d Work may still hold
    (an issued one's until its wait; a waited one's until the backend's thread drops the Work, some
    time after the wait; ``wait_tensor`` finds the Work by storage): autograd attaches the
    graph (in a recomputed layer, every tensor the recomputation made) to the tensor an
    autograd.Function returns. Through a tensor of its own (not a view: the program may write to it
    in place), the graph is not kept alive by the Work, which keeps only the buffer."""
    return y.new_empty(0).set_(y)


def _chunk(x: torch.Tensor, dim: int, rank: int, size: int, groups: int = 1) -> torch.Tensor:
    """This rank's block of ``x`` along ``dim``: a view, or with ``groups`` its blocks of every group
    (a copy)."""
    if groups == 1:
        n = x.size(dim) // size
        return x.narrow(dim, rank * n, n)
    return x.unflatten(dim, (groups, size, -1)).select(dim + 1, rank).flatten(dim, dim + 1)


def _all_to_all(x: torch.Tensor, src_dim: int, dst_dim: int, size: int, name: str, src_groups: int = 1,
                dst_groups: int = 1) -> torch.Tensor:
    # Block r of the result is rank r's src_dim shard of this rank's dst_dim block.
    return _unblocks(_ops.wait_tensor(_start_all_to_all(x, dst_dim, size, name, dst_groups=dst_groups)), src_dim, src_groups)


def _summed_in(dtype: torch.dtype | None, reduce, g: torch.Tensor) -> torch.Tensor:
    """``reduce(g)`` run in ``dtype`` where given (a lower-precision weight copy's gradient summed in
    its float32 master's dtype: passes.precision.reduce_dtype_of), given back in ``g``'s dtype, which
    autograd requires of the gradient of a ``g.dtype`` input."""
    if dtype is None or dtype == g.dtype:
        return reduce(g)
    return reduce(g.to(dtype)).to(g.dtype)


class _AllGather(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, dim, name, grad, groups, reduce_dtype):
        rank, size = _group(name)
        ctx.args = dim, name, grad, rank, size, groups, reduce_dtype
        return _released(_gather(x, dim, size, name, groups))

    @staticmethod
    def backward(ctx, g):
        dim, name, grad, rank, size, groups, reduce_dtype = ctx.args
        if grad == "slice":
            return _chunk(g, dim, rank, size, groups), None, None, None, None, None
        return (_summed_in(reduce_dtype, lambda t: _reduce_scatter(t, dim, size, name, groups), g),
                None, None, None, None, None)


class _ReduceScatter(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, dim, name, groups):
        _, size = _group(name)
        _check_divisible("reduce_scatter", x, dim, size, name, groups)
        ctx.args = dim, name, size, groups
        return _reduce_scatter(x, dim, size, name, groups)

    @staticmethod
    def backward(ctx, g):
        dim, name, size, groups = ctx.args
        return _gather(g, dim, size, name, groups), None, None, None


class _AllReduce(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, name):
        return _released(_all_reduce(x, name))

    @staticmethod
    def backward(ctx, g):
        return g, None


class _GradAllReduce(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, name, reduce_dtype):
        ctx.name, ctx.reduce_dtype = name, reduce_dtype
        return x

    @staticmethod
    def backward(ctx, g):
        return _summed_in(ctx.reduce_dtype, lambda t: _all_reduce(t, ctx.name), g), None, None


class _LocalChunk(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, dim, name, groups):
        rank, size = _group(name)
        _check_divisible("local_chunk", x, dim, size, name, groups)
        ctx.args = dim, name, size, groups
        return _chunk(x, dim, rank, size, groups)

    @staticmethod
    def backward(ctx, g):
        dim, name, size, groups = ctx.args
        return _gather(g, dim, size, name, groups), None, None, None


class _AllToAll(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, src_dim, dst_dim, name, src_groups, dst_groups):
        _, size = _group(name)
        _check_divisible("all_to_all", x, dst_dim, size, name, dst_groups)
        ctx.args = src_dim, dst_dim, name, size, src_groups, dst_groups
        return _released(_all_to_all(x, src_dim, dst_dim, size, name, src_groups, dst_groups))

    @staticmethod
    def backward(ctx, g):
        src_dim, dst_dim, name, size, src_groups, dst_groups = ctx.args
        return _all_to_all(g, dst_dim, src_dim, size, name, dst_groups, src_groups), None, None, None, None, None


def all_gather(x: torch.Tensor, dim: int, group_name: str, grad: str = "reduce_scatter", groups: int = 1,
               reduce_dtype: torch.dtype | None = None) -> torch.Tensor:
    """S(dim) -> R: concatenate every rank's ``x`` along ``dim`` in rank order (S(dim,groups) -> R:
    interleave the ranks' blocks of each group).

    ``grad`` says what the incoming gradient is. ``"reduce_scatter"``: partial over the group (its
    sum over ranks is the true gradient), so the backward reduce-scatters it (the Megatron
    sequence-parallel and FSDP pairing), in ``reduce_dtype`` where given. ``"slice"``: already
    replicated, so the backward takes this rank's chunk, with no communication.
    """
    if grad not in ("reduce_scatter", "slice"):
        raise ValueError(f"all_gather: grad={grad!r}; use 'reduce_scatter' or 'slice'")
    _check_groups("all_gather", groups)
    return _AllGather.apply(x, _dim(x, dim), group_name, grad, groups, reduce_dtype)


def reduce_scatter(x: torch.Tensor, dim: int, group_name: str, groups: int = 1) -> torch.Tensor:
    """P -> S(dim) (or S(dim,groups)): sum over the group, keep this rank's chunk along ``dim``.
    Backward: all-gather."""
    _check_groups("reduce_scatter", groups)
    return _ReduceScatter.apply(x, _dim(x, dim), group_name, groups)


def all_reduce(x: torch.Tensor, group_name: str) -> torch.Tensor:
    """P -> R: sum over the group. Backward: identity (the replicated gradient is every term's)."""
    return _AllReduce.apply(x, group_name)


def grad_all_reduce(x: torch.Tensor, group_name: str, reduce_dtype: torch.dtype | None = None) -> torch.Tensor:
    """Identity forward; the backward sums the gradient over the group, in ``reduce_dtype`` where given
    (a bfloat16 weight copy's gradient summed in float32).

    Megatron's "f" operator before a column-parallel layer, and DDP's gradient sync.
    """
    return _GradAllReduce.apply(x, group_name, reduce_dtype)


class _ColumnLinears(torch.autograd.Function):
    """``grad_all_reduce`` of ``x`` read by linear layers only (Megatron's "f" before column-parallel
    layers), as one node whose backward issues the all-reduce of ``x``'s gradient before it computes the
    weights' gradients and waits after, as Megatron-LM's asynchronous tensor-parallel all-reduce does.
    Both parts run autograd's own backward of the linears (a graph built in forward over detached
    inputs), so the numbers are those of ``grad_all_reduce`` followed by the linears."""

    @staticmethod
    def forward(ctx, x, name, *weights):
        with torch.enable_grad():
            ctx.x = x.detach().requires_grad_()
            ctx.leaves = [None if t is None else t.detach().requires_grad_(t.requires_grad) for t in weights]
            outs = [torch.ops.aten.linear.default(ctx.x, w, b) for w, b in zip(ctx.leaves[::2], ctx.leaves[1::2])]
        # The outputs' edges, not the outputs: the graph keeps what the linears' backward saves, no more.
        ctx.edges = [torch.autograd.graph.get_gradient_edge(o) for o in outs]
        ctx.name = name
        return tuple(o.detach() for o in outs)

    @staticmethod
    def backward(ctx, *grads):
        edges, leaves = ctx.edges, ctx.leaves
        (dx,) = torch.autograd.grad(edges, ctx.x, grads, retain_graph=True)
        issued = _start_all_reduce(dx, ctx.name)
        wanted = [t for t in leaves if t is not None and t.requires_grad]
        got = iter(torch.autograd.grad(edges, wanted, grads) if wanted else ())
        dws = [next(got) if t is not None and t.requires_grad else None for t in leaves]
        del ctx.edges, ctx.leaves, ctx.x
        return (_ops.wait_tensor(issued), None, *dws)


def column_linears(x: torch.Tensor, group_name: str, *weights: torch.Tensor | None) -> tuple[torch.Tensor, ...]:
    """``linear(grad_all_reduce(x, group_name), w, b)`` for each ``w, b`` of ``weights`` (a bias may be
    None), with the all-reduce of ``x``'s gradient in flight while the weights' gradients are computed
    (codegen/overlap.py)."""
    if not torch.is_grad_enabled():
        return tuple(torch.ops.aten.linear.default(x, w, b) for w, b in zip(weights[::2], weights[1::2]))
    return _ColumnLinears.apply(x, group_name, *weights)


def local_chunk(x: torch.Tensor, dim: int, group_name: str, groups: int = 1) -> torch.Tensor:
    """R -> S(dim) with no communication: a view of this rank's chunk along ``dim`` (R -> S(dim,groups):
    a copy of its block of every group).

    Backward: all-gather, since the incoming gradient is one shard of a replicated gradient.
    """
    _check_groups("local_chunk", groups)
    return _LocalChunk.apply(x, _dim(x, dim), group_name, groups)


def param_chunk(x: torch.Tensor, dim: int, group_name: str, groups: int = 1) -> torch.Tensor:
    """``local_chunk`` of a parameter (codegen/overlap.py): backward all-gathers its gradient's chunks
    after the rest of backward has run past it, as ``defer_gather`` does, where autograd accumulates
    the parameter's gradient; otherwise at once."""
    _check_groups("local_chunk", groups)
    return _ParamChunk.apply(x, _dim(x, dim), group_name, groups)


def all_to_all(x: torch.Tensor, src_dim: int, dst_dim: int, group_name: str, src_groups: int = 1,
               dst_groups: int = 1) -> torch.Tensor:
    """S(src_dim) -> S(dst_dim): gather ``src_dim``, split ``dst_dim``. Backward: the inverse.
    ``src_groups``/``dst_groups`` make either side a strided shard.

    Uses c10d's native all-to-all on every backend; gloo has one (checked on torch 2.13).
    """
    src_dim, dst_dim = _dim(x, src_dim), _dim(x, dst_dim)
    if src_dim == dst_dim:
        raise ValueError(f"all_to_all: src_dim and dst_dim are both {src_dim}; S(d) -> S(d) needs no collective")
    _check_groups("all_to_all", src_groups)
    _check_groups("all_to_all", dst_groups)
    return _AllToAll.apply(x, src_dim, dst_dim, group_name, src_groups, dst_groups)


# Split collectives, for overlap (codegen/overlap.py): ``*_start`` issues the collective and returns
# its raw result, not yet valid; ``*_wait`` waits for it and gives the same value as the one-call form.
# The program runs independent compute between the two. Backwards communicate at once, as above.

class _Wait(torch.autograd.Function):
    @staticmethod
    def forward(ctx, y):
        return _ops.wait_tensor(y)

    @staticmethod
    def backward(ctx, g):
        return g


class _ReduceScatterWait(torch.autograd.Function):
    @staticmethod
    def forward(ctx, y):
        ctx.rows = y.size(0)
        return _scattered(_ops.wait_tensor(y))

    @staticmethod
    def backward(ctx, g):
        return g.expand(ctx.rows, *g.shape[1:])


class _DeferredGradients:
    """Collectives of parameter gradients issued in backward and waited later, as FSDP2 does its
    reduce-scatters: one is waited when the next is issued (so that at most one extra gradient is held,
    the one in flight), the last when backward ends (an autograd engine callback). Waiting adds the
    result to the parameter's ``.grad``. Every rank issues them in backward's order, which is the same
    on all. One left by a backward that raised (its end callback never ran) is waited for and dropped."""

    def __init__(self):
        self.in_flight: tuple | None = None      # (parameter, the issued collective's raw result, what
                                                 # makes the gradient of it, the backward that issued it)

    def issue(self, param: torch.Tensor, issued: torch.Tensor, finish) -> None:
        task = torch._C._current_graph_task_id()
        if self.in_flight is not None and self.in_flight[3] != task:
            _ops.wait_tensor(self.in_flight[1])
            self.in_flight = None
        if self.in_flight is None:
            torch.autograd.Variable._execution_engine.queue_callback(self.wait)
        else:
            self.wait()
        self.in_flight = param, issued, finish, task

    def wait(self) -> None:
        if self.in_flight is None:
            return
        param, issued, finish, _ = self.in_flight
        self.in_flight = None
        grad = finish(_ops.wait_tensor(issued))
        param.grad = grad if param.grad is None else param.grad.add_(grad)


_deferred = _DeferredGradients()


def defer_reduce_scatter(param: torch.Tensor, grad: torch.Tensor, dim: int, group_name: str) -> None:
    """Issue the sum reduce-scatter of ``grad`` along ``dim`` and add this rank's block, in ``param``'s
    dtype (a sharded float32 master's gradient is reduced in its bfloat16 copy's dtype, or in float32
    where the caller widened it), to ``param.grad`` when it is waited: at the next such issue or when
    backward ends. Called in backward."""
    _deferred.issue(param, _start_reduce_scatter(grad, dim, _group(group_name)[1], group_name),
                    lambda y: _scattered(y).squeeze(0).to(param.dtype))


def defer_gather(param: torch.Tensor, grad: torch.Tensor, dim: int, group_name: str, groups: int = 1) -> None:
    """Issue the all-gather of ``grad``, this rank's chunk of ``param``'s gradient along ``dim``, and
    add the whole gradient to ``param.grad`` when it is waited, as ``defer_reduce_scatter``."""
    size = _group(group_name)[1]
    _deferred.issue(param, _start_gather(grad, size, group_name),
                    lambda y: y if dim == 0 and groups == 1 else _unblocks(y.view(size, *grad.shape), dim, groups))


def _plain_leaf(x: torch.Tensor) -> bool:
    """A parameter whose gradient autograd would only accumulate: no hooks read it on the way (the
    runtime's ZeRO-1/2, offload and bucketed reductions register post-accumulate hooks)."""
    return x.is_leaf and x.requires_grad and not x._backward_hooks and not x._post_accumulate_grad_hooks


def _runs_accumulation(param: torch.Tensor) -> bool | None:
    """Whether the running backward runs ``param``'s gradient accumulation; None where it returns the
    gradient instead (``torch.autograd.grad`` names ``param``)."""
    try:
        return torch._C._will_engine_execute_node(torch.autograd.graph.get_gradient_edge(param).node)
    except RuntimeError:        # torch's refusal for a leaf whose gradient autograd.grad returns
        return None


def accumulates(param: torch.Tensor) -> bool:
    """Whether the running backward adds ``param``'s gradient to its ``.grad`` (``backward()``, or
    ``backward(inputs=...)`` naming it) rather than returning it (``torch.autograd.grad``, which leaves
    ``.grad`` and the post-accumulate hooks alone): a reduction the runtime defers to ``.grad`` or to
    such a hook must then run at once, in the gradient autograd returns."""
    return _runs_accumulation(param) is True


def asked(param: torch.Tensor) -> bool:
    """Whether the running backward accumulates ``param``'s gradient or returns it."""
    return _runs_accumulation(param) is not False


def deferrable(param: torch.Tensor) -> bool:
    """Whether ``param``'s reduce-scatter may go to ``defer_reduce_scatter`` from the running backward."""
    return _plain_leaf(param) and accumulates(param)


class _ParamChunk(_LocalChunk):
    @staticmethod
    def forward(ctx, x, dim, name, groups):
        ctx.param = x
        return _LocalChunk.forward(ctx, x, dim, name, groups)

    @staticmethod
    def backward(ctx, g):
        if not deferrable(ctx.param):
            return _LocalChunk.backward(ctx, g)
        dim, name, _, groups = ctx.args
        defer_gather(ctx.param, g, dim, name, groups)
        return None, None, None, None


class _AllGatherStart(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, name, grad, reduce_dtype):
        rank, size = _group(name)
        ctx.args = name, grad, rank, size, reduce_dtype
        # A sharded parameter (ZeRO-3): its gradient's reduce-scatter may be waited after the rest of
        # backward has run past it.
        ctx.param = x if grad == "reduce_scatter" and x.is_leaf else None
        return _released(_start_gather(x, size, name))

    @staticmethod
    def backward(ctx, g):
        # ``g`` is in the raw layout: every rank's block stacked along dim 0 (the wait interleaves a
        # strided shard's groups, and its backward undoes that).
        name, grad, rank, size, reduce_dtype = ctx.args
        if grad == "slice":
            return _chunk(g, 0, rank, size), None, None, None
        if ctx.param is not None and deferrable(ctx.param):
            defer_reduce_scatter(ctx.param, g, 0, name)
            return None, None, None, None
        return _summed_in(reduce_dtype, lambda t: _reduce_scatter(t, 0, size, name), g), None, None, None


class _ReduceScatterStart(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, dim, name, groups):
        _, size = _group(name)
        _check_divisible("reduce_scatter", x, dim, size, name, groups)
        ctx.args = dim, name, size, groups
        return _released(_start_reduce_scatter(x, dim, size, name, groups=groups))

    @staticmethod
    def backward(ctx, g):
        dim, name, size, groups = ctx.args
        return _gather(g[0], dim, size, name, groups), None, None, None


class _AllReduceStart(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, name):
        return _released(_start_all_reduce(x, name))

    @staticmethod
    def backward(ctx, g):
        return g, None


class _AllToAllStart(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, src_dim, dst_dim, name, src_groups, dst_groups):
        _, size = _group(name)
        _check_divisible("all_to_all", x, dst_dim, size, name, dst_groups)
        ctx.args = src_dim, dst_dim, name, size, src_groups, dst_groups
        return _released(_start_all_to_all(x, dst_dim, size, name, dst_groups=dst_groups))

    @staticmethod
    def backward(ctx, g):
        src_dim, dst_dim, name, size, src_groups, dst_groups = ctx.args
        return (_all_to_all(_unblocks(g, src_dim, src_groups), dst_dim, src_dim, size, name, dst_groups, src_groups),
                None, None, None, None, None)


def all_gather_start(x: torch.Tensor, dim: int, group_name: str, grad: str = "reduce_scatter",
                     groups: int = 1, reduce_dtype: torch.dtype | None = None) -> torch.Tensor:
    """Issue ``all_gather(x, dim, group_name, grad, groups, reduce_dtype)``; ``all_gather_wait`` gives its
    result."""
    if grad not in ("reduce_scatter", "slice"):
        raise ValueError(f"all_gather: grad={grad!r}; use 'reduce_scatter' or 'slice'")
    _check_groups("all_gather", groups)
    _dim(x, dim)
    return _AllGatherStart.apply(x, group_name, grad, reduce_dtype)


def all_gather_wait(y: torch.Tensor, dim: int, group_name: str, groups: int = 1) -> torch.Tensor:
    """Wait for ``all_gather_start``'s ``y`` and concatenate the ranks' blocks along ``dim``."""
    return _blocks_joined(_Wait.apply(y), dim, group_name, groups)


def _blocks_joined(y: torch.Tensor, dim: int, group_name: str, groups: int) -> torch.Tensor:
    """A waited all-gather's result (every rank's block along dim 0) as the blocks joined along ``dim``."""
    if dim == 0 and groups == 1:
        return y
    _, size = _group(group_name)
    blocks = y.unflatten(0, (size, -1))
    return _unblocks(blocks, dim % (blocks.dim() - 1), groups)


class _ParamGatherWait(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, y, name):
        ctx.args = name, _group(name)[1]
        return _ops.wait_tensor(y)

    @staticmethod
    def backward(ctx, g):
        # Issued in backward's order with the deferred ones: the one in flight is waited first.
        _deferred.wait()
        name, size = ctx.args
        return _reduce_scatter(g, 0, size, name), None, None


def param_gather_start(x: torch.Tensor, dim: int, group_name: str, groups: int = 1) -> torch.Tensor:
    """Issue the all-gather of ``x``, a sharded parameter (ZeRO-3) that a recomputed or offloaded layer's
    body reads (codegen/overlap.py), making no autograd node: ``param_gather_wait`` makes it, so that its
    backward, the gradient's reduce-scatter, runs right after the reader's. Autograd runs ready nodes
    latest-made first, and the body issues its first gather when it starts: a node made there would run
    only after the backward of the whole body before the reader, the whole gradient held until then.
    The reduce-scatter is waited at once, where the step memory model frees the whole gradient, after
    the deferred one in flight (``_DeferredGradients``), as a deferred one would be."""
    _check_groups("all_gather", groups)
    _dim(x, dim)
    return _released(_start_gather(x.detach(), _group(group_name)[1], group_name))


def param_gather_wait(y: torch.Tensor, x: torch.Tensor, dim: int, group_name: str, groups: int = 1) -> torch.Tensor:
    """Wait for ``param_gather_start``'s ``y`` (the gather of ``x``), as ``all_gather_wait``."""
    return _blocks_joined(_ParamGatherWait.apply(x, y, group_name), dim, group_name, groups)


def reduce_scatter_start(x: torch.Tensor, dim: int, group_name: str, groups: int = 1) -> torch.Tensor:
    """Issue ``reduce_scatter(x, dim, group_name, groups)``; ``reduce_scatter_wait`` gives its result."""
    _check_groups("reduce_scatter", groups)
    return _ReduceScatterStart.apply(x, _dim(x, dim), group_name, groups)


def reduce_scatter_wait(y: torch.Tensor, group_name: str) -> torch.Tensor:
    return _ReduceScatterWait.apply(y).squeeze(0)


def all_reduce_start(x: torch.Tensor, group_name: str) -> torch.Tensor:
    """Issue ``all_reduce(x, group_name)``; ``all_reduce_wait`` gives its result."""
    return _AllReduceStart.apply(x, group_name)


def all_reduce_wait(y: torch.Tensor, group_name: str) -> torch.Tensor:
    return _Wait.apply(y)


def all_to_all_start(x: torch.Tensor, src_dim: int, dst_dim: int, group_name: str, src_groups: int = 1,
                     dst_groups: int = 1) -> torch.Tensor:
    """Issue ``all_to_all(x, src_dim, dst_dim, group_name, src_groups, dst_groups)``; ``all_to_all_wait``
    gives its result."""
    src_dim, dst_dim = _dim(x, src_dim), _dim(x, dst_dim)
    if src_dim == dst_dim:
        raise ValueError(f"all_to_all: src_dim and dst_dim are both {src_dim}; S(d) -> S(d) needs no collective")
    _check_groups("all_to_all", src_groups)
    _check_groups("all_to_all", dst_groups)
    return _AllToAllStart.apply(x, src_dim, dst_dim, group_name, src_groups, dst_groups)


def all_to_all_wait(y: torch.Tensor, src_dim: int, group_name: str, src_groups: int = 1) -> torch.Tensor:
    return _unblocks(_Wait.apply(y), src_dim % (y.dim() - 1), src_groups)


def _strided(groups: int) -> tuple:
    """A strided shard's groups as a trailing argument; none for a plain shard (the printed call stays short)."""
    return (groups,) if groups > 1 else ()


# The one-call form of each split collective: (start, wait, arguments of the wait taken from the call).
SPLIT = {
    all_gather: (all_gather_start, all_gather_wait,
                 lambda x, dim, group_name, grad="reduce_scatter", groups=1, reduce_dtype=None:
                 (dim, group_name, *_strided(groups))),
    reduce_scatter: (reduce_scatter_start, reduce_scatter_wait, lambda x, dim, group_name, groups=1: (group_name,)),
    all_reduce: (all_reduce_start, all_reduce_wait, lambda x, group_name: (group_name,)),
    all_to_all: (all_to_all_start, all_to_all_wait,
                 lambda x, src_dim, dst_dim, group_name, src_groups=1, dst_groups=1:
                 (src_dim, group_name, *_strided(src_groups))),
}


_INT_OF_WIDTH = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}


def _checksum(t: torch.Tensor) -> torch.Tensor:
    """Sum and position-weighted sum of the bit patterns, in wrapping int64 arithmetic.

    Integer sums do not depend on summation order, so equal tensors give equal checksums on any
    rank, and any single changed element (even by one ulp) changes the plain sum.
    """
    flat = t.detach().reshape(-1)
    if flat.is_complex():
        flat = torch.view_as_real(flat).reshape(-1)
    bits = flat.view(_INT_OF_WIDTH[flat.element_size()]).to(torch.int64)
    pos = torch.arange(1, bits.numel() + 1, dtype=torch.int64, device=bits.device)
    return torch.stack([bits.sum(), (bits * pos).sum(), torch.tensor(bits.numel(), device=bits.device)])


def same_on_all_ranks(tensors, group_name: str, device: torch.device | None = None) -> bool:
    """True when every tensor in ``tensors`` is bitwise equal on every rank of the group.

    A cheap check for replicated weights: one all-reduce of three int64s per tensor. Every rank
    must pass the same number of tensors. The checksums are taken where the tensors are and
    reduced on ``device`` (the one the group's backend communicates on; default: the tensors').
    """
    tensors = list(tensors)
    if not tensors:
        return True
    sums = torch.cat([_checksum(t) for t in tensors]).to(device or tensors[0].device)
    # max(~v) == ~min(v): one MAX all-reduce yields both the maximum and the minimum of each entry.
    both = _ops.wait_tensor(_ops.all_reduce(torch.cat([sums, ~sums]), "max", group_name))
    n = sums.numel()
    return torch.equal(both[:n], ~both[n:])


COLLECTIVE_KIND = {
    all_gather: "all_gather",
    reduce_scatter: "reduce_scatter",
    all_reduce: "all_reduce",
    grad_all_reduce: "all_reduce",  # in the backward
    local_chunk: None,  # no communication in the forward
    param_chunk: None,
    all_to_all: "all_to_all",
    all_gather_start: "all_gather",
    param_gather_start: "all_gather",
    reduce_scatter_start: "reduce_scatter",
    all_reduce_start: "all_reduce",
    all_to_all_start: "all_to_all",
}
