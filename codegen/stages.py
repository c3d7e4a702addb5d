"""A rank's local program cut into pipeline stages (``split_stages``).

The local program of a pipeline plan is generated for one microbatch on the mesh's other axes (the
pipeline axis is replicated in every layout, so it carries no collective). It is then cut where the
plan's stages end:

- a node inside a layer instance runs on that instance's stage;
- a node that depends on no parameter (masks, positions, rotary tables, input reshardings) runs on
  every stage that reads it, so only activations travel between stages;
- any other node runs on the latest stage among its inputs (the embedding on the first stage; the final
  norm, the head and the loss after the last layer, on the last stage).

A value made on stage ``i`` and read on stage ``j > i`` is an output of every stage from ``i`` to
``j - 1`` and an input of every stage from ``i + 1`` to ``j``: ``torch.distributed.pipelining`` sends
each stage's outputs to the next stage only. The last stage returns the loss.
"""
from __future__ import annotations

import torch
import torch.fx as fx
from torch.utils import _pytree as pytree

from autopar.errors import AutoparError
from autopar.passes.meta import meta_of, program_meta
from autopar.passes.precision import gradient_carrier
from autopar.runtime.program import StageProgram


def split_stages(gm: fx.GraphModule, stage_of_layer: dict[str, int], num_stages: int, loss_position: int,
                 axis_of_group: dict[str, str]) -> tuple:
    """``gm`` (a local program of one microbatch) as ``num_stages`` StagePrograms; the loss is output
    leaf ``loss_position`` (``loss_output``); ``axis_of_group`` names the mesh axis of each group."""
    info = program_meta(gm)
    placeholders = [n for n in gm.graph.nodes if n.op == "placeholder"]
    kind_of = {n: kt for n, kt in zip(placeholders, info.placeholders)}
    deferred = _defer_gradient_reductions(gm, kind_of, axis_of_group)
    nodes = list(gm.graph.nodes)
    output = next(n for n in nodes if n.op == "output")

    param_dep = {n: kind_of[n][0] == "param" for n in placeholders}
    stage: dict = {}
    for n in nodes:
        if n.op not in ("call_function", "get_attr"):
            continue
        ins = n.all_input_nodes
        param_dep[n] = any(param_dep.get(a, False) for a in ins)
        tag = meta_of(n).layer
        layer = tag.layer if tag is not None else None
        earliest = max((stage[a] for a in ins if a in stage), default=0)
        if layer is not None and param_dep[n]:
            if layer not in stage_of_layer:
                raise AutoparError(f"node {n.name} belongs to layer {layer!r}, which no pipeline stage of the "
                                   f"plan holds; plan this model again")
            stage[n] = stage_of_layer[layer]
            if earliest > stage[n]:
                late = next(a for a in ins if stage.get(a, -1) == earliest)
                raise AutoparError(f"pipeline stages out of order: {n.name} (layer {layer}, stage {stage[n]}) reads "
                                   f"{late.name}, computed on the later stage {earliest}; the plan's stages must "
                                   f"hold the layers in the order the model runs them")
        elif param_dep[n]:
            stage[n] = earliest

    loss = pytree.tree_leaves(output.args[0])[loss_position]
    if stage.get(loss, num_stages - 1) != num_stages - 1:
        raise AutoparError(f"the loss ({loss.name}) is computed on pipeline stage {stage[loss]}, not on the last "
                           f"stage {num_stages - 1}: every stage must hold at least one layer")

    # Where each staged value is read (replicated nodes count as read wherever their readers are).
    readers: dict = {n: set() for n in stage}

    def note_reads(n, at):
        for a in n.all_input_nodes:
            if a in stage:
                readers[a].add(at)
            elif a.op != "placeholder":
                note_reads(a, at)

    for n in stage:
        note_reads(n, stage[n])
    readers[loss].add(num_stages - 1)
    carried = [[n for n in stage if stage[n] < k <= max(readers[n], default=-1)] for k in range(num_stages)]

    out = []
    for k in range(num_stages):
        g = fx.Graph()
        env: dict = {}
        kinds = []
        for n in carried[k]:
            env[n] = g.placeholder(f"recv_{n.name}")
            kinds.append(("recv", n.name))

        def value(a):
            if a in env:
                return env[a]
            if a.op == "placeholder":
                env[a] = g.placeholder(a.name)
                kinds.append(kind_of[a])
                return env[a]
            if a in stage:
                raise AutoparError(f"stage {k} reads {a.name} from stage {stage[a]}, which does not send it")
            env[a] = g.node_copy(a, value)       # replicated: depends on inputs, buffers and constants only
            return env[a]

        for n in nodes:
            if stage.get(n) == k:
                env[n] = g.node_copy(n, value)
        if k == num_stages - 1:
            g.output(value(loss))
            sends = ()
        else:
            sends = tuple(carried[k + 1])
            g.output(tuple(value(n) for n in sends))
        _placeholders_first(g)          # parameters and inputs were made on demand, between ops
        g.lint()
        sub = fx.GraphModule(gm, g, class_name=f"Stage{k}")
        held = {t for kd, t in kinds if kd == "param"}
        out.append(StageProgram(k, sub, tuple(kinds), tuple(n.name for n in sends),
                                tuple(d for d in deferred if d[0] in held)))
    return tuple(out)


