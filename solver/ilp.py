"""Exact layout selection as an integer linear program (PuLP; HiGHS when installed, else bundled CBC).

x[c][i] = 1 when choice c takes option i. A pairwise edge cost is linear in x when its matrix is
separable (cost[i][j] = a[i] + b[j], constants included), so only the remainder of a non-separable
matrix needs the product variables y[i][j] = x_src[i] * x_dst[j], linearized exactly through their
marginals: sum_j y[i][j] = x_src[i] and sum_i y[i][j] = x_dst[j].
"""
from __future__ import annotations

import dataclasses
import functools
import logging
import math
import time
import warnings
from typing import Callable, Sequence

import pulp

from autopar.errors import AutoparError

from .greedy import greedy
from .problem import Problem, Solution

log = logging.getLogger(__name__)

# Optimality gaps, relative and absolute (in units of the largest objective coefficient after scaling).
# Tighter than the solvers' defaults (HiGHS stops at 1e-4) so "optimal" means optimal to about 1e-7.
_GAP_REL = 1e-7
_GAP_ABS = 1e-9

_STATUS = {pulp.LpSolutionOptimal: "optimal", pulp.LpSolutionIntegerFeasible: "feasible"}

Variables = list[list[pulp.LpVariable] | None]   # per choice; None for a single-option (fixed) choice


@functools.cache
def _highs_available() -> bool:
    return pulp.HiGHS(msg=False).available()


@functools.cache
def _warn_no_highs() -> None:   # cached so a planning sweep warns once, not once per solve
    log.warning("solver backend 'highs' was requested but highspy is not installed; using the bundled "
                "CBC instead (pip install highspy for faster solves)")


def resolve_backend(backend: str) -> str:
    """'auto', 'highs' or 'cbc' -> the backend that will run: 'highs' or 'cbc'."""
    if backend not in ("auto", "highs", "cbc"):
        raise ValueError(f"unknown solver backend {backend!r}: expected 'auto', 'highs' or 'cbc'")
    if backend == "cbc":
        return "cbc"
    if _highs_available():
        return "highs"
    if backend == "highs":
        _warn_no_highs()
    return "cbc"


def make_solver(backend: str, time_limit: float, warm_start: bool) -> pulp.LpSolver:
    if backend == "highs":   # pulp's HiGHS interface takes no initial solution
        return pulp.HiGHS(msg=False, timeLimit=time_limit, gapRel=_GAP_REL, gapAbs=_GAP_ABS)
    with warnings.catch_warnings():   # PuLP 3.3 deprecates its bundled CBC (gone in 4.0); it still works
        warnings.simplefilter("ignore", DeprecationWarning)
        return pulp.PULP_CBC_CMD(msg=False, timeLimit=time_limit, gapRel=_GAP_REL, gapAbs=_GAP_ABS,
                                 warmStart=warm_start)


def variable(model: pulp.LpProblem, name: str, *, cat: str = pulp.LpContinuous,
             low: float | None = None) -> pulp.LpVariable:
    # PuLP >= 3.3 creates variables through the model (its 4.0 API) and deprecates the constructor.
    if hasattr(model, "add_variable"):
        return model.add_variable(name, lowBound=low, cat=cat)
    return pulp.LpVariable(name, lowBound=low, cat=cat)


def one_hot(model: pulp.LpProblem, problem: Problem) -> Variables:
    x: Variables = []
    for c, ch in enumerate(problem.choices):
        if len(ch.costs) == 1:
            x.append(None)
            continue
        xs = [variable(model, f"x{c}_{i}", cat=pulp.LpBinary) for i in range(len(ch.costs))]
        model += pulp.lpSum(xs) == 1, f"one_{c}"
        for v, cost in zip(xs, ch.costs):
            if math.isinf(cost):
                v.upBound = 0
        x.append(xs)
    return x


