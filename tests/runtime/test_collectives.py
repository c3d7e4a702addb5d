"""The runtime collectives on real gloo groups, against single-process references.

Every rank builds the full (logical) tensors from fixed seeds, so it can compute what its own
output and input gradient must be under the gradient convention of ``autopar.runtime.collectives``.
"""
import faulthandler
import itertools
import time
import zlib

import pytest
import torch
import torch.distributed as dist
import torch.fx
from torch.distributed.device_mesh import init_device_mesh
from torch.testing import assert_close

from autopar.errors import ShardingError
from autopar.runtime.collectives import (
    COLLECTIVE_KIND,
    SPLIT,
    all_gather,
    all_reduce,
    all_to_all,
    grad_all_reduce,
    local_chunk,
    param_chunk,
    reduce_scatter,
    all_gather_start,
    all_reduce_start,
    all_to_all_start,
    all_gather_wait,
    defer_reduce_scatter,
    param_gather_start,
    param_gather_wait,
    reduce_scatter_start,
    same_on_all_ranks,
)
from tests.distributed_utils import run_distributed

SHAPE = (4, 8, 12)  # every dim divides by 2 and by 4
STRIDED = ((1, 2), (2, 3))  # (dim, groups) of strided shards: every group divides by 2 and by 4


def _rand(shape, *seed):
    # crc32, not hash(): string hashes differ between processes.
    g = torch.Generator().manual_seed(zlib.crc32(repr(seed).encode()))
    return torch.randn(shape, generator=g)


def _check(fn, x, weight, out, grad):
    """``fn(x)`` equals ``out`` and the gradient of sum(fn(x) * weight) equals ``grad``."""
    assert_close(fn(x), out)  # without autograd
    x = x.clone().requires_grad_()
    y = fn(x)
    (y * weight).sum().backward()
    assert_close(y, out)
    assert_close(x.grad, grad)


ONE_CALL = (all_gather, reduce_scatter, all_reduce, all_to_all)


def _split(one):
    """The issue-then-wait form of the one-call collective ``one``, with compute in between."""
    start, wait, wait_args = SPLIT[one]

    def run(x, *args, **kwargs):
        issued = start(x, *args, **kwargs)
        torch.randn(64, 64) @ torch.randn(64, 64)
        return wait(issued, *wait_args(x, *args, **kwargs))
    return run


def _check_all(name, salt):
    """Check every collective on group ``name``; ``salt`` tells apart groups of one mesh axis."""
    group = dist.distributed_c10d._resolve_process_group(name)
    r, n = dist.get_rank(group), dist.get_world_size(group)

    def chunk(t, d):
        return t.chunk(n, d)[r]

    def strided(t, d, groups):
        """This rank's block of every one of ``groups`` groups of dim ``d``: S(d,groups)."""
        return torch.cat([chunk(g, d) for g in t.chunk(groups, d)], d)

    full = _rand(SHAPE, salt, "full")  # a replicated value, or the full value of a sharded one
    partial = [_rand(SHAPE, salt, "partial", q) for q in range(n)]  # rank q's term of a Partial
    weight = _rand(SHAPE, salt, "weight")  # loss weight with a replicated gradient
    weights = [_rand(SHAPE, salt, "weight", q) for q in range(n)]  # rank q's term of a partial one

    for gather, scatter, reduce, a2a in (ONE_CALL, tuple(_split(f) for f in ONE_CALL)):
        for d in range(3):
            # S(d) -> R, the output's gradient replicated: each rank slices it.
            _check(lambda x: gather(x, d, name, grad="slice"), chunk(full, d), weight, full, chunk(weight, d))
            # S(d) -> R, the output's gradient partial: its sum over ranks is the true gradient.
            _check(lambda x: gather(x, d, name), chunk(full, d), weights[r], full, chunk(sum(weights), d))
            # P -> S(d): the input gradient is replicated.
            _check(lambda x: scatter(x, d, name), partial[r], chunk(weight, d), chunk(sum(partial), d), weight)
        for d, k in STRIDED:
            _check(lambda x: gather(x, d, name, grad="slice", groups=k), strided(full, d, k), weight, full,
                   strided(weight, d, k))
            _check(lambda x: gather(x, d, name, groups=k), strided(full, d, k), weights[r], full,
                   strided(sum(weights), d, k))
            _check(lambda x: scatter(x, d, name, groups=k), partial[r], strided(weight, d, k),
                   strided(sum(partial), d, k), weight)
        _check(lambda x: reduce(x, name), partial[r], weight, sum(partial), weight)
        # gloo has a native all-to-all (torch 2.13), so this runs the same path as nccl.
        for s, d in itertools.permutations(range(3), 2):
            _check(lambda x: a2a(x, s, d, name), chunk(full, s), chunk(weight, d), chunk(full, d),
                   chunk(weight, s))
        # Strided on either side: S(1,2) -> S(2,3), S(2,3) -> S(0), S(0) -> S(1,2).
        for (s, ks), (d, kd) in (((1, 2), (2, 3)), ((2, 3), (0, 1)), ((0, 1), (1, 2))):
            _check(lambda x: a2a(x, s, d, name, src_groups=ks, dst_groups=kd), strided(full, s, ks),
                   strided(weight, d, kd), strided(full, d, kd), strided(weight, s, ks))
    for d in range(3):
        # R -> S(d) without communication; the backward assembles the replicated gradient.
        _check(lambda x: local_chunk(x, d, name), full, chunk(weight, d), chunk(full, d), weight)
    for d, k in STRIDED:
        _check(lambda x: local_chunk(x, d, name, groups=k), full, strided(weight, d, k), strided(full, d, k), weight)
    _check(lambda x: grad_all_reduce(x, name), full, weights[r], full, sum(weights))
    # Negative dims name the same dims.
    assert_close(all_to_all(chunk(full, 0), -3, -1, name), chunk(full, 2))
    assert_close(_split(all_to_all)(chunk(full, 0), -3, -1, name), chunk(full, 2))
    assert_close(_split(all_gather)(chunk(full, 2), -1, name), full)


