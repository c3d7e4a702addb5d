import pytest

from autopar.solver import Choice, Edge, MemoryConstraint, Problem, brute_force


def test_refuses_more_than_a_million_assignments():
    p = Problem(choices=[Choice(f"c{i}", (0.0,) * 10) for i in range(7)])   # 10^7 assignments
    with pytest.raises(ValueError, match="10000000 assignments"):
        brute_force(p)


def test_cheapest_feasible_then_cheapest_overall():
    p = Problem(choices=[Choice("a", (1.0, 2.0)), Choice("b", (1.0, 1.0))],
                edges=[Edge(0, 1, ((5.0, 0.0), (0.0, 5.0)))],
                memory=[MemoryConstraint("peak", ((0, (3.0, 1.0)),))], memory_budget=2.0)
    s = brute_force(p)
    assert (s.assignment, s.objective, s.status) == ((1, 0), 3.0, "optimal")
    p.memory_budget = 0.5   # nothing fits: the cheapest assignment, flagged
    s = brute_force(p)
    assert (s.assignment, s.objective, s.status) == ((0, 1), 2.0, "infeasible")
