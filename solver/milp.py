"""A mixed-integer linear program held as arrays, and the two ways it runs: HiGHS through highspy's own
API, or CBC through PuLP when highspy is not installed.

The layout ILP has tens of thousands of columns. Built through PuLP's expression objects it spends
seconds in Python before the solver starts, and PuLP's HiGHS interface takes neither a starting
solution nor a cutoff. Built as arrays it is handed to highspy in one call, with the greedy
assignment as a starting solution and, when planning over several meshes, the best plan so far as
a cutoff that stops a worse mesh early. CBC keeps PuLP as its modelling layer (docs/solver.md).
"""
from __future__ import annotations

import functools
import logging
import math
import os
import sys
import threading
import time
import warnings
from dataclasses import dataclass, field

log = logging.getLogger("autopar.solver.ilp")

INF = math.inf


@dataclass
class Model:
    """min cost . v + offset  s.t.  row_lo <= A v <= row_hi,  lo <= v <= hi,  v integer where marked.

    A is kept row by row (``start``, ``index``, ``value``, as CSR)."""

    cost: list[float] = field(default_factory=list)
    lo: list[float] = field(default_factory=list)
    hi: list[float] = field(default_factory=list)
    integer: list[bool] = field(default_factory=list)
    row_lo: list[float] = field(default_factory=list)
    row_hi: list[float] = field(default_factory=list)
    start: list[int] = field(default_factory=lambda: [0])
    index: list[int] = field(default_factory=list)
    value: list[float] = field(default_factory=list)
    offset: float = 0.0

    @property
    def num_cols(self) -> int:
        return len(self.cost)

    @property
    def num_rows(self) -> int:
        return len(self.row_lo)

    def col(self, *, lo: float = 0.0, hi: float = INF, integer: bool = False) -> int:
        self.cost.append(0.0)
        self.lo.append(lo)
        self.hi.append(hi)
        self.integer.append(integer)
        return len(self.cost) - 1

    def binaries(self, n: int) -> list[int]:
        return [self.col(hi=1.0, integer=True) for _ in range(n)]

    def row(self, index, value, lo: float = -INF, hi: float = INF) -> None:
        self.index.extend(index)
        self.value.extend(value)
        self.start.append(len(self.index))
        self.row_lo.append(lo)
        self.row_hi.append(hi)

    def objective(self, v) -> float:
        return self.offset + sum(c * x for c, x in zip(self.cost, v) if c)

    def violation(self, v) -> float:
        """The largest violation of a row or a bound by ``v`` (0.0 when ``v`` is feasible)."""
        worst = max((max(lo - x, x - hi) for x, lo, hi in zip(v, self.lo, self.hi)), default=0.0)
        for r in range(self.num_rows):
            s = sum(self.value[k] * v[self.index[k]] for k in range(self.start[r], self.start[r + 1]))
            worst = max(worst, self.row_lo[r] - s, s - self.row_hi[r])
        return max(worst, 0.0)


@dataclass(frozen=True)
class Result:
    status: str | None        # "optimal", "feasible" (stopped early with an incumbent), "infeasible", None
    values: list[float] | None
    gap: float | None         # relative gap between the incumbent and the proven bound at the end
    bound: float | None = None   # the proven least objective (HiGHS's dual bound); None where not reported


@functools.cache
def highs_available() -> bool:
    try:
        import highspy  # noqa: F401
    except ImportError:
        return False
    return True


_banner_lock = threading.Lock()
_banner_printed = False


def _quiet_highs():
    """A new ``highspy.Highs``. highspy >= 1.16 prints its banner to the process's stdout (C level, before
    any option can be set) when the first instance is made; that first construction runs with file
    descriptor 1 pointed at /dev/null, so a user's stdout (``autopar plan`` output piped on) stays clean."""
    global _banner_printed
    import highspy

    with _banner_lock:
        if _banner_printed:
            return highspy.Highs()
        sys.stdout.flush()
        saved = os.dup(1)
        try:
            with open(os.devnull, "wb") as devnull:
                os.dup2(devnull.fileno(), 1)
                h = highspy.Highs()
        finally:
            os.dup2(saved, 1)
            os.close(saved)
            _banner_printed = True
        return h


