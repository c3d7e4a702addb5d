"""Exact layout selection as an integer linear program, solved by HiGHS (through highspy's own API)
or, when highspy is not installed, by the CBC that PuLP bundles (solver/milp.py).

x[c][i] = 1 when choice c takes option i. A pairwise edge cost is linear in x when its matrix is
separable (cost[i][j] = a[i] + b[j], constants included), so only the remainder of a non-separable
matrix needs the product variables y[i][j] = x_src[i] * x_dst[j], linearized exactly through their
marginals: sum_j y[i][j] = x_src[i] and sum_i y[i][j] = x_dst[j].

Solves stop at a relative optimality gap of ``GAP`` (HiGHS's default): the plan returned costs at
most that fraction more than the best plan of its problem, and ``Solution.gap`` says what the solver
proved. A ``bound`` (the best plan found so far on another mesh) lets the solver stop as soon as it
proves that nothing cheaper exists.
"""
from __future__ import annotations

import dataclasses
import functools
import logging
import math
import time
from collections import defaultdict
from typing import Callable, Sequence

from autopar.errors import AutoparError

from . import milp
from .greedy import greedy
from .milp import INF, Model
from .problem import Problem, Solution

log = logging.getLogger(__name__)

GAP = 1e-4
_NEAR = 0.8


@functools.cache
def _highs_available() -> bool:
    return milp.highs_available()


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