def pair_variables(model: pulp.LpProblem, x: Variables, s: int, d: int, cache: dict) -> list[list]:
    """y[i][j] = x[s][i] * x[d][j] (s < d, both free), linearized exactly through its marginals; made
    once per pair and shared by the objective and the memory constraints."""
    if (s, d) not in cache:
        y = [[variable(model, f"y{s}_{d}_{i}_{j}", low=0) for j in range(len(x[d]))] for i in range(len(x[s]))]
        for i, row in enumerate(y):
            model += pulp.lpSum(row) == x[s][i], f"row_{s}_{d}_{i}"
        for j, col in enumerate(zip(*y)):
            model += pulp.lpSum(col) == x[d][j], f"col_{s}_{d}_{j}"
        cache[(s, d)] = y
    return cache[(s, d)]


def memory_rows(problem: Problem, x: Variables, model: pulp.LpProblem,
                pairs: dict) -> list[tuple[float, dict[pulp.LpVariable, float]]]:
    """Each memory constraint as (constant bytes, bytes per variable), fixed choices folded in. A pair
    term is split like an edge: its separable part onto x, the remainder onto pair variables."""
    rows = []
    for m in problem.memory:
        constant, coef = m.constant, {}

        def add(c, per):
            nonlocal constant
            if x[c] is None:
                constant += per[0]
            else:
                for v, b in zip(x[c], per):
                    coef[v] = coef.get(v, 0.0) + b

        for c, per in m.terms:
            add(c, per)
        for a, b, per in m.pairs:
            if a == b:
                add(a, [row[i] for i, row in enumerate(per)])
                continue
            if a > b:
                a, b, per = b, a, tuple(zip(*per))
            add(a, [row[0] for row in per])
            add(b, [v - per[0][0] for v in per[0]])
            if x[a] is None or x[b] is None:       # one side fixed: the pair was linear after all
                continue
            y = pair_variables(model, x, a, b, pairs)
            for i, row in enumerate(per):
                for j, v in enumerate(row):
                    r = v - row[0] - per[0][j] + per[0][0]
                    if r:
                        coef[y[i][j]] = coef.get(y[i][j], 0.0) + r
        rows.append((constant, coef))
    return rows


def run(model: pulp.LpProblem, solver: pulp.LpSolver) -> str | None:
    """'optimal', 'feasible' or 'infeasible'; None when the solver stopped without an incumbent."""
    model.solve(solver)
    if model.status == pulp.LpStatusInfeasible:   # CBC's "Integer infeasible" carries no solution status
        return "infeasible"
    return _STATUS.get(model.sol_status)


def assignment(x: Variables) -> tuple[int, ...]:
    # argmax rather than == 1: solvers return binaries only to within their integrality tolerance
    return tuple(0 if xs is None else max(range(len(xs)), key=lambda i: xs[i].varValue or 0.0) for xs in x)


def warm(x: Variables, start: Sequence[int]) -> None:
    for xs, a in zip(x, start):
        if xs is not None and xs[a].upBound != 0:     # a forbidden greedy pick is no start at all
            xs[a].setInitialValue(1)


def _finite(e):
    """An edge with its forbidden (infinite) pairs priced 0: ``forbid_pairs`` excludes them."""
    if not any(math.isinf(v) for row in e.cost for v in row):
        return e
    return dataclasses.replace(e, cost=tuple(tuple(0.0 if math.isinf(v) else v for v in row) for row in e.cost))


def forbid(model, problem: Problem, x: Variables) -> bool:
    """Constraints for infinite costs; True when a fixed choice makes the problem infeasible outright."""
    impossible = any(all(math.isinf(c) for c in ch.costs) for ch in problem.choices)
    for k, e in enumerate(problem.edges):
        for i, row in enumerate(e.cost):
            for j, v in enumerate(row):
                if not math.isinf(v):
                    continue
                xi = None if x[e.src] is None else x[e.src][i]
                xj = None if x[e.dst] is None else x[e.dst][j]
                if e.src == e.dst:      # both ends take one option: only the diagonal happens
                    if i == j:
                        impossible |= xi is None
                        if xi is not None:
                            xi.upBound = 0
                elif xi is None and xj is None:
                    impossible = True
                elif xi is None or xj is None:
                    (xj if xi is None else xi).upBound = 0
                else:
                    model += xi + xj <= 1, f"forbid_{k}_{i}_{j}"
    return impossible


