"""The per-op overhead (DeviceSpec.op_overhead) in the cost model: every op that launches a kernel pays it
once in forward and twice in backward, a recomputed op pays its forward share again, and views pay
nothing. The figure itself is measured by ClusterSpec.profile() (tests/test_cluster.py)."""
import dataclasses

import pytest
import torch

import autopar
from autopar.models import GPT, GPTConfig
from autopar.passes.costs import VIEW_OPS

OVERHEAD = 1e-4     # large against these models' roofline, so the term decides their order


def _cluster(op_overhead: float, preset: str | None = None):
    spec = autopar.ClusterSpec.preset(preset) if preset else autopar.ClusterSpec.local_cpu(1)
    return dataclasses.replace(spec, device=dataclasses.replace(spec.device, op_overhead=op_overhead))


class OneProjection(torch.nn.Module):
    def __init__(self, h=32):
        super().__init__()
        self.proj = torch.nn.Linear(h, h, bias=False)

    def forward(self, x):
        return self.proj(x).sum()


class FourProjections(torch.nn.Module):
    """OneProjection's FLOPs in four quarter-width projections: more ops, more launches."""

    def __init__(self, h=32):
        super().__init__()
        self.parts = torch.nn.ModuleList(torch.nn.Linear(h, h // 4, bias=False) for _ in range(4))

    def forward(self, x):
        return sum(p(x).sum() for p in self.parts)


def _plan(model, op_overhead, preset=None, **options):
    x = torch.randn(8, 32)
    return autopar.plan(model, _cluster(op_overhead, preset), (x,), progress=False, **options)


def _launched(plan) -> int:
    """The plan's ops that run a kernel: every node but views."""
    views = {str(t).removeprefix("aten.") for t in VIEW_OPS}
    return sum(n.op not in views for n in plan.nodes)


def test_more_small_ops_cost_more_than_the_same_flops_in_fewer():
    few, many = OneProjection(), FourProjections()
    bare = [_plan(m, 0.0).breakdown["compute"] for m in (few, many)]
    priced = [_plan(m, OVERHEAD) for m in (few, many)]
    assert priced[1].breakdown["compute"] > priced[0].breakdown["compute"]
    assert _launched(priced[1]) > _launched(priced[0])
    for plan, without in zip(priced, bare):
        # Forward once and backward twice per launched op; the input's sum has no gradient of its own
        # to compute, but every op here is downstream of a parameter.
        assert plan.breakdown["compute"] - without == pytest.approx(3 * OVERHEAD * _launched(plan), rel=1e-6)


class Viewed(OneProjection):
    def forward(self, x):
        return self.proj(x).t().unsqueeze(0).sum()


def test_on_a_gpu_the_overhead_is_a_floor_not_an_addition():
    """The host launches ahead of the GPU: an op whose kernel is shorter than the overhead costs the
    overhead, a longer one its roofline. These ops are all far shorter."""
    bare, priced = (_plan(FourProjections(), d, "1xH100") for d in (0.0, OVERHEAD))
    assert 0 < bare.breakdown["compute"] < 3 * OVERHEAD
    assert priced.breakdown["compute"] == pytest.approx(3 * OVERHEAD * _launched(priced), rel=1e-6)


def test_views_pay_no_overhead():
    plan = _plan(Viewed(), OVERHEAD)
    views = {str(t).removeprefix("aten.") for t in VIEW_OPS}
    assert any(n.op in views for n in plan.nodes), [n.op for n in plan.nodes]
    for n in plan.nodes:
        if n.op in views:
            assert n.compute_seconds == 0.0, n


def test_recompute_prices_the_overhead_of_every_re_run_op():
    torch.manual_seed(0)
    model = GPT(GPTConfig(vocab_size=64, n_layer=2, n_head=2, d_model=16, d_ff=32, max_seq=16))
    ids = torch.randint(0, 64, (2, 16), generator=torch.Generator().manual_seed(1))

    def plan(op_overhead):
        return autopar.plan(model, _cluster(op_overhead), (ids,), {"labels": ids.clone()}, progress=False,
                            recompute={"*": "all"})

    bare, priced = plan(0.0), plan(OVERHEAD)
    layers = set(priced.recompute["layers"])
    assert layers == set(bare.recompute["layers"]) and len(layers) == 2
    before = {n.name: n.compute_seconds for n in bare.nodes}
    # A recomputed op runs its forward again: one overhead per op that launches a kernel, whatever its
    # FLOPs; the views in the layers run again too, and cost nothing.
    rerun = [n for n in priced.nodes if n.layer in layers and n.compute_seconds > before[n.name]]
    assert len(rerun) > 10
    extra = priced.breakdown["recompute"] - bare.breakdown["recompute"]
    assert extra == pytest.approx(OVERHEAD * len(rerun), rel=1e-6)
    assert priced.step_time - bare.step_time == pytest.approx(
        priced.breakdown["compute"] - bare.breakdown["compute"] + extra, rel=1e-6)
