"""The smallest memory budget that any layout fits: what an infeasible-budget error tells the user."""
from __future__ import annotations

import dataclasses
import math
import threading
from collections import OrderedDict
from typing import NamedTuple, Sequence

from .greedy import greedy
from .ilp import Formulation, memory_pair_matrices, over, resolve_backend, run
from .milp import INF
from .problem import Problem

_GAP = 1e-7   # the budget an error message reports: off the hot path, so solved tightly where it closes
# The layout solves stop at NODE_LIMIT branch-and-bound nodes where the caller gives no time limit, a
# cut-off that, unlike a wall clock, does not depend on the machine's load; this wall clock only guards
# against a solve that would never end (the test and zoo models close in tens of nodes).
NODE_LIMIT = 20_000
GUARD_SECONDS = 600.0
# The min-max model's own cut-off. Its relaxation can be weak: on LLaMA on a 2 x 2 mesh with 2-D pins
# (tests/memory_cases.py) the root stands at a 6-8% gap that a thousand nodes close by 2 points, so a
# solve stopped here returns its best layout with the bound it proved (``MinimumBudget.lower``), and the
# infeasible-budget error states both; the test and zoo models close long before it.
MINIMUM_NODE_LIMIT = 100
# Where the min-max stops short of its least t, the least budget is proven within PROOF_GAP of the best
# layout's peak by asking whether any layout fits that much below it (``fits_within``, from
# passes.memory.minimum_budget): a question of feasibility alone, which closes sooner than the min-max
# where its relaxation is near (the 2 x 2 test's model with its min-max stopped at the root, 1.5-3% apart:
# 1% proven in 29 s at load 9). It is asked only where the min-max left at most PROOF_REACH: on LLaMA's
# 2 x 2 case (11% apart) one question ran FIT_NODE_LIMIT nodes in 234 s, and 400 s unlimited, unsettled.
PROOF_GAP = 0.01
PROOF_REACH = 0.05
FIT_NODE_LIMIT = 200
# The constraints the min-max model starts with, the highest under the starting layout; the rest join
# when a layout breaks them. Every constraint is a dense row (a point of the step, ~2700 nonzeros on the
# zoo's GPT on a 4 x 2 mesh), and a few of them bind: with all 230 of that model's points HiGHS spent
# most of a minute on LPs of 620k nonzeros.
FIRST_ROWS = 8
# Recent answers, keyed by all they depend on: planning the same model and cluster again under another
# budget that is too small repeats the same min-max solves for its error (tests/test_planner.py's 2 x 2
# mesh: three rounds of 16-19 s each at load 5, the second time served from here). A solve under a wall
# clock depends on the machine's load and is not kept.
_ANSWERS: OrderedDict = OrderedDict()
_ANSWERS_KEPT = 64
_answers_lock = threading.Lock()


class Fit(NamedTuple):
    status: str | None                  # "fits", "none" (proven), None (stopped at a limit)
    assignment: tuple[int, ...] | None  # the assignment that fits


class MinimumBudget(NamedTuple):
    budget: float                  # the least peak found: a layout fits it
    assignment: tuple[int, ...]    # that layout
    lower: float                   # proven: no valid layout peaks below it (``budget`` where the solve closed)


def minimum_feasible_budget(problem: Problem, *, time_limit: float = math.inf, backend: str = "auto",
                            start: Sequence[int] | None = None,
                            cutoff: float | None = None) -> MinimumBudget:
    """(L, assignment, lower): L = min over valid assignments (no forbidden option or pair) of the max
    over memory constraints of their bytes.

    Solved as min t subject to every constraint's bytes <= t; ``problem.memory_budget`` is ignored.
    The constraints join lazily, as in ``ilp.solve``: the ``FIRST_ROWS`` highest under the start, then
    those each answer breaks, until an answer breaks none. A model with fewer constraints has a least t
    no higher than the whole problem's, so its proven bound holds for the whole problem, and an answer
    that fits all of them at that t is the whole problem's optimum.
    If the time limit or ``MINIMUM_NODE_LIMIT`` stops the solver early, L is the best found (an upper
    bound) and ``lower`` what the solver proved. Without memory constraints any budget fits: returns
    0.0 and the greedy assignment. ``start``: an assignment to start from (the greedy one when it is
    better). ``cutoff``: only L below it is wanted; where HiGHS proves that none is, it stops and
    returns (inf, the start, cutoff).
    """
    problem.validate()
    what = ("minimum", None if start is None else tuple(start), cutoff, MINIMUM_NODE_LIMIT, FIRST_ROWS)
    return _kept(what, problem, backend, time_limit, lambda: _minimum(problem, time_limit, backend, start, cutoff))


def fits_within(problem: Problem, budget: float, *, time_limit: float = math.inf,
                backend: str = "auto") -> Fit:
    """Whether a valid assignment (no forbidden option or pair) keeps every memory constraint within
    ``budget`` bytes: ("fits", that assignment), ("none", None) proven, or (None, None) where
    ``FIT_NODE_LIMIT`` or the time limit stopped the solver first. ``problem.memory_budget`` is ignored.

    The min-max model at a fixed t, with no objective: the solver stops at the first assignment that
    fits, and has only the infeasibility of the rest to prove, which can close where the least t does
    not (docs/solver.md). A problem with fewer constraints than
    another is no harder to fit, so "none" over some of a step's points holds for all of them.
    """
    problem.validate()
    return _kept(("fits", budget, FIT_NODE_LIMIT), problem, backend, time_limit,
                 lambda: _fits(problem, budget, time_limit, backend))


