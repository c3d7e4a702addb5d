"""Planning: capture, annotate, solve for every candidate mesh, keep the fastest feasible plan."""
from __future__ import annotations

import contextlib
import dataclasses
import hashlib
import logging
import math
import time
import warnings
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

import torch
import torch.fx as fx

from autopar.cluster import ClusterSpec, default_axis_names
from autopar.errors import AutoparError, AutoparWarning, InfeasiblePlanError
from autopar.layout import format_layout
from autopar.passes.capture import CapturedProgram, batch_of, rebatch
from autopar.passes.costs import INFEASIBLE, CostModel, OptimizerSpec
from autopar.passes.layers import layer_counts, layer_instances
from autopar.passes.memory import StepMemory, minimum_budget, solve_under_budget
from autopar.passes.reshard_plan import collectives, plan_reshards
from autopar.passes.meta import meta_of, op_name
from autopar.passes.precision import Precision, resolve_precision
from autopar.passes.ilp_build import ProblemIndex, build_problem
from autopar.passes.runner import PassRunner
from autopar.alternatives import alternatives
from autopar.pass_pipeline import FrontEnd, analysis_passes, front_end, mesh_passes, new_runner
from autopar.plan import Plan
from autopar.solver import GAP, NODE_LIMIT, greedy

log = logging.getLogger("autopar")

SOLVER_THREADS = 2   # candidate meshes solved at once
_PHASES = ("capture", "passes", "build", "solve", "evaluate")


@dataclass
class Prepared:
    captured: CapturedProgram
    gm: fx.GraphModule
    runner: PassRunner
    fingerprint: str
    capture_seconds: float = 0.0   # 0.0 when the caller ran the front end
    precision: Precision | None = None


def prepare(model, example_inputs, example_kwargs, cluster: ClusterSpec, *, skip_passes=(), insert_passes=(),
            front: FrontEnd | None = None, precision: str | None = None, programs: dict | None = None
            ) -> Prepared:
    """Capture the model and run the passes that do not depend on the mesh; ``front`` is a front end
    already run (``autopar.compile`` runs it once and plans from it). ``programs`` (batch size -> a
    capture before its passes) holds the captures made so far: with two of them at batches of 2 or
    more, a third batch's program is derived from them rather than captured (passes/capture.py
    ``rebatch``), and a new capture is added to it."""
    capture_seconds = 0.0
    if front is None:
        t0 = time.perf_counter()
        captured = _derived(programs, example_inputs, example_kwargs)
        front = front_end(model, example_inputs, example_kwargs, new_runner(skip_passes, insert_passes),
                          precision=precision, device_type=cluster.device_type, captured=captured,
                          keep_raw=programs is not None and captured is None
                          and _batch(example_inputs, example_kwargs) >= 2)
        if front.raw is not None and batch_of(front.raw) is not None:
            programs[batch_of(front.raw)] = front.raw
        capture_seconds = time.perf_counter() - t0 - sum(r.seconds for r in front.runner.records)
    gm = front.runner.run(analysis_passes(cluster.device_type), front.gm, "analysis")
    return Prepared(front.captured, gm, front.runner, model_fingerprint(model), capture_seconds, front.precision)


def _batch(example_inputs, example_kwargs) -> int:
    """Dim 0 of the first input, 0 without one: a capture at a batch under 2 derives nothing."""
    from autopar.pipelining import batch_size

    try:
        return batch_size(example_inputs, example_kwargs)
    except AutoparError:
        return 0


def _derived(programs: dict | None, example_inputs, example_kwargs):
    """The capture at these inputs derived from two of ``programs`` at batches of 2 or more, or None."""
    usable = [c for b, c in sorted((programs or {}).items(), reverse=True) if b >= 2]
    return rebatch(usable[0], usable[1], example_inputs, example_kwargs) if len(usable) >= 2 else None


def model_fingerprint(model: torch.nn.Module) -> str:
    h = hashlib.sha256(type(model).__qualname__.encode())
    for name, p in model.named_parameters():
        h.update(f"{name}:{tuple(p.shape)}:{p.dtype};".encode())
    return h.hexdigest()[:16]


def default_optimizer(model, precision: str | None = None) -> OptimizerSpec:
    """torch's Adam: two states in the dtype of the parameters it updates, float32 master weights under
    "bf16-mixed" (with the master itself, ZeRO's K = 12 bytes per parameter), bfloat16 under "bf16-true"."""
    return OptimizerSpec(2.0 * resolve_precision(precision, model).param_dtype.itemsize)


