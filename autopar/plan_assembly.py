"""Plan assembly: the Plan of one solved mesh, with its collectives, recomputed layers, step time
and the memory timeline of the step memory model (passes/memory.py)."""
from __future__ import annotations

from dataclasses import dataclass, replace
from typing import TYPE_CHECKING

import torch

from autopar.cluster import ClusterSpec
from autopar.layout import format_layout
from autopar.passes.costs import CostModel
from autopar.passes.exposure import BUCKET_CANDIDATES_MB, Replay, cheapest_bucket
from autopar.passes.ilp_build import ProblemIndex
from autopar.passes.layers import layer_counts, layer_instances
from autopar.passes.memory import StepMemory
from autopar.passes.meta import is_param, meta_of, op_name
from autopar.passes.precision import sharded_master_copy
from autopar.passes.reshard_plan import behind_weight_grads, collectives, plan_reshards
from autopar.plan import DDP_BUCKET_MB, MemoryPoint, Plan, PlanMemory, PlanNode, PlanZero

if TYPE_CHECKING:
    from autopar.planner import Prepared


def serial_seconds(plan: Plan) -> float:
    """The plan's step time with no communication hidden, an upper bound of ``plan.step_time``
    (docs/cost-model.md). Pipeline plans price no overlap."""
    return plan.breakdown.get("serial", plan.step_time)


def objective_seconds(plan: Plan) -> float:
    """What the solver minimizes, as the plan's figures give it: the serial step time less the
    communication the solver's hiding credits count as hidden (``breakdown["credit"]``). Plans of
    different meshes are compared by it, so that the bounds of the mesh search hold."""
    return serial_seconds(plan) - plan.breakdown.get("credit", 0.0)


@dataclass(frozen=True)
class SolvedMesh:
    """One mesh as plan assembly reads it: its shape and axis names, the solver's index of its
    strategies, its cost model and the step's memory model on it."""

    shape: tuple
    names: tuple
    idx: ProblemIndex
    cm: CostModel
    memory: StepMemory