def _check_tensor_parallel_mlp(rank, world_size):
    """A tensor-parallel MLP, plain and sequence-parallel, matches the single-process MLP."""
    name = dist.group.WORLD.group_name
    x, w1, w2, target = (_rand(s, k) for k, s in enumerate([(2, 8, 6), (16, 6), (6, 16), (2, 8, 6)]))
    ref = [t.clone().requires_grad_() for t in (x, w1, w2)]
    (((ref[0] @ ref[1].T).relu() @ ref[2].T) * target).sum().backward()
    gx, gw1, gw2 = (t.grad for t in ref)

    def chunk(t, d):
        return t.chunk(world_size, d)[rank]

    for sequence_parallel in (False, True):
        # Column-parallel w1 (rows sharded), row-parallel w2 (columns sharded).
        lx = (chunk(x, 1) if sequence_parallel else x).clone().requires_grad_()
        lw1 = chunk(w1, 0).clone().requires_grad_()
        lw2 = chunk(w2, 1).clone().requires_grad_()
        h = all_gather(lx, 1, name) if sequence_parallel else grad_all_reduce(lx, name)
        y = (h @ lw1.T).relu() @ lw2.T  # Partial over the group
        if sequence_parallel:
            (reduce_scatter(y, 1, name) * chunk(target, 1)).sum().backward()
        else:
            (all_reduce(y, name) * target).sum().backward()
        assert_close(lx.grad, chunk(gx, 1) if sequence_parallel else gx)
        assert_close(lw1.grad, chunk(gw1, 0))
        assert_close(lw2.grad, chunk(gw2, 1))


def _reference_body(rank, world_size):
    _check_all(dist.group.WORLD.group_name, salt=0)
    if world_size == 4:
        mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
        _check_all(mesh.get_group("tp").group_name, salt=mesh.get_local_rank("dp"))
        _check_all(mesh.get_group("dp").group_name, salt=10 + mesh.get_local_rank("tp"))
    _check_tensor_parallel_mlp(rank, world_size)


# One process group per world size: spawning ranks costs more than all the checks they run.
@pytest.mark.parametrize("world_size", [2, 4])
def test_collectives_match_single_process_reference(world_size):
    """Every collective over the world group and, on 4 ranks, over each axis of a 2x2 mesh."""
    run_distributed(_reference_body, world_size)


def _deferred_after_a_failed_backward(name, world_size):
    """A gradient reduce-scatter left in flight by a backward that raised is dropped, not added to the
    next backward's gradient."""
    param = torch.zeros(2, requires_grad=True)

    class Reduced(torch.autograd.Function):
        @staticmethod
        def forward(ctx, x, fail):
            ctx.fail = fail
            return x.repeat(world_size)

        @staticmethod
        def backward(ctx, g):
            defer_reduce_scatter(param, g, 0, name)
            if ctx.fail:
                raise RuntimeError("backward fails after issuing")
            return None, None

    with pytest.raises(RuntimeError, match="fails after issuing"):
        (Reduced.apply(param, True) * 5.0).sum().backward()
    assert param.grad is None
    (Reduced.apply(param, False) * 1.0).sum().backward()
    assert_close(param.grad, torch.full((2,), float(world_size)))