def plan(model: torch.nn.Module, cluster: ClusterSpec, example_inputs=(), example_kwargs=None, *,
         memory_budget: float | None = None, mesh_shape=None, axis_names=None, time_limit: float = 60.0,
         optimizer: OptimizerSpec | None = None, progress: bool | None = None, skip_passes=(),
         insert_passes=(), pins: dict | None = None, kernels: str = "aten", sharded_outputs: bool = False,
         recompute: bool | dict = True, cost_model: type[CostModel] = CostModel,
         front: FrontEnd | None = None, microbatches: int | None = None, schedule: str | None = None,
         pipeline: bool | None = None, precision: str | None = None) -> Plan:
    """Find the fastest layout of ``model`` on ``cluster`` that fits ``memory_budget`` bytes per device.

    ``pins`` forces layouts by hand: ``{"*.mlp.c_fc.weight": ["R", "S(1)"], "input_ids": ["S(0)", "R"]}``
    (globs over parameter FQNs, input names and node names); the solver fills in the rest.
    ``kernels`` is the backend the plan will run with ("aten", "triton", or "auto": Triton on a CUDA
    cluster); with Triton, chains of pointwise ops are priced as fused kernels (CostModel ``fused``).
    ``sharded_outputs=True`` plans for a program that returns non-scalar outputs (logits) in the layout
    they are computed in, as ``compile(..., sharded_outputs=True)`` runs it, so they are never gathered;
    scalar outputs (the loss) are still returned whole.
    ``recompute=True`` lets the solver checkpoint the first instances of a repeated layer (their
    activations are recomputed in backward) where memory is short; ``False`` keeps every activation;
    ``{"model.layers.*": "all"}`` (or a count) fixes it for the layer classes a glob names.
    ``skip_passes`` names passes not to run; ``insert_passes`` is a sequence of (name of a pass, a pass
    to run right after it) (autopar/pass_pipeline.py lists the passes; docs/extending.md).
    ``cost_model`` is the class that prices every candidate, ``CostModel`` or a subclass of it (e.g.
    one that looks op times up in a measured table; docs/extending.md).
    A mesh axis named ``pp`` makes a pipeline plan (autopar/pipelining.py, docs/pipeline.md):
    ``microbatches`` and ``schedule`` (one of ``pipelining.SCHEDULES``) fix what is otherwise chosen by
    predicted step time. With the mesh left to the planner, ``pipeline=None`` also tries pipeline meshes
    on clusters of several nodes (``pipeline_meshes``), ``True`` on any cluster, ``False`` never.
    ``precision`` is Lightning's name of the training precision: "32-true", "bf16-mixed" (autocast's
    bfloat16 compute and activations over float32 master weights and optimizer states) or "bf16-true";
    None trains in the model's own dtype (passes/precision.py).
    """
    t0 = time.perf_counter()
    if mesh_shape is not None:
        cluster = _with_mesh(cluster, mesh_shape, axis_names)
    memory_budget = float(memory_budget) if memory_budget is not None else cluster.usable_memory
    prec = resolve_precision(precision, model)
    if front is not None and front.precision != prec:
        raise AutoparError(f"the front end was captured under precision {front.precision.name!r}, not {prec.name!r}")
    optimizer = optimizer or default_optimizer(model, prec.name)
    if kernels not in ("auto", "triton", "aten"):
        raise ValueError(f"kernels must be 'auto', 'triton' or 'aten', got {kernels!r}")
    fused = kernels == "triton" or (kernels == "auto" and cluster.device_type == "cuda")
    offload = offload_offered(cluster, pins)
    if cluster.mesh_shape is None:
        candidates = [(shape, default_axis_names(shape)) for shape in cluster.mesh_candidates()]
        if pipeline or (pipeline is None and cluster.num_nodes > 1):
            candidates += pipeline_meshes(cluster)
    else:
        candidates = [(cluster.mesh_shape, tuple(cluster.axis_names or default_axis_names(cluster.mesh_shape)))]
    with _progress(progress, total=2 + 4 * len(candidates)) as report:
        prep = None
        # Captures before their passes, by batch size: pipeline meshes derive their microbatch programs
        # from two of them where they can rather than capture again.
        programs = {} if any("pp" in names for _, names in candidates) else None
        if front is not None and front.raw is not None and programs is not None and batch_of(front.raw):
            programs[batch_of(front.raw)] = front.raw
        if any("pp" not in names for _, names in candidates):
            report("capturing")
            prep = prepare(model, example_inputs, example_kwargs, cluster, skip_passes=skip_passes,
                           insert_passes=insert_passes, front=front, precision=prec.name, programs=programs)
        best, tried, meshes, t_build = None, [], [], time.perf_counter()
        pipe = {k: 0.0 for k in _PHASES}        # seconds of the pipeline meshes, by phase
        for shape, names in candidates:
            if "pp" in names:
                try:
                    p = _plan_pipeline(model, cluster, shape, names, example_inputs, example_kwargs, memory_budget,
                                       optimizer, fused, pins, sharded_outputs, recompute, time_limit, skip_passes,
                                       insert_passes, microbatches, schedule, tried, report, cost_model,
                                       added=cluster.mesh_shape is None, timings=pipe, precision=prec.name,
                                       programs=programs)
                except AutoparError as e:
                    if cluster.mesh_shape is not None:
                        raise
                    # A pipeline mesh the planner added itself: this model cannot use it.
                    tried.append({"mesh": list(shape), "status": "skipped", "reason": str(e)})
                    continue
                if p is not None and (best is None or p.step_time < best.step_time):
                    best = p
                continue
            report(f"mesh {shape}: strategies")
            prep.runner.run(mesh_passes(shape, offload=offload), prep.gm, f"mesh {shape}")
            cm = cost_model(cluster, shape, optimizer, fused=fused)
            report(f"mesh {shape}: costs")
            prob, idx = build_problem(prep.gm, cm, memory_budget, pins, sharded_outputs, recompute)
            quick = greedy(prob)
            meshes.append(_Mesh(len(meshes), shape, names, prob, idx, cm,
                                prob.lower_bound(), prob.objective(quick) if prob.feasible(quick) else math.inf,
                                prep.gm, sharded_outputs))
        t_build = time.perf_counter() - t_build
        t_search = time.perf_counter()
        best, searched, infeasible, t_eval = _search(meshes, best, prep, cluster, memory_budget, sharded_outputs,
                                                     time_limit, report)
        tried += searched
        t_search = time.perf_counter() - t_search
        if best is None and not infeasible and tried and all("pipeline" in t for t in tried) \
                and cluster.mesh_shape is not None:
            from autopar.pipelining import no_fit

            raise no_fit(tried[-1]["mesh"][0], tried[-1]["pipeline"]["microbatches"], memory_budget)
        if best is None:
            _raise_infeasible(prep, infeasible, cluster, memory_budget)
        _check_host_memory(best, cluster)
        best.precision = prec.name
        best.extra["warnings"] = idle_axis_warnings(prep.gm, best) if prep is not None else []
        for w in best.extra["warnings"]:
            warnings.warn(w, AutoparWarning, stacklevel=2)
        best.solver["candidates"] = tried
        best.solver["gap_tolerance"] = GAP
        front_passes = 0.0 if prep is None else sum(r.seconds for r in prep.runner.records
                                                    if not r.stage.startswith("mesh"))
        own = {"capture": 0.0 if prep is None else prep.capture_seconds, "passes": front_passes,
               "build": t_build - sum(pipe.values()), "solve": t_search - t_eval, "evaluate": t_eval}
        best.solver["timings"] = {k: own[k] + pipe[k] for k in _PHASES}
        best.solver["planning_seconds"] = time.perf_counter() - t0
        best.solver["passes"] = [{"name": r.name, "stage": r.stage, "seconds": r.seconds, "skipped": r.skipped}
                                 for r in (prep.runner.records if prep is not None else [])]
        report("done")
    return best


