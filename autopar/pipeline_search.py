"""Pipeline meshes: the meshes the planner adds (Megatron-LM's rule), and the plan of one pipeline mesh:
layouts solved per microbatch on the other axes, then stages, schedule and microbatch count chosen by
predicted step time (autopar/pipelining.py, docs/pipeline.md)."""
from __future__ import annotations

import dataclasses
import time

from autopar.cluster import ClusterSpec
from autopar.errors import AutoparError
from autopar.passes.costs import INFEASIBLE, Collective, CostModel
from autopar.passes.layers import layer_instances
from autopar.passes.memory import StepMemory, solve_under_budget
from autopar.passes.meta import is_param, meta_of
from autopar.passes.precision import reduce_dtype_of, reduce_itemsize
from autopar.passes.ilp_build import build_problem
from autopar.pass_pipeline import mesh_passes
from autopar.plan import Plan, PlanCollective, PlanPipeline, PlanRank, PlanStage
from autopar.plan_assembly import SolvedMesh, assemble_plan

def pipeline_meshes(cluster: ClusterSpec) -> list:
    """Pipeline meshes to try beside ``cluster.mesh_candidates()``, after Megatron-LM's rule: tensor
    parallel inside a node, pipeline across nodes, data parallel over the rest. ``pp`` is 2, 4 or 8
    ranks, whole nodes each; the two largest that fit are tried."""
    k = cluster.devices_per_node
    out = []
    for p in (2, 4, 8):
        if cluster.num_devices % (p * k) or cluster.num_devices < p * k:
            continue
        rest = cluster.num_devices // (p * k)
        out.append(((p, rest, k), ("pp", "dp", "tp")) if rest > 1 else ((p, k), ("pp", "tp")))
    return out[-2:]


