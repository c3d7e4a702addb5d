import logging
import math
import random

import pytest
from hypothesis import given, settings
from solver_strategies import problems, unit_of

from autopar.errors import AutoparError
from autopar.solver import Choice, Edge, MemoryConstraint, Problem, SharedEdge, brute_force, greedy, solve
from autopar.solver import ilp, milp

SETTINGS = settings(max_examples=100, deadline=None, derandomize=True)


def same_objective(a: float, b: float, p: Problem) -> bool:
    return math.isclose(a, b, rel_tol=1e-6, abs_tol=1e-9 * unit_of(p))


@pytest.mark.parametrize("backend", ["cbc", "highs"])
@pytest.mark.parametrize("warm_start", [True, False])
@SETTINGS
@given(p=problems())
def test_matches_brute_force(backend, warm_start, p):
    got, want = solve(p, backend=backend, warm_start=warm_start), brute_force(p)
    assert got.backend == backend
    assert (got.status == "infeasible") == (want.status == "infeasible")
    if want.status == "infeasible":
        assert got.assignment == greedy(p)
    else:
        assert got.status == "optimal"
        assert p.feasible(got.assignment)
    assert got.objective == p.objective(got.assignment)
    if want.status == "optimal":
        assert same_objective(got.objective, want.objective, p)


@SETTINGS
@given(p=problems())
def test_never_worse_than_greedy(p):
    g = greedy(p)
    assert len(g) == len(p.choices) and all(0 <= a < len(c.costs) for a, c in zip(g, p.choices))
    s = solve(p)
    if p.feasible(g):
        assert s.status == "optimal"
        assert s.objective <= p.objective(g) * (1 + 1e-9)


def test_separable_and_constant_edges_need_no_pair_variables():
    c = [Choice(f"c{i}", (1.0, 2.0, 0.5)) for i in range(3)]
    edges = [Edge(0, 1, ((7.0,) * 3,) * 3),                                           # constant
             Edge(1, 2, tuple(tuple(a + b for b in (0.0, 3.0, 1.0)) for a in (2.0, 0.0, 5.0))),  # a[i] + b[j]
             Edge(2, 2, ((1.0, 9.0, 9.0), (9.0, 0.0, 9.0), (9.0, 9.0, 4.0)))]          # self: diagonal only
    p = Problem(choices=c, edges=edges)
    s = solve(p)
    assert s.num_variables == 9            # only the one-hot x: no y for any edge
    assert s.num_constraints == 3
    assert s.objective == pytest.approx(brute_force(p).objective)


def test_parallel_edges_merge_into_one_pair():
    rng = random.Random(1)
    mat = lambda: tuple(tuple(rng.random() for _ in range(3)) for _ in range(3))
    p = Problem(choices=[Choice("a", (0.1, 0.2, 0.3)), Choice("b", (0.3, 0.2, 0.1))],
                edges=[Edge(0, 1, mat()), Edge(0, 1, mat(), count=2), Edge(1, 0, mat())])
    s = solve(p)
    assert s.num_variables == 6 + 9        # x, and one 3x3 y block for the three edges together
    assert s.objective == pytest.approx(brute_force(p).objective)


def test_single_option_choices_are_fixed():
    p = Problem(choices=[Choice("a", (2.0,), count=3), Choice("b", (1.0,))], edges=[Edge(0, 1, ((0.5,),))])
    s = solve(p)
    assert (s.assignment, s.status, s.num_variables) == ((0, 0), "optimal", 0)
    assert s.objective == pytest.approx(3 * 2.0 + 1.0 + 0.5)
    p.memory = [MemoryConstraint("peak", ((0, (10.0,)),), constant=5.0)]
    p.memory_budget = 14.0
    assert solve(p).status == "infeasible"
    p.memory_budget = 15.0
    assert solve(p).status == "optimal"


def test_empty_problem():
    s = solve(Problem())
    assert (s.assignment, s.objective, s.status, s.num_variables) == ((), 0.0, "optimal", 0)
    assert greedy(Problem()) == ()
    assert brute_force(Problem()).assignment == ()


