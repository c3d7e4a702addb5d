"""The mesh search: solve the candidate meshes, two at a time, and keep the fastest plan that fits."""
from __future__ import annotations

import dataclasses
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

import torch.fx as fx

from autopar.alternatives import alternatives
from autopar.errors import AutoparError
from autopar.passes.costs import INFEASIBLE, CostModel
from autopar.passes.ilp_build import ProblemIndex, serial_objective
from autopar.passes.memory import StepMemory, solve_under_budget
from autopar.passes.meta import is_param
from autopar.plan_assembly import SolvedMesh, assemble_plan, objective_seconds
from autopar.solver import Problem

SOLVER_THREADS = 2   # candidate meshes solved at once


@dataclass
class MeshCandidate:
    """One candidate mesh, its solver problem and what the search needs of it."""

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
    overlap: bool = True
    bucket_mb: float | None = None       # the gradient bucket size given; None: the plan chooses it
    _memory: StepMemory | None = None

    @property
    def memory(self) -> StepMemory:
        """The step's memory on this mesh, made when first needed: a mesh cut off by its lower bound
        never needs it."""
        if self._memory is None:
            self._memory = StepMemory(self.gm, self.cm, self.idx, [len(c.costs) for c in self.prob.choices],
                                      sharded_outputs=self.sharded_outputs, overlap=self.overlap)
        return self._memory

    def solved(self) -> SolvedMesh:
        return SolvedMesh(self.shape, self.names, self.idx, self.cm, self.memory)


def search(meshes: list[MeshCandidate], best, prep, cluster, memory_budget, sharded_outputs, time_limit,
           report):
    """Solve the candidate meshes and keep the plan of least step time (``best``: one already found).

    Plans are compared by what the solver minimizes (``objective_seconds``: the serial step time less
    the solver's hiding credits). The mesh whose greedy layout is fastest goes first, and the best plan
    so far bounds the rest: a mesh whose lower bound is no better is not solved, and the solver stops a
    mesh as soon as it proves it cannot beat it. A plan's figure is never below its problem's objective
    (it adds the reshardings recomputed layers run again), so neither shortcut loses the best
    plan. Two meshes are solved at a time (the solver runs outside Python's lock), in waves whose bound is
    the best plan of the waves before; the plans are evaluated here.
    """
    order = sorted(meshes, key=lambda m: (m.estimate, m.lower_bound, m.position))
    best_key = None if best is None else (objective_seconds(best), -1)
    tried, infeasible, t_eval = {}, [], 0.0
    won = None          # (mesh, assignment) of the best plan when this search found it
    workers = max(1, min(SOLVER_THREADS, len(order)))
    with ThreadPoolExecutor(max_workers=workers) as pool:
        while order:
            # A wave of meshes solved together under the bound of the waves before it, its results taken
            # in order: which mesh finishes first never changes a bound, so the plan does not depend on
            # the machine's load.
            bound = None if best is None else objective_seconds(best)
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
                    infeasible.append(m)
                    continue
                report(f"mesh {m.shape}: evaluating")
                t0 = time.perf_counter()
                p = within_budget(assemble_plan(prep, m.solved(), sol.assignment, cluster, memory_budget,
                                                sharded_outputs, bucket_mb=m.bucket_mb), m, memory_budget)
                p.alternatives = alternatives(m.prob, m.idx, sol.assignment, m.cm, m.names)
                p.solver.update(status=sol.status, seconds=sol.seconds, variables=sol.num_variables,
                                constraints=sol.num_constraints, backend=sol.backend, gap=sol.gap)
                if best is None or (objective_seconds(p), m.position) < best_key:
                    best, best_key, won = p, (objective_seconds(p), m.position), (m, sol.assignment)
                t_eval += time.perf_counter() - t0
    if won is not None:
        t0 = time.perf_counter()
        best = replay_cheapest(best, *won, prep, cluster, memory_budget, sharded_outputs, time_limit, report)
        t_eval += time.perf_counter() - t0
    infeasible.sort(key=lambda m: m.position)
    return best, [tried[k] for k in sorted(tried)], infeasible, t_eval


def within_budget(p, m: MeshCandidate, memory_budget: float):
    """``p``, the plan solved on mesh ``m``, checked against its budget: one over it is a bug."""
    if p.memory.peak > memory_budget * (1 + 1e-9):
        raise AutoparError(f"internal error: the plan for mesh {list(m.shape)} peaks at {p.memory.peak:.0f} "
                           f"bytes, over its budget of {memory_budget:.0f}; please report this")
    return p


def replicated_parameters(prob: Problem, idx: ProblemIndex) -> Problem:
    """``prob`` with every parameter whole on every device, its optimizer state too (data
    parallelism's parameters); the activations' layouts are left to the solver."""
    choices = list(prob.choices)
    for key, roots in idx.roots_of_key.items():
        rep = roots[0]
        if not is_param(rep):
            continue
        ci = idx.choice_of_key[key]
        opts = idx.strategies[rep]
        ch = choices[ci]
        choices[ci] = dataclasses.replace(ch, costs=tuple(
            c if all(p.kind == "R" for p in s.outputs[0]) and s.zero is None and not s.offload else INFEASIBLE
            for c, s in zip(ch.costs, opts)))
    return dataclasses.replace(prob, choices=choices, memory=[])


def replay_cheapest(best, m: MeshCandidate, assignment, prep, cluster, memory_budget, sharded_outputs, time_limit,
                    report):
    """``best`` (the plan of ``assignment`` on mesh ``m``) or another layout on the same mesh, whichever
    the replay (passes/exposure.py) prices fastest: the replicated-parameter layout, since the solver's
    hiding credits count a backward window at the least compute any layout runs in it, so they
    undercount what data parallelism's bucketed gradient all-reduce hides behind backward; and, where
    the solver's layout is credited more hiding than its replay saves, the layout solved without
    credits, since a credit can count compute the runtime does not hide behind (a window inside a
    recomputed layer: ``HidingWindows``). ``best.solver["replayed"]`` records
    each figure."""
    alts = []
    replicated = replicated_parameters(m.prob, m.idx)
    if replicated.objective(assignment) >= INFEASIBLE:     # some parameter is not replicated
        alts.append(("replicated parameters", replicated))
    if m.idx.credit is not None and best.breakdown.get("credit", 0.0) > \
            m.cm.overlap_saving(best.breakdown.get("hidden", 0.0)) * (1 + 1e-9):
        alts.append(("without hiding credits", serial_objective(m.prob, m.idx)))
    if not alts:
        return best
    replayed = {"solver": best.step_time}
    for name, alt in alts:
        report(f"mesh {m.shape}: {name}")
        sol = solve_under_budget(alt, m.memory, memory_budget, time_limit=time_limit)
        if sol.status == "infeasible" or alt.objective(sol.assignment) >= INFEASIBLE or \
                tuple(sol.assignment) == tuple(assignment):
            continue
        # Solved under the same memory rounds as the first plan, and held to the same budget.
        p = within_budget(assemble_plan(prep, m.solved(), sol.assignment, cluster, memory_budget, sharded_outputs,
                                        bucket_mb=m.bucket_mb), m, memory_budget)
        replayed[name] = p.step_time
        if p.step_time < best.step_time:
            p.alternatives = alternatives(m.prob, m.idx, sol.assignment, m.cm, m.names)
            p.solver, best = {**best.solver, **p.solver}, p      # the solver's record, this layout's buckets
    if len(replayed) > 1:
        best.solver["replayed"] = replayed
    return best
