"""Planning: capture, annotate, solve for every candidate mesh, keep the fastest feasible plan."""
from __future__ import annotations

import contextlib
import dataclasses
import hashlib
import logging
import math
import time
import warnings
from dataclasses import dataclass

import torch
import torch.fx as fx

from autopar.cluster import ClusterSpec, default_axis_names
from autopar.errors import AutoparError, AutoparWarning
from autopar.forked import Forked, fork_available
from autopar.infeasible import check_host_memory, raise_infeasible
from autopar.mesh_search import MeshCandidate, search
from autopar.passes.capture import CapturedProgram, batch_of, rebatch
from autopar.passes.costs import CostModel, OptimizerSpec
from autopar.passes.meta import meta_of
from autopar.passes.precision import Precision, dtype_name, resolve_precision
from autopar.passes.ilp_build import build_problem
from autopar.passes.runner import PassRunner
from autopar.pass_pipeline import FrontEnd, analysis_passes, front_end, mesh_passes, new_runner
from autopar.pipeline_search import pipeline_meshes, plan_pipeline
from autopar.plan import Plan
from autopar.plan_assembly import objective_seconds
from autopar.solver import GAP, greedy

log = logging.getLogger("autopar")

PLANNING_PHASES = ("capture", "passes", "build", "solve", "evaluate")
# Plan the pipeline meshes of a mesh search in forked child processes, beside the other meshes (Linux);
# False plans them one after the other in this process, with the same plan.
FORK_PIPELINE_MESHES = True


@dataclass
class Prepared:
    captured: CapturedProgram
    gm: fx.GraphModule
    runner: PassRunner
    fingerprint: str
    capture_seconds: float = 0.0   # 0.0 when the caller ran the front end
    precision: Precision | None = None