def assemble_plan(prep: Prepared, mesh: SolvedMesh, assignment, cluster: ClusterSpec, memory_budget: float,
                  sharded_outputs: bool = False, pipeline: bool = False, bucket_mb: float | None = None) -> Plan:
    """The Plan of ``assignment`` (the solver's choice per decision) on ``mesh``; ``pipeline``: one
    stage's, whose ZeRO-1 parameters keep their master whole. Where the program buckets gradient
    all-reduces (overlap, no pipeline), the plan's bucket size is ``bucket_mb``, or else the one of
    ``passes.exposure.BUCKET_CANDIDATES_MB`` whose replay is fastest on this layout."""
    gm, cap = prep.gm, prep.captured
    idx, cm, axis_names, sm = mesh.idx, mesh.cm, mesh.names, mesh.memory
    chosen = idx.chosen(assignment)
    masters = {} if pipeline else {n: c for n in chosen if is_param(n)
                                   and (c := sharded_master_copy(n, chosen)) is not None}
    low = plan_reshards(gm, chosen, cm.mesh_shape, sharded_outputs)
    colls = collectives(low, cm, axis_names, masters)
    recompute = recomputed_layers(gm, idx.recompute_counts(assignment), idx.selective_counts(assignment),
                                  idx.offload_counts(assignment))
    cores = {name for names in recompute.get("attention", {}).get("regions", {}).values() for name in names}
    instance_of = {n: meta_of(n).layer.layer for n in chosen
                   if n.op == "call_function" and meta_of(n).layer and (meta_of(n).layer.layer in recompute["layers"]
                                                                        or n.name in cores)}
    # Recomputed layers and attention cores run their forward again in backward, with the collectives
    # they read through.
    recomputed_nodes = {n.name for n in instance_of}
    rerun = [replace(c, phase="backward", recompute=True) for c in colls
             if c.phase == "forward" and c.node in recomputed_nodes]
    recompute_compute = sum(cm.forward_compute_seconds(n, chosen[n]) for n in instance_of)
    colls += rerun
    serial_comm = sum(c.seconds for c in colls)
    resharded_for: dict = {}
    for (consumer, _), key in low.uses.items():
        resharded_for.setdefault(key.value.node.name, set()).add(consumer.name)
    # The regions codegen makes one call of (codegen/recompute.py), each scheduling its own collectives.
    off_layers = set(recompute.get("offload", {}).get("layers", ()))
    regions = {n.name: tag.layer for n in chosen
               if n.op == "call_function" and (tag := meta_of(n).layer) and tag.layer in off_layers}
    regions |= {n.name: inst for n, inst in instance_of.items()}
    regions |= {name: core for core, names in recompute.get("attention", {}).get("regions", {}).items()
                for name in names}
    replay = Replay(gm, chosen, colls, cm, axis_names, recomputed_nodes, resharded_for=resharded_for, regions=regions,
                    behind_weight_grads=behind_weight_grads(gm, low))
    bucketed = sm.overlap and not pipeline
    sizes = (bucket_mb,) if bucket_mb is not None else BUCKET_CANDIDATES_MB if bucketed else (DDP_BUCKET_MB,)
    chosen_mb, ex, priced = cheapest_bucket(replay, cm, sizes)
    colls = [replace(c, seconds=seconds, exposed=exposed) for c, seconds, exposed in zip(colls, ex.seconds, ex.exposed)]
    # Offloaded layers' saved activations go to host memory in forward and come back in backward.
    offload_seconds = 0.0
    if off_layers:
        saved = sum(cm.activation_bytes(n, chosen[n]) for n in chosen
                    if n.op == "call_function" and meta_of(n).layer and meta_of(n).layer.layer in off_layers)
        recompute["offload"]["bytes"] = saved
        offload_seconds = 2 * saved / cluster.host_link_bandwidth
    comm_by_node: dict = {}
    for c in colls:
        comm_by_node[c.node] = comm_by_node.get(c.node, 0.0) + c.seconds

    params, inputs, nodes, param_bytes, zero, offload = {}, {}, [], {}, {}, {}
    mem = {"params": 0.0, "grads": 0.0, "optimizer": 0.0, "host": 0.0}
    compute = optim = 0.0
    for n, s in chosen.items():
        role = meta_of(n).role
        if n.op == "placeholder":
            if role and role.kind == "param":
                lay = s.outputs[0]
                params[role.target] = format_layout(lay)
                whole = masters[n].meta["val"].dtype if n in masters else None
                if s.zero is not None:
                    zero[role.target] = PlanZero(s.zero.stage, axis_names[s.zero.axis], s.zero.dim,
                                                 sm.gather_bucket[n], n in masters)
                if s.offload:
                    host = cm.host_bytes(n, lay)
                    freed = sum(cm.param_bytes(n, lay)) - sum(cm.param_bytes(n, lay, None, True))
                    offload[role.target] = {"host_bytes": host, "device_bytes_freed": max(freed, 0.0)}
                    mem["host"] += host
                p, g, o = cm.param_bytes(n, lay, s.zero, s.offload, whole)
                mem["params"] += p
                mem["grads"] += g
                mem["optimizer"] += o
                param_bytes[role.target] = p + g + o
                optim += cm.optimizer_seconds(n, lay, s.zero, s.offload)
            elif role and role.kind == "input" and s.outputs:
                inputs[role.target] = format_layout(s.outputs[0])
            continue
        c = 0.0 if n in masters.values() else cm.compute_seconds(n, s)     # a sharded master's cast: not run
        a = cm.activation_bytes(n, s)
        compute += c
        tag = meta_of(n).layer
        root = idx.strategies.root_of(n)
        nodes.append(PlanNode(
            n.name, op_name(n), tuple(tuple(format_layout(l)) for l in s.inputs),
            tuple(tuple(format_layout(l)) for l in s.outputs),
            tuple(axis_names[a] for a, f in enumerate(s.splits_work) if f), c, comm_by_node.get(n.name, 0.0), a,
            layer=tag.layer if tag else None, layer_class=tag.cls if tag else None,
            follows=None if root is n else root.name,
            shape=tuple(n.meta["val"].shape) if isinstance(n.meta.get("val"), torch.Tensor) else None))
    comm_axis = {name: 0.0 for name in axis_names}
    for c in colls:
        comm_axis[c.axis] += c.seconds
    timeline, peak_point = memory_timeline(sm.walk(assignment, max(ex.buckets, default=0.0) if bucketed else None))
    memory = PlanMemory(peak_point.total, mem["params"], mem["grads"], mem["optimizer"],
                        timeline["end_of_forward"]["activations"], memory_budget, mem["host"], param_bytes,
                        timeline["points"], timeline["peak_index"], memory_point(peak_point))
    serial = compute + recompute_compute + serial_comm + optim + offload_seconds
    saved = cm.overlap_saving(ex.hidden)
    step = compute + recompute_compute + sum(comm_axis.values()) - saved + optim + offload_seconds
    # The step time at each bucket size priced: only the replayed communication differs.
    at_size = {mb: step - priced[f"{chosen_mb:g}"] + cost for mb, cost in priced.items()}
    return Plan(
        model={"class": cap.model_class, "fingerprint": prep.fingerprint,
               "num_params": sum(int(n.meta["val"].numel()) for n in gm.graph.nodes
                                 if is_param(n)),
               "input_shapes": [list(s) if s is not None else None for s in cap.input_shapes],
               "layers": layer_counts(gm)},
        cluster=cluster.to_dict(),
        mesh={"shape": list(mesh.shape), "axes": list(axis_names)},
        params=params, inputs=inputs, nodes=nodes, collectives=colls, memory=memory, step_time=step,
        breakdown={"compute": compute, "communication": comm_axis, "optimizer": optim,
                   "recompute": recompute_compute, "exposed": sum(comm_axis.values()) - ex.hidden, "hidden": ex.hidden,
                   "serial": serial, **({"offload": offload_seconds} if off_layers else {}),
                   **({"contention": ex.hidden - saved} if saved != ex.hidden else {}),
                   **({"credit": idx.hiding_credit(assignment)} if idx.credit is not None else {})},
        solver={"buckets": at_size} if bucketed else {}, sharded_outputs=sharded_outputs, recompute=recompute,
        zero=zero, offload=offload, bucket_mb=chosen_mb if bucketed else None,
    )


