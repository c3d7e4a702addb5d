"""Overlap of forward collectives with compute in a rank's local program (``overlap_pass``).

Code generation emits each resharding as one call that communicates and waits, just before the op
that reads it. This pass splits every such call into ``*_start`` (issue) and ``*_wait`` (the
``runtime.collectives`` pairs): the wait moves to just before the first use of the result, and the
start moves up to as soon as both its input is computed and the previous collective has been waited.
Independent compute then runs while the collective is in flight. At most one split collective is in
flight at a time, and collectives are issued in program order, so every rank issues them in the same
order and no more than one extra communication buffer is alive (a ZeRO-3 parameter is gathered
while the compute before its first use runs, not all parameters at the start of the step).

A recomputed or offloaded layer (codegen/recompute.py) is one call of a submodule, its body. The body's
collectives are split the same way inside it, starting with none in flight: the first is issued at the
earliest when the body starts, and each waits inside the body. A body runs whole in forward and, when
recomputed, whole again in backward, so every rank issues the same collectives in the same order in
both runs. The call of a body that communicates so is a wait for the program around it: a collective
of that program is issued after the call, never in flight across it, which keeps one in flight at a
time.

A parameter read through ``local_chunk`` (a replicated weight a rank uses one chunk of, as the
solver's feature splits over DDP's layout do) is read through ``param_chunk`` instead: its gradient's
all-gather is issued in backward and waited at the next such issue or when backward ends, so the rest
of backward runs while it is in flight (runtime/collectives.py). So is one read inside a body: autograd
runs the parameter's chunk's backward in the layer's backward, after its re-run.

A sharded parameter a body gathers (ZeRO-3) is gathered through ``param_gather_start`` and
``param_gather_wait``: the gather's autograd node is made at its wait, just before its reader, so its
backward (the gradient's reduce-scatter, waited at once) runs right after the reader's. Made at the issue,
at the body's start for its first collective, it ran after the backward of everything the body ran
between, the whole gradient held meanwhile (Qwen2's recomputed ZeRO-3 plan measured 1.009x its prediction,
1.001x since).

Collectives inside sharded ops (runtime/sharded_ops.py) still wait at once.
"""
from __future__ import annotations

import operator

import torch.fx as fx

from autopar.passes.exposure import hides_behind_weight_grads
from autopar.passes.meta import program_meta
from autopar.passes.runner import requires
from autopar.runtime import collectives as C
from autopar.runtime.recompute import checkpointed, offloaded


@requires("local_program_pass")
def overlap_pass(gm: fx.GraphModule) -> fx.GraphModule:
    graph = gm.graph
    params = {p for p, (kind, _) in zip((n for n in graph.nodes if n.op == "placeholder"),
                                        program_meta(gm).placeholders) if kind == "param"}
    _read_params_in_chunks(gm, params)
    barriers = set()
    for node in graph.nodes:
        if node.op == "call_function" and node.target in (checkpointed, offloaded):
            body = getattr(gm, node.args[0].target)
            inputs = [n for n in body.graph.nodes if n.op == "placeholder"]
            # The body reads the parameters its call passes it.
            body_params = {b for b, a in zip(inputs, node.args[1:]) if a in params}
            _read_params_in_chunks(body, body_params)
            if _split_collectives(body.graph, set()):
                barriers.add(node)
            _gather_params_at_their_reads(body.graph, body_params)
            body.graph.lint()
            body.recompile()
    _reduce_input_gradients_behind_weight_gradients(graph)
    _split_collectives(graph, barriers)
    graph.lint()
    gm.recompile()
    return gm


