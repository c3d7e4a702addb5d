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
has its reductions on the uses of the copy, in the copy's dtype. The copy's gradient, summed over its
uses, is the weight's whole gradient (the cast's backward only widens it), so the weight is bucketed
the same way, its accumulated gradient reduced in the copy's dtype, as Megatron-LM's buckets reduce
the bfloat16 gradients of its float32 masters.
"""
from __future__ import annotations

import torch.fx as fx

from autopar.passes.meta import program_meta, set_program_meta
from autopar.passes.precision import gradient_carrier
from autopar.passes.runner import requires
from autopar.runtime import collectives as C


@requires("local_program_pass")
def grad_buckets_pass(gm: fx.GraphModule) -> fx.GraphModule:
    graph = gm.graph
    position = {n: i for i, n in enumerate(graph.nodes)}
    found = []
    placeholders = [n for n in graph.nodes if n.op == "placeholder"]
    # A ZeRO-2 gradient is reduce-scattered by the runtime once accumulated, an offloaded one copied to
    # host memory: its reductions stay in the program, so that it is complete by then.
    scattered = {fqn for fqn, stage, *_ in program_meta(gm).sharded_states if stage >= 2}
    scattered |= set(program_meta(gm).offloaded)
    for p, (kind, target) in zip(placeholders, program_meta(gm).placeholders):
        if kind != "param" or not p.users or target in scattered:
            continue
        carrier = gradient_carrier(p)
        users = list(carrier.users)
        groups = {u.args[1] if len(u.args) > 1 else u.kwargs.get("group_name") for u in users
                  if u.op == "call_function" and u.target is C.grad_all_reduce}
        if len(groups) != 1 or any(u.target is not C.grad_all_reduce for u in users):
            continue
        first_use = min(position[v] for u in users for v in u.users) if any(u.users for u in users) else 0
        for u in users:
            u.replace_all_uses_with(carrier)
            graph.erase_node(u)
        found.append((first_use, target, groups.pop(), len(users), None if carrier is p else carrier.kwargs["dtype"]))
    ready_order = tuple(f[1:] for f in sorted(found, key=lambda f: -f[0]))
    set_program_meta(gm, grad_reductions=ready_order)
    graph.lint()
    gm.recompile()
    return gm