def prepare(model, example_inputs, example_kwargs, cluster: ClusterSpec, *, skip_passes=(), insert_passes=(),
            front: FrontEnd | None = None, precision: str | Precision | None = None, programs: dict | None = None,
            fused: bool = False) -> Prepared:
    """Capture the model and run the passes that do not depend on the mesh; ``front`` is a front end
    already run (``autopar.compile`` runs it once and plans from it). ``programs`` (batch size -> a
    capture before its passes) holds the captures made so far: with two of them at batches of 2 or
    more, a third batch's program is derived from them rather than captured (passes/capture.py
    ``rebatch``), and a new capture is added to it. ``fused``: for the program the Triton backend runs."""
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
    gm = front.runner.run(analysis_passes(cluster.device_type, fused), front.gm, "analysis")
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
         memory_budget: float | None = None, mesh_shape=None, axis_names=None, time_limit: float | None = None,
         optimizer: OptimizerSpec | None = None, progress: bool | None = None, skip_passes=(),
         insert_passes=(), pins: dict | None = None, kernels: str = "aten", sharded_outputs: bool = False,
         recompute: bool | dict = True, cost_model: type[CostModel] = CostModel,
         front: FrontEnd | None = None, microbatches: int | None = None, schedule: str | None = None,
         pipeline: bool | None = None, precision: str | None = None, overlap: bool = True,
         bucket_mb: float | None = None, reduce_dtype: str | torch.dtype | None = None) -> Plan:
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
    ``time_limit`` bounds each solver run in seconds; None (the default) stops each at a number of
    branch-and-bound nodes instead (``solver.NODE_LIMIT``, with ``solver.GUARD_SECONDS`` of wall clock as
    a guard), so the plan does not depend on the machine's load.
    ``precision`` is Lightning's name of the training precision: "32-true", "bf16-mixed" (autocast's
    bfloat16 compute and activations over float32 master weights and optimizer states) or "bf16-true";
    None trains in the model's own dtype (passes/precision.py). ``reduce_dtype`` is what "bf16-mixed"
    sums the weights' gradients over ranks in: "float32" (the default, their own dtype, as Megatron-LM
    and torchtitan do) or "bfloat16" (the copies the weights are computed with, half the bytes, as
    FSDP2 does by default); the cost and memory models price it and ``plan.reduce_dtype`` records it.
    ``overlap=False`` plans for the program ``compile(overlap=False)`` runs: no communication hidden,
    no gradient buckets, ZeRO-2 reduce-scatters waited at once (its time and memory).
    ``bucket_mb`` fixes the size in MiB of the buckets data-parallel gradients are all-reduced in during
    backward (the solver's hiding credits, the replay and the memory model price it); None lets the
    planner choose it among ``passes.exposure.BUCKET_CANDIDATES_MB`` by the replay of the chosen layout
    (``plan.bucket_mb``; docs/cost-model.md, "Overlap").
    """
    t0 = time.perf_counter()
    if mesh_shape is not None:
        cluster = _with_mesh(cluster, mesh_shape, axis_names)
    memory_budget = float(memory_budget) if memory_budget is not None else cluster.usable_memory
    check_bucket_mb(bucket_mb)
    prec = resolve_precision(precision, model, reduce_dtype)
    if front is not None and front.precision != prec:
        raise AutoparError(f"the front end was captured under precision {front.precision.to_dict()}, not {prec.to_dict()}")
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
    with _progress(progress, total=2 + 4 * len(candidates)) as report, _rare_collections():
        prep = None
        # Captures before their passes, by batch size: pipeline meshes derive their microbatch programs
        # from two of them where they can rather than capture again.
        programs = {} if any("pp" in names for _, names in candidates) else None
        if front is not None and front.raw is not None and programs is not None and batch_of(front.raw):
            programs[batch_of(front.raw)] = front.raw
        if any("pp" not in names for _, names in candidates):
            report("capturing")
            prep = prepare(model, example_inputs, example_kwargs, cluster, skip_passes=skip_passes,
                           insert_passes=insert_passes, front=front, precision=prec, programs=programs,
                           fused=fused)
        best, tried, meshes = None, [], []
        pipe = {k: 0.0 for k in PLANNING_PHASES}        # seconds of the pipeline meshes, by phase

        def pipeline_mesh(shape, names, report):
            """The pipeline plan of one mesh (None when none fits), its entries of ``tried`` and its
            seconds by phase."""
            entries, seconds = [], {k: 0.0 for k in PLANNING_PHASES}
            try:
                p = plan_pipeline(model, cluster, shape, names, example_inputs, example_kwargs, memory_budget,
                                  optimizer, fused, pins, sharded_outputs, recompute, time_limit, skip_passes,
                                  insert_passes, microbatches, schedule, entries, report, cost_model,
                                  added=cluster.mesh_shape is None, timings=seconds, precision=prec,
                                  programs=programs)
            except AutoparError as e:
                if cluster.mesh_shape is not None:
                    raise
                # A pipeline mesh the planner added itself: this model cannot use it.
                entries.append({"mesh": list(shape), "status": "skipped", "reason": str(e)})
                p = None
            return p, entries, seconds

        # The pipeline meshes are planned in child processes while this one builds the other meshes'
        # problems: they share nothing until the search compares their plans.
        forked = {}
        if FORK_PIPELINE_MESHES and cluster.mesh_shape is None and len(candidates) > 1 and fork_available():
            forked = {shape: Forked(pipeline_mesh, shape, names, lambda stage: log.info("planning: %s", stage))
                      for shape, names in candidates if "pp" in names}
        t_build, t_pipeline = time.perf_counter(), 0.0
        try:
            for shape, names in candidates:
                if "pp" in names:
                    t_mesh = time.perf_counter()
                    job = forked.pop(shape, None)
                    p, entries, seconds = job.result() if job else pipeline_mesh(shape, names, report)
                    tried += entries
                    for k in PLANNING_PHASES:
                        pipe[k] += seconds[k]
                    if p is not None and (best is None or objective_seconds(p) < objective_seconds(best)):
                        best = p
                    t_pipeline += time.perf_counter() - t_mesh
                    continue
                report(f"mesh {shape}: strategies")
                prep.runner.run(mesh_passes(shape, offload=offload), prep.gm, f"mesh {shape}")
                cm = cost_model(cluster, shape, optimizer, fused=fused)
                report(f"mesh {shape}: costs")
                prob, idx = build_problem(prep.gm, cm, memory_budget, pins, sharded_outputs, recompute, overlap,
                                          bucket_mb=bucket_mb)
                quick = greedy(prob)
                meshes.append(MeshCandidate(len(meshes), shape, names, prob, idx, cm, prob.lower_bound(),
                                            prob.objective(quick) if prob.feasible(quick) else math.inf,
                                            prep.gm, sharded_outputs, overlap, bucket_mb))
        finally:
            for job in forked.values():     # left uncollected by an error
                job.cancel()
        t_build = time.perf_counter() - t_build - t_pipeline
        t_search = time.perf_counter()
        best, searched, infeasible, t_eval = search(meshes, best, prep, cluster, memory_budget, sharded_outputs,
                                                     time_limit, report)
        tried += searched
        t_search = time.perf_counter() - t_search
        if best is None and not infeasible and tried and all("pipeline" in t for t in tried) \
                and cluster.mesh_shape is not None:
            from autopar.pipelining import no_fit

            raise no_fit(tried[-1]["mesh"][0], tried[-1]["pipeline"]["microbatches"], memory_budget)
        if best is None:
            raise_infeasible(prep, infeasible, cluster, memory_budget)
        check_host_memory(best, cluster)
        best.precision = prec.name
        best.reduce_dtype = dtype_name(prec.grad_reduce_dtype) if prec.mixed else None
        best.extra["warnings"] = idle_axis_warnings(prep.gm, best) if prep is not None else []
        for w in best.extra["warnings"]:
            warnings.warn(w, AutoparWarning, stacklevel=2)
        best.solver["candidates"] = tried
        best.solver["gap_tolerance"] = GAP
        front_passes = 0.0 if prep is None else sum(r.seconds for r in prep.runner.records
                                                    if not r.stage.startswith("mesh"))
        own = {"capture": 0.0 if prep is None else prep.capture_seconds, "passes": front_passes,
               "build": t_build, "solve": t_search - t_eval, "evaluate": t_eval}
        best.solver["timings"] = {k: own[k] + pipe[k] for k in PLANNING_PHASES}
        best.solver["planning_seconds"] = time.perf_counter() - t0
        best.solver["passes"] = [{"name": r.name, "stage": r.stage, "seconds": r.seconds, "skipped": r.skipped}
                                 for r in (prep.runner.records if prep is not None else [])]
        report("done")
    return best


def check_bucket_mb(bucket_mb) -> None:
    """A gradient bucket size in MiB is a finite number, 0 or more (0: one gradient per bucket), or None."""
    if bucket_mb is not None and (isinstance(bucket_mb, bool) or not isinstance(bucket_mb, (int, float))
                                  or not math.isfinite(bucket_mb) or bucket_mb < 0):
        raise AutoparError(f"bucket_mb={bucket_mb!r}: a gradient bucket's size in MiB is a finite number, 0 or "
                           f"more, or None for the planner to choose it")


def offload_offered(cluster: ClusterSpec, pins) -> bool:
    """Whether parameters may keep their optimizer state in host memory: on a cluster whose host is
    not its devices' memory and whose host figures are known, or where a pin asks for it (which then
    needs the host figures; on CPU processes, to run the offloaded program where it frees nothing)."""
    if any(isinstance(p, dict) and p.get("offload") for p in (pins or {}).values()):
        cluster.require_host_figures("a pin that offloads an optimizer state")
        return True
    return cluster.has_host_figures and not cluster.host_is_device


def idle_axis_warnings(gm, p: Plan) -> list[str]:
    """Warnings for mesh axes along which no work is split (every device along one computes the same
    thing), and for inputs whose batch dim does not divide by an axis, so the data cannot be split along
    it and the plan falls back to other dims (or to none)."""
    out = []
    split = {a for n in p.nodes for a in n.split_axes}
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


def _with_mesh(cluster, mesh_shape, axis_names):
    shape = tuple(mesh_shape)
    names = tuple(axis_names) if axis_names else default_axis_names(shape)
    return dataclasses.replace(cluster, mesh_shape=shape, axis_names=names)


@contextlib.contextmanager
def _rare_collections():
    """Python's cyclic garbage collector run far less often while planning: planning makes millions of
    small objects that live on (strategies, cost-table keys, the step's memory events), and every
    collection of the older generations walks all of them, a cost that grows with the model (on
    LLaMA-2-70B a quarter of the planning's CPU seconds; bench/README.md). The memory it holds
    back is small (under 2% of the process's peak there)."""
    import gc

    thresholds = gc.get_threshold()
    gc.set_threshold(max(thresholds[0], 100_000), max(thresholds[1], 50), max(thresholds[2], 100))
    try:
        yield
    finally:
        gc.set_threshold(*thresholds)


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


