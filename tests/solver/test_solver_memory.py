import itertools

import pytest
from hypothesis import given, settings
from solver_strategies import MB, problems

from autopar.solver import Choice, MemoryConstraint, Problem, greedy, minimum_feasible_budget, solve


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