def _kept(what: tuple, problem: Problem, backend: str, time_limit: float, compute):
    """``compute()``, or its answer kept from an earlier call with the same inputs (``_ANSWERS``)."""
    if math.isfinite(time_limit):
        return compute()
    key = (what, tuple(problem.choices), tuple(problem.edges), tuple(problem.shared), tuple(problem.memory),
           resolve_backend(backend))
    with _answers_lock:
        if key in _ANSWERS:
            _ANSWERS.move_to_end(key)
            return _ANSWERS[key]
    out = compute()
    with _answers_lock:
        _ANSWERS[key] = out
        while len(_ANSWERS) > _ANSWERS_KEPT:
            _ANSWERS.popitem(last=False)
    return out


def _minimum(problem: Problem, time_limit: float, backend: str, start: Sequence[int] | None,
             cutoff: float | None) -> MinimumBudget:
    """``minimum_feasible_budget`` solved, not looked up."""
    def peak(a: Sequence[int]) -> float:
        return max(problem.memory_usage(a).values())

    start = min([greedy(problem), *([tuple(start)] if start is not None else [])],
                key=peak if problem.memory else (lambda a: 0.0))
    if not problem.memory:
        return MinimumBudget(0.0, start, 0.0)

    usage = problem.memory_usage(start)
    held = set(sorted(range(len(problem.memory)), key=lambda k: -usage[problem.memory[k].name])[:FIRST_ROWS])
    # Defensive: never worse than the start, nor one that cannot run where one can.
    key = lambda a: (math.isinf(problem.objective(a)), peak(a))  # noqa: E731
    best, lower = start, 0.0
    while True:
        part = dataclasses.replace(problem, memory=[problem.memory[k] for k in sorted(held)])
        status, found, proved = _min_max(part, best, time_limit, backend, cutoff)
        if status == "cut off":
            return MinimumBudget(INF, start, cutoff)
        lower = max(lower, proved)
        if found is None:
            break
        best = min([found, best], key=key)
        # A layout's t is its peak over the held constraints: those above it join.
        broken = over(problem, found, max(part.memory_usage(found).values())) - held
        if not broken:
            break
        held |= broken
    least = peak(best)
    return MinimumBudget(least, best, min(lower, least))


def _memory_model(problem: Problem):
    """(formulation, memory rows, scale): the one-hot model of the valid assignments and its memory
    constraints as rows (constant bytes, bytes per column), with the bytes' scale."""
    f = Formulation(problem)
    # Only layouts that can run: a resharding that cannot happen is no plan at any budget, nor a shared
    # value's request that cannot be served (seconds play no part here: no columns for them).
    f.forbid()
    f.forbid_shared()
    # Options a pair's memory terms cannot tell apart share its pair columns: the same relaxation with
    # fewer columns (tests/memory_cases.py's LLaMA on a 2 x 2 mesh, four points: 41977 columns, 12940).
    f.group(memory_pair_matrices(problem.memory, f.x))
    rows = f.memory_rows()
    # Bytes are ~1e10: scale to O(1) for the solvers' tolerances; answers are recomputed exactly.
    scale = max((abs(b) for c, coef in rows for b in (c, *coef.values())), default=0.0) or 1.0
    return f, rows, scale


def _min_max(problem: Problem, start: tuple[int, ...], time_limit: float, backend: str, cutoff: float | None):
    """One solve of min t over ``problem``'s memory constraints: (status, its layout or None, its proven
    least t); status "cut off" where HiGHS proves that no t is below ``cutoff``."""
    def peak(a: Sequence[int]) -> float:
        return max(problem.memory_usage(a).values())

    f, rows, scale = _memory_model(problem)
    m = f.model
    t = m.col(lo=-INF)
    m.cost[t] = 1.0
    for constant, coef in rows:
        m.row([*coef, t], [*(b / scale for b in coef.values()), -1.0], hi=-constant / scale)
    first = f.start(start)
    first[t] = peak(start) / scale
    # HiGHS's presolve restarts on this min-max model and costs 2-3x the rest of the solve.
    res = run(m, resolve_backend(backend), time_limit=time_limit, gap=_GAP, start=first,
              cutoff=None if cutoff is None else cutoff / scale, presolve=False, node_limit=MINIMUM_NODE_LIMIT)
    found = None if res.values is None else f.assignment(res.values)
    # HiGHS keeps a start above the cut-off as its answer: "optimal" then proves only that none is below.
    if cutoff is not None and (res.status == "infeasible" or res.status == "optimal" and peak(found) >= cutoff):
        return "cut off", None, cutoff
    # HiGHS's dual bound; CBC reports none
    proved = peak(found) if res.status == "optimal" else 0.0 if res.bound is None else res.bound * scale
    return res.status, found, proved


def _fits(problem: Problem, budget: float, time_limit: float, backend: str) -> Fit:
    """``fits_within`` solved, not looked up."""
    if not problem.memory:
        return Fit("fits", greedy(problem))
    f, rows, scale = _memory_model(problem)
    m = f.model
    for constant, coef in rows:
        if not coef and constant > budget:
            return Fit("none", None)
        m.row(list(coef), [b / scale for b in coef.values()], hi=(budget - constant) / scale)
    res = run(m, resolve_backend(backend), time_limit=time_limit, gap=_GAP, presolve=True,
              node_limit=FIT_NODE_LIMIT)
    if res.status == "infeasible":
        return Fit("none", None)
    return Fit("fits", f.assignment(res.values)) if res.values is not None else Fit(None, None)
