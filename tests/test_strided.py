"""Strided shards for fused projections (docs/sharding.md): the solver lays out GPT-2's fused q, k, v
projection (the model's other projections pinned to Megatron's split) and a fused gate-up MLP as
Megatron does (S(d,k) weights, each part split by heads or columns), the generated program runs one
all-reduce per row-split projection in forward (two per GPT-2 layer) and no all-to-all, and training
matches single-device eager training on 2 and 4 gloo ranks (the tolerances of tests/test_parity.py).
Plans carry the layout through JSON, explain it, and refuse a malformed one."""
import collections
import copy

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from tests.distributed_utils import run_distributed
from tests.eager_parity import train_and_compare
from tests.hf_models import MEGATRON, batch, build


class FusedGateUp(nn.Module):
    """Pre-norm gated MLP blocks whose gate and up projections are one matrix, chunked after the
    matmul (Phi-3's ``gate_up_proj``), on an activation input, ending in a scalar loss."""

    def __init__(self, hidden=64, ffn=256, layers=2):
        super().__init__()
        self.norms = nn.ModuleList(nn.LayerNorm(hidden) for _ in range(layers))
        self.gate_up = nn.ModuleList(nn.Linear(hidden, 2 * ffn, bias=False) for _ in range(layers))
        self.down = nn.ModuleList(nn.Linear(ffn, hidden, bias=False) for _ in range(layers))

    def forward(self, x):
        for norm, gate_up, down in zip(self.norms, self.gate_up, self.down):
            gate, up = gate_up(norm(x)).chunk(2, dim=-1)
            x = x + down(F.silu(gate) * up)
        return x.pow(2).mean()


def _forward_collectives(pm) -> collections.Counter:
    from autopar.runtime.collectives import COLLECTIVE_KIND

    graphs = [m.graph for m in pm.local_program.modules() if isinstance(m, torch.fx.GraphModule)]
    return collections.Counter(COLLECTIVE_KIND[n.target] for g in graphs for n in g.nodes
                               if n.op == "call_function" and n.target in COLLECTIVE_KIND
                               and COLLECTIVE_KIND[n.target] is not None and n.target.__name__ != "grad_all_reduce")


def _check_megatron_layout(pm, weight, layout, all_reduces, where):
    """The solver chose the strided ``layout`` for ``weight``, and the program runs Megatron's forward
    collectives: one all-reduce after each row-split projection, no all-to-all."""
    assert pm.plan.params[weight] == layout, f"{where}: {weight} is {pm.plan.params[weight]}, not {layout}"
    counts = _forward_collectives(pm)
    assert counts["all_to_all"] == 0 and counts["all_reduce"] == all_reduces, f"{where}: forward collectives {counts}"


def _solver_picks_megatron(rank, world):
    import autopar

    cluster = autopar.ClusterSpec.local_cpu(world)
    mesh = (world,)
    whole = ["R"]

    torch.manual_seed(0)
    gpt2 = build("gpt2")
    ids, labels = batch()
    # Whole batches on every rank and Megatron's split of every projection but the fused one, which
    # is left to the solver. Left free, the solver splits GPT-2's batch after its input instead, the
    # plan the replay prices faster on local_cpu than splitting the layers.
    unfused = {k: [v] for k, v in MEGATRON["gpt2"].items() if ".c_attn." not in k}
    pm = autopar.compile(gpt2, cluster, (ids,), {"labels": labels}, mesh_shape=mesh,
                         pins={"input_ids": whole, "labels": whole, **unfused})
    where = f"gpt2 on {world} ranks"
    _check_megatron_layout(pm, "transformer.h.0.attn.c_attn.weight", ["S(1,3)"], 2 * gpt2.config.n_layer, where)
    train_and_compare(pm, copy.deepcopy(gpt2), None, None, where, call=lambda m: m(ids, labels=labels).loss)

    torch.manual_seed(0)
    mlp = FusedGateUp()
    x = torch.randn(4, 16, 64)
    # A whole batch, where the solver splits the layers: the replay prices that faster than the
    # parameters replicated (plan.solver["replayed"]).
    pm = autopar.compile(mlp, cluster, (x,), mesh_shape=mesh, pins={"x": whole})
    where = f"fused gate-up MLP on {world} ranks"
    _check_megatron_layout(pm, "gate_up.0.weight", ["S(0,2)"], len(mlp.down), where)
    train_and_compare(pm, copy.deepcopy(mlp), None, None, where, call=lambda m: m(x))


@pytest.mark.parametrize("world", [2, 4])
def test_solver_lays_out_fused_projections_as_megatron_and_trains_like_eager(world):
    run_distributed(_solver_picks_megatron, world, timeout=600)


def test_plan_round_trips_and_explains_a_strided_layout():
    import autopar
    from autopar.errors import PlanFormatError
    from autopar.plan import Plan

    model = FusedGateUp()
    x = torch.randn(4, 16, 64)
    plan = autopar.plan(model, autopar.ClusterSpec.local_cpu(2), (x,), mesh_shape=(2,), progress=False,
                        pins={"x": ["R"], "gate_up.*.weight": ["S(0,2)"]})
    again = Plan.from_dict(plan.to_dict())
    assert again.params["gate_up.0.weight"] == ["S(0,2)"] == plan.params["gate_up.0.weight"]
    assert "S(0,2)" in plan.explain("gate_up.0.weight")
    for bad, why in (("S(0,1)", "2 or more groups"), ("S(0,x)", "cannot parse")):
        broken = plan.to_dict()
        broken["params"]["gate_up.0.weight"] = [bad]
        with pytest.raises(PlanFormatError, match=why):
            Plan.from_dict(broken)


def test_a_strided_pin_where_no_split_follows_says_where_it_is_offered():
    import autopar
    from autopar.errors import ShardingError

    model = FusedGateUp()
    with pytest.raises(ShardingError, match=r"down\.0\.weight .*S\(1,2\).* offered only where dim d is split"):
        autopar.plan(model, autopar.ClusterSpec.local_cpu(2), (torch.randn(4, 16, 64),), mesh_shape=(2,),
                     progress=False, pins={"down.*.weight": ["S(1,2)"]})
