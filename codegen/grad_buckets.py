"""Bucketed gradient reductions (``grad_buckets_pass``), as DDP does them.

Code generation reduces a replicated parameter's gradient with a ``grad_all_reduce`` on each of its
uses, inside the backward of that use, waiting at once. When every use of a parameter is reduced over
the same group, reducing the parameter's accumulated gradient once gives the same sum. This pass takes
those reductions out of the program and lists the parameters in ``ProgramMeta.grad_reductions``, in
the order their gradients become ready in backward (reverse order of first use), with their group,
the number of reductions each replaces and the dtype they reduce in (None: the parameter's); the runtime
(runtime/grad_buckets.py) packs them into buckets and launches each bucket's all-reduce as soon as
its gradients are accumulated, while backward goes on. It runs before ``recompute_pass``, which would
hide a parameter's uses inside a recomputed layer behind the layer's checkpoint call.

A weight read only through its lower-precision copy (bf16-mixed: ``passes.precision.gradient_carrier``)
has its reductions on the uses of the copy, in the weight's dtype where the plan's ``reduce_dtype``
is that dtype (the default), else in the copy's (``passes.precision.reduce_dtype_of``). The copy's
gradient, summed over its uses, is the weight's whole gradient (the cast's backward only widens it),
so the weight is bucketed the same way: its accumulated gradient reduced as it is, in float32, as
Megatron-LM's buckets reduce the gradients of its float32 masters, or (``reduce_dtype`` bfloat16, as
FSDP2 reduces by default) in the copy's dtype.

A ZeRO-1 parameter is read through ``runtime.zero.whole_of``, whose reductions are those of its uses:
the read's gradient, summed over them, is the whole local tensor's, which the runtime's buckets reduce as
a replicated parameter's (each rank's optimizer then reads its block of it). Which parameters are
bucketed is ``passes.precision.reduced_in_buckets``, which the cost and memory models share.
"""
from __future__ import annotations

import torch
import torch.fx as fx

from autopar.passes.meta import program_meta, set_program_meta
from autopar.passes.precision import cast_source, gradient_carrier, reduced_in_buckets
from autopar.passes.runner import requires
from autopar.runtime import collectives as C


def narrowed_dtype(carrier: fx.Node, reductions) -> torch.dtype | None:
    """The dtype a parameter's gradient is summed in where it is not the parameter's own: that of its
    copy ``carrier`` (a cast in the local program) whose ``reductions`` (``grad_all_reduce`` calls of
    it) sum in the copy's dtype, carrying no ``reduce_dtype``; None where the carrier is the parameter
    (or its ZeRO read) or the reductions sum in the parameter's dtype. The runtime's buckets and a
    pipeline's once-a-step sum (codegen/stages.py) take over those reductions in that dtype."""
    if cast_source(carrier) is None or any(r.kwargs.get("reduce_dtype") is not None for r in reductions):
        return None
    return carrier.kwargs["dtype"]


@requires("local_program_pass")
def grad_buckets_pass(gm: fx.GraphModule) -> fx.GraphModule:
    graph = gm.graph
    position = {n: i for i, n in enumerate(graph.nodes)}
    found = []
    placeholders = [n for n in graph.nodes if n.op == "placeholder"]
    meta = program_meta(gm)
    zero = {fqn: (stage, copy_dtype) for fqn, stage, _, _, _, copy_dtype, _ in meta.sharded_states}
    offloaded = set(meta.offloaded)
    for p, (kind, target) in zip(placeholders, meta.placeholders):
        if kind != "param" or not p.users:
            continue
        stage, copy_dtype = zero.get(target, (None, None))
        # A ZeRO-1/2 parameter's one reader is its read (``whole_of``); a sharded master's read is its copy.
        read = next(iter(p.users)) if stage is not None else p
        carrier = gradient_carrier(read)
        if not reduced_in_buckets(stage, target in offloaded, carrier is not read or copy_dtype is not None):
            continue
        users = list(carrier.users)
        groups = {u.args[1] if len(u.args) > 1 else u.kwargs.get("group_name") for u in users
                  if u.op == "call_function" and u.target is C.grad_all_reduce}
        if len(groups) != 1 or any(u.target is not C.grad_all_reduce for u in users):
            continue
        first_use = min(position[v] for u in users for v in u.users) if any(u.users for u in users) else 0
        dtype = narrowed_dtype(carrier, users)
        for u in users:
            u.replace_all_uses_with(carrier)
            graph.erase_node(u)
        found.append((first_use, target, groups.pop(), len(users), dtype))
    ready_order = tuple(f[1:] for f in sorted(found, key=lambda f: -f[0]))
    set_program_meta(gm, grad_reductions=ready_order)
    graph.lint()
    gm.recompile()
    return gm