class Formulation:
    """The ILP of a Problem as a ``Model``, with the columns that stand for each option (``x``) and
    what it takes to turn an assignment into a full starting point for the solver."""

    def __init__(self, problem: Problem):
        self.problem = problem
        self.model = Model()
        self.impossible = False          # a fixed choice or a fixed pair can never be valid
        self.pairs: dict = {}            # (s, d) -> y[i][j] columns
        self.groups: dict = {}           # (s, d) -> (group of each s option, group of each d option)
        self.products: list = []         # (column, a, b): column = sum(a) * sum(b), a and b lists of columns
        self.maxima: list = []           # (column, [[columns]]): column = max over lists of their sum
        self.links: dict = {}            # (source, reader) -> y[i][j] columns of a shared value's reader
        self.indicators: dict = {}       # lists of columns -> the column bounded below by each list's sum
        self.x: list[list[int] | None] = []
        for ch in problem.choices:
            if len(ch.costs) == 1:
                self.impossible |= math.isinf(ch.costs[0])
                self.x.append(None)
                continue
            xs = self.model.binaries(len(ch.costs))
            self.model.row(xs, [1.0] * len(xs), 1.0, 1.0)
            for k, cost in zip(xs, ch.costs):
                if math.isinf(cost):
                    self.model.hi[k] = 0.0
            self.x.append(xs)

    def group(self, matrices: dict) -> None:
        """Options of ``s`` whose rows are equal in every matrix priced on pair (s, d) (``matrices``:
        (s, d) -> list of [s option][d option] matrices) share their pair variables, and so do options
        of ``d`` with equal columns: y over groups is the same relaxation with fewer columns."""
        for key, mats in matrices.items():
            rows = [tuple(v for m in mats for v in m[i]) for i in range(len(mats[0]))]
            cols = [tuple(m[i][j] for m in mats for i in range(len(m))) for j in range(len(mats[0][0]))]
            self.groups[key] = (_classes(rows), _classes(cols))

    def pair(self, s: int, d: int) -> list[list[int]]:
        """y[i][j] = x[s][i] * x[d][j] (s < d, both free), linearized through its marginals, made once per
        pair and shared by the objective and the memory constraints. Options grouped by ``group`` share a
        column: y[i][j] is then the product of the two groups' sums, and its coefficient is added once
        per distinct column (``Formulation.priced``)."""
        if (s, d) not in self.pairs:
            m, xs, xd = self.model, self.x[s], self.x[d]
            row_of, col_of = self.groups.get((s, d), (list(range(len(xs))), list(range(len(xd)))))
            ng, nh = max(row_of) + 1, max(col_of) + 1
            members_s = [[xs[i] for i in range(len(xs)) if row_of[i] == g] for g in range(ng)]
            members_d = [[xd[j] for j in range(len(xd)) if col_of[j] == h] for h in range(nh)]
            big = [[m.col() for _ in range(nh)] for _ in range(ng)]
            for g, row in enumerate(big):
                m.row(row + members_s[g], [1.0] * nh + [-1.0] * len(members_s[g]), 0.0, 0.0)
            for h in range(nh):
                col = [row[h] for row in big]
                m.row(col + members_d[h], [1.0] * ng + [-1.0] * len(members_d[h]), 0.0, 0.0)
            self.products += [(big[g][h], members_s[g], members_d[h]) for g in range(ng) for h in range(nh)]
            self.pairs[(s, d)] = [[big[row_of[i]][col_of[j]] for j in range(len(xd))] for i in range(len(xs))]
        return self.pairs[(s, d)]

    @staticmethod
    def priced(y, r, coef: dict) -> None:
        """Add matrix ``r`` onto pair variables ``y``, once per distinct column."""
        cell = {}
        for i, row in enumerate(r):
            for j, v in enumerate(row):
                if v:
                    cell[y[i][j]] = v
        for col, v in cell.items():
            coef[col] += v

    def forbid(self) -> None:
        """Rows for infinite edge costs: the two options cannot both be taken."""
        x, m = self.x, self.model
        for e in self.problem.edges:
            for i, row in enumerate(e.cost):
                for j, v in enumerate(row):
                    if not math.isinf(v):
                        continue
                    xi = None if x[e.src] is None else x[e.src][i]
                    xj = None if x[e.dst] is None else x[e.dst][j]
                    if e.src == e.dst:      # both ends take one option: only the diagonal happens
                        if i == j:
                            self.impossible |= xi is None
                            if xi is not None:
                                m.hi[xi] = 0.0
                    elif xi is None and xj is None:
                        self.impossible = True
                    elif xi is None or xj is None:
                        m.hi[xj if xi is None else xi] = 0.0
                    else:
                        m.row([xi, xj], [1.0, 1.0], hi=1.0)

    def objective(self, lin, residual) -> tuple[dict, float]:
        """Seconds per column, and the seconds no column carries (fixed choices, each choice's cheapest
        option, fixed parts of shared edges), from ``_fold_objective``'s parts."""
        coef: dict = defaultdict(float)
        constant = 0.0
        for xs, costs in zip(self.x, lin):
            if xs is None:
                constant += costs[0]
                continue
            low = min(costs)   # one option is always taken: only differences matter, which helps the gap
            constant += low
            for v, c in zip(xs, costs):
                if c != low:
                    coef[v] += c - low
        for (s, d), r in residual.items():
            self.priced(self.pair(s, d), r, coef)
        for e in self.problem.shared:
            constant += self._shared(e, coef)
        return coef, constant

    def forbid_shared(self) -> None:
        """Rows for the shared values' requests that cannot be served (infinite cost), without their
        seconds: for a model that prices no time (solver/memory_bound.py)."""
        for e in self.problem.shared:
            self._shared(e, None)

    def _shared(self, e, coef: dict | None) -> float:
        """Objective terms of a shared edge; returns its seconds that no column carries. For each reader,
        y[i][j] links the source's option i and the reader's option j (rows sum to x_src, columns to
        x_reader, as for an ordinary edge); a request r at source option i is paid through w[i][r] >=
        the reader's y[i][j] over the options j that make r, for every reader, so it is paid once however
        many readers make it. The bound is as tight as an ordinary edge's, with a max over readers where
        a per-reader sum would count a request twice. Readers that are one choice making the same
        requests (the copies of a folded layer) are one reader."""
        m, x = self.model, self.x
        src = x[e.src]
        readers = list(dict.fromkeys(e.readers))
        constant = 0.0
        made = set(e.always)
        for c, reqs in readers:
            if x[c] is None and reqs[0] >= 0:
                made.add(reqs[0])
        for r in made:      # always paid: linear in the source's option
            for i, c in enumerate(e.cost[r]):
                if src is None:
                    self.impossible |= math.isinf(c)
                    constant += 0.0 if math.isinf(c) else e.count * c
                elif math.isinf(c):
                    m.hi[src[i]] = 0.0
                elif coef is not None:
                    coef[src[i]] += e.count * c
        for (i, r), lists in self._request_columns(e.src, readers, made).items():
            c = e.cost[r][i]
            if math.isinf(c):               # this request cannot be served from that source option
                for cols in lists:
                    m.row(cols, [1.0] * len(cols), hi=0.0)
                continue
            if c == 0 or coef is None:
                continue
            coef[self.indicator(lists)] += e.count * c
        return constant

    def link(self, s: int, c: int) -> list[list[int]]:
        """y[i][j] = x[s][i] * x[c][j] for a shared value's source ``s`` and reader ``c``, linearized through
        its marginals, made once and shared by the objective and the memory rows; x[c] itself where the
        source is fixed."""
        m, src, xc = self.model, self.x[s], self.x[c]
        if src is None:
            return [list(xc)]
        if (s, c) not in self.links:
            links = [[m.col() for _ in xc] for _ in src]
            for i, row in enumerate(links):
                m.row(row + [src[i]], [1.0] * len(row) + [-1.0], 0.0, 0.0)
            for j in range(len(xc)):
                col = [links[i][j] for i in range(len(src))]
                m.row(col + [xc[j]], [1.0] * len(src) + [-1.0], 0.0, 0.0)
            self.products += [(links[i][j], [src[i]], [xc[j]]) for i in range(len(src)) for j in range(len(xc))]
            self.links[(s, c)] = links
        return self.links[(s, c)]

    def _request_columns(self, s: int | None, readers, made: set) -> dict:
        """(source option, request) -> one list of columns per free reader, whose sum is 1 where that
        reader's option makes the request at that source option; requests in ``made`` left out."""
        out: dict = defaultdict(list)
        for c, reqs in readers:
            if self.x[c] is None or all(r < 0 or r in made for r in reqs):
                continue
            links = [list(self.x[c])] if s is None else self.link(s, c)
            for i, row in enumerate(links):
                by_request: dict = defaultdict(list)
                for j, r in enumerate(reqs):
                    if r >= 0 and r not in made:
                        by_request[r].append(row[j])
                for r, cols in by_request.items():
                    out[(i, r)].append(cols)
        return out

    def indicator(self, lists: list[list[int]]) -> int:
        """A column bounded below by the sum of each list (1 where any reader makes a request): the max
        over them wherever its coefficient is positive, as in the objective and the memory rows."""
        key = tuple(sorted(tuple(cols) for cols in lists))
        if key not in self.indicators:
            w = self.model.col()
            for cols in lists:
                self.model.row([w] + cols, [1.0] + [-1.0] * len(cols), lo=0.0)
            self.maxima.append((w, lists))
            self.indicators[key] = w
        return self.indicators[key]

    def memory_rows(self, which=None) -> list[tuple[float, dict]]:
        """Memory constraints (all, or those ``which`` lists by index) as (constant bytes, bytes per
        column), fixed choices folded in. A pair term is split like an edge: its separable part onto x,
        the remainder onto pair variables."""
        x, rows = self.x, []
        memory = self.problem.memory
        for mc in memory if which is None else [memory[k] for k in sorted(which)]:
            constant, coef = mc.constant, defaultdict(float)

            def add(c, per):
                nonlocal constant
                if c is None or x[c] is None:
                    constant += per[0]
                else:
                    for v, b in zip(x[c], per):
                        coef[v] += b

            for c, per in mc.terms:
                add(c, per)
            for sb in mc.shared:
                self._shared_bytes(sb, add, coef)
            for a, b, per in mc.pairs:
                if a == b:
                    add(a, [row[i] for i, row in enumerate(per)])
                    continue
                if a > b:
                    a, b, per = b, a, tuple(zip(*per))
                add(a, [row[0] for row in per])
                add(b, [v - per[0][0] for v in per[0]])
                if x[a] is None or x[b] is None:       # one side fixed: the pair was linear after all
                    continue
                self.priced(self.pair(a, b), _pair_residual(per), coef)
            rows.append((constant, coef))
        return rows

    def _shared_bytes(self, sb, add, coef: dict) -> None:
        """A memory row's ``SharedBytes``: requests always made are linear in the source's option; each
        other request's bytes sit on the indicator that any reader makes it (a reader's own columns
        where only one reader can)."""
        x = self.x
        made = set(sb.always) | {reqs[0] for c, reqs in sb.readers if x[c] is None and reqs[0] >= 0}
        for r in made:
            add(sb.src, sb.bytes[r])
        for (i, r), lists in self._request_columns(sb.src, list(dict.fromkeys(sb.readers)), made).items():
            b = sb.bytes[r][i]
            if not b:
                continue
            for col in (lists[0] if len(lists) == 1 else [self.indicator(lists)]):
                coef[col] += b

    def start(self, assignment: Sequence[int]) -> list[float]:
        """The columns' values for an assignment: a starting point for the solver."""
        v = [0.0] * self.model.num_cols
        for xs, a in zip(self.x, assignment):
            if xs is not None:
                v[xs[a]] = 1.0
        for col, a, b in self.products:
            v[col] = sum(v[k] for k in a) * sum(v[k] for k in b)
        for col, lists in self.maxima:
            v[col] = max(sum(v[k] for k in cols) for cols in lists)
        return v

    def assignment(self, values: Sequence[float]) -> tuple[int, ...]:
        # argmax rather than == 1: solvers return binaries only to within their integrality tolerance
        return tuple(0 if xs is None else max(range(len(xs)), key=lambda i: values[xs[i]]) for xs in self.x)


