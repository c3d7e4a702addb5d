from hypothesis import given, settings
from solver_strategies import problems

from autopar.solver import Choice, Edge, MemoryConstraint, Problem, greedy

SETTINGS = settings(max_examples=100, deadline=None, derandomize=True)


def neighbours(p: Problem, a: tuple[int, ...]):
    for c, ch in enumerate(p.choices):
        for j in range(len(ch.costs)):
            if j != a[c]:
                yield a[:c] + (j,) + a[c + 1:]


@SETTINGS
@given(p=problems(memory=False))
def test_valid_deterministic_and_locally_optimal(p):
    a = greedy(p)
    assert len(a) == len(p.choices) and all(0 <= i < len(c.costs) for i, c in zip(a, p.choices))
    assert greedy(p) == a
    # Coordinate descent ran to convergence: no single change of one choice is cheaper.
    assert all(p.objective(b) >= p.objective(a) * (1 - 1e-9) for b in neighbours(p, a))


@SETTINGS
@given(p=problems(memory=True))
def test_memory_moves_keep_feasibility(p):
    a = greedy(p)
    assert greedy(p) == a
    if p.feasible(a):   # no single change stays within the limit and is cheaper
        assert all(p.objective(b) >= p.objective(a) * (1 - 1e-9) for b in neighbours(p, a) if p.feasible(b))


def test_neighbours_and_self_edges_steer_the_choice():
    # Alone, b would take option 0; the edge from a (option 0) makes option 1 cheaper overall.
    p = Problem(choices=[Choice("a", (0.0, 5.0)), Choice("b", (1.0, 2.0))],
                edges=[Edge(0, 1, ((3.0, 0.0), (0.0, 0.0)))])
    assert greedy(p) == (0, 1)
    # A self-edge charges only its diagonal: 1 + 10 versus 2 + 0.
    p = Problem(choices=[Choice("a", (1.0, 2.0))], edges=[Edge(0, 0, ((10.0, -50.0), (-50.0, 0.0)))])
    assert greedy(p) == (1,)


def test_repair_takes_the_cheapest_bytes():
    # The fastest layout needs 30 bytes for 10 allowed. Shrinking "a" saves 10 bytes for 1 s, shrinking "b"
    # saves 10 bytes for 5 s, shrinking "c" saves 20 bytes for 100 s: repair shrinks a, then b.
    p = Problem(choices=[Choice("a", (1.0, 2.0)), Choice("b", (1.0, 6.0)), Choice("c", (1.0, 101.0))],
                memory=[MemoryConstraint("peak", ((0, (10.0, 0.0)), (1, (10.0, 0.0)), (2, (10.0, -10.0))))],
                memory_budget=10.0)
    a = greedy(p)
    assert p.feasible(a)
    assert a == (1, 1, 0)


def test_descent_stays_within_memory():
    # In index order "a" is decided before its edge to "b" is priced, so it takes option 0; descent then
    # finds option 1 cheaper (0.5 instead of 2), but option 1 does not fit in memory.
    p = Problem(choices=[Choice("a", (0.0, 0.5)), Choice("b", (0.0, 0.0))],
                edges=[Edge(0, 1, ((2.0, 2.0), (0.0, 0.0)))],
                memory=[MemoryConstraint("peak", ((0, (0.0, 10.0)),))])
    assert greedy(p) == (1, 0)
    p.memory_budget = 5.0
    assert greedy(p) == (0, 0)
