"""The peer wait (DeviceSpec.peer_wait) in the cost model: every collective a step runs pays it once, on top
of its alpha-beta time, so the plans that synchronize the ranks often pay it often; a bucket of gradient
all-reduces is one collective and pays it once; a plan that runs no collective pays nothing. The figure
itself is measured by ClusterSpec.profile() (tests/test_cluster.py)."""
import dataclasses
import warnings

import pytest

import autopar
from autopar.passes.costs import CostModel

WAIT = 2e-3      # large against these plans' collectives (tens of microseconds), so it shows in every price


def _cluster(peer_wait: float):
    spec = autopar.ClusterSpec.local_cpu(2)
    return dataclasses.replace(spec, device=dataclasses.replace(spec.device, peer_wait=peer_wait))


def test_a_collective_pays_the_peer_wait_once_and_nothing_is_not_a_collective():
    bare, waited = (CostModel(_cluster(w), (2,)) for w in (0.0, WAIT))
    for kind in ("all_reduce", "all_gather", "reduce_scatter", "all_to_all", "send_recv"):
        assert waited.collective_seconds(kind, 1 << 20, 0) == pytest.approx(
            bare.collective_seconds(kind, 1 << 20, 0) + WAIT)
        assert waited.collective_seconds(kind, 0, 0) == 0.0          # nothing moved: no collective runs
    assert CostModel(_cluster(WAIT), (1, 2)).collective_seconds("all_reduce", 1 << 20, 0) == 0.0   # one rank


def _plans(kind, wait=WAIT, batch=4, **extra):
    """The plan of ``kind`` (tests/memory_cases.py's pins) planned without the peer wait and with ``wait``."""
    from tests.memory_cases import build, options

    model, args, kwargs = build("gpt", seq=32, batch=batch, device="cpu")
    opts = (options("gpt", kind, 2, model) if kind != "replicated"
            else {"mesh_shape": (2,), "recompute": False, "pins": {"*": ["R"]}})
    with warnings.catch_warnings():        # the replicated plan's idle axis is the point of it
        warnings.simplefilter("ignore", autopar.AutoparWarning)
        return [autopar.plan(model, _cluster(w), args, kwargs, progress=False, **opts, **extra) for w in (0.0, wait)]


def _check_breakdown(plan):
    b = plan.breakdown
    # The exposed/hidden split stays a split of the communication the plan lists.
    assert b["exposed"] + b["hidden"] == pytest.approx(sum(b["communication"].values()))
    assert plan.step_time == pytest.approx(b["compute"] + b["recompute"] + b["exposed"] + b.get("contention", 0.0)
                                           + b["optimizer"])
    assert all(0.0 <= c.exposed <= c.seconds * (1 + 1e-9) for c in plan.collectives)


@pytest.mark.parametrize("kind", ["megatron", "zero3"])
def test_every_collective_that_synchronizes_the_ranks_pays_the_wait(kind):
    bare, waited = _plans(kind)
    alpha_beta = CostModel(_cluster(0.0), (2,)).collective_seconds
    assert waited.collectives and all(c.seconds == pytest.approx(alpha_beta(c.kind, c.bytes, 0) + WAIT)
                                      for c in waited.collectives)
    _check_breakdown(waited)
    # Most of them wait where they are issued: the step pays their wait.
    assert waited.step_time - bare.step_time > 0.5 * len(waited.collectives) * WAIT


def _gradient_reductions(plan):
    """A parameter's gradient all-reduces (the value is the parameter's placeholder, p_...)."""
    return [c for c in plan.collectives if c.step == "grad_all_reduce" and c.value.startswith("p_")]


def test_a_bucket_of_gradient_reductions_pays_the_wait_once():
    # A wait small against this model's step and a batch large enough that the plan stays data
    # parallel, at DDP's bucket size (the planner's own may split them in two).
    _, waited = _plans("dp", wait=5e-5, batch=16, bucket_mb=25)
    reductions = _gradient_reductions(waited)
    assert len(reductions) > 10
    grad_bytes = {}
    for c in reductions:
        grad_bytes[c.value] = max(grad_bytes.get(c.value, 0), c.bytes)
    # The model's gradients fit in one 25 MiB bucket: one all-reduce, one wait, shared by bytes.
    one = CostModel(_cluster(0.0), (2,)).collective_seconds("all_reduce", sum(grad_bytes.values()), 0) + 5e-5
    assert sum(c.seconds for c in reductions) == pytest.approx(one)
    _check_breakdown(waited)


def test_a_wait_larger_than_what_splitting_saves_keeps_a_small_model_whole():
    # At 2 ms a collective, this step's few milliseconds of compute are not worth a collective: with the
    # parameters pinned replicated, the solver splits no work (neither the batch nor the weights' reads),
    # and the plan runs none, where without the wait it splits some.
    bare, waited = _plans("dp")
    assert bare.collectives and waited.collectives == []
    assert all(layout == ["R"] for layout in waited.inputs.values())


def test_the_ranks_that_never_synchronize_pay_no_wait():
    bare, waited = _plans("replicated")
    assert waited.collectives == [] == bare.collectives
    assert waited.step_time == pytest.approx(bare.step_time)
