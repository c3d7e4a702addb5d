"""A naive reference executor: runs one op under a strategy by looping over every mesh coordinate,
with no process group, and reassembles the global result from the per-rank pieces.

Partial inputs are split into random terms that sum to the value, so an op wrongly declared linear
fails. Replicated outputs must be equal on every coordinate. An op whose sharded form communicates by
itself (a rule's ``local_call``, e.g. the vocab-parallel loss) runs every coordinate in its own thread,
with the runtime's group lookup, all-reduce and point-to-point transfers replaced by exchanges
between those threads.
"""
import itertools
import threading
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager

import torch
import torch.fx as fx
from torch.utils import _pytree as pytree

from autopar.layout import block_runs, local_shape
from autopar.codegen.local_program import resolve_function
from autopar.passes.rules import context_for, rule_for


def single_op_node(op, args, kwargs=None):
    """An fx node of ``op`` whose tensor args are placeholders holding the given real tensors."""
    g = fx.Graph()
    count = iter(range(1000))

    def to_node(a):
        if isinstance(a, torch.Tensor):
            n = g.placeholder(f"x{next(count)}")
            n.meta["val"] = a
            return n
        return a

    nargs = pytree.tree_map(to_node, args)
    nkwargs = pytree.tree_map(to_node, kwargs or {})
    node = g.call_function(op, tuple(nargs), dict(nkwargs))
    node.meta["val"] = op(*args, **(kwargs or {}))
    return node


def _local_input(full, layout, mesh_shape, coord, noise_seed):
    x = full
    for a, (p, n) in enumerate(zip(layout, mesh_shape)):
        if p.is_shard:
            x = torch.cat([x.narrow(p.dim, start, length) for start, length in
                           block_runs(x.shape[p.dim], p, n, coord[a])], p.dim)
        elif p.is_partial:
            # Random terms that sum to x over this axis; the same terms whatever the other coordinates.
            gen = torch.Generator().manual_seed(noise_seed * 31 + a)
            terms = [torch.randn(x.shape, generator=gen, dtype=torch.float64).to(x.dtype) for _ in range(n - 1)]
            terms.append(x - sum(terms) if terms else x)
            x = terms[coord[a]]
    return x


class _SimulatedMesh:
    """Stands in for process groups: group ``axis<a>`` of a thread's coordinate is every coordinate that
    differs from it only along axis ``a``."""

    def __init__(self, mesh_shape):
        self.mesh_shape = mesh_shape
        self.local = threading.local()
        self.cond = threading.Condition()
        self.pending: dict = {}
        self.calls: dict = {}

    def group(self, name):
        a = int(name[len("axis"):])
        return self.local.coord[a], self.mesh_shape[a]

    def all_reduce(self, x, name, *, op="sum"):
        a = int(name[len("axis"):])
        coord = self.local.coord
        peers = coord[:a] + (None,) + coord[a + 1:]
        n = self.calls[coord, name] = self.calls.get((coord, name), 0) + 1
        key = (name, peers, n)
        with self.cond:
            self.pending.setdefault(key, {})[coord[a]] = x.clone()
            self.cond.wait_for(lambda: len(self.pending[key]) == self.mesh_shape[a], timeout=30)
            parts = [self.pending[key][i] for i in range(self.mesh_shape[a])]
            self.cond.notify_all()
        stacked = torch.stack(parts)
        return {"sum": stacked.sum(0), "max": stacked.amax(0)}[op]

    def p2p(self, sends, recvs, name):
        """Point-to-point transfers between the coordinates of one group: the n-th message from a to
        b meets the n-th receive at b from a. Done when this call returns (no requests to wait)."""
        a = int(name[len("axis"):])
        coord = self.local.coord
        peers = coord[:a] + (None,) + coord[a + 1:]
        me = coord[a]
        with self.cond:
            for dst, t in sends:
                n = self.calls[coord, name, "to", dst] = self.calls.get((coord, name, "to", dst), 0) + 1
                self.pending[(name, peers, me, dst, n)] = t.clone()
            self.cond.notify_all()
            for src, buf in recvs:
                n = self.calls[coord, name, "from", src] = self.calls.get((coord, name, "from", src), 0) + 1
                key = (name, peers, src, me, n)
                self.cond.wait_for(lambda: key in self.pending, timeout=30)
                buf.copy_(self.pending.pop(key))
        return []