def _classes(keys: list) -> list[int]:
    """The class of each key: keys that are equal share one, numbered in order of first appearance."""
    seen: dict = {}
    return [seen.setdefault(k, len(seen)) for k in keys]


def _pair_residual(per) -> list[list[float]]:
    """A pair term's remainder once its parts linear in either choice (its first row and column) are taken out."""
    return [[v - row[0] - per[0][j] + per[0][0] for j, v in enumerate(row)] for row in per]


def _pair_matrices(problem: Problem, x, residual: dict, memory) -> dict:
    """(s, d) -> every matrix priced on that pair's variables: the objective's remainder and the
    remainders of the memory pair terms ``formulate`` will include."""
    mats: dict = defaultdict(list)
    for key, r in residual.items():
        mats[key].append(r)
    if problem.memory_budget is not None:
        chosen = problem.memory if memory is None else [problem.memory[k] for k in sorted(memory)]
        memory_pair_matrices(chosen, x, mats)
    return mats


def memory_pair_matrices(constraints, x, mats: dict | None = None) -> dict:
    """Add to ``mats`` ((s, d) -> matrices, as ``Formulation.group`` takes them) the remainders of the
    pair terms of memory ``constraints`` whose two choices are both free."""
    mats = defaultdict(list) if mats is None else mats
    for mc in constraints:
        for a, b, per in mc.pairs:
            if a == b or x[a] is None or x[b] is None:
                continue
            if a > b:
                a, b, per = b, a, tuple(zip(*per))
            mats[(a, b)].append(_pair_residual(per))
    return mats