def _misc_body(rank, world_size):
    name = dist.group.WORLD.group_name
    _deferred_after_a_failed_backward(name, world_size)

    # Divisibility: every rank raises before communicating, so nothing hangs.
    odd = torch.zeros(3, 4)
    for call in (lambda: reduce_scatter(odd, 0, name), lambda: local_chunk(odd, 0, name),
                 lambda: all_to_all(odd, 1, 0, name)):
        with pytest.raises(ValueError, match=r"dim 0 .* size 3, .* group size 2") as err:
            call()
        assert isinstance(err.value, ShardingError)
    with pytest.raises(ValueError, match="grad="):
        all_gather(odd, 0, name, grad="sum")
    with pytest.raises(ValueError, match="src_dim and dst_dim"):
        all_to_all(odd, 1, 1, name)
    with pytest.raises(IndexError, match="out of range"):
        all_gather(odd, 2, name)

    same = [_rand((5, 3), "w"), torch.arange(7), torch.ones(4, dtype=torch.bfloat16), torch.tensor([True, False]),
            _rand((3, 4), "t").T]
    assert same_on_all_ranks(same, name)
    assert same_on_all_ranks([], name)
    differs = [t.clone() for t in same]
    if rank == 1:  # one element, one ulp apart
        differs[0][2, 1] = torch.nextafter(differs[0][2, 1], torch.tensor(float("inf")))
    assert not same_on_all_ranks(differs, name)
    swapped = [t.clone() for t in same]
    if rank == 1:  # same values, two positions swapped
        swapped[1][[0, 1]] = swapped[1][[1, 0]]
    assert not same_on_all_ranks(swapped, name)

    # A resharding step makes a storage of its own exactly where the step memory model says it does.
    from autopar.codegen.local_program import step_call
    from autopar.layout import P, R, S
    from autopar.passes.resharding import transition

    made = set()
    for src, dst, partial in [(S(0), R, ()), (S(1), R, ()), (P, R, ()), (P, S(0), ()), (R, S(1), ()),
                              (R, S(1, 2), ()), (S(0), S(1), ()), (R, R, (0,))]:
        for st in transition((src,), (dst,), (4, 8, 12), (world_size,), grad_partial=frozenset(partial)):
            x = _rand((4, 8, 12), "storage", rank)
            fn, args, kwargs = step_call(st, x, name)
            shares = fn(*args, **kwargs).untyped_storage().data_ptr() == x.untyped_storage().data_ptr()
            assert shares != st.makes_storage, (st, shares)
            made.add((st.op, st.groups, st.makes_storage))
    assert made >= {("local_chunk", 1, False), ("local_chunk", 2, True), ("grad_all_reduce", 1, False),
                    ("all_reduce", 1, True), ("all_gather", 1, True), ("all_to_all", 1, True)}, made

    # Generated code calls the collectives as fx call_function targets with the group name inline.
    graph = torch.fx.Graph()
    graph.output(graph.call_function(all_gather, (graph.placeholder("x"), 0, name)))
    gm = torch.fx.GraphModule(torch.nn.Module(), graph)
    assert f"all_gather(x, 0, {name!r})" in gm.code
    x = torch.full((2, 3), float(rank), requires_grad=True)
    out = gm(x)
    assert_close(out, torch.arange(world_size).repeat_interleave(2)[:, None].expand(-1, 3).float())
    out.sum().backward()  # each rank's gradient is all ones: the sum over ranks is world_size
    assert_close(x.grad, torch.full((2, 3), float(world_size)))


def test_errors_checksums_and_fx_codegen():
    run_distributed(_misc_body, 2)


def test_collective_kinds():
    assert COLLECTIVE_KIND == {
        all_gather: "all_gather", reduce_scatter: "reduce_scatter", all_reduce: "all_reduce",
        grad_all_reduce: "all_reduce", local_chunk: None, param_chunk: None, all_to_all: "all_to_all",
        all_gather_start: "all_gather", reduce_scatter_start: "reduce_scatter", all_reduce_start: "all_reduce",
        all_to_all_start: "all_to_all", param_gather_start: "all_gather",
    }