def _fold_objective(problem: Problem) -> tuple[list[list[float]], dict[tuple[int, int], list[list[float]]]]:
    """The objective as per-option costs plus, per choice pair, the non-separable remainder of the
    merged edge matrices (oriented [lower index option][higher index option])."""
    lin = [[0.0 if math.isinf(c) else ch.count * c for c in ch.costs] for ch in problem.choices]
    pairs: dict[tuple[int, int], list[list[float]]] = {}
    for e in problem.edges:
        e = _finite(e)
        if e.src == e.dst:   # a folded layer feeding itself: both ends take the same option
            for i in range(len(lin[e.src])):
                lin[e.src][i] += e.count * e.cost[i][i]
            continue
        s, d, m = e.src, e.dst, e.cost
        if s > d:   # orient every pair one way so that edges in both directions merge too
            s, d, m = d, s, tuple(zip(*m))
        acc = pairs.setdefault((s, d), [[0.0] * len(lin[d]) for _ in lin[s]])
        for i, row in enumerate(m):
            for j, v in enumerate(row):
                acc[i][j] += e.count * v
    residual = {}
    for (s, d), m in pairs.items():
        # m[i][j] = m[i][0] + (m[0][j] - m[0][0]) + r[i][j]; the first two parts are linear in x.
        for i, row in enumerate(m):
            lin[s][i] += row[0]
        for j, v in enumerate(m[0]):
            lin[d][j] += v - m[0][0]
        r = [[v - row[0] - m[0][j] + m[0][0] for j, v in enumerate(row)] for row in m]
        tol = 1e-12 * max(abs(v) for row in m for v in row)   # rounding noise of the subtraction above
        if len(r) > 1 and len(r[0]) > 1 and any(abs(v) > tol for row in r for v in row):
            residual[(s, d)] = r
    return lin, residual


def _shared_terms(model, k: int, e, x: Variables) -> tuple[list, bool]:
    """Objective terms of a shared edge. For each reader, y[i][j] links the source's option i and the
    reader's option j (rows sum to x_src, columns to x_reader, as for an ordinary edge); a request r
    at source option i is paid through w[i][r] >= the reader's y[i][j] over the options j that make r,
    for every reader, so it is paid once however many readers make it. The bound is as tight as an
    ordinary edge's, with a max over readers where a per-reader sum would count a request twice."""
    terms, impossible = [], False
    src = x[e.src]
    n_src = len(e.cost[0]) if e.cost else 1
    made = set(e.always)
    for c, reqs in e.readers:
        if x[c] is None and reqs[0] >= 0:
            made.add(reqs[0])
    for r in made:      # always paid: linear in the source's option
        for i, c in enumerate(e.cost[r]):
            if src is None:
                impossible |= math.isinf(c)
            elif math.isinf(c):
                src[i].upBound = 0
            else:
                terms.append((src[i], e.count * c))
    pays: dict = {}     # (i, r) -> [expression that must be paid for]
    for n, (c, reqs) in enumerate(e.readers):
        if x[c] is None or all(r < 0 or r in made for r in reqs):
            continue
        if src is None:
            links = [[v for v in x[c]]]
        else:
            links = [[variable(model, f"sy{k}_{n}_{i}_{j}", low=0) for j in range(len(reqs))] for i in range(n_src)]
            for i, row in enumerate(links):
                model += pulp.lpSum(row) == src[i], f"ys{k}_{n}_{i}"
            for j in range(len(reqs)):
                model += pulp.lpSum(links[i][j] for i in range(n_src)) == x[c][j], f"yc{k}_{n}_{j}"
        for i, row in enumerate(links):
            by_request: dict = {}
            for j, r in enumerate(reqs):
                if r >= 0 and r not in made:
                    by_request.setdefault(r, []).append(row[j])
            for r, vs in by_request.items():
                pays.setdefault((i, r), []).append(pulp.lpSum(vs))
    for (i, r), exprs in pays.items():
        c = e.cost[r][i]
        if math.isinf(c):               # this request cannot be served from that source option
            for n, ex in enumerate(exprs):
                model += ex <= 0, f"bar_{k}_{i}_{r}_{n}"
            continue
        if c == 0:
            continue
        w = variable(model, f"sw{k}_{i}_{r}", low=0)
        for n, ex in enumerate(exprs):
            model += w >= ex, f"pay_{k}_{i}_{r}_{n}"
        terms.append((w, e.count * c))
    return terms, impossible


