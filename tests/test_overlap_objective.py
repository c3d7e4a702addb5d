"""The solver prefers layouts whose communication hides (passes/ilp_build.py's hiding credits,
passes/exposure.py's HidingWindows; docs/cost-model.md, "What the solver minimizes")."""
import dataclasses

import pytest
import torch
from torch import nn

import autopar
from autopar.cluster import default_axis_names
from autopar.passes.costs import CostModel
from autopar.passes.ilp_build import build_problem
from autopar.passes.memory import StepMemory
from autopar.passes.strategies import strategies_pass
from autopar.plan_assembly import SolvedMesh, assemble_plan
from autopar.planner import default_optimizer, prepare
from autopar.solver import solve

# fc2's weight is one 25 MiB gradient bucket (DDP's size) of its own, ready as soon as fc2's backward
# has run: under data parallelism its all-reduce hides behind fc1's backward. Sharded (ZeRO-3), it is
# gathered in forward and its gradient reduce-scattered in backward, which waits at once, but its
# optimizer step is halved; split by columns (tensor parallel) it moves activations, 4 MiB each way,
# and its optimizer step is halved too. With nothing hidden, the tensor-parallel split is cheaper.
WIDTH, BATCH = 2560, 1024


class TwoLayers(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc1 = nn.Linear(WIDTH, WIDTH, bias=False)
        self.fc2 = nn.Linear(WIDTH, WIDTH, bias=False)

    def forward(self, x, y):
        return ((self.fc2(torch.relu(self.fc1(x))) - y) ** 2).mean()


PINS = {"x": ["S(0)"], "y": ["S(0)"], "fc1.weight": {"output": ["R"], "zero": 0}}


@pytest.fixture(scope="module")
def solved():
    """fc2's weight layout and the replayed plan, solved with and without the hiding credits."""
    cpu = autopar.ClusterSpec.local_cpu(2)
    # A device whose optimizer step is cheap beside the layers' communication.
    cluster = dataclasses.replace(cpu, device=dataclasses.replace(cpu.device, memory_bandwidth=1e11))
    torch.manual_seed(0)
    model = TwoLayers()
    args = (torch.randn(BATCH, WIDTH), torch.randn(BATCH, WIDTH))
    prep = prepare(model, args, {}, cluster)
    shape = (2,)
    strategies_pass(prep.gm, shape)
    cm = CostModel(cluster, shape, default_optimizer(model))
    out = {}
    for overlap in (False, True):
        prob, idx = build_problem(prep.gm, cm, None, PINS, recompute=False, overlap=overlap)
        sol = solve(prob, time_limit=60.0)
        sm = StepMemory(prep.gm, cm, idx, [len(c.costs) for c in prob.choices])
        plan = assemble_plan(prep, SolvedMesh(shape, default_axis_names(shape), idx, cm, sm), sol.assignment, cluster,
                             cluster.usable_memory)
        out[overlap] = (prob, idx, sol, plan)
    return out


def test_the_overlap_aware_objective_picks_the_layout_whose_communication_hides(solved):
    serial_plan, aware_plan = solved[False][3], solved[True][3]
    assert serial_plan.params["fc2.weight"] == ["S(1)"] or serial_plan.params["fc2.weight"] == ["S(0)"]
    assert aware_plan.params["fc2.weight"] == ["R"] and "fc2.weight" not in aware_plan.zero
    # The replay agrees: the layout chosen for what it hides is the faster step, though its serial
    # step is slower.
    assert aware_plan.breakdown["serial"] > serial_plan.breakdown["serial"]
    assert aware_plan.step_time < serial_plan.step_time


def test_the_objective_is_the_serial_step_less_the_credits_and_they_never_exceed_the_replay(solved):
    for overlap, (prob, idx, sol, plan) in solved.items():
        credit = plan.breakdown.get("credit", 0.0)
        assert (credit > 0) == overlap
        assert prob.objective(sol.assignment) + credit == pytest.approx(plan.breakdown["serial"], rel=1e-9)
        assert credit <= plan.breakdown["hidden"] * (1 + 1e-9)


class Deep(nn.Module):
    """Four 512-wide layers with biases: eight gradients that the runtime's DDP-style bucket reduces in
    one all-reduce, paying the link's latency once; the solver's objective charges each its share."""

    def __init__(self):
        super().__init__()
        self.fcs = nn.ModuleList(nn.Linear(512, 512) for _ in range(4))

    def forward(self, x, y):
        for fc in self.fcs:
            x = torch.relu(fc(x))
        return ((x - y) ** 2).mean()


def _deep_plan(latency, bucket_mb=None):
    cpu = autopar.ClusterSpec.local_cpu(2)
    cluster = dataclasses.replace(cpu, intra_node_latency=latency)
    torch.manual_seed(0)
    model = Deep()
    args = (torch.randn(512, 512), torch.randn(512, 512))
    prep = prepare(model, args, {}, cluster)
    strategies_pass(prep.gm, (2,))
    cm = CostModel(cluster, (2,), default_optimizer(model))
    prob, idx = build_problem(prep.gm, cm, None, None, recompute=False, bucket_mb=bucket_mb)
    sol = solve(prob, time_limit=60.0)
    sm = StepMemory(prep.gm, cm, idx, [len(c.costs) for c in prob.choices])
    ilp = assemble_plan(prep, SolvedMesh((2,), default_axis_names((2,)), idx, cm, sm), sol.assignment, cluster,
                        cluster.usable_memory, bucket_mb=bucket_mb)
    return ilp, autopar.plan(model, cluster, args, recompute=False, progress=False, bucket_mb=bucket_mb)


def test_the_solver_charges_a_buckets_latency_once_not_once_per_gradient():
    # Over a link of 3 ms latency, splitting the layers (tensor parallel) pays it per collective, data
    # parallelism once for the bucket of the eight gradients. Charged per gradient, the solver split
    # the layers and the replay had to undo it; charged its share, the solver itself keeps every
    # parameter replicated, the plan the replay prices faster, and there is nothing left to replay.
    ilp, plan = _deep_plan(latency=3e-3)
    assert all(lay == ["R"] for lay in ilp.params.values()) and not ilp.zero
    assert ilp.inputs["x"] == ["S(0)"]
    assert plan.params == ilp.params and "replayed" not in plan.solver
    split = _deep_plan(latency=1e-4, bucket_mb=25)[0]       # the layers split where latency is cheap
    assert any(lay != ["R"] for lay in split.params.values()) or split.zero


def test_the_planner_keeps_the_replicated_parameters_where_the_replay_prices_them_faster():
    # Over a link of 0.5 ms the solver, whose credits pack the gradients in DDP's 25 MiB bucket, splits
    # the layers; the replicated layout replayed at the bucket size the planner chooses for it hides
    # its smaller buckets behind backward and is faster.
    ilp, plan = _deep_plan(latency=5e-4)
    assert any(lay != ["R"] for lay in ilp.params.values()) or ilp.zero
    assert plan.solver["replayed"]["solver"] == pytest.approx(ilp.step_time, rel=1e-9)
    assert all(lay == ["R"] for lay in plan.params.values()) and not plan.zero
    assert plan.step_time == plan.solver["replayed"]["replicated parameters"] < ilp.step_time


def test_the_planner_keeps_the_solvers_answer_where_the_replay_prices_it_faster():
    # The latency the bucket saves is small beside the bytes. In DDP's one 25 MiB bucket the eight
    # gradients' all-reduce waits for the last of them; smaller buckets, which the planner may choose,
    # hide it behind backward and make the replicated layout the faster again.
    ilp, plan = _deep_plan(latency=1e-4, bucket_mb=25)
    assert any(lay != ["R"] for lay in ilp.params.values()) or ilp.zero
    assert plan.params == ilp.params and plan.step_time == pytest.approx(ilp.step_time, rel=1e-9)
    assert plan.solver["replayed"]["replicated parameters"] > plan.step_time


def test_the_planner_keeps_the_layout_solved_without_credits_where_the_replay_prices_it_faster():
    # The built-in GPT with its weights pinned ZeRO-3 and every layer recomputed: credited for hiding
    # Megatron's "f" before column-parallel linears, the solver reads each weight's shard as a column
    # split; the replay of that plan hides less than the credits count, and the layout solved at serial
    # prices (the batch split, each weight gathered) replays faster.
    from tests.memory_cases import build, options

    model, args, kwargs = build("gpt", 64, 8, "cpu")
    plan = autopar.plan(model, autopar.ClusterSpec.local_cpu(2), args, kwargs, progress=False,
                        **options("gpt", "zero3-recompute", 2, model))
    replayed = plan.solver["replayed"]
    assert plan.step_time == replayed["without hiding credits"] < replayed["solver"]


def test_the_credits_count_the_input_gradients_all_reduce_before_column_parallel_linears():
    """Megatron's "f" before column-parallel linears runs behind their weight gradients
    (runtime/collectives.py ``column_linears``): the replay hides it, and the solver's credits count
    it too, never above the replay's hiding."""
    from tests.memory_cases import build, options

    model, args, kwargs = build("gpt", seq=32, batch=4, device="cpu")
    plan = autopar.plan(model, autopar.ClusterSpec.local_cpu(2), args, kwargs, progress=False,
                        **options("gpt", "megatron", 2, model))
    f = [c for c in plan.collectives if c.phase == "backward" and c.kind == "all_reduce"]
    assert f and all(c.exposed == 0.0 for c in f)
    assert 0.0 < plan.breakdown["credit"] <= plan.breakdown["hidden"]


def test_only_a_gradient_all_reduced_alone_is_charged_a_share_of_its_buckets_latency():
    # A replicated weight read whole by a batch split has its gradient all-reduced in a bucket: charged
    # a share of the bucket's latency, less than the all-reduce's own. Read in chunks by a split of its
    # rows, its gradient's chunks are all-gathered outside any bucket (passes.exposure.bucketed_params),
    # and it pays the gather's whole latency.
    from autopar.layout import parse_layout
    from autopar.passes.meta import is_param
    from autopar.passes.strategies import Value, strategies_on

    cluster = dataclasses.replace(autopar.ClusterSpec.local_cpu(2), intra_node_latency=3e-3)
    model = Deep()
    prep = prepare(model, (torch.randn(512, 512), torch.randn(512, 512)), {}, cluster)
    strategies_pass(prep.gm, (2,))
    cm = CostModel(cluster, (2,), default_optimizer(model))
    weight = next(n for n in prep.gm.graph.nodes if is_param(n) and len(n.meta["val"].shape) == 2)
    replicated = next(s for s in strategies_on(prep.gm, (2,))[weight]
                      if s.outputs[0] == parse_layout(["R"]) and s.zero is None and not s.offload)
    value = Value(weight)
    for dst, partial, shared in ((["R"], frozenset({0}), True), (["S(0)"], frozenset(), False)):
        layout = parse_layout(dst)
        alone = cm.transition_phase_seconds(value, replicated.outputs[0], layout, partial)
        charged = cm.param_transition_phase_seconds(value, replicated, layout, partial)
        assert alone[0] == charged[0] == 0.0 and alone[1] > cluster.intra_node_latency
        if shared:
            assert charged[1] == pytest.approx(alone[1] - cluster.intra_node_latency * (1 - 1 / 8))
        else:
            assert charged == alone
