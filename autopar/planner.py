"""Planning: capture, annotate, solve for every candidate mesh, keep the fastest feasible plan."""
from __future__ import annotations

import contextlib
import dataclasses
import hashlib
import logging
import math
import time
from concurrent.futures import FIRST_COMPLETED, ThreadPoolExecutor, wait
from dataclasses import dataclass

import torch
import torch.fx as fx

from autopar.cluster import ClusterSpec, default_axis_names
from autopar.errors import AutoparError, InfeasiblePlanError
from autopar.layout import format_layout
from autopar.passes.capture import CapturedProgram, capture
from autopar.passes.costs import INFEASIBLE, CostModel, OptimizerSpec, VIEW_OPS, count_saving_consumers
from autopar.passes.layers import layer_counts, layer_instances, layers_pass
from autopar.passes.lowering import collectives, lower
from autopar.passes.memory import saved_activations_pass
from autopar.passes.meta import meta_of, op_name
from autopar.passes.normalize import normalize_pass
from autopar.passes.problem import ProblemIndex, build_problem
from autopar.passes.runner import PassRunner
from autopar.passes.strategies import requires_grad, root_of, strategies_pass
from autopar.plan import Plan
from autopar.solver import GAP, greedy, minimum_feasible_budget, solve

log = logging.getLogger("autopar")

SOLVER_THREADS = 2   # candidate meshes solved at once


@dataclass
class Prepared:
    captured: CapturedProgram
    gm: fx.GraphModule
    runner: PassRunner
    fingerprint: str
    capture_seconds: float = 0.0


def prepare(model, example_inputs, example_kwargs, cluster: ClusterSpec, *, skip_passes=()) -> Prepared:
    """Capture the model and run the passes that do not depend on the mesh."""
    t0 = time.perf_counter()
    captured = capture(model, example_inputs, example_kwargs)
    capture_seconds = time.perf_counter() - t0
    runner = PassRunner([normalize_pass, layers_pass, _saved_pass(cluster.device_type)],
                        skip=frozenset(skip_passes))
    gm = runner(captured.gm)
    count_saving_consumers(gm)
    return Prepared(captured, gm, runner, model_fingerprint(model), capture_seconds)


def _saved_pass(device_type):
    def saved_activations_pass_for_target(gm):
        return saved_activations_pass(gm, target_device=device_type)
    saved_activations_pass_for_target.__name__ = "saved_activations_pass"
    return saved_activations_pass_for_target


def model_fingerprint(model: torch.nn.Module) -> str:
    h = hashlib.sha256(type(model).__qualname__.encode())
    for name, p in model.named_parameters():
        h.update(f"{name}:{tuple(p.shape)}:{p.dtype};".encode())
    return h.hexdigest()[:16]


def default_optimizer(model) -> OptimizerSpec:
    dtype = next((p.dtype for p in model.parameters()), torch.float32)
    # Adam keeps two fp32 states; low-precision parameters also keep an fp32 master copy (ZeRO's K=12).
    return OptimizerSpec(8.0 if dtype == torch.float32 else 12.0)