def test_infeasible_returns_greedy_without_raising():
    p = Problem(choices=[Choice("a", (1.0, 2.0)), Choice("b", (1.0, 3.0))],
                memory=[MemoryConstraint("peak", ((0, (6.0, 4.0)), (1, (6.0, 5.0))))], memory_budget=8.0)
    s = solve(p)
    assert s.status == "infeasible"
    assert s.assignment == greedy(p)
    p.memory_budget = 9.0                   # now only (1, 1) fits, the most expensive assignment
    s = solve(p)
    assert (s.status, s.assignment) == ("optimal", (1, 1))


@pytest.mark.parametrize("bad, match", [
    (Problem(choices=[Choice("a", (1.0,))], edges=[Edge(0, 1, ((1.0,),))]), "out of range"),
    (Problem(choices=[Choice("a", (1.0, 2.0))], edges=[Edge(0, 0, ((1.0,),))]), "2x2"),
    (Problem(choices=[Choice("a", (1.0, 2.0))], memory=[MemoryConstraint("m", ((0, (1.0,)),))]), "1 entries"),
    (Problem(choices=[Choice("a", (1.0, 2.0))], memory=[MemoryConstraint("m", ((-1, (1.0, 2.0)),))]),
     "out of range"),
    (Problem(choices=[Choice("a", (1.0,))], memory=[MemoryConstraint("m", ()), MemoryConstraint("m", ())]),
     "unique"),
])
def test_validate_errors(bad, match):
    for fn in (solve, greedy, brute_force):
        with pytest.raises(ValueError, match=match):
            fn(bad)


def test_choice_errors():
    with pytest.raises(ValueError, match="no options"):
        Choice("a", ())
    with pytest.raises(ValueError, match="labels"):
        Choice("a", (1.0, 2.0), labels=("x",))
    with pytest.raises(ValueError, match="count"):
        Choice("a", (1.0,), count=0)


def test_backends(monkeypatch, caplog):
    with pytest.raises(ValueError, match="unknown solver backend"):
        solve(Problem(), backend="gurobi")
    assert solve(Problem(), backend="auto").backend == "highs"   # highspy is a test dependency
    monkeypatch.setattr(ilp, "_highs_available", lambda: False)
    ilp._warn_no_highs.cache_clear()
    assert solve(Problem(), backend="auto").backend == "cbc"
    assert not caplog.records                                       # auto falls back silently
    with caplog.at_level(logging.WARNING, logger="autopar.solver.ilp"):
        assert solve(Problem(), backend="highs").backend == "cbc"
        assert solve(Problem(), backend="highs").backend == "cbc"
    assert [r.levelno for r in caplog.records] == [logging.WARNING]   # once, not per solve
    assert "highspy" in caplog.records[0].message


def test_progress_stages():
    stages = []
    solve(Problem(choices=[Choice("a", (1.0, 2.0))]), progress=stages.append)
    assert stages == ["building model", "solving", "done"]


def test_timeout_without_any_fitting_layout_raises(monkeypatch):
    # A solver that stops with no incumbent on a budget the greedy misses must not claim infeasibility.
    p = Problem(choices=[Choice("a", (1.0, 2.0)), Choice("b", (1.0, 3.0))],
                memory=[MemoryConstraint("peak", ((0, (6.0, 4.0)), (1, (6.0, 5.0))))], memory_budget=9.0)
    monkeypatch.setattr(ilp, "greedy", lambda problem: (0, 0))
    monkeypatch.setattr(ilp, "run", lambda model, backend, **kw: milp.Result(None, None, None))
    with pytest.raises(AutoparError, match="time limit"):
        solve(p)


def chain_optimum(p: Problem) -> float:
    """Exact optimum of a chain by dynamic programming: an oracle independent of the ILP."""
    best = [p.choices[0].costs[i] for i in range(len(p.choices[0].costs))]
    for e in p.edges:
        nxt = p.choices[e.dst].costs
        best = [nxt[j] + min(best[i] + e.cost[i][j] for i in range(len(best))) for j in range(len(nxt))]
    return min(best)


