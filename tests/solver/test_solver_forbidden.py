"""Infinite costs forbid an option, a pair of options or a request: the ILP treats them as
constraints and agrees with brute force, which simply never picks an infinite assignment."""
import dataclasses
import math

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from autopar.solver import brute_force, solve
from tests.solver.solver_strategies import problems


@st.composite
def with_forbidden(draw):
    p = draw(problems(max_choices=6, memory=False))

    def maybe_inf(v):
        return math.inf if draw(st.integers(0, 5)) == 0 else v

    p.choices = [dataclasses.replace(c, costs=tuple(maybe_inf(v) for v in c.costs)) for c in p.choices]
    p.edges = [dataclasses.replace(e, cost=tuple(tuple(maybe_inf(v) for v in row) for row in e.cost))
               for e in p.edges]
    p.shared = [dataclasses.replace(e, cost=tuple(tuple(maybe_inf(v) for v in row) for row in e.cost))
                for e in p.shared]
    return p


@pytest.mark.parametrize("backend", ["cbc", "highs"])
@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(p=with_forbidden())
def test_forbidden_choices_match_brute_force(backend, p):
    want = brute_force(p)
    got = solve(p, backend=backend)
    if math.isinf(want.objective):
        assert got.status == "infeasible" or math.isinf(got.objective)
    else:
        assert got.status == "optimal"
        assert got.objective == pytest.approx(want.objective, rel=1e-6, abs=1e-12)