def plan_pipeline(model, cluster, shape, names, example_inputs, example_kwargs, memory_budget, optimizer, fused, pins,
                   sharded_outputs, recompute, time_limit, skip_passes, insert_passes, microbatches, schedule,
                   tried, report, cost_model=CostModel, added=False, timings=None, precision=None,
                   programs=None) -> Plan | None:
    """The fastest pipeline plan on mesh ``shape`` (axis ``pp`` among ``names``), or None when none fits.
    On a mesh the planner ``added`` itself, only the most microbatches that leave every data-parallel
    rank a whole sample are tried (each count is one more solve, and a capture unless derived from
    ``programs``, see ``prepare``). ``timings`` (capture, passes, build, solve, evaluate seconds)
    accumulates this mesh's."""
    import math

    from autopar import pipelining as PL
    from autopar.codegen.stages import loss_output
    from autopar.planner import PLANNING_PHASES, prepare   # the planner imports this module

    axis = names.index("pp")
    p = shape[axis]
    if axis != 0:
        raise AutoparError(f"the pipeline axis 'pp' must be the mesh's first (outermost) axis, got axes {names}")
    if schedule is not None and schedule not in PL.SCHEDULES:
        raise AutoparError(f"unknown pipeline schedule {schedule!r}; choose one of {PL.SCHEDULES}")
    for pattern, pin in (pins or {}).items():
        if isinstance(pin, dict) and pin.get("zero") == 2:
            raise AutoparError(f"pin {pattern!r} asks for ZeRO-2, which pipeline plans do not offer: a stage's "
                               f"gradients accumulate whole over the microbatches; pin 'zero': 1 (optimizer "
                               f"states sharded) or a sharded layout (ZeRO-3)")
    batch = PL.batch_size(example_inputs, example_kwargs)
    if microbatches is not None:
        if batch % microbatches:
            raise AutoparError(f"the batch of {batch} does not split into {microbatches} equal microbatches; "
                               f"pick a count that divides {batch}")
        counts = [microbatches]
    else:
        counts = sorted({k * p for k in (1, 2, 4, 8) if batch % (k * p) == 0} or {batch})
        if added:
            spread = math.prod(shape[1:-1]) if len(shape) > 2 else 1     # the data-parallel axis
            whole = [c for c in counts if (batch // c) % spread == 0]
            counts = whole[-1:] or counts[:1]
    schedules = [schedule] if schedule else list(PL.SCHEDULES)
    # Layouts are solved on the other axes; a pipeline axis alone leaves a mesh of one device.
    sub_shape, sub_names = (tuple(shape[1:]), tuple(names[1:])) if len(shape) > 1 else ((1,), names)
    sub_cluster = dataclasses.replace(cluster, num_devices=math.prod(sub_shape), mesh_shape=sub_shape,
                                      axis_names=sub_names)
    if len(shape) > 1:
        pins = _drop_first_axis(pins)
    link = cluster.axis_link(shape, axis)
    best = None
    timings = {k: 0.0 for k in PLANNING_PHASES} if timings is None else timings
    for m in counts:
        mb_args, mb_kwargs = PL.microbatch_inputs(example_inputs, example_kwargs, m)
        report(f"mesh {shape}, {m} microbatches: capturing")
        t0 = time.perf_counter()
        prep = prepare(model, mb_args, mb_kwargs, sub_cluster, skip_passes=skip_passes, insert_passes=insert_passes,
                       precision=precision, programs=programs, fused=fused)
        front_passes = sum(r.seconds for r in prep.runner.records)
        timings["capture"] += prep.capture_seconds
        timings["passes"] += front_passes
        timings["build"] += time.perf_counter() - t0 - prep.capture_seconds - front_passes
        t0 = time.perf_counter()
        PL.check_layers(prep.gm, p, schedule)
        loss_output(prep.gm)          # the last stage hands the loss to the schedule
        # ZeRO-1 (Megatron-LM's distributed optimizer): optimizer states sharded over a stage's
        # data-parallel ranks. Not ZeRO-2: a gradient accumulates whole over the microbatches.
        prep.runner.run(mesh_passes(sub_shape, zero=1), prep.gm, f"mesh {shape}")
        cm = cost_model(sub_cluster, sub_shape, optimizer, fused=fused)
        # The ILP prices one microbatch, with what runs once per step (gradient sync, optimizer) divided by
        # m, and bounds the memory of 1F1B's first stage: a p-th of the parameters and states, and the
        # activations of p microbatches through a p-th of the layers (one microbatch through all of
        # them). Every rank is checked against the budget under each schedule below.
        scaled = _per_microbatch(cost_model)(sub_cluster, sub_shape, optimizer, fused=fused)
        scaled.microbatches, scaled.stages = m, p
        prob, idx = build_problem(prep.gm, scaled, memory_budget, pins, sharded_outputs, False, overlap=False,
                                  sharded_masters=False)
        sm = StepMemory(prep.gm, scaled, idx, [len(c.costs) for c in prob.choices], sharded_outputs=sharded_outputs,
                        sharded_masters=False, split_collectives=False)
        report(f"mesh {shape}, {m} microbatches: solving {len(prob.choices)} decisions")
        timings["build"] += time.perf_counter() - t0
        t0 = time.perf_counter()
        entry = {"mesh": list(shape), "pipeline": {"microbatches": m, "schedules": {}}}
        tried.append(entry)
        class_of = {inst: cls for cls, insts in layer_instances(prep.gm).items() for inst in insts}
        ilp_budget = memory_budget
        for attempt in range(1 + (_TIGHTER_SOLVES_ADDED if added else _TIGHTER_SOLVES)):
            sol = solve_under_budget(prob, sm, ilp_budget, time_limit=time_limit)
            if sol.status == "infeasible" and recompute is not False and not added and attempt == 0:
                # Recomputing layers inside the stages (chosen per rank below) may fit what one microbatch's
                # activations through every layer do not: the fastest layouts, with memory left to the
                # stages. Only on a mesh the user asked for: for the meshes the planner adds, this second
                # solve costs more than the search gains (llama2-70b on 1024xH100: 49 -> 74 s, the same plan).
                sol = solve_under_budget(prob, sm, math.inf, time_limit=time_limit)
            timings["solve"] += time.perf_counter() - t0
            t0 = time.perf_counter()
            entry.update(status=sol.status, objective=sol.objective, seconds=sol.seconds, variables=sol.num_variables,
                         constraints=sol.num_constraints, gap=sol.gap, tighter_solves=attempt)
            if sol.status == "infeasible" or prob.objective(sol.assignment) >= INFEASIBLE:
                break
            sub = assemble_plan(prep, SolvedMesh(sub_shape, sub_names, idx, cm, sm), sol.assignment, sub_cluster,
                                memory_budget, sharded_outputs, pipeline=True)
            sub.collectives = _deferred_to_parameters(prep.gm, sub.collectives, cm, sub_names, idx.chosen(sol.assignment))
            costs = _layer_costs(prep.gm, sub, idx.chosen(sol.assignment), cm, recompute)
            evaluated = [sched for sched in schedules if sched in ("GPipe", "1F1B") or m % p == 0]
            for sched in evaluated:     # torch's interleaved schedules need whole rounds of p microbatches
                found = PL.schedule_plan(costs, sched, p, m, memory_budget, link)
                entry["pipeline"]["schedules"][sched] = None if found is None else found["step_time"]
                if found is not None and (best is None or found["step_time"] < best[0]["step_time"]):
                    best = (found, sub, sol, class_of)
            timings["evaluate"] += time.perf_counter() - t0
            if any(t is not None for t in entry["pipeline"]["schedules"].values()):
                break
            # The layout ILP bounds one step's memory, each rank's check counts every in-flight microbatch
            # beside the whole gradients: where no schedule fits, solve again under the ILP's own peak of
            # this answer less what its least full schedule is over.
            excess = min((PL.excess_bytes(costs, sched, p, m, memory_budget, link) for sched in evaluated),
                         default=math.inf)
            if not math.isfinite(excess):
                break
            ilp_budget = sm.peak(sol.assignment)[1] - excess
            t0 = time.perf_counter()
    if best is None:
        return None
    found, sub, sol, class_of = best
    return _pipeline_plan(sub, found, shape, names, axis, cluster, memory_budget, sol, class_of)


# How many times a pipeline mesh's layouts are solved again under a tighter bound when no schedule fits
# the first answer (a solve of LLaMA-2-70B's pp=4 mesh takes tens of seconds: one for meshes the planner
# adds).
_TIGHTER_SOLVES, _TIGHTER_SOLVES_ADDED = 2, 1


def _layer_costs(gm, sub: Plan, chosen: dict, cm: CostModel, recompute) -> "PL.LayerCosts":
    """The per-layer figures of the solved microbatch program ``sub`` (its layouts ``chosen``)."""
    from autopar import pipelining as PL

    instance_of = {n: meta_of(n).layer.layer for n in chosen if n.op == "call_function" and meta_of(n).layer}
    optimizer_seconds = {meta_of(n).role.target: cm.optimizer_seconds(n, st.outputs[0], st.zero, st.offload)
                         for n, st in chosen.items() if is_param(n)}
    return PL.LayerCosts(gm, sub, optimizer_seconds, _boundary_bytes(instance_of, chosen, cm),
                         _recompute_seconds(instance_of, chosen, cm, sub.collectives),
                         _forced_pipeline_recompute(gm, recompute), recompute is not False)


def _per_microbatch(cost_model: type[CostModel]) -> type[CostModel]:
    """``cost_model`` for one of ``microbatches`` microbatches of a pipeline step of ``stages`` ranks: a
    parameter's gradient all-reduce and the optimizer step run once per step, so each microbatch pays
    1/m of them; a rank holds 1/stages of the parameters."""
    from autopar.passes.costs import _transition_cached
    from autopar.passes.strategies import requires_grad, value_info

    class PerMicrobatch(cost_model):
        microbatches = 1
        stages = 1

        def transition_phase_seconds(self, value, src_layout, dst_layout, partial_axes):
            param = reduced_param(value.node)
            if param is None:
                return super().transition_phase_seconds(value, src_layout, dst_layout, partial_axes)
            info = value_info(value)
            steps = _transition_cached(tuple(src_layout), tuple(dst_layout), info.shape, self.mesh_shape,
                                       partial_axes)
            if steps is None:
                return None
            grad = requires_grad(value.node)
            # The gradient all-reduce, once per step, sums the parameter's own (float32 master) gradient,
            # in the dtype the plan sums it in (a bf16-mixed copy's reduce_dtype).
            phases = [self.steps_phase_seconds([st], reduce_dtype_of(value.node).itemsize, grad,
                                               lambda _: 1 / self.microbatches) if st.op == "grad_all_reduce"
                      else self.steps_phase_seconds([st], info.dtype.itemsize, grad,
                                                    reduce_itemsize=reduce_itemsize(value.node)) for st in steps]
            return sum(f for f, _ in phases), sum(b for _, b in phases)

        def param_bytes(self, node, layout, zero=None, offload=False, whole_dtype=None):
            return tuple(x / self.stages for x in super().param_bytes(node, layout, zero, offload, whole_dtype))

        def optimizer_seconds(self, node, layout, zero=None, offload=False):   # of the whole parameter, once per step
            return super().optimizer_seconds(node, layout, zero, offload) * self.stages / self.microbatches

        def zero_collectives(self, node, layout, zero, whole_dtype=None):
            # ZeRO-1's all-gather of the updated shards runs once per step, on the whole parameter; and
            # the gradient sync along its axis, priced as an all-reduce with the parameter's readers,
            # runs as a reduce-scatter (runtime/pipeline.py): the difference is the parameter's own.
            if zero is None:
                return []
            p = super().param_bytes(node, layout)[0]
            seconds = self.collective_seconds("all_gather", p, zero.axis) + \
                self.collective_seconds("reduce_scatter", p, zero.axis) - self.collective_seconds("all_reduce", p, zero.axis)
            return [Collective("all_gather", zero.axis, "optimizer", p, seconds / self.microbatches)]

    return PerMicrobatch


def reduced_param(node) -> object | None:
    """The parameter whose gradient a pipeline's data-parallel sync reduces once per step where ``node``'s
    gradient is all-reduced (codegen/stages.py): a parameter itself, or the one bfloat16 copy that is
    its only use under bf16-mixed. None for any other value."""
    from autopar.passes.precision import cast_source, gradient_carrier

    if is_param(node):
        return node
    src = cast_source(node)
    return src if src is not None and is_param(src) and gradient_carrier(src) is node else None


def _deferred_to_parameters(gm, collectives: list[PlanCollective], cm: CostModel, axis_names,
                            chosen: dict) -> list[PlanCollective]:
    """The collectives, with the gradient all-reduces of parameters' bfloat16 copies recorded as the
    parameters' own, as the pipeline runs them: once per step, on the float32 gradient, summed in the
    dtype the copy's reduction was priced in (its ``reduce_dtype``); along the axis a ZeRO-1 parameter
    (under ``chosen``, the strategies) shards its state on, a reduce-scatter."""
    nodes = {n.name: n for n in gm.graph.nodes}
    out = []
    for c in collectives:
        node = nodes.get(c.value)
        param = reduced_param(node) if c.step == "grad_all_reduce" and node is not None else None
        if param is not None:
            zero = chosen[param].zero
            kind = "reduce_scatter" if zero is not None and axis_names[zero.axis] == c.axis else c.kind
            if param is node and kind == c.kind:
                out.append(c)
                continue
            c = dataclasses.replace(c, kind=kind, value=param.name,
                                    seconds=cm.collective_seconds(kind, c.bytes, axis_names.index(c.axis)))
        out.append(c)
    return out


def _recompute_seconds(instance_of: dict, chosen: dict, cm: CostModel, collectives: list) -> dict:
    """Per layer instance: the seconds of running its forward again in backward, its compute and the
    forward collectives of its nodes."""
    out: dict = {}
    for n, inst in instance_of.items():
        out[inst] = out.get(inst, 0.0) + cm.forward_compute_seconds(n, chosen[n])
    inst_of_name = {n.name: inst for n, inst in instance_of.items()}
    for c in collectives:
        if c.phase == "forward" and c.node in inst_of_name:
            inst = inst_of_name[c.node]
            out[inst] += c.seconds
    return out


def _forced_pipeline_recompute(gm, recompute) -> frozenset:
    """The layer instances a ``recompute`` dict makes every pipeline plan recompute (the first ``count``
    of each class it names); a pipeline plan recomputes whole layers only."""
    from autopar.passes.ilp_build import forced_recompute

    out = set()
    for cls, insts in layer_instances(gm).items():
        forced = forced_recompute(cls, len(insts), recompute)
        if forced in ("attention", "offload"):
            raise AutoparError(f"recompute asks {cls} to {'recompute its attention cores only' if forced == 'attention' else 'offload its activations'}; "
                               f"pipeline plans recompute whole layers: give 'all' or a count")
        out.update(list(insts)[:forced or 0])
    return frozenset(out)


def _pipeline_plan(sub: Plan, found: dict, shape, names, axis, cluster, memory_budget, sol, class_of: dict) -> Plan:
    """The sub-mesh plan of one microbatch, widened to the whole mesh, with its pipeline."""

    def widen(lay):
        return ["R", *lay] if len(shape) > 1 else ["R"]

    def widen_all(lays):
        return tuple(tuple(widen(lay)) for lay in lays)

    sub.mesh = {"shape": list(shape), "axes": list(names)}
    sub.cluster = cluster.to_dict()
    sub.params = {k: widen(v) for k, v in sub.params.items()}
    sub.inputs = {k: widen(v) for k, v in sub.inputs.items()}
    sub.nodes = [dataclasses.replace(n, inputs=widen_all(n.inputs), outputs=widen_all(n.outputs)) for n in sub.nodes]
    m = found["microbatches"]
    worst = max(found["ranks"], key=lambda r: r["peak"])
    mem = sub.memory
    scale = worst["static_bytes"] / max(mem.params + mem.grads + mem.optimizer, 1.0)
    sub.memory = dataclasses.replace(mem, peak=found["peak"], memory_budget=memory_budget,
                                     activations=worst["activation_bytes"], params=mem.params * scale,
                                     grads=mem.grads * scale, optimizer=mem.optimizer * scale)
    slow = found["ranks"][found["slowest_rank"]]
    comm = {a: m * slow["comm_seconds"].get(a, 0.0) for a in names}
    comm["pp"] += m * slow["p2p_seconds"]
    for a, t in found["ranks"][found["tail_rank"]]["grad_sync_seconds"].items():
        comm[a] += t
    # The slowest rank's microbatches, the pipeline's idle time, the slowest optimizer step: they add up
    # to step_time.
    sub.breakdown = {"compute": m * slow["compute_seconds"], "communication": comm,
                     "optimizer": found["optimizer_seconds"], "recompute": m * slow["recompute_seconds"],
                     "bubble": found["bubble_seconds"]}
    sub.recompute = _pipeline_recompute(found["stages"], class_of)
    sub.step_time = found["step_time"]
    sub.pipeline = PlanPipeline("pp", found["schedule"], m, tuple(PlanStage.from_dict(st) for st in found["stages"]),
                                found["bubble_fraction"], found["bubble_seconds"], found["virtual_stages"],
                                found["grad_sync_seconds"], tuple(PlanRank.from_dict(r) for r in found["ranks"]))
    sub.solver.update(status=sol.status, seconds=sol.seconds, variables=sol.num_variables,
                      constraints=sol.num_constraints, backend=sol.backend)
    return sub


def _pipeline_recompute(stages: list[dict], class_of: dict) -> dict:
    """The plan's ``recompute`` entry for the layers the pipeline's ranks recompute (any instances, not
    only a class's first ones: each rank recomputes what its own memory needs)."""
    classes: dict = {}
    for inst in (inst for st in stages for inst in st.get("recompute", [])):
        cls = class_of[inst]
        entry = classes.setdefault(cls, {"count": 0, "of": sum(c == cls for c in class_of.values()), "layers": []})
        entry["count"] += 1
        entry["layers"].append(inst)
    return {"classes": classes, "layers": [inst for c in classes.values() for inst in c["layers"]]}


def _drop_first_axis(pins):
    """Pins written for the whole mesh, without their first (pipeline) axis's placement."""
    if not pins:
        return pins

    def drop(v):
        if isinstance(v, list) and v and all(isinstance(x, str) for x in v):
            if v[0] != "R":
                raise AutoparError(f"pin {v}: a pipeline plan replicates every layout along its first axis 'pp' "
                                   f"(each rank holds whole stages); pin 'R' there")
            return v[1:]
        if isinstance(v, list):
            return [drop(x) for x in v]
        if isinstance(v, dict):
            return {k: drop(x) for k, x in v.items()}
        return v

    return {k: drop(v) for k, v in pins.items()}


def _boundary_bytes(instance_of: dict, chosen: dict, cm: CostModel) -> dict:
    """Per layer instance: the bytes of the activations it reads from outside (each value counted once,
    at the layout it is produced in): what a pipeline stage receives from the previous one."""
    from autopar.layout import local_fraction
    from autopar.passes.strategies import input_values, value_info

    out, seen = {}, set()
    for n, inst in instance_of.items():
        for v in input_values(n):
            role = meta_of(v.node).role
            if v in seen or instance_of.get(v.node) == inst or (role is not None and role.kind != "input"):
                continue
            seen.add(v)
            info = value_info(v)
            if info.dtype.is_floating_point:
                lay = chosen[v.node].outputs[v.index]
                out[inst] = out.get(inst, 0.0) + info.nbytes * local_fraction(lay, cm.mesh_shape)
    return out