def test_chain_200_by_16():
    rng = random.Random(0)
    n, k = 200, 16
    p = Problem(choices=[Choice(f"c{i}", tuple(rng.random() * 1e-3 for _ in range(k))) for i in range(n)],
                edges=[Edge(i, i + 1, tuple(tuple(rng.random() * 1e-3 for _ in range(k)) for _ in range(k)))
                       for i in range(n - 1)])
    s = solve(p)
    assert s.status == "optimal"
    assert s.objective == pytest.approx(chain_optimum(p), rel=1e-6)
    assert s.num_variables == n * k + (n - 1) * k * k


@SETTINGS
@given(p=problems())
def test_bound_stops_a_problem_that_cannot_beat_it(p):
    want = brute_force(p)
    if want.status == "infeasible":
        assert solve(p, bound=1e9).status == "bounded"   # nothing within the memory limit, at any price
        return
    below = solve(p, bound=want.objective - 1e-3 * unit_of(p))
    assert below.status == "bounded"
    above = solve(p, bound=want.objective + 1e-3 * unit_of(p))
    assert above.status == "optimal"
    assert math.isclose(above.objective, want.objective, rel_tol=ilp.GAP, abs_tol=1e-9 * unit_of(p))


def test_memory_constraints_join_when_the_answer_breaks_them(caplog):
    # The greedy layout (0, 0) is stuck in a local optimum far under the budget; the layout of least
    # time, (1, 1), breaks the budget, so the constraint joins the model after the first solve.
    p = Problem(choices=[Choice("a", (1.0, 1.1)), Choice("b", (1.0, 0.0))],
                edges=[Edge(0, 1, ((0.0, 5.0), (5.0, 0.0)))],
                memory=[MemoryConstraint("peak", ((0, (0.0, 10.0)),))], memory_budget=9.0)
    assert greedy(p) == (0, 0)
    with caplog.at_level(logging.DEBUG, logger="autopar.solver.ilp"):
        s = solve(p)
    assert (s.status, s.assignment) == ("optimal", (0, 0))
    assert s.assignment == brute_force(p).assignment
    assert any("join the model" in r.message for r in caplog.records)
    p.memory_budget = 10.0
    assert solve(p).assignment == (1, 1)


@pytest.mark.parametrize("seed", range(2))
def test_gap_holds_against_an_exact_solve_beyond_brute_force(seed):
    # Chains with memory and shared edges too big to enumerate: the default gap against a zero-gap solve.
    rng = random.Random(seed)
    n, k = 16, 5
    choices = [Choice(f"c{i}", tuple(rng.random() for _ in range(k)), count=rng.randint(1, 4)) for i in range(n)]
    edges = [Edge(i, i + 1, tuple(tuple(rng.random() for _ in range(k)) for _ in range(k))) for i in range(n - 1)]
    shared = [SharedEdge(i, ((i + 1, tuple(rng.randrange(-1, 3) for _ in range(k))),
                             (i + 2, tuple(rng.randrange(-1, 3) for _ in range(k)))),
                         tuple(tuple(rng.random() for _ in range(k)) for _ in range(3))) for i in range(0, n - 2, 3)]
    mem = [MemoryConstraint(f"m{j}", tuple((i, tuple(rng.random() for _ in range(k))) for i in range(n)))
           for j in range(3)]
    p = Problem(choices=choices, edges=edges, shared=shared, memory=mem, memory_budget=0.4 * n)
    exact = ilp.run(ilp.formulate(p)[0].model, "highs", time_limit=600.0, gap=0.0)
    assert exact.status == "optimal"
    s = solve(p)
    assert s.status == "optimal" and p.feasible(s.assignment) and s.gap <= ilp.GAP
    best = p.objective(ilp.formulate(p)[0].assignment(exact.values))
    assert best <= s.objective <= best * (1 + ilp.GAP)