def _finite(e):
    """An edge with its forbidden (infinite) pairs priced 0: ``Formulation.forbid`` excludes them."""
    if not any(math.isinf(v) for row in e.cost for v in row):
        return e
    return dataclasses.replace(e, cost=tuple(tuple(0.0 if math.isinf(v) else v for v in row) for row in e.cost))


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
        # m[i][j] = a[i] + b[j] + r[i][j], a and b linear in x; r >= 0 gives HiGHS's objective propagation
        # bounds of zero to start from (negative pair costs made it 2.4x slower on a pipeline stage).
        a = [min(row) for row in m]
        b = [min(m[i][j] - a[i] for i in range(len(m))) for j in range(len(m[0]))]
        for i, v in enumerate(a):
            lin[s][i] += v
        for j, v in enumerate(b):
            lin[d][j] += v
        r = [[v - a[i] - b[j] for j, v in enumerate(row)] for i, row in enumerate(m)]
        tol = 1e-12 * max(abs(v) for row in m for v in row)   # rounding noise of the subtraction above
        if len(r) > 1 and len(r[0]) > 1 and any(abs(v) > tol for row in r for v in row):
            residual[(s, d)] = r
    return lin, residual


def formulate(problem: Problem, memory=None) -> tuple[Formulation, float, float]:
    """The layout ILP: (formulation, scale, constant), with the memory constraints ``memory`` lists by
    index (None: all of them). Its model's objective times ``scale`` is the problem's objective in
    seconds (``constant`` of it carried by no column)."""
    f = Formulation(problem)
    f.forbid()
    lin, residual = _fold_objective(problem)
    f.group(_pair_matrices(problem, f.x, residual, memory))
    coef, constant = f.objective(lin, residual)
    # Seconds can be 1e-6: scale to O(1) so the solvers' absolute tolerances do not swallow them.
    scale = max((abs(c) for c in coef.values()), default=0.0) or 1.0
    m = f.model
    for k, c in coef.items():
        m.cost[k] = c / scale
    m.offset = constant / scale
    if problem.memory_budget is not None:
        for constant_bytes, row in f.memory_rows(memory):
            rhs = problem.memory_budget - constant_bytes
            if not row:   # nothing to decide: the Problem.feasible test settles it
                f.impossible |= constant_bytes > problem.memory_budget * (1 + 1e-9)
                continue
            s = max([abs(rhs), *map(abs, row.values())]) or 1.0   # bytes are ~1e10: scale rows to O(1)
            m.row(list(row), [b / s for b in row.values()], hi=rhs / s)
    return f, scale, constant


