"""The smallest memory budget that any layout fits: what an infeasible-budget error tells the user."""
from __future__ import annotations

from typing import Sequence

from .greedy import greedy
from .ilp import Formulation, resolve_backend, run
from .milp import INF
from .problem import Problem

_GAP = 1e-7   # the budget an error message reports: off the hot path, so solved tightly


def minimum_feasible_budget(problem: Problem, *, time_limit: float = 60.0,
                            backend: str = "auto") -> tuple[float, tuple[int, ...]]:
    """(L, assignment): L = min over assignments of the max over memory constraints of their bytes.

    Solved as min t subject to every constraint's bytes <= t; ``problem.memory_budget`` is ignored.
    If the time limit stops the solver early, L is the best found (an upper bound). Without memory
    constraints any budget fits: returns 0.0 and the greedy assignment.
    """
    problem.validate()
    start = greedy(problem)
    if not problem.memory:
        return 0.0, start

    def peak(a: Sequence[int]) -> float:
        return max(problem.memory_usage(a).values())

    f = Formulation(problem)
    rows = f.memory_rows()
    m = f.model
    # Bytes are ~1e10: scale to O(1) for the solvers' tolerances; the answer is recomputed exactly below.
    scale = max((abs(b) for c, coef in rows for b in (c, *coef.values())), default=0.0) or 1.0
    t = m.col(lo=-INF)
    m.cost[t] = 1.0
    for constant, coef in rows:
        m.row([*coef, t], [*(b / scale for b in coef.values()), -1.0], hi=-constant / scale)
    first = f.start(start)
    first[t] = peak(start) / scale
    res = run(m, resolve_backend(backend), time_limit=time_limit, gap=_GAP, start=first)
    candidates = ([f.assignment(res.values)] if res.values is not None else []) + [start]
    best = min(candidates, key=peak)   # defensive: never worse than the greedy assignment
    return peak(best), best