def solve(problem: Problem, *, time_limit: float = 60.0, backend: str = "auto", warm_start: bool = True,
          progress: Callable[[str], None] | None = None) -> Solution:
    """The assignment of least Problem.objective within the memory limit.

    Status "infeasible" (no assignment fits memory_limit) returns the greedy assignment instead of
    raising; the caller turns it into the user-facing error. Raises AutoparError only when the time
    limit passes before any assignment that fits is known. ``time_limit`` bounds the solver's search
    (CBC's preprocessing can overrun it); "feasible" means it stopped there with a layout in hand.
    """
    start = time.perf_counter()
    report = progress or (lambda stage: None)
    problem.validate()
    name = resolve_backend(backend)
    report("building model")
    fallback = greedy(problem)   # the warm start, and the answer whenever the solver does worse
    model = pulp.LpProblem("autopar_layout", pulp.LpMinimize)
    x = one_hot(model, problem)
    known_infeasible = forbid(model, problem, x)
    lin, residual = _fold_objective(problem)

    terms = []   # (variable, seconds)
    for xs, costs in zip(x, lin):
        if xs is not None:   # one option is always taken: only differences matter, which helps the gap
            terms += [(v, c - min(costs)) for v, c in zip(xs, costs)]
    pairs: dict = {}
    for (s, d), r in residual.items():
        y = pair_variables(model, x, s, d, pairs)
        terms += [(y[i][j], v) for i, row in enumerate(r) for j, v in enumerate(row) if v]
        if warm_start:
            y[fallback[s]][fallback[d]].setInitialValue(1)
    for k, e in enumerate(problem.shared):
        shared_terms, impossible = _shared_terms(model, k, e, x)
        terms += shared_terms
        known_infeasible |= impossible
    # Seconds can be 1e-6: scale to O(1) so the solvers' absolute tolerances do not swallow them.
    # A variable may appear in several terms (shared edges charge the source's options): sum them, as an
    # LpAffineExpression built from pairs keeps only the last coefficient of a repeated variable.
    coef: dict = {}
    for v, c in terms:
        coef[v] = coef.get(v, 0.0) + c
    scale = max((abs(c) for c in coef.values()), default=0.0) or 1.0
    model += pulp.LpAffineExpression([(v, c / scale) for v, c in coef.items() if c])

    if problem.memory_limit is not None:
        for k, (constant, coef) in enumerate(memory_rows(problem, x, model, pairs)):
            rhs = problem.memory_limit - constant
            if not coef:   # nothing to decide: the Problem.feasible test settles it
                known_infeasible |= constant > problem.memory_limit * (1 + 1e-9)
                continue
            s = max([abs(rhs), *map(abs, coef.values())]) or 1.0   # bytes are ~1e10: scale rows to O(1)
            model += pulp.LpAffineExpression([(v, b / s) for v, b in coef.items()]) <= rhs / s, f"mem_{k}"
    if warm_start:
        warm(x, fallback)

    report("solving")
    found = None
    if known_infeasible:
        status = "infeasible"
    elif not model.numVariables():
        status, found = "optimal", assignment(x)
    else:
        status = run(model, make_solver(name, time_limit, warm_start))
        if status in ("optimal", "feasible"):
            found = assignment(x)

    fits = [a for a in (found, fallback) if a is not None and problem.feasible(a)]
    if fits:
        best = min(fits, key=problem.objective)   # defensive: never return worse than the greedy
        if status not in ("optimal", "feasible"):
            status = "feasible"
    elif found is not None:
        best = found   # over the limit only within the solver's feasibility tolerance
    elif status == "infeasible":
        best = fallback
    else:
        raise AutoparError(f"the {name} solver found no layout within the memory budget in its time limit "
                           f"of {time_limit:g} s, and neither did the greedy heuristic; raise the time limit "
                           f"or the memory budget")
    report("done")
    return Solution(assignment=best, objective=problem.objective(best), status=status,
                    seconds=time.perf_counter() - start, num_variables=model.numVariables(),
                    num_constraints=model.numConstraints(), backend=name)