def _check_host_memory(plan: Plan, cluster: ClusterSpec) -> None:
    """The offloaded states of a node's devices must fit its host memory: a constraint of the ILP
    (``StepMemory.host_constraint``), checked again on the plan."""
    if not plan.offload or cluster.host_is_device:
        return
    need = plan.memory["host"] * cluster.devices_per_node
    if need > cluster.host_memory:
        raise InfeasiblePlanError(
            f"the plan offloads {len(plan.offload)} parameters' optimizer states, {need / 1e9:.1f} GB per node of "
            f"host memory, more than the node's {cluster.host_memory / 1e9:.1f} GB (host_memory); raise the device "
            f"budget, add devices, or give the host's real memory", memory_budget=plan.memory.get("memory_budget"))


def offload_offered(cluster: ClusterSpec, pins) -> bool:
    """Whether parameters may keep their optimizer state in host memory: on a cluster whose host is
    not its devices' memory and whose host figures are known, or where a pin asks for it (which then
    needs the host figures; on CPU processes, to run the offloaded program where it frees nothing)."""
    if any(isinstance(p, dict) and p.get("offload") for p in (pins or {}).values()):
        cluster.require_host_figures("a pin that offloads an optimizer state")
        return True
    return cluster.has_host_figures and not cluster.host_is_device


def _per_microbatch(cost_model: type[CostModel]) -> type[CostModel]:
    """``cost_model`` for one of ``microbatches`` microbatches of a pipeline step of ``stages`` ranks: a
    parameter's gradient all-reduce and the optimizer step run once per step, so each microbatch pays
    1/m of them; a rank holds 1/stages of the parameters."""
    from autopar.passes.costs import _transition_cached
    from autopar.passes.strategies import requires_grad, value_info

    class PerMicrobatch(cost_model):
        microbatches = 1
        stages = 1

        def transition_seconds(self, value, src_layout, dst_layout, partial_axes):
            role = meta_of(value.node).role
            if value.node.op != "placeholder" or role is None or role.kind != "param":
                return super().transition_seconds(value, src_layout, dst_layout, partial_axes)
            info = value_info(value)
            steps = _transition_cached(tuple(src_layout), tuple(dst_layout), info.shape, self.mesh_shape,
                                       partial_axes)
            if steps is None:
                return INFEASIBLE
            grad = requires_grad(value.node)
            return sum(self.steps_seconds([st], info.dtype.itemsize, grad)
                       / (self.microbatches if st.op == "grad_all_reduce" else 1) for st in steps)

        def param_bytes(self, node, layout, zero=None, offload=False):
            return tuple(x / self.stages for x in super().param_bytes(node, layout, zero, offload))

        def optimizer_seconds(self, node, layout, zero=None, offload=False):   # of the whole parameter, once per step
            return super().optimizer_seconds(node, layout, zero, offload) * self.stages / self.microbatches

    return PerMicrobatch


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


