"""The cost model under fused kernels: a pointwise chain reads and writes memory once; matmuls cost the
same as before."""
import torch

import autopar
from autopar.passes.costs import CostModel
from autopar.passes.strategies import strategies_on, strategies_pass
from autopar.planner import prepare


class MLP(torch.nn.Module):
    def __init__(self, h=1024):
        super().__init__()
        self.fc1 = torch.nn.Linear(h, 4 * h, bias=False)
        self.fc2 = torch.nn.Linear(4 * h, h, bias=False)

    def forward(self, x):
        y = self.fc1(x)
        y = 0.5 * y * (1.0 + torch.tanh(0.79788456 * (y + 0.044715 * y * y * y)))   # a GELU chain
        return self.fc2(y)


def test_fused_costs_less_for_a_pointwise_chain_and_the_same_for_matmuls():
    cluster = autopar.ClusterSpec.preset("8xH100")
    prep = prepare(MLP(), (torch.randn(4, 512, 1024),), None, cluster)
    strategies = strategies_on(strategies_pass(prep.gm, (8,)), (8,))
    plain, fused = CostModel(cluster, (8,)), CostModel(cluster, (8,), fused=True)
    pointwise = {"plain": 0.0, "fused": 0.0}
    matmuls = 0
    for n in prep.gm.graph.nodes:
        if n.op != "call_function":
            continue
        s = strategies[n][0]
        a, b = plain.compute_seconds(n, s), fused.compute_seconds(n, s)
        if torch.Tag.pointwise in getattr(n.target, "tags", ()):
            pointwise["plain"] += a
            pointwise["fused"] += b
            assert b <= a
        elif n.target in (torch.ops.aten.mm.default, torch.ops.aten.linear.default):
            matmuls += 1
            assert a == b, f"{n.name}: a matmul costs {b} fused but {a} unfused"
    assert matmuls == 2
    # Nine pointwise ops: unfused, each reads and writes the activation; fused, about once in total.
    assert pointwise["fused"] < pointwise["plain"] / 3, pointwise