def plan(model: torch.nn.Module, cluster: ClusterSpec, example_inputs=(), example_kwargs=None, *,
         memory_budget: float | None = None, mesh_shape=None, axis_names=None, time_limit: float = 60.0,
         optimizer: OptimizerSpec | None = None, progress: bool | None = None, skip_passes=(),
         pins: dict | None = None, kernels: str = "aten", sharded_outputs: bool = False,
         recompute: bool | dict = True) -> Plan:
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
    """
    t0 = time.perf_counter()
    if mesh_shape is not None:
        cluster = _with_mesh(cluster, mesh_shape, axis_names)
    budget = float(memory_budget) if memory_budget is not None else cluster.usable_memory
    optimizer = optimizer or default_optimizer(model)
    if kernels not in ("auto", "triton", "aten"):
        raise ValueError(f"kernels must be 'auto', 'triton' or 'aten', got {kernels!r}")
    fused = kernels == "triton" or (kernels == "auto" and cluster.device_type == "cuda")
    candidates = cluster.mesh_candidates() if cluster.mesh_shape is None else [cluster.mesh_shape]
    with _progress(progress, total=2 + 4 * len(candidates)) as report:
        report("capturing")
        prep = prepare(model, example_inputs, example_kwargs, cluster, skip_passes=skip_passes)
        meshes, t_build = [], time.perf_counter()
        for shape in candidates:
            names = tuple(cluster.axis_names) if cluster.mesh_shape is not None and cluster.axis_names \
                else default_axis_names(shape)
            if "pp" in names:
                raise AutoparError(f"mesh axes {names} name a pipeline axis 'pp', but pipeline parallelism is "
                                   f"not implemented yet (docs/status.md); name the axes yourself "
                                   f"(axis_names=...) to use that axis for data or tensor sharding")
            report(f"mesh {shape}: strategies")
            strategies_pass(prep.gm, shape)
            cm = CostModel(cluster, shape, optimizer, fused=fused)
            report(f"mesh {shape}: costs")
            prob, idx = build_problem(prep.gm, cm, budget, pins, sharded_outputs, recompute)
            quick = greedy(prob)
            meshes.append(_Mesh(len(meshes), shape, names, prob, idx, cm, _strategies_of(prep.gm),
                                prob.lower_bound(), prob.objective(quick) if prob.feasible(quick) else math.inf))
        t_build = time.perf_counter() - t_build
        t_search = time.perf_counter()
        best, tried, infeasible, t_eval = _search(meshes, prep, cluster, budget, sharded_outputs, time_limit,
                                                  report)
        t_search = time.perf_counter() - t_search
        if best is None:
            _raise_infeasible(prep, infeasible, cluster, budget)
        best.solver["candidates"] = tried
        best.solver["gap_tolerance"] = GAP
        best.solver["timings"] = {"capture": prep.capture_seconds,
                                  "passes": sum(r.seconds for r in prep.runner.records),
                                  "build": t_build, "solve": t_search - t_eval, "evaluate": t_eval}
        best.solver["planning_seconds"] = time.perf_counter() - t0
        best.solver["passes"] = [{"name": r.name, "seconds": r.seconds, "skipped": r.skipped}
                                 for r in prep.runner.records]
        report("done")
    return best


@dataclass
class _Mesh:
    position: int              # in the cluster's candidate order, which breaks ties between equal plans
    shape: tuple
    names: tuple
    prob: object
    idx: ProblemIndex
    cm: CostModel
    strategies: dict           # node -> its StrategySet on this mesh
    lower_bound: float         # no layout on this mesh is faster
    estimate: float            # the greedy layout's step time (inf when it does not fit)


def _strategies_of(gm) -> dict:
    return {n: meta_of(n).strategies for n in gm.graph.nodes if meta_of(n).strategies is not None}


def _search(meshes: list[_Mesh], prep, cluster, budget, sharded_outputs, time_limit, report):
    """Solve the candidate meshes and keep the plan of least step time.

    The mesh whose greedy layout is fastest goes first, and the step time of the best plan so far bounds
    the rest: a mesh whose lower bound is no better is not solved, and the solver stops a mesh as soon
    as it proves it cannot beat it. A plan's step time is never below its problem's objective (it adds
    the reshardings recomputed layers run again), so neither shortcut loses the best plan. Two meshes
    are solved at a time (the solver runs outside Python's lock); the plans are evaluated here.
    """
    order = sorted(meshes, key=lambda m: (m.estimate, m.lower_bound, m.position))
    best, best_key, tried, infeasible, t_eval = None, None, {}, [], 0.0
    workers = max(1, min(SOLVER_THREADS, len(order)))
    with ThreadPoolExecutor(max_workers=workers) as pool:
        running: dict = {}
        while order or running:
            while order and len(running) < workers:
                m = order.pop(0)
                bound = None if best is None else best.step_time
                if bound is not None and m.lower_bound >= bound:
                    tried[m.position] = {"mesh": list(m.shape), "status": "bounded", "objective": None,
                                         "lower_bound": m.lower_bound, "seconds": 0.0, "variables": 0,
                                         "constraints": 0, "gap": None}
                    continue
                report(f"mesh {m.shape}: solving {len(m.prob.choices)} decisions, "
                       f"{len(m.prob.edges) + len(m.prob.shared)} edges")
                running[pool.submit(solve, m.prob, time_limit=time_limit, bound=bound)] = m
            if not running:
                break
            done, _ = wait(running, return_when=FIRST_COMPLETED)
            for fut in sorted(done, key=lambda f: running[f].position):
                m = running.pop(fut)
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
                    infeasible.append((m.shape, m.names, m.prob, m.idx, m.cm))
                    continue
                report(f"mesh {m.shape}: evaluating")
                t0 = time.perf_counter()
                _restore_strategies(m.strategies)
                p = evaluate(prep, m.idx, sol.assignment, m.cm, m.shape, m.names, cluster, budget, sharded_outputs)
                p.alternatives = alternatives(prep.gm, m.prob, m.idx, sol.assignment, m.cm, m.names)
                p.solver.update(status=sol.status, seconds=sol.seconds, variables=sol.num_variables,
                                constraints=sol.num_constraints, backend=sol.backend, gap=sol.gap)
                if best is None or (p.step_time, m.position) < best_key:
                    best, best_key = p, (p.step_time, m.position)
                t_eval += time.perf_counter() - t0
    infeasible.sort(key=lambda item: [m.shape for m in meshes].index(item[0]))
    return best, [tried[k] for k in sorted(tried)], infeasible, t_eval


def _restore_strategies(strategies: dict) -> None:
    for n, sset in strategies.items():
        meta_of(n).strategies = sset


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
             cluster: ClusterSpec, budget: float, sharded_outputs: bool = False) -> Plan:
    gm, cap = prep.gm, prep.captured
    chosen = {}
    for n in gm.graph.nodes:
        if n.op in ("placeholder", "call_function") and meta_of(n).strategies is not None:
            chosen[n] = meta_of(n).strategies.strategies[idx.option_of(n, assignment)]
    low = lower(gm, chosen, cm, sharded_outputs)
    colls = collectives(low, cm, axis_names)
    recompute = recomputed_layers(gm, idx.recompute_counts(assignment))
    instance_of = {n: meta_of(n).layer.layer for n in chosen
                   if n.op == "call_function" and meta_of(n).layer and meta_of(n).layer.layer in recompute["layers"]}
    # Recomputed layers run their forward again in backward, with the collectives inside them.
    recomputed_nodes = {n.name for n in instance_of}
    rerun = [{**c, "phase": "backward", "recompute": True} for c in colls
             if c["phase"] == "forward" and c["node"] in recomputed_nodes]
    recompute_compute = sum(cm.forward_compute_seconds(n, chosen[n]) for n in instance_of)
    colls += rerun
    comm_by_node: dict = {}
    for c in colls:
        comm_by_node[c["node"]] = comm_by_node.get(c["node"], 0.0) + c["seconds"]

    params, inputs, nodes, param_bytes = {}, {}, [], {}
    mem = {"params": 0.0, "grads": 0.0, "optimizer": 0.0}
    compute = optim = 0.0
    acts = []
    for n, s in chosen.items():
        role = meta_of(n).role
        if n.op == "placeholder":
            if role and role.kind == "param":
                lay = s.outputs[0]
                params[role.target] = format_layout(lay)
                p, g, o = cm.param_bytes(n, lay)
                mem["params"] += p
                mem["grads"] += g
                mem["optimizer"] += o
                param_bytes[role.target] = p + g + o
                optim += cm.optimizer_seconds(n, lay)
            elif role and role.kind == "input" and s.outputs:
                inputs[role.target] = format_layout(s.outputs[0])
            continue
        c = cm.compute_seconds(n, s)
        a = cm.activation_bytes(n, s)
        compute += c
        acts.append((n, a))
        tag = meta_of(n).layer
        root = root_of(n)
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
    boundary = _boundary_bytes(instance_of, chosen, cm)
    full = {}
    for n, a in acts:
        if n in instance_of:
            full[instance_of[n]] = full.get(instance_of[n], 0.0) + a
    mem["activations"] = sum(a for n, a in acts if n not in instance_of) + sum(boundary.values())
    timeline, peak = _timeline(gm, chosen, acts, mem, cm, instance_of, boundary, full)
    mem.update(peak=peak, budget=budget, timeline=timeline, by_param=param_bytes)
    step = compute + recompute_compute + sum(comm_axis.values()) + optim
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
                   "recompute": recompute_compute},
        solver={}, sharded_outputs=sharded_outputs, recompute=recompute,
    )


def alternatives(gm, prob, idx: ProblemIndex, assignment, cm: CostModel, axis_names, top: int = 3) -> dict:
    """For every decision: the chosen option and the ``top`` cheapest others, each with its own cost,
    the resharding it would cause with its neighbours (held at their chosen layouts) and its memory."""
    from autopar.passes.problem import strategy_of
    from autopar.passes.strategies import input_values

    chosen = {n: meta_of(n).strategies.strategies[idx.option_of(n, assignment)]
              for n in gm.graph.nodes if n.op in ("placeholder", "call_function") and meta_of(n).strategies}
    members: dict = {}
    for n in chosen:
        members.setdefault(root_of(n), []).append(n)
    fwd_mem = {ci: per for ci, per in prob.memory[0].terms} if prob.memory else {}
    touching: dict = {}      # choice -> the shared values it produces or reads
    for e in prob.shared:
        for c in {e.src, *(c for c, _ in e.readers)}:
            touching.setdefault(c, []).append(e)
    pairs: dict = {}         # choice -> the plain edges it is an end of
    for e in prob.edges:
        for c in {e.src, e.dst}:
            pairs.setdefault(c, []).append(e)
    out = {}
    for key, roots in idx.roots_of_key.items():
        rep = roots[0]
        ci = idx.choice_of_key[key]
        choice = prob.choices[ci]
        if len(choice.costs) < 2:
            continue
        scored = []
        for o in range(len(choice.costs)):
            trial = list(assignment)
            trial[ci] = o
            edge = sum(e.seconds(trial) for e in touching.get(ci, ()))
            edge += sum(e.count * e.cost[trial[e.src]][trial[e.dst]] for e in pairs.get(ci, ()))
            scored.append((choice.costs[o] + edge / choice.count, o, edge / choice.count))
        scored.sort()
        keep = [o for _, o, _ in scored if o == assignment[ci]] + [o for _, o, _ in scored if o != assignment[ci]][:top]
        entries = []
        for o in keep:
            total, _, edge = next(x for x in scored if x[1] == o)
            colls = []
            for m in members.get(rep, []):
                s = strategy_of(m, o)
                colls += _op_collectives(cm, m, s, axis_names)
                if m.op == "call_function":
                    for k, v in enumerate(input_values(m)):
                        if root_of(v.node) is not rep and v.node in chosen:
                            colls += _edge_collectives(cm, v, chosen[v.node].outputs[v.index], s, k, v.node.name, axis_names)
                for c in m.users:
                    if c.op != "call_function" or root_of(c) is rep or c not in chosen:
                        continue
                    for k, v in enumerate(input_values(c)):
                        if v.node is m:
                            colls += _edge_collectives(cm, v, s.outputs[v.index], chosen[c], k, c.name, axis_names)
            mem = fwd_mem.get(ci, [0.0] * len(choice.costs))[o] / choice.count
            rs = meta_of(rep).strategies.strategies[o]
            entries.append({"layout": choice.labels[o] if choice.labels else str(o), "chosen": o == assignment[ci],
                            "inputs": [format_layout(l) for l in rs.inputs],
                            "own_seconds": choice.costs[o], "resharding_seconds": edge, "total_seconds": total,
                            "memory_bytes": mem, "collectives": colls})
        name = meta_of(rep).role.target if rep.op == "placeholder" else rep.name
        out[name] = entries
    return out


def _op_collectives(cm, node, s, axis_names):
    return [{"kind": oc.kind, "axis": axis_names[oc.axis], "phase": oc.phase, "bytes": int(oc.nbytes),
             "seconds": cm.op_collective_seconds(oc), "neighbor": node.name, "value": node.name}
            for oc in cm.op_collectives(node, s)]


def _edge_collectives(cm, v, src, dst_strategy, k, neighbor, axis_names):
    from autopar.passes.resharding import collective_seconds
    from autopar.passes.strategies import value_info

    steps = cm.resharding(v, src, None, dst_strategy, k)
    if steps is None:
        return [{"kind": "impossible", "neighbor": neighbor, "value": v.node.name}]
    info = value_info(v)
    out = []
    for st in steps:
        bw, lat = cm.links[st.axis]
        for kind, phase, nbytes in st.collectives(info.dtype.itemsize, requires_grad(v.node)):
            out.append({"kind": kind, "axis": axis_names[st.axis], "phase": phase, "bytes": int(nbytes),
                        "seconds": collective_seconds(kind, nbytes, cm.mesh_shape[st.axis], bw, lat),
                        "neighbor": neighbor, "value": v.node.name})
    return out


def _smallest_valid_budget(prob):
    """The smallest budget with a valid plan, and that plan.

    The memory-only minimum ignores seconds, so it may pick a resharding that cannot happen (priced
    INFEASIBLE); starting from it, look for the least budget at which the time-aware solve avoids them.
    """
    lower_bound, _ = minimum_feasible_budget(prob)
    for factor in (1.0 + 1e-6, 1.01, 1.05, 1.1, 1.25, 1.5, 2.0, 3.0, 5.0, 10.0, 100.0):
        trial = dataclasses.replace(prob, memory_limit=lower_bound * factor)
        sol = solve(trial, time_limit=30.0)
        if sol.status != "infeasible" and prob.objective(sol.assignment) < INFEASIBLE:
            return max(prob.memory_usage(sol.assignment).values()), sol.assignment
    return None


def recomputed_layers(gm, counts: dict) -> dict:
    """The plan's ``recompute`` entry: per layer class, how many of its instances recompute (the first
    ones, in execution order), and the instances by name."""
    order = layer_instances(gm)
    classes = {cls: {"count": r, "of": len(order[cls]), "layers": list(order[cls])[:r]}
               for cls, r in counts.items() if r}
    return {"classes": classes, "layers": [inst for c in classes.values() for inst in c["layers"]]}


def _boundary_bytes(instance_of: dict, chosen: dict, cm: CostModel) -> dict:
    """Per recomputed instance: the bytes of the activations it reads from outside, which checkpointing
    keeps instead of its own (each value counted once, at the layout it is produced in)."""
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


def _timeline(gm, chosen, acts, mem, cm, instance_of=None, boundary=None, full=None):
    """Live bytes over one step: saved activations grow through forward and are freed in backward,
    while gradients appear; the transient is the node's own output (its gradient in backward). A
    recomputed layer instance keeps only its inputs through forward and holds its whole activations
    again while its backward runs."""
    from autopar.layout import local_fraction
    from autopar.passes.rules import output_infos

    instance_of, boundary, full = instance_of or {}, boundary or {}, full or {}
    static = mem["params"] + mem["optimizer"]
    points, running = [], 0.0
    fwd, started = [], set()
    for n, a in acts:
        s = chosen[n]
        out = 0.0 if n.target in VIEW_OPS else sum(
            o.nbytes * local_fraction(l, cm.mesh_shape) for o, l in zip(output_infos(n), s.outputs))
        inst = instance_of.get(n)
        if inst is None:
            running += a
        elif inst not in started:
            started.add(inst)
            running += boundary.get(inst, 0.0)
        fwd.append((n, running, out))
        points.append(("forward", n.name, static, 0.0, running, out))
    grads = 0.0
    total_grads = mem["grads"]
    nf = max(len(fwd), 1)
    for i, (n, running, out) in enumerate(reversed(fwd)):
        grads = total_grads * (i + 1) / nf
        again = full.get(instance_of[n], 0.0) if n in instance_of else 0.0
        points.append(("backward", n.name, static, grads, running + again, out))
    peak = max((p[2] + p[3] + p[4] + p[5] for p in points), default=static)
    peak = max(peak, static + total_grads)
    # At most ~200 points, always keeping the highest one of each window so the peak stays visible.
    stride = max(1, len(points) // 200)
    keep = [max(points[i:i + stride], key=lambda p: p[2] + p[3] + p[4] + p[5]) for i in range(0, len(points), stride)]
    timeline = [{"phase": ph, "node": nm, "params": mem["params"], "optimizer": mem["optimizer"], "grads": g,
                 "activations": a, "transient": t} for ph, nm, _s, g, a, t in keep]
    return timeline, peak


def _raise_infeasible(prep, infeasible, cluster, budget):
    best = None
    for shape, names, prob, idx, cm in infeasible:
        found = _smallest_valid_budget(prob)
        if found is not None and (best is None or found[0] < best[0]):
            best = (*found, shape, names, idx, cm)
    if best is None:
        raise InfeasiblePlanError(f"no valid plan exists on {cluster.name or cluster.num_devices} devices at any "
                                  f"budget: the pinned layouts cannot be reached; relax the pins", budget=budget)
    need, assignment, shape, names, idx, cm = best
    strategies_pass(prep.gm, shape)        # the graph holds the last candidate mesh's strategies
    p = evaluate(prep, idx, assignment, cm, shape, names, cluster, budget)
    consumers = [(f"param {k} (+grad, optimizer)", v) for k, v in p.memory["by_param"].items()]
    consumers += [(f"activations of {n['name']}", n["activation_bytes"]) for n in p.nodes]
    consumers = sorted(consumers, key=lambda x: -x[1])[:5]
    top = ", ".join(f"{name} ({b / 2**20:.1f} MiB)" for name, b in consumers)
    raise InfeasiblePlanError(
        f"no plan fits {budget / 2**30:.3f} GiB per device on {cluster.name or cluster.num_devices} "
        f"(meshes tried: {[list(s) for s, *_ in infeasible]}). The smallest feasible budget is "
        f"{need / 2**30:.3f} GiB ({need:.0f} bytes), on mesh {list(shape)}. Largest consumers there: {top}. "
        f"Raise memory_budget, use more devices, or reduce the batch or sequence length.",
        budget=budget, min_feasible_budget=need, largest_consumers=consumers)