def idle_axis_warnings(gm, p: Plan) -> list[str]:
    """Warnings for mesh axes along which no work is split (every device along one computes the same
    thing), and for inputs whose batch dim does not divide by an axis, so the data cannot be split along
    it and the plan falls back to other dims (or to none)."""
    out = []
    split = {a for n in p.nodes for a in n["split_axes"]}
    batches = [(meta_of(n).role.target, tuple(n.meta["val"].shape)) for n in gm.graph.nodes
               if n.op == "placeholder" and meta_of(n).role and meta_of(n).role.kind == "input"
               and isinstance(n.meta.get("val"), torch.Tensor) and n.meta["val"].dim() > 0]
    for axis, size in zip(p.axis_names, p.mesh_shape):
        if size == 1 or (p.pipeline and axis == p.pipeline["axis"]):     # stages split the work there
            continue
        # A batch of one is never split by data, which surprises nobody.
        odd = [(name, shape[0]) for name, shape in batches if shape[0] > 1 and shape[0] % size]
        cause = ""
        if odd:
            cause = (f"the batch dim of {', '.join(f'{name} ({b})' for name, b in odd)} does not divide by "
                     f"{size}, so the data cannot be split along mesh axis {axis!r}; ")
        if axis not in split:
            out.append(f"{cause}mesh axis {axis!r} ({size} devices) splits no work: every device along it "
                       f"computes the same thing. Use a batch that divides by {size}, or fewer devices")
        elif odd:
            out.append(f"{cause}the plan splits other dims along it instead. Use a batch that divides by "
                       f"{size} for data parallelism")
    return out


