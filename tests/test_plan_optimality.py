"""The planner's shortcuts (a 1e-4 optimality gap, memory constraints added lazily, candidate meshes
skipped or cut off by the best plan so far, two meshes solved at once) keep its plans within 0.1% of
the optimum: checked against an exact solve of every candidate mesh, with every memory constraint in
the model from the start and no gap, on the zoo's small models."""
import dataclasses
import functools

import pytest

import autopar
from autopar import zoo
from autopar.cluster import default_axis_names
from autopar.passes.costs import CostModel
from autopar.passes.memory import StepMemory
from autopar.passes.ilp_build import build_problem
from autopar.passes.strategies import strategies_pass
from autopar.plan_assembly import SolvedMesh, assemble_plan, objective_seconds, serial_seconds
from autopar.planner import default_optimizer, prepare
from autopar.solver import ilp, milp, minimum_feasible_budget

CLUSTER = autopar.ClusterSpec.preset("8xH100")


def exact(prob):
    """The optimum of ``prob`` with every memory constraint and a zero gap: (objective, assignment); None
    where no layout fits its budget (proven)."""
    f, _, _ = ilp.formulate(prob)
    res = None if f.impossible else milp.run(f.model, "highs", time_limit=600.0, gap=0.0)
    if res is None or res.status == "infeasible":
        assert prob.memory_budget is not None
        return None
    assert res.status == "optimal"
    a = f.assignment(res.values)
    assert prob.feasible(a)
    return prob.objective(a), a


@functools.cache
def unconstrained(name):
    """Zoo model ``name`` (batch 8) and, per candidate mesh, its problem with every point of
    ``StepMemory`` as a constraint (the points that bound the rest, ``bounding_points``) and no
    budget, and its exact optimum (objective, assignment): shared
    by the cases of one model."""
    model, args, kwargs = zoo.build(name, batch=8)
    prep = prepare(model, args, kwargs, CLUSTER)
    built = {}
    for shape in CLUSTER.mesh_candidates():
        strategies_pass(prep.gm, shape)
        cm = CostModel(CLUSTER, shape, default_optimizer(model))
        prob, idx = build_problem(prep.gm, cm, None)
        sm = StepMemory(prep.gm, cm, idx, [len(c.costs) for c in prob.choices])
        prob = dataclasses.replace(prob, memory=sm.constraints(sm.bounding_points()))
        built[shape] = (prob, idx, cm, sm, exact(prob))
    return (model, args, kwargs), prep, built


def reference(name, tight: bool):
    """The budget, and per candidate mesh (its problem, exact objective, and the exact optimum's figure
    that the planner compares plans by, ``objective_seconds``; None where no layout fits). A tight budget lies between the least
    any layout needs and what the fastest layouts use, so memory binds. Memory is the step's: every
    point of ``StepMemory`` is a constraint of the exact solve."""
    _, prep, built = unconstrained(name)
    budget = None
    if tight:
        # The least peak of the first mesh, (8,), whose min-max settles in seconds: no less than the least
        # over all meshes, so the budget still lies above what the leanest layout needs and below what the
        # fastest use. On both models no other mesh goes below it (their min-maxes, cut off there, took
        # 20-110 s each to prove it): the budget is the one the least over all meshes gives.
        least = minimum_feasible_budget(next(iter(built.values()))[0]).budget
        used = max(sm.peak(free[1])[1] for _, _, _, sm, free in built.values())
        assert least < used
        budget = (least + used) / 2
    out = {}
    for shape, (prob, idx, cm, sm, free) in built.items():
        prob = dataclasses.replace(prob, memory_budget=budget)
        # The optimum without a budget is the optimum under any budget it fits; where none fits, the exact
        # solve proves it.
        found = free if budget is None or sm.peak(free[1])[1] <= budget else exact(prob)
        if found is None:
            out[shape] = (prob, None, None)
            continue
        objective, a = found
        assert budget is None or sm.peak(a)[1] <= budget * (1 + 1e-9)
        mesh = SolvedMesh(shape, default_axis_names(shape), idx, cm, sm)
        p = assemble_plan(prep, mesh, a, CLUSTER, budget or CLUSTER.usable_memory)
        out[shape] = (prob, objective, objective_seconds(p))
    return budget, out


@pytest.mark.parametrize("name, tight", [("gpt2-tiny", False), ("gpt2-tiny", True), ("llama-tiny", False),
                                         ("bert-tiny", False), ("gpt-tiny", True)])
def test_plan_within_a_tenth_of_a_percent_of_the_exact_optimum(name, tight):
    (model, args, kwargs), _, _ = unconstrained(name)
    budget, ref = reference(name, tight)
    plan = autopar.plan(model, CLUSTER, args, kwargs, memory_budget=budget, progress=False)
    best = min(step for _, _, step in ref.values() if step is not None)
    assert objective_seconds(plan) <= best * (1 + 1e-3) and plan.step_time <= serial_seconds(plan)
    assert plan.memory["peak"] <= plan.memory["memory_budget"]
    for entry in plan.solver["candidates"]:
        prob, objective, step = ref[tuple(entry["mesh"])]
        if entry["status"] == "bounded":       # skipped or cut off: it could not have beaten the plan
            assert step is None or step >= objective_seconds(plan) * (1 - 1e-9)
            assert objective is None or entry["lower_bound"] <= objective * (1 + 1e-9)
        elif entry["status"] == "optimal":
            assert entry["gap"] is not None and entry["gap"] <= ilp.GAP
            assert objective * (1 - 1e-9) <= entry["objective"] <= objective * (1 + ilp.GAP)