def solve(problem: Problem, *, time_limit: float = 60.0, backend: str = "auto", warm_start: bool = True,
          progress: Callable[[str], None] | None = None, gap: float = GAP,
          bound: float | None = None, node_limit: int | None = None) -> Solution:
    """The assignment of least Problem.objective within the memory limit, to a relative ``gap``.

    Status "infeasible" (no assignment fits memory_budget) returns the greedy assignment instead of
    raising; the caller turns it into the user-facing error. With ``bound`` (seconds), the solver may
    stop once it proves that no assignment within the memory limit costs less than the bound: status
    "bounded", whose assignment is not an answer. Raises AutoparError only when the time limit passes before any assignment
    that fits is known. ``time_limit`` bounds each solver run, and ``node_limit`` its branch-and-bound
    nodes (a cut-off that does not depend on the machine's load); "feasible" means it stopped there
    with a layout in hand.

    Memory constraints join the model lazily: first those that the step time alone comes close to
    breaking (the greedy layout without a budget; none under a bound), then any the solver's answer
    breaks, until an answer fits them all. An answer of a model with fewer constraints that fits every constraint is optimal
    for the whole problem, and a model without the constraints that bind solves several times faster.
    """
    start = time.perf_counter()
    report = progress or (lambda stage: None)
    problem.validate()
    name = resolve_backend(backend)
    report("building model")
    fallback = greedy(problem)   # the warm start, and the answer whenever the solver does worse
    usable = problem.feasible(fallback) and math.isfinite(problem.objective(fallback))
    # Under a bound, the relaxation without memory rows is a cheap first test: when nothing beats the
    # bound even without a budget, the problem is done.
    active = set() if bound is not None else _binding(problem)
    report("solving")
    while True:
        f, scale, _ = formulate(problem, active)
        found, solver_gap = None, None
        if f.impossible:
            status = "infeasible"
            break
        first = f.start(fallback) if warm_start and usable else None
        res = run(f.model, name, time_limit=time_limit, gap=gap, start=first,
                  cutoff=None if bound is None else bound / scale, node_limit=node_limit)
        status, solver_gap = res.status, res.gap
        if res.values is None:
            break
        found = f.assignment(res.values)
        broken = set() if problem.memory_budget is None else over(problem, found, problem.memory_budget) - active
        if not broken:
            break
        log.debug("memory constraints %s join the model", sorted(broken))
        active |= broken
    if status == "infeasible" and bound is not None:
        status, found = "bounded", None

    fits = [a for a in (found, fallback) if a is not None and problem.feasible(a)]
    if status == "bounded":
        best, solver_gap = fallback, None
        if usable and problem.objective(fallback) < bound:   # the solver missed the start it was given
            status = "feasible"
    elif fits:
        best = min(fits, key=problem.objective)   # defensive: never return worse than the greedy
        if status not in ("optimal", "feasible"):
            status, solver_gap = "feasible", None
        elif best != found:
            solver_gap = None
    elif found is not None:
        best = found   # over the limit only within the solver's feasibility tolerance
    elif status == "infeasible":
        best = fallback
    else:
        limit = f"time limit of {time_limit:g} s" + ("" if node_limit is None else f" or {node_limit} nodes")
        raise AutoparError(f"the {name} solver found no layout within the memory budget in its {limit}, and neither "
                           f"did the greedy heuristic; raise the time limit or the memory budget")
    if bound is not None and status in ("optimal", "feasible") and problem.objective(best) >= bound:
        # Nothing cheaper than the bound: HiGHS stops there and keeps its start; CBC takes no cutoff.
        status, solver_gap = "bounded", None
    report("done")
    return Solution(assignment=best, objective=problem.objective(best), status=status,
                    seconds=time.perf_counter() - start, num_variables=f.model.num_cols,
                    num_constraints=f.model.num_rows, backend=name, gap=solver_gap)


def over(problem: Problem, assignment, cap: float) -> set[int]:
    """The memory constraints whose bytes under ``assignment`` are above ``cap``, by index."""
    cap *= 1 + 1e-9
    usage = problem.memory_usage(assignment)
    return {k for k, m in enumerate(problem.memory) if usage[m.name] > cap}


def _binding(problem: Problem) -> set[int]:
    """The memory constraints to start with: those that the layout chosen for time alone breaks or
    comes within ``_NEAR`` of (the optimum will likely break them too, and a second solve costs more
    than starting with them)."""
    if problem.memory_budget is None or not problem.memory:
        return set()
    return over(problem, greedy(dataclasses.replace(problem, memory_budget=None)), _NEAR * problem.memory_budget)


def run(model: Model, backend: str, **kwargs) -> milp.Result:
    """Run the solver (a seam for tests)."""
    return milp.run(model, backend, **kwargs)