def run_highs(model: Model, *, time_limit: float, gap: float, start=None, cutoff: float | None = None,
              threads: int = 1, presolve: bool = True, node_limit: int | None = None) -> Result:
    """Solve with HiGHS. ``cutoff``: only solutions of objective below it are wanted; when none exists
    the status is "infeasible" (the caller knows whether that means over memory or over the cutoff).
    ``presolve=False`` skips HiGHS's presolve, which costs more than it saves on some models; otherwise
    it runs light (``presolve_mode`` 2, HiGHS >= 1.11; older versions ignore the option): its full mode
    probes every binary, 90% of the solve on a pipeline stage's problem whose relaxation is integral.
    ``node_limit``: a cut-off in branch-and-bound nodes, which unlike ``time_limit`` does not depend on
    the machine's load."""
    import highspy
    import numpy as np

    h = _quiet_highs()
    h.setOptionValue("output_flag", False)
    h.setOptionValue("time_limit", float(time_limit))
    h.setOptionValue("mip_rel_gap", float(gap))
    h.setOptionValue("mip_abs_gap", 0.0)
    h.setOptionValue("threads", int(threads))
    if not presolve:
        h.setOptionValue("presolve", "off")
    else:
        h.setOptionValue("presolve_mode", 2)
    if node_limit is not None:
        h.setOptionValue("mip_max_nodes", int(node_limit))
    if cutoff is not None:
        h.setOptionValue("objective_bound", float(cutoff))
    lp = highspy.HighsLp()
    lp.num_col_, lp.num_row_ = model.num_cols, model.num_rows
    lp.col_cost_ = np.asarray(model.cost, dtype=np.float64)
    lp.col_lower_ = np.asarray(model.lo, dtype=np.float64)
    lp.col_upper_ = np.asarray(model.hi, dtype=np.float64)
    lp.row_lower_ = np.asarray(model.row_lo, dtype=np.float64)
    lp.row_upper_ = np.asarray(model.row_hi, dtype=np.float64)
    lp.offset_ = float(model.offset)
    lp.a_matrix_.format_ = highspy.MatrixFormat.kRowwise
    lp.a_matrix_.num_col_, lp.a_matrix_.num_row_ = model.num_cols, model.num_rows
    lp.a_matrix_.start_ = np.asarray(model.start, dtype=np.int32)
    lp.a_matrix_.index_ = np.asarray(model.index, dtype=np.int32)
    lp.a_matrix_.value_ = np.asarray(model.value, dtype=np.float64)
    if any(model.integer):
        lp.integrality_ = [highspy.HighsVarType.kInteger if i else highspy.HighsVarType.kContinuous
                           for i in model.integer]
    h.passModel(lp)
    if start is not None:
        sol = highspy.HighsSolution()
        sol.col_value = list(start)
        sol.value_valid = True
        h.setSolution(sol)
    h.run()
    status = h.getModelStatus()
    info = h.getInfo()
    has_solution = info.primal_solution_status == highspy.SolutionStatus.kSolutionStatusFeasible
    values = list(h.getSolution().col_value) if has_solution else None
    mip_gap = info.mip_gap if any(model.integer) else 0.0
    bound = info.mip_dual_bound if any(model.integer) else info.objective_function_value
    bound = bound if math.isfinite(bound) else None
    if status == highspy.HighsModelStatus.kOptimal:
        return Result("optimal", values, max(mip_gap, 0.0), bound)
    if status == highspy.HighsModelStatus.kInfeasible:
        return Result("infeasible", None, None)
    if has_solution:
        return Result("feasible", values, mip_gap if math.isfinite(mip_gap) else None, bound)
    return Result(None, None, None, bound)


def run_cbc(model: Model, *, time_limit: float, gap: float, start=None, node_limit: int | None = None) -> Result:
    """Solve with CBC through PuLP (bundled with PuLP, so it needs nothing else installed)."""
    import pulp

    lp = pulp.LpProblem("autopar_layout", pulp.LpMinimize)
    cols = []
    for k in range(model.num_cols):
        cat = pulp.LpBinary if model.integer[k] and model.lo[k] == 0 and model.hi[k] == 1 else \
            pulp.LpInteger if model.integer[k] else pulp.LpContinuous
        low = None if model.lo[k] == -INF else model.lo[k]
        up = None if model.hi[k] == INF else model.hi[k]
        if hasattr(lp, "add_variable"):   # PuLP >= 3.3 creates variables through the model
            v = lp.add_variable(f"v{k}", lowBound=low, upBound=up, cat=cat)
        else:
            v = pulp.LpVariable(f"v{k}", lowBound=low, upBound=up, cat=cat)
        if cat == pulp.LpBinary and up is not None:
            v.upBound = up
        cols.append(v)
    lp += pulp.LpAffineExpression([(cols[k], c) for k, c in enumerate(model.cost) if c]) + model.offset
    for r in range(model.num_rows):
        span = range(model.start[r], model.start[r + 1])
        expr = pulp.LpAffineExpression([(cols[model.index[k]], model.value[k]) for k in span])
        lo, hi = model.row_lo[r], model.row_hi[r]
        if lo == hi:
            lp += expr == lo, f"r{r}"
        else:
            if lo > -INF:
                lp += expr >= lo, f"r{r}l"
            if hi < INF:
                lp += expr <= hi, f"r{r}u"
    if start is not None:
        for k, v in enumerate(cols):
            if model.integer[k]:
                v.setInitialValue(round(start[k]))
    with warnings.catch_warnings():   # PuLP 3.3 deprecates its bundled CBC (gone in 4.0); it still works
        warnings.simplefilter("ignore", DeprecationWarning)
        solver = pulp.PULP_CBC_CMD(msg=False, timeLimit=time_limit if math.isfinite(time_limit) else None,
                                   gapRel=gap, gapAbs=0.0, warmStart=start is not None, maxNodes=node_limit)
    lp.solve(solver)
    if lp.status == pulp.LpStatusInfeasible:   # CBC's "Integer infeasible" carries no solution status
        return Result("infeasible", None, None)
    status = {pulp.LpSolutionOptimal: "optimal", pulp.LpSolutionIntegerFeasible: "feasible"}.get(lp.sol_status)
    if status is None:
        return Result(None, None, None)
    # CBC stops at the requested gap; PuLP does not report the gap it reached.
    return Result(status, [v.varValue or 0.0 for v in cols], gap if status == "optimal" else None)


def run(model: Model, backend: str, *, time_limit: float, gap: float, start=None,
        cutoff: float | None = None, presolve: bool = True, node_limit: int | None = None) -> Result:
    t0 = time.perf_counter()
    if not model.num_cols:
        return Result("optimal" if model.violation([]) <= 1e-9 else "infeasible", [], 0.0)
    if backend == "highs":
        out = run_highs(model, time_limit=time_limit, gap=gap, start=start, cutoff=cutoff, presolve=presolve,
                        node_limit=node_limit)
    else:
        out = run_cbc(model, time_limit=time_limit, gap=gap, start=start, node_limit=node_limit)
    log.debug("%s: %d columns, %d rows: %s in %.2f s", backend, model.num_cols, model.num_rows, out.status,
              time.perf_counter() - t0)
    return out