def _plan_pipeline(model, cluster, shape, names, example_inputs, example_kwargs, memory_budget, optimizer, fused, pins,
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

    axis = names.index("pp")
    p = shape[axis]
    if axis != 0:
        raise AutoparError(f"the pipeline axis 'pp' must be the mesh's first (outermost) axis, got axes {names}")
    if schedule is not None and schedule not in PL.SCHEDULES:
        raise AutoparError(f"unknown pipeline schedule {schedule!r}; choose one of {PL.SCHEDULES}")
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
    timings = {k: 0.0 for k in _PHASES} if timings is None else timings
    for m in counts:
        mb_args, mb_kwargs = PL.microbatch_inputs(example_inputs, example_kwargs, m)
        report(f"mesh {shape}, {m} microbatches: capturing")
        t0 = time.perf_counter()
        prep = prepare(model, mb_args, mb_kwargs, sub_cluster, skip_passes=skip_passes, insert_passes=insert_passes,
                       precision=precision, programs=programs)
        front_passes = sum(r.seconds for r in prep.runner.records)
        timings["capture"] += prep.capture_seconds
        timings["passes"] += front_passes
        timings["build"] += time.perf_counter() - t0 - prep.capture_seconds - front_passes
        t0 = time.perf_counter()
        PL.check_layers(prep.gm, p, schedule)
        loss_output(prep.gm)          # the last stage hands the loss to the schedule
        prep.runner.run(mesh_passes(sub_shape, zero=False), prep.gm, f"mesh {shape}")
        cm = cost_model(sub_cluster, sub_shape, optimizer, fused=fused)
        # The ILP prices one microbatch, with what runs once per step (gradient sync, optimizer) divided by
        # m, and bounds the memory of 1F1B's first stage: a p-th of the parameters and states, and the
        # activations of p microbatches through a p-th of the layers (one microbatch through all of
        # them). Every rank is checked against the budget under each schedule below.
        scaled = _per_microbatch(cost_model)(sub_cluster, sub_shape, optimizer, fused=fused)
        scaled.microbatches, scaled.stages = m, p
        prob, idx = build_problem(prep.gm, scaled, memory_budget, pins, sharded_outputs, False)
        sm = StepMemory(prep.gm, scaled, idx, [len(c.costs) for c in prob.choices], sharded_outputs=sharded_outputs)
        report(f"mesh {shape}, {m} microbatches: solving {len(prob.choices)} decisions")
        timings["build"] += time.perf_counter() - t0
        t0 = time.perf_counter()
        sol = solve_under_budget(prob, sm, memory_budget, time_limit=time_limit)
        if sol.status == "infeasible" and recompute is not False and not added:
            # Recomputing layers inside the stages (chosen per rank below) may fit what one microbatch's
            # activations through every layer do not: the fastest layouts, with memory left to the stages.
            # Only on a mesh the user asked for: for the meshes the planner adds, this second solve
            # costs more than the search gains (llama2-70b on 1024xH100: 49 -> 74 s, the same plan).
            sol = solve_under_budget(prob, sm, math.inf, time_limit=time_limit)
        timings["solve"] += time.perf_counter() - t0
        t0 = time.perf_counter()
        entry = {"mesh": list(shape), "status": sol.status, "objective": sol.objective, "seconds": sol.seconds,
                 "variables": sol.num_variables, "constraints": sol.num_constraints, "gap": sol.gap,
                 "pipeline": {"microbatches": m, "schedules": {}}}
        tried.append(entry)
        if sol.status == "infeasible" or prob.objective(sol.assignment) >= INFEASIBLE:
            continue
        t0 = time.perf_counter()
        sub = evaluate(prep, idx, sol.assignment, cm, sub_shape, sub_names, sub_cluster, memory_budget, sm,
                       sharded_outputs)
        chosen = idx.chosen(sol.assignment)
        instance_of = {n: meta_of(n).layer.layer for n in chosen if n.op == "call_function" and meta_of(n).layer}
        costs = PL.LayerCosts(prep.gm, sub, _boundary_bytes(instance_of, chosen, cm),
                              _recompute_seconds(instance_of, chosen, cm, sub.collectives),
                              _forced_pipeline_recompute(prep.gm, recompute), recompute is not False)
        for sched in schedules:
            if sched != "GPipe" and sched != "1F1B" and m % p:
                continue          # torch's interleaved schedules need whole rounds of p microbatches
            found = PL.schedule_plan(costs, sched, p, m, memory_budget, link)
            entry["pipeline"]["schedules"][sched] = None if found is None else found["step_time"]
            if found is not None and (best is None or found["step_time"] < best[0]["step_time"]):
                best = (found, sub, sol, {inst: cls for cls, insts in layer_instances(prep.gm).items()
                                          for inst in insts})
        timings["evaluate"] += time.perf_counter() - t0
    if best is None:
        return None
    found, sub, sol, class_of = best
    return _pipeline_plan(sub, found, shape, names, axis, cluster, memory_budget, sol, class_of)


def _recompute_seconds(instance_of: dict, chosen: dict, cm: CostModel, collectives: list) -> dict:
    """Per layer instance: the seconds of running its forward again in backward, its compute and the
    forward collectives of its nodes."""
    out: dict = {}
    for n, inst in instance_of.items():
        out[inst] = out.get(inst, 0.0) + cm.forward_compute_seconds(n, chosen[n])
    inst_of_name = {n.name: inst for n, inst in instance_of.items()}
    for c in collectives:
        if c["phase"] == "forward" and c["node"] in inst_of_name:
            inst = inst_of_name[c["node"]]
            out[inst] += c["seconds"]
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

    sub.mesh = {"shape": list(shape), "axes": list(names)}
    sub.cluster = cluster.to_dict()
    sub.params = {k: widen(v) for k, v in sub.params.items()}
    sub.inputs = {k: widen(v) for k, v in sub.inputs.items()}
    for n in sub.nodes:
        n["inputs"] = [widen(l) for l in n["inputs"]]
        n["outputs"] = [widen(l) for l in n["outputs"]]
    m = found["microbatches"]
    worst = max(found["ranks"], key=lambda r: r["peak"])
    scale = worst["static_bytes"] / max(sub.memory["params"] + sub.memory["grads"] + sub.memory["optimizer"], 1.0)
    sub.memory.update(peak=found["peak"], memory_budget=memory_budget, activations=worst["activation_bytes"],
                      params=sub.memory["params"] * scale, grads=sub.memory["grads"] * scale,
                      optimizer=sub.memory["optimizer"] * scale)
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
    sub.pipeline = {"axis": "pp", "schedule": found["schedule"], "microbatches": m,
                    "virtual_stages": found["virtual_stages"], "bubble_fraction": found["bubble_fraction"],
                    "bubble_seconds": found["bubble_seconds"], "grad_sync_seconds": found["grad_sync_seconds"],
                    "stages": found["stages"], "ranks": found["ranks"]}
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


@dataclass
class _Mesh:
    position: int              # in the cluster's candidate order, which breaks ties between equal plans
    shape: tuple
    names: tuple
    prob: object
    idx: ProblemIndex
    cm: CostModel
    lower_bound: float         # no layout on this mesh is faster
    estimate: float            # the greedy layout's step time (inf when it does not fit)
    gm: fx.GraphModule
    sharded_outputs: bool
    _memory: StepMemory | None = None

    @property
    def memory(self) -> StepMemory:
        """The step's memory on this mesh, made when first needed: a mesh cut off by its lower bound
        never needs it."""
        if self._memory is None:
            self._memory = StepMemory(self.gm, self.cm, self.idx, [len(c.costs) for c in self.prob.choices],
                                      sharded_outputs=self.sharded_outputs)
        return self._memory


def _search(meshes: list[_Mesh], best, prep, cluster, memory_budget, sharded_outputs, time_limit, report):
    """Solve the candidate meshes and keep the plan of least step time (``best``: one already found).

    The mesh whose greedy layout is fastest goes first, and the step time of the best plan so far bounds
    the rest: a mesh whose lower bound is no better is not solved, and the solver stops a mesh as soon
    as it proves it cannot beat it. A plan's step time is never below its problem's objective (it adds
    the reshardings recomputed layers run again), so neither shortcut loses the best plan. Two meshes
    are solved at a time (the solver runs outside Python's lock), in waves whose bound is the best plan
    of the waves before; the plans are evaluated here.
    """
    order = sorted(meshes, key=lambda m: (m.estimate, m.lower_bound, m.position))
    best_key = None if best is None else (best.step_time, -1)
    tried, infeasible, t_eval = {}, [], 0.0
    workers = max(1, min(SOLVER_THREADS, len(order)))
    with ThreadPoolExecutor(max_workers=workers) as pool:
        while order:
            # A wave of meshes solved together under the bound of the waves before it, its results taken
            # in order: which mesh finishes first never changes a bound, so the plan does not depend on
            # the machine's load.
            bound = None if best is None else best.step_time
            wave = []
            while order and len(wave) < workers:
                m = order.pop(0)
                if bound is not None and m.lower_bound >= bound:
                    tried[m.position] = {"mesh": list(m.shape), "status": "bounded", "objective": None,
                                         "lower_bound": m.lower_bound, "seconds": 0.0, "variables": 0,
                                         "constraints": 0, "gap": None}
                    continue
                report(f"mesh {m.shape}: solving {len(m.prob.choices)} decisions, "
                       f"{len(m.prob.edges) + len(m.prob.shared)} edges")
                wave.append((m, pool.submit(solve_under_budget, m.prob, m.memory, memory_budget,
                                            time_limit=time_limit, bound=bound)))
            for m, fut in wave:
                sol = fut.result()
                tried[m.position] = {"mesh": list(m.shape), "status": sol.status, "objective": sol.objective,
                                     "lower_bound": m.lower_bound, "seconds": sol.seconds,
                                     "variables": sol.num_variables, "constraints": sol.num_constraints,
                                     "gap": sol.gap}
                if sol.status == "bounded":
                    continue
                if sol.status != "infeasible" and m.prob.objective(sol.assignment) >= INFEASIBLE:
                    sol = dataclasses.replace(sol, status="infeasible")      # only a broken pin satisfies it
                if sol.status == "infeasible":
                    infeasible.append((m.shape, m.names, m.prob, m.idx, m.cm, m.memory))
                    continue
                report(f"mesh {m.shape}: evaluating")
                t0 = time.perf_counter()
                p = evaluate(prep, m.idx, sol.assignment, m.cm, m.shape, m.names, cluster, memory_budget, m.memory,
                             sharded_outputs)
                if p.memory["peak"] > memory_budget * (1 + 1e-9):
                    raise AutoparError(f"internal error: the plan for mesh {list(m.shape)} peaks at "
                                       f"{p.memory['peak']:.0f} bytes, over its budget of {memory_budget:.0f}; please "
                                       f"report this")
                p.alternatives = alternatives(m.prob, m.idx, sol.assignment, m.cm, m.names)
                p.solver.update(status=sol.status, seconds=sol.seconds, variables=sol.num_variables,
                                constraints=sol.num_constraints, backend=sol.backend, gap=sol.gap)
                if best is None or (p.step_time, m.position) < best_key:
                    best, best_key = p, (p.step_time, m.position)
                t_eval += time.perf_counter() - t0
    infeasible.sort(key=lambda item: [m.shape for m in meshes].index(item[0]))
    return best, [tried[k] for k in sorted(tried)], infeasible, t_eval


def _with_mesh(cluster, mesh_shape, axis_names):
    shape = tuple(mesh_shape)
    names = tuple(axis_names) if axis_names else default_axis_names(shape)
    return dataclasses.replace(cluster, mesh_shape=shape, axis_names=names)


@contextlib.contextmanager
def _progress(enabled, total: int):
    """A rich progress bar with the stage name, shown once planning has taken more than a second
    (always with ``progress=True``, never with ``progress=False``, else when stderr is a terminal)."""
    import sys

    t0 = time.perf_counter()
    state = {"bar": None, "task": None, "done": 0}

    def report(stage):
        log.info("planning: %s", stage)
        state["done"] += 1
        if enabled is False or not (enabled or sys.stderr.isatty()):
            return
        if state["bar"] is None and (enabled or time.perf_counter() - t0 > 1.0):
            from rich.console import Console
            from rich.progress import BarColumn, Progress, TextColumn, TimeElapsedColumn

            state["bar"] = Progress(TextColumn("planning"), BarColumn(), TextColumn("{task.description}"),
                                    TimeElapsedColumn(), console=Console(stderr=True), transient=True)
            state["bar"].start()
            state["task"] = state["bar"].add_task(stage, total=total)
        if state["bar"] is not None:
            state["bar"].update(state["task"], completed=state["done"], description=stage)

    try:
        yield report
    finally:
        if state["bar"] is not None:
            state["bar"].stop()


def evaluate(prep: Prepared, idx: ProblemIndex, assignment, cm: CostModel, mesh_shape, axis_names,
             cluster: ClusterSpec, memory_budget: float, sm: StepMemory, sharded_outputs: bool = False) -> Plan:
    gm, cap = prep.gm, prep.captured
    chosen = idx.chosen(assignment)
    low = plan_reshards(gm, chosen, cm.mesh_shape, sharded_outputs)
    colls = collectives(low, cm, axis_names)
    recompute = recomputed_layers(gm, idx.recompute_counts(assignment), idx.selective_counts(assignment),
                                  idx.offload_counts(assignment))
    cores = {name for names in recompute.get("attention", {}).get("regions", {}).values() for name in names}
    instance_of = {n: meta_of(n).layer.layer for n in chosen
                   if n.op == "call_function" and meta_of(n).layer and (meta_of(n).layer.layer in recompute["layers"]
                                                                        or n.name in cores)}
    # Recomputed layers and attention cores run their forward again in backward, with the collectives
    # they read through.
    recomputed_nodes = {n.name for n in instance_of}
    rerun = [{**c, "phase": "backward", "recompute": True} for c in colls
             if c["phase"] == "forward" and c["node"] in recomputed_nodes]
    recompute_compute = sum(cm.forward_compute_seconds(n, chosen[n]) for n in instance_of)
    colls += rerun
    # Offloaded layers' saved activations go to host memory in forward and come back in backward.
    off_layers = set(recompute.get("offload", {}).get("layers", ()))
    offload_seconds = 0.0
    if off_layers:
        saved = sum(cm.activation_bytes(n, chosen[n]) for n in chosen
                    if n.op == "call_function" and meta_of(n).layer and meta_of(n).layer.layer in off_layers)
        recompute["offload"]["bytes"] = saved
        offload_seconds = 2 * saved / cluster.host_link_bandwidth
    comm_by_node: dict = {}
    for c in colls:
        comm_by_node[c["node"]] = comm_by_node.get(c["node"], 0.0) + c["seconds"]

    params, inputs, nodes, param_bytes, zero, offload = {}, {}, [], {}, {}, {}
    mem = {"params": 0.0, "grads": 0.0, "optimizer": 0.0, "host": 0.0}
    compute = optim = 0.0
    for n, s in chosen.items():
        role = meta_of(n).role
        if n.op == "placeholder":
            if role and role.kind == "param":
                lay = s.outputs[0]
                params[role.target] = format_layout(lay)
                if s.zero is not None:
                    zero[role.target] = {"stage": s.zero.stage, "axis": axis_names[s.zero.axis], "dim": s.zero.dim,
                                         "bucket": sm.gather_bucket[n]}
                if s.offload:
                    host = cm.host_bytes(n, lay)
                    freed = sum(cm.param_bytes(n, lay)) - sum(cm.param_bytes(n, lay, None, True))
                    offload[role.target] = {"host_bytes": host, "device_bytes_freed": max(freed, 0.0)}
                    mem["host"] += host
                p, g, o = cm.param_bytes(n, lay, s.zero, s.offload)
                mem["params"] += p
                mem["grads"] += g
                mem["optimizer"] += o
                param_bytes[role.target] = p + g + o
                optim += cm.optimizer_seconds(n, lay, s.zero, s.offload)
            elif role and role.kind == "input" and s.outputs:
                inputs[role.target] = format_layout(s.outputs[0])
            continue
        c = cm.compute_seconds(n, s)
        a = cm.activation_bytes(n, s)
        compute += c
        tag = meta_of(n).layer
        root = idx.strategies.root_of(n)
        nodes.append({
            "name": n.name, "op": op_name(n),
            "inputs": [format_layout(l) for l in s.inputs], "outputs": [format_layout(l) for l in s.outputs],
            "split_axes": [axis_names[a] for a, f in enumerate(s.splits_work) if f],
            "compute_seconds": c, "comm_seconds": comm_by_node.get(n.name, 0.0), "activation_bytes": a,
            "layer": tag.layer if tag else None, "layer_class": tag.cls if tag else None,
            "follows": None if root is n else root.name,
            "shape": list(n.meta["val"].shape) if isinstance(n.meta.get("val"), torch.Tensor) else None,
        })
    comm_axis = {name: 0.0 for name in axis_names}
    for c in colls:
        comm_axis[c["axis"]] += c["seconds"]
    timeline, peak_point = _timeline(sm.walk(assignment))
    mem.update(activations=timeline["end_of_forward"]["activations"], peak=peak_point.total,
               peak_point=timeline["peak_index"], peak_at={"phase": peak_point.phase, "node": peak_point.name,
                                                           **peak_point.bytes},
               memory_budget=memory_budget, timeline=timeline["points"], by_param=param_bytes)
    step = compute + recompute_compute + sum(comm_axis.values()) + optim + offload_seconds
    return Plan(
        model={"class": cap.model_class, "fingerprint": prep.fingerprint,
               "num_params": sum(int(n.meta["val"].numel()) for n in gm.graph.nodes
                                 if n.op == "placeholder" and meta_of(n).role and meta_of(n).role.kind == "param"),
               "input_shapes": [list(s) if s is not None else None for s in cap.input_shapes],
               "layers": layer_counts(gm)},
        cluster=cluster.to_dict(),
        mesh={"shape": list(mesh_shape), "axes": list(axis_names)},
        params=params, inputs=inputs, nodes=nodes, collectives=colls, memory=mem, step_time=step,
        breakdown={"compute": compute, "communication": comm_axis, "optimizer": optim,
                   "recompute": recompute_compute, **({"offload": offload_seconds} if off_layers else {})},
        solver={}, sharded_outputs=sharded_outputs, recompute=recompute, zero=zero, offload=offload,
    )


def _smallest_valid_budget(prob, sm: StepMemory, above: float | None = None):
    """The smallest budget with a valid plan, and that plan; None where there is none, or none below
    ``above``.

    The memory-only minimum ignores seconds, so it may pick a resharding that cannot happen (priced
    INFEASIBLE); starting from it, look for the least budget at which the time-aware solve avoids them.
    """
    found = minimum_budget(prob, sm, above=above)
    if found is None:
        return None
    lower_bound, least = found
    if prob.objective(least) < INFEASIBLE:          # the least peak's own layout is a valid plan
        return lower_bound, least
    for factor in (1.0 + 1e-6, 1.01, 1.05, 1.1, 1.25, 1.5, 2.0, 3.0, 5.0, 10.0, 100.0):
        try:
            sol = solve_under_budget(prob, sm, lower_bound * factor, time_limit=math.inf, node_limit=NODE_LIMIT)
        except AutoparError:        # no layout found within the node limit at this budget: try a larger one
            continue
        if sol.status != "infeasible" and prob.objective(sol.assignment) < INFEASIBLE:
            return sm.peak(sol.assignment)[1], sol.assignment
    return None


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


def _timeline(walk) -> tuple[dict, object]:
    """The plan's memory timeline from the step's points: at most ~200 of them, always keeping the
    highest of each window so that the peak stays visible."""
    totals = [p.total for p in walk]
    k = max(range(len(walk)), key=totals.__getitem__)
    stride = max(1, len(walk) // 200)
    keep = [max(range(i, min(i + stride, len(walk))), key=totals.__getitem__) for i in range(0, len(walk), stride)]
    fwd = [p for p in walk if p.phase == "forward"]
    points = [{"phase": walk[i].phase, "node": walk[i].name, **walk[i].bytes} for i in keep]
    return {"points": points, "peak_index": k, "end_of_forward": (fwd[-1] if fwd else walk[0]).bytes}, walk[k]


def _raise_infeasible(prep, infeasible, cluster, memory_budget):
    best = None
    for shape, names, prob, idx, cm, sm in infeasible:
        found = _smallest_valid_budget(prob, sm, above=None if best is None else best[0])
        if found is not None and (best is None or found[0] < best[0]):
            best = (*found, shape, names, idx, cm, sm)
    if best is None:
        raise InfeasiblePlanError(f"no valid plan exists on {cluster.name or cluster.num_devices} devices at any "
                                  f"budget: the pinned layouts cannot be reached; relax the pins",
                                  memory_budget=memory_budget)
    need, assignment, shape, names, idx, cm, sm = best
    p = evaluate(prep, idx, assignment, cm, shape, names, cluster, memory_budget, sm)
    consumers = [(f"param {k} (+grad, optimizer)", v) for k, v in p.memory["by_param"].items()]
    consumers += [(f"activations of {n['name']}", n["activation_bytes"]) for n in p.nodes]
    consumers = sorted(consumers, key=lambda x: -x[1])[:5]
    top = ", ".join(f"{name} ({b / 2**20:.1f} MiB)" for name, b in consumers)
    host = ""
    if p.offload and not cluster.host_is_device and p.memory["host"] * cluster.devices_per_node > cluster.host_memory:
        host = (f" That plan offloads optimizer states, {p.memory['host'] * cluster.devices_per_node / 1e9:.1f} GB per "
                f"node of host memory, more than the node's {cluster.host_memory / 1e9:.1f} GB (host_memory): the "
                f"smallest budget within the host's memory is higher.")
    raise InfeasiblePlanError(
        f"no plan fits {memory_budget / 2**30:.3f} GiB per device on {cluster.name or cluster.num_devices} "
        f"(meshes tried: {[list(s) for s, *_ in infeasible]}). The smallest feasible budget is "
        f"{need / 2**30:.3f} GiB ({need:.0f} bytes), on mesh {list(shape)}. Largest consumers there: {top}.{host} "
        f"Raise memory_budget, use more devices, or reduce the batch or sequence length.",
        memory_budget=memory_budget, min_feasible_budget=need, largest_consumers=consumers)
