"""Exhaustive search: the optimality oracle the tests hold the ILP to. Deliberately naive."""
from __future__ import annotations

import itertools
import math
import time

from .problem import Problem, Solution

MAX_ASSIGNMENTS = 1_000_000


def brute_force(problem: Problem) -> Solution:
    """The cheapest feasible assignment (the first in lexicographic order among equals).

    With no feasible assignment the status is "infeasible" and the assignment is the cheapest overall.
    """
    problem.validate()
    sizes = [len(c.costs) for c in problem.choices]
    total = math.prod(sizes)
    if total > MAX_ASSIGNMENTS:
        raise ValueError(f"brute force would enumerate {total} assignments, more than {MAX_ASSIGNMENTS}")
    start = time.perf_counter()
    best_key, best = None, ()
    for a in itertools.product(*(range(k) for k in sizes)):
        key = (not problem.feasible(a), problem.objective(a))   # feasible first, then cheapest
        if best_key is None or key < best_key:
            best_key, best = key, a
    return Solution(assignment=best, objective=problem.objective(best),
                    status="infeasible" if best_key[0] else "optimal",
                    seconds=time.perf_counter() - start, num_variables=0, num_constraints=0,
                    backend="brute-force")
