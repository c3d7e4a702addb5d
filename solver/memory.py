"""The smallest memory budget that any layout fits: what an infeasible-budget error tells the user."""
from __future__ import annotations

from typing import Sequence

import pulp

from .greedy import greedy
from .ilp import assignment, make_solver, memory_rows, one_hot, resolve_backend, run, variable, warm
from .problem import Problem


def minimum_feasible_budget(problem: Problem, *, time_limit: float = 60.0,
                            backend: str = "auto") -> tuple[float, tuple[int, ...]]:
    """(L, assignment): L = min over assignments of the max over memory constraints of their bytes.

    Solved as min t subject to every constraint's bytes <= t; ``problem.memory_limit`` is ignored.
    If the time limit stops the solver early, L is the best found (an upper bound). Without memory
    constraints any budget fits: returns 0.0 and the greedy assignment.
    """
    problem.validate()
    start = greedy(problem)
    if not problem.memory:
        return 0.0, start

    def peak(a: Sequence[int]) -> float:
        return max(problem.memory_usage(a).values())

    model = pulp.LpProblem("autopar_min_budget", pulp.LpMinimize)
    x = one_hot(model, problem)
    rows = memory_rows(problem, x, model, {})
    # Bytes are ~1e10: scale to O(1) for the solvers' tolerances; the answer is recomputed exactly below.
    scale = max((abs(b) for c, coef in rows for b in (c, *coef.values())), default=0.0) or 1.0
    t = variable(model, "t")
    model += t
    for k, (constant, coef) in enumerate(rows):
        model += pulp.LpAffineExpression([(v, b / scale) for v, b in coef.items()]) - t <= -constant / scale, \
            f"mem_{k}"
    warm(x, start)
    t.setInitialValue(peak(start) / scale)
    status = run(model, make_solver(resolve_backend(backend), time_limit, warm_start=True))
    candidates = ([assignment(x)] if status in ("optimal", "feasible") else []) + [start]
    best = min(candidates, key=peak)   # defensive: never worse than the greedy assignment
    return peak(best), best