def _split_collectives(graph: fx.Graph, barriers: set) -> bool:
    """Split every one-call collective of ``graph`` into its issue and its wait (module docstring), none
    issued before a node of ``barriers`` and waited after it. Returns whether any was split."""
    position = {n: i for i, n in enumerate(graph.nodes)}
    previous_wait = None
    split = False
    for node in [n for n in graph.nodes if (n.op == "call_function" and n.target in C.SPLIT) or n in barriers]:
        if node in barriers:
            previous_wait = node
            continue
        start_fn, wait_fn, wait_args = C.SPLIT[node.target]
        users = sorted(node.users, key=position.__getitem__)
        if not users:
            continue
        if (previous_wait is not None and previous_wait not in barriers
                and position[previous_wait] > position[users[0]] > position[previous_wait.args[0]]):
            # The previous collective is waited after this one's first use (its own first use comes
            # later): wait for it before this one is issued, to keep one in flight in program order.
            users[0].prepend(previous_wait)
            position = {n: i for i, n in enumerate(graph.nodes)}
        # Issue after the latest of: the inputs, the previous collective's wait (or a barrier).
        after = max((*node.all_input_nodes, *((previous_wait,) if previous_wait else ())), key=position.__getitem__)
        first_op = next(n for n in graph.nodes if n.op not in ("placeholder", "get_attr"))
        with graph.inserting_before(first_op) if position[after] < position[first_op] else graph.inserting_after(after):
            start = graph.call_function(start_fn, node.args, dict(node.kwargs))
        with graph.inserting_before(users[0]):
            wait = graph.call_function(wait_fn, (start, *wait_args(*node.args, **node.kwargs)))
        start.meta.update(node.meta)
        wait.meta.update(node.meta)
        node.replace_all_uses_with(wait)
        graph.erase_node(node)
        position = {n: i for i, n in enumerate(graph.nodes)}
        previous_wait = wait
        split = True
    return split


def _reduce_input_gradients_behind_weight_gradients(graph: fx.Graph) -> None:
    """Make each ``grad_all_reduce`` read by linear layers alone, with their weights computed before the
    first (``passes.exposure.hides_behind_weight_grads``), one ``column_linears`` call of them all at the
    first: its backward issues the all-reduce of the input's gradient, computes the weights' gradients,
    then waits."""
    position = {n: i for i, n in enumerate(graph.nodes)}
    for reduce in [n for n in graph.nodes if n.op == "call_function" and n.target is C.grad_all_reduce]:
        readers = sorted(reduce.users, key=position.__getitem__)
        reads = [(r, k) for r in readers for k, a in enumerate(r.args) if a is reduce]
        first = position[readers[0]] if readers else 0
        if reduce.kwargs or not hides_behind_weight_grads(
                reads, lambda r: all(position[a] < first for a in r.args[1:] if isinstance(a, fx.Node))):
            continue
        weights = [a for r in readers for a in (r.args[1], r.args[2] if len(r.args) > 2 else None)]
        with graph.inserting_before(readers[0]):
            call = graph.call_function(C.column_linears, (reduce.args[0], reduce.args[1], *weights))
            call.meta.update(reduce.meta)
        for k, r in enumerate(readers):
            with graph.inserting_before(r):
                out = graph.call_function(operator.getitem, (call, k))
            out.meta.update(r.meta)
            r.replace_all_uses_with(out)
            graph.erase_node(r)
        graph.erase_node(reduce)
        position = {n: i for i, n in enumerate(graph.nodes)}


def _read_params_in_chunks(gm: fx.GraphModule, params: set) -> None:
    """Read each parameter in ``params`` that ``gm`` reads through ``local_chunk`` through ``param_chunk``."""
    for node in gm.graph.nodes:
        if node.op == "call_function" and node.target is C.local_chunk and node.args[0] in params:
            node.target = C.param_chunk


def _gather_params_at_their_reads(graph: fx.Graph, params: set) -> None:
    """Gather each parameter in ``params`` that a body's split all-gather reads (ZeRO-3) through
    ``param_gather_start``/``param_gather_wait``, whose autograd node is made at the wait, not at the
    issue: its gradient is reduce-scattered right after its reader's backward."""
    for start in [n for n in graph.nodes if n.op == "call_function" and n.target is C.all_gather_start]:
        x, dim, group, grad, groups = _all_gather_call(*start.args, **start.kwargs)
        # A parameter itself, not a copy of it: its gradient is summed in its own dtype.
        if x not in params or grad != "reduce_scatter":
            continue
        start.target, start.args, start.kwargs = C.param_gather_start, (x, dim, group, groups), {}
        for wait in list(start.users):
            wait.target, wait.args = C.param_gather_wait, (start, x, *wait.args[1:])


def _all_gather_call(x, dim, group_name, grad="reduce_scatter", groups=1, reduce_dtype=None):
    """The arguments of a call of ``all_gather`` (or its ``all_gather_start``), defaults filled in."""
    return x, dim, group_name, grad, groups
