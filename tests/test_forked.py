"""autopar.forked: a call run in a forked child hands back its value, its exception, or why it has none."""
import os

import pytest

from autopar.errors import AutoparError, InfeasiblePlanError
from autopar.forked import Forked, fork_available

pytestmark = pytest.mark.skipif(not fork_available(), reason="needs the fork start method")


def _infeasible(budget):
    raise InfeasiblePlanError("no layout fits", memory_budget=budget, min_feasible_budget=2 * budget)


def test_the_child_hands_back_its_value_computed_from_the_parent_memory():
    table = {"pid": os.getpid()}
    assert Forked(lambda k: (table[k], os.getpid()), "pid").result()[0] == os.getpid()
    assert Forked(lambda k: os.getpid(), "pid").result() != os.getpid()


def test_the_child_exception_is_raised_in_the_parent_with_its_fields():
    with pytest.raises(InfeasiblePlanError, match="no layout fits") as e:
        Forked(_infeasible, 5.0).result()
    assert (e.value.memory_budget, e.value.min_feasible_budget) == (5.0, 10.0)


def test_a_child_that_dies_before_its_result_is_an_error():
    with pytest.raises(AutoparError, match="exited with code 3 before handing back its result"):
        Forked(os._exit, 3).result()
