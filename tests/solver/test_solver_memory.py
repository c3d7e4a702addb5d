import itertools
import math
from unittest import mock

import pytest
from hypothesis import given, settings
from solver_strategies import MB, problems

from autopar.solver import (Choice, MemoryConstraint, Problem, fits_within, greedy, memory_bound,
                            minimum_feasible_budget, solve)


def brute_force_budget(p: Problem) -> float:
    return min(max(p.memory_usage(a).values()) for a in itertools.product(*(range(len(c.costs)) for c in p.choices)))


@pytest.mark.parametrize("backend", ["cbc", "highs"])
@settings(max_examples=60, deadline=None, derandomize=True)
@given(p=problems(memory=True))
def test_matches_brute_force(backend, p):
    budget, a, lower = minimum_feasible_budget(p, backend=backend)
    assert lower == budget       # closed: the least peak is proven
    assert budget == pytest.approx(brute_force_budget(p), rel=1e-9)
    assert budget == max(p.memory_usage(a).values())
    # The budget is tight: solve fits within it and not within one byte-unit less.
    p.memory_budget = budget
    assert solve(p, backend=backend).status == "optimal"
    p.memory_budget = budget - MB / 2
    assert solve(p, backend=backend).status == "infeasible"


@pytest.mark.parametrize("backend", ["cbc", "highs"])
@settings(max_examples=40, deadline=None, derandomize=True)
@given(p=problems(memory=True))
def test_fits_within_matches_brute_force(backend, p):
    # The feasibility question that proves a smallest budget: at the least peak an assignment fits (and is
    # one that does), half a unit below it none does, proven.
    least = brute_force_budget(p)
    status, a = fits_within(p, least, backend=backend)
    assert status == "fits" and max(p.memory_usage(a).values()) <= least + MB * 1e-6 and math.isfinite(p.objective(a))
    assert fits_within(p, least - MB / 2, backend=backend) == ("none", None)


@pytest.mark.parametrize("backend", ["cbc", "highs"])
@settings(max_examples=40, deadline=None, derandomize=True)
@given(p=problems(memory=True))
def test_constraints_joining_from_one_find_the_same_least_budget(backend, p):
    # The min-max model starts from the highest constraint under the start; those its answers break join
    # until one breaks none: still the least peak, and proven least.
    with mock.patch.object(memory_bound, "FIRST_ROWS", 1):
        budget, a, lower = minimum_feasible_budget(p, backend=backend)
    assert lower == budget
    assert budget == pytest.approx(brute_force_budget(p), rel=1e-9)
    assert budget == max(p.memory_usage(a).values())


@settings(max_examples=40, deadline=None, derandomize=True)
@given(p=problems(memory=True))
def test_a_cutoff_below_the_least_budget_reports_none_below_it(p):
    # Only a budget below the cut-off is wanted (the smallest another mesh reached): at or under the
    # least peak none is, and the answer says so without claiming a bound above the least; above it
    # the least is found as without one. HiGHS keeps a start above the cut-off as its answer, which
    # must not read as a proven least.
    least = brute_force_budget(p)
    for cutoff in (least * 0.9, least - MB / 2, least):
        assert minimum_feasible_budget(p, backend="highs", cutoff=cutoff) == (math.inf, greedy(p), cutoff)
    budget, a, lower = minimum_feasible_budget(p, backend="highs", cutoff=least + MB / 2)
    assert budget == lower == pytest.approx(least, rel=1e-9) and max(p.memory_usage(a).values()) == budget


def test_a_solve_stopped_at_its_node_limit_brackets_the_least_budget():
    # What the infeasible-budget error states where the min-max stops early: the budget is a layout's own
    # peak (a plan fits it) and the bound it proved is at most the least peak, so the gap between them
    # never hides a smaller budget. Each decision puts its bytes on one of two points: a partition of
    # an odd total, whose relaxation (half on each) the root cannot close.
    sizes = [3, 5, 7, 11, 13, 17, 19, 23, 29, 31, 37]
    p = Problem(choices=[Choice(f"c{i}", (1.0, 1.0)) for i in range(len(sizes))],
                memory=[MemoryConstraint("a", tuple((i, (b * MB, 0.0)) for i, b in enumerate(sizes))),
                        MemoryConstraint("b", tuple((i, (0.0, b * MB)) for i, b in enumerate(sizes)))])
    least = brute_force_budget(p)
    with mock.patch.object(memory_bound, "MINIMUM_NODE_LIMIT", 1):
        budget, a, lower = minimum_feasible_budget(p, backend="highs")
    assert lower < budget                  # stopped short of closing
    assert budget == max(p.memory_usage(a).values())
    assert lower <= least * (1 + 1e-9) and least <= budget


def test_the_same_problem_is_solved_once():
    # Planning again under another budget too small repeats the error's min-max solves: the second time the
    # answer is looked up, and a problem that differs in one byte is solved for its own answer.
    p = Problem(choices=[Choice("a", (1.0, 9.0)), Choice("b", (1.0, 9.0, 5.0))],
                memory=[MemoryConstraint("fwd", ((0, (8.0, 3.0)), (1, (1.0, 4.0, 2.0))), constant=1.0),
                        MemoryConstraint("bwd", ((1, (9.0, 1.0, 2.0)),), constant=4.0)])
    calls = []
    real = memory_bound.run

    def counted(*args, **kwargs):
        calls.append(args)
        return real(*args, **kwargs)

    with mock.patch.object(memory_bound, "run", counted):
        first = minimum_feasible_budget(p)
        solves = len(calls)
        assert solves and minimum_feasible_budget(p) == first and len(calls) == solves
        p.memory[1] = MemoryConstraint("bwd", ((1, (9.0, 1.0, 2.0)),), constant=5.0)
        assert minimum_feasible_budget(p).budget == brute_force_budget(p) == 7.0
        assert len(calls) > solves

def test_ignores_time_and_limit():
    # The fast option needs more memory; the budget question is about memory alone.
    p = Problem(choices=[Choice("a", (1.0, 9.0)), Choice("b", (1.0, 9.0, 5.0))],
                memory=[MemoryConstraint("fwd", ((0, (8.0, 3.0)), (1, (1.0, 4.0, 2.0))), constant=1.0),
                        MemoryConstraint("bwd", ((1, (9.0, 1.0, 2.0)),), constant=4.0)],
                memory_budget=1.0)
    budget, a, _ = minimum_feasible_budget(p)
    assert budget == brute_force_budget(p) == 6.0
    assert a == (1, 2)


def test_without_memory_constraints():
    p = Problem(choices=[Choice("a", (2.0, 1.0))])
    assert minimum_feasible_budget(p) == (0.0, greedy(p), 0.0)