@contextmanager
def _simulated(mesh):
    from autopar.runtime import collectives as C

    saved = C._group, C._all_reduce, C._p2p
    C._group, C._all_reduce, C._p2p = mesh.group, mesh.all_reduce, mesh.p2p
    try:
        yield
    finally:
        C._group, C._all_reduce, C._p2p = saved


def run_strategy(node: fx.Node, strategy, mesh_shape):
    """Global outputs reassembled from every coordinate's local run of ``node`` under ``strategy``."""
    ctx = context_for(node)
    rule = rule_for(node)
    full_ins = [a.meta["val"] for a in ctx.input_nodes]
    out_infos = ctx.outs
    coords = list(itertools.product(*[range(n) for n in mesh_shape]))
    group_names = [f"axis{a}" for a in range(len(mesh_shape))]
    mesh = _SimulatedMesh(tuple(mesh_shape))

    def local_call(coord):
        locals_ = [_local_input(x, lay, mesh_shape, coord, k) for k, (x, lay) in
                   enumerate(zip(full_ins, strategy.inputs))]
        it = iter(locals_)
        args = pytree.tree_map_only(fx.Node, lambda n: next(it), node.args)
        kwargs = pytree.tree_map_only(fx.Node, lambda n: next(it), dict(node.kwargs))
        if rule.local_args is not None:
            lin = [local_shape(i.shape, l, mesh_shape) for i, l in zip(ctx.ins, strategy.inputs)]
            lout = [local_shape(o.shape, l, mesh_shape) for o, l in zip(out_infos, strategy.outputs)]
            args, kwargs = rule.local_args(ctx, args, kwargs, lin, lout)
        call = rule.local_call(ctx, strategy.inputs, args, kwargs, group_names) if rule.local_call else None
        if call is None:
            return node.target, args, kwargs
        path, args, kwargs = call
        return resolve_function(path), args, kwargs

    def run(coord):
        mesh.local.coord = coord
        target, args, kwargs = local_call(coord)
        out = target(*args, **kwargs)
        return [o for o in pytree.tree_leaves(out) if isinstance(o, torch.Tensor)]

    if any(local_call(c)[0] is not node.target for c in coords[:1]):
        with _simulated(mesh), ThreadPoolExecutor(len(coords)) as pool:
            results = dict(zip(coords, pool.map(run, coords)))
    else:
        results = {coord: run(coord) for coord in coords}
    assembled = []
    for k, (info, lay) in enumerate(zip(out_infos, strategy.outputs)):
        full = torch.zeros(info.shape, dtype=torch.float64)
        for coord in coords:
            local = results[coord][k]
            rep_axes = [a for a, p in enumerate(lay) if p.is_replicate]
            if any(coord[a] for a in rep_axes):
                base = tuple(0 if a in rep_axes else c for a, c in enumerate(coord))
                torch.testing.assert_close(local, results[base][k], msg=f"replicated output {k} differs at {coord}")
                continue
            # Each dim's indices this coordinate holds (a strided shard holds a run in every group).
            index = [torch.arange(size) for size in info.shape]
            for a, p in enumerate(lay):
                if p.is_shard:
                    runs = block_runs(len(index[p.dim]), p, mesh_shape[a], coord[a])
                    index[p.dim] = torch.cat([index[p.dim][start:start + length] for start, length in runs])
            sizes = [len(i) for i in index]
            assert tuple(local.shape) == tuple(sizes), f"output {k}: local shape {tuple(local.shape)} != {sizes}"
            if index:
                full[tuple(torch.meshgrid(*index, indexing="ij"))] += local.to(torch.float64)
            else:
                full += local.to(torch.float64)
        assembled.append(full)
    return assembled