def recomputed_layers(gm, counts: dict, selective: dict | None = None, offloaded: dict | None = None) -> dict:
    """The plan's ``recompute`` entry: per layer class, how many of its instances recompute (the first
    ones, in execution order), and the instances by name; with ``selective`` (class -> how many of the
    next instances recompute their attention cores only), ``attention`` lists those too, with each
    core's nodes by region name."""
    from autopar.passes.layers import attention_cores
    from autopar.passes.memory import core_region

    order = layer_instances(gm)
    classes = {cls: {"count": r, "of": len(order[cls]), "layers": list(order[cls])[:r]}
               for cls, r in counts.items() if r}
    out = {"classes": classes, "layers": [inst for c in classes.values() for inst in c["layers"]]}
    picked = {cls: list(order[cls])[counts.get(cls, 0):counts.get(cls, 0) + k]
              for cls, k in (selective or {}).items() if k}
    if picked:
        regions = {core_region(inst, c): [n.name for n in core]
                   for cls, insts in picked.items() for inst in insts
                   for c, core in enumerate(attention_cores(order[cls][inst]))}
        out["attention"] = {"classes": {cls: {"count": len(insts), "of": len(order[cls]), "layers": insts}
                                        for cls, insts in picked.items()},
                            "layers": [inst for insts in picked.values() for inst in insts], "regions": regions}
    # With ``offloaded`` (class -> how many of the instances after those keep their saved activations in
    # host memory), ``offload`` lists them.
    moved = {cls: list(order[cls])[counts.get(cls, 0) + (selective or {}).get(cls, 0):][:f]
             for cls, f in (offloaded or {}).items() if f}
    if moved:
        out["offload"] = {"classes": {cls: {"count": len(insts), "of": len(order[cls]), "layers": insts}
                                      for cls, insts in moved.items()},
                          "layers": [inst for insts in moved.values() for inst in insts]}
    return out


def memory_timeline(walk) -> tuple[dict, object]:
    """The plan's memory timeline from the step's points: at most ~200 of them, always keeping the
    highest of each window so that the peak stays visible."""
    totals = [p.total for p in walk]
    k = max(range(len(walk)), key=totals.__getitem__)
    stride = max(1, len(walk) // 200)
    keep = [max(range(i, min(i + stride, len(walk))), key=totals.__getitem__) for i in range(0, len(walk), stride)]
    fwd = [p for p in walk if p.phase == "forward"]
    points = tuple(memory_point(walk[i]) for i in keep)
    return {"points": points, "peak_index": k, "end_of_forward": (fwd[-1] if fwd else walk[0]).bytes}, walk[k]


def memory_point(point) -> MemoryPoint:
    """The plan's record of one point of the step (a passes.memory.StepPoint)."""
    return MemoryPoint(point.phase, point.name, **point.bytes)