def _summed_in_float32_body(rank, world):
    """A bfloat16 gradient summed with ``reduce_dtype=torch.float32`` is the float32 sum of the ranks'
    terms rounded once to bfloat16, whatever order the backend adds them in; summed in bfloat16 (gloo's
    all-reduce), a term of 1 added before the small ones rounds them away. Element e has its 1 on rank e % world, the
    2^-9 terms elsewhere: 1 + 3 * 2^-9 rounds to 1 + 2^-7, where any bfloat16 partial sum of the 1 and
    a small term is 1 (the small terms sum exactly among themselves)."""
    name = dist.group.WORLD.group_name
    n = 8 * world
    terms = torch.where(torch.arange(n) % world == rank, 1.0, 2.0 ** -9)
    expected = (1.0 + (world - 1) * 2.0 ** -9) * torch.ones(n)
    results = {}
    for how, call in [("grad_all_reduce", lambda x, d: grad_all_reduce(x, name, reduce_dtype=d)),
                      ("all_gather", lambda x, d: all_gather(x, 0, name, reduce_dtype=d)),
                      ("all_gather_start", lambda x, d: all_gather_wait(all_gather_start(x, 0, name, reduce_dtype=d),
                                                                        0, name))]:
        for dtype in (torch.float32, None):
            whole = how == "grad_all_reduce"
            x = torch.zeros(n if whole else n // world, dtype=torch.bfloat16, requires_grad=True)
            call(x, dtype).backward(terms.to(torch.bfloat16))
            want = expected if whole else expected.chunk(world)[rank]
            assert x.grad.dtype == torch.bfloat16, how
            results[how, dtype] = (x.grad, want.to(torch.bfloat16))
    for how in ("grad_all_reduce", "all_gather", "all_gather_start"):
        got, want = results[how, torch.float32]
        assert torch.equal(got, want), (how, got, want)
    # A reduce-scatter on gloo sums the blocks it receives with torch's sum, which accumulates bfloat16
    # in float32 already; gloo's all-reduce adds in bfloat16.
    assert not torch.equal(*results["grad_all_reduce", None]), "gloo summed bfloat16 exactly: the check shows nothing"


def test_a_bf16_gradient_summed_in_float32_rounds_once():
    run_distributed(_summed_in_float32_body, 4)


def test_a_parameter_gathered_at_its_wait_reduce_scatters_its_gradient_after_its_readers_backward():
    run_distributed(_param_gather_body, 2)


def _param_gather_body(rank, world):
    """A sharded parameter's gather issued before other compute: through ``param_gather_start``/``_wait``
    its gradient's reduce-scatter (an all-to-all on gloo) runs right after its reader's backward, before
    the backward of the compute between the issue and the reader; through ``all_gather_start``/``_wait``
    autograd runs it after that compute's backward (its node is made at the issue). The gradients are the
    same."""
    from torch.utils._python_dispatch import TorchDispatchMode

    class Ops(TorchDispatchMode):
        def __init__(self):
            super().__init__()
            self.names = []

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            self.names.append(func.__name__)
            return func(*args, **(kwargs or {}))

    name = dist.group.WORLD.group_name
    torch.manual_seed(0)
    whole, x = torch.randn(4, 3), torch.randn(5, 3, requires_grad=True)
    grads = {}
    for how in ("at its wait", "at its issue"):
        p = whole.chunk(world)[rank].clone().requires_grad_(True)
        if how == "at its wait":
            y = param_gather_start(p, 0, name)
        else:
            y = all_gather_start(p, 0, name)
        h = torch.tanh(x) * 2
        w = param_gather_wait(y, p, 0, name) if how == "at its wait" else all_gather_wait(y, 0, name)
        ops = Ops()
        with ops:
            (h @ w.t()).sum().backward()
        rs, tanh = ops.names.index("all_to_all_single.default"), ops.names.index("tanh_backward.default")
        assert (rs < tanh) == (how == "at its wait"), (how, ops.names)
        grads[how] = p.grad
    expected = (torch.tanh(x.detach()) * 2).sum(0).expand(4, 3) * world
    assert_close(grads["at its wait"], expected.chunk(world)[rank])
    assert_close(grads["at its issue"], grads["at its wait"])


def _fail_on_rank_1(rank, world_size):
    if rank == 1:
        raise RuntimeError("rank 1 failed on purpose")
    dist.barrier()  # fails on rank 0 too, once rank 1 is gone


def _hang(rank, world_size):
    time.sleep(60)


def _segfault_in_a_named_function(rank, world_size):
    if rank == 1:
        faulthandler._sigsegv()
    dist.barrier()


def test_run_distributed_reports_a_failing_rank():
    with pytest.raises(RuntimeError, match="(?s)rank 1 failed first:.*rank 1 failed on purpose"):
        run_distributed(_fail_on_rank_1, 2)


def test_run_distributed_reports_where_a_rank_died_of_a_signal():
    where = "(?s)rank 1 at the signal:.*Segmentation fault.*in _segfault_in_a_named_function"
    with pytest.raises(RuntimeError, match=where):
        run_distributed(_segfault_in_a_named_function, 2)


def test_run_distributed_times_out_on_a_hanging_rank():
    where = r"(?s)ranks \[0\] still running after 3 s.*rank 0 at the timeout:.*in _hang"
    with pytest.raises(TimeoutError, match=where):
        run_distributed(_hang, 1, timeout=3)