def _defer_gradient_reductions(gm: fx.GraphModule, kind_of: dict, axis_of_group: dict) -> list:
    """Take out the per-microbatch gradient all-reduces of parameters (data parallelism's gradient
    sync): a parameter whose every use starts with ``grad_all_reduce`` over one axis gets its gradient
    summed over that axis once per step instead, after the last microbatch. Under bf16-mixed the
    reductions are those of the parameter's one bfloat16 copy: its gradient accumulates into the
    float32 ``.grad``, which is then summed once, in float32 (as Megatron-LM reduces bf16 training's
    gradients), or narrowed to bfloat16 for the sum where the plan's ``reduce_dtype`` says so. Returns
    (FQN, axis, the dtype to sum it in where not the parameter's, else None) triples
    (codegen/grad_buckets.py ``narrowed_dtype``)."""
    from autopar.codegen.grad_buckets import narrowed_dtype
    from autopar.runtime.collectives import grad_all_reduce

    deferred = []
    for p, (kind, fqn) in kind_of.items():
        if kind != "param":
            continue
        reduced = gradient_carrier(p)
        while reduced.users and all(u.target is grad_all_reduce for u in reduced.users):
            groups = {u.args[1] for u in reduced.users}
            if len(groups) != 1:
                break
            deferred.append((fqn, axis_of_group[groups.pop()], narrowed_dtype(reduced, reduced.users)))
            for u in list(reduced.users):
                u.replace_all_uses_with(reduced)
                gm.graph.erase_node(u)
    gm.recompile()
    return deferred


def _placeholders_first(g: fx.Graph) -> None:
    nodes = list(g.nodes)
    ph = [n for n in nodes if n.op == "placeholder"]
    rest = [n for n in nodes if n.op != "placeholder"]
    if not rest:
        return
    anchor = rest[0]
    for p in ph:
        anchor.prepend(p)


def loss_output(gm: fx.GraphModule) -> int:
    """The position, among the output leaves of the captured ``gm``, of the loss: its first scalar."""
    output = next(n for n in gm.graph.nodes if n.op == "output")
    for k, a in enumerate(pytree.tree_leaves(output.args[0])):
        if isinstance(a, fx.Node) and isinstance(a.meta.get("val"), torch.Tensor) and a.meta["val"].numel() == 1:
            return k
    raise AutoparError("a pipeline plan needs the model to return a scalar loss (pass labels): the last stage "
                       "returns it to the schedule, which runs backward from it")

