"""Pipeline planning: the schedule formulas against the published ones, stage balancing, the plan's
pipeline record, and clear errors for what a pipeline cannot do."""
import gc
import json
import math

import pytest
import torch

import autopar
from autopar import pipelining as PL
from autopar.plan import PlanPipeline, PlanRank, PlanStage
from tests.toy_models import Stack, wide_stack


@pytest.mark.parametrize("p,m", [(2, 4), (4, 8), (8, 32), (4, 4)])
def test_bubble_matches_narayanan(p, m):
    # Narayanan et al.: (p-1)/m of the ideal time for GPipe and 1F1B, (p-1)/(v*m) interleaved.
    assert PL.bubble_fraction("1F1B", p, m) == pytest.approx((p - 1) / m)
    assert PL.bubble_fraction("GPipe", p, m) == pytest.approx((p - 1) / m)
    assert PL.bubble_fraction("Interleaved1F1B", p, m, 2) == pytest.approx((p - 1) / (2 * m))
    assert PL.bubble_fraction("Interleaved1F1B", p, m, 4) == pytest.approx((p - 1) / (4 * m))
    # ... which is (p-1)/(m+p-1) of the total time.
    f = PL.bubble_fraction("1F1B", p, m)
    assert f / (1 + f) == pytest.approx((p - 1) / (m + p - 1))
    # Zero bubble (Qi et al.): about a third of the corresponding bubble.
    assert PL.bubble_fraction("InterleavedZeroBubble", p, m, 2) == pytest.approx((p - 1) / (2 * m) / 3)


@pytest.mark.parametrize("p,m", [(2, 4), (4, 8), (8, 32)])
def test_in_flight_microbatches_match_korthikanti(p, m):
    # 1F1B: the first stage holds p microbatches, GPipe all m; interleaving v stages per rank multiplies
    # the first stage's by 1 + (p-1)/(p*v) (Korthikanti et al. 4.2.3, their m being the stages per rank).
    assert PL.in_flight("1F1B", p, m, 0) == p
    assert [PL.in_flight("1F1B", p, m, r) for r in range(p)] == [p - r for r in range(p)]
    assert PL.in_flight("GPipe", p, m, p - 1) == m
    assert PL.in_flight("Interleaved1F1B", p, m, 0) == pytest.approx(p * (1 + (p - 1) / (p * 2)))
    # ZB-H1 keeps 1F1B's first-stage peak on every rank (Qi et al.).
    assert [PL.in_flight("InterleavedZeroBubble", p, m, r) for r in range(p)] == [p] * p


def _in_flight_under_torch(rank, world, p, group, cases):
    """Run tiny stages under each (schedule, microbatches) of ``cases`` on this rank's pipeline group of
    ``p`` ranks; return the most stage-microbatches whose activations were held at once, in microbatches
    through all of the rank's layers (a stage's are held from its forward to its backward, or to its
    weight-gradient pass where the schedule splits backward)."""
    from torch.distributed import pipelining as P

    me = torch.distributed.get_rank(group)
    classes = {"GPipe": P.ScheduleGPipe, "1F1B": P.Schedule1F1B, "Interleaved1F1B": P.ScheduleInterleaved1F1B,
               "InterleavedZeroBubble": P.ScheduleInterleavedZeroBubble, "ZBVZeroBubble": P.ScheduleZBVZeroBubble}
    measured = {}
    for schedule, m in cases:
        v = PL.VIRTUAL[schedule]
        live = {"now": 0, "peak": 0}
        stages = []
        for index in [s for s in range(p * v) if PL.rank_of_stage(schedule, s, p) == me]:
            stage = P.PipelineStage(torch.nn.Linear(4, 4), index, p * v, torch.device("cpu"), group=group)
            fwd, bwd, wgt = stage.forward_one_chunk, stage.backward_one_chunk, stage.backward_weight_one_chunk

            def forward(*a, _f=fwd, **k):
                live["now"] += 1
                live["peak"] = max(live["peak"], live["now"])
                return _f(*a, **k)

            def backward(*a, _b=bwd, **k):
                out = _b(*a, **k)
                live["now"] -= k.get("full_backward", True)
                return out

            def weight_backward(*a, _w=wgt, **k):
                out = _w(*a, **k)
                live["now"] -= 1
                return out

            stage.forward_one_chunk, stage.backward_one_chunk = forward, backward
            stage.backward_weight_one_chunk = weight_backward
            stages.append(stage)
        run = classes[schedule](stages if v > 1 else stages[0], n_microbatches=m, loss_fn=lambda y, _: y.sum())
        inputs = (torch.randn(2 * m, 4),) if any(st.is_first for st in stages) else ()
        targets = {"target": torch.zeros(2 * m, 4), "losses": []} if any(st.is_last for st in stages) else {}
        run.step(*inputs, **targets)
        measured[schedule, m] = live["peak"] / v
    return measured


def _check_in_flight(rank, world):
    # Four ranks: one pipeline of 4, and two of 2 on ranks {0, 1} and {2, 3}.
    pairs = [torch.distributed.new_group([0, 1]), torch.distributed.new_group([2, 3])]
    for p, group, counts in ((4, None, (4, 8)), (2, pairs[rank // 2], (2, 4))):
        me = rank if p == 4 else rank % 2
        cases = [(sched, m) for sched in PL.SCHEDULES for m in counts]
        for (sched, m), got in _in_flight_under_torch(rank, world, p, group, cases).items():
            want = PL.in_flight(sched, p, m, me)
            assert got == want, f"{sched}, p={p}, m={m}, pipeline rank {me}: torch holds {got}, the model {want}"


def test_in_flight_microbatches_match_torch_schedules():
    """The memory model's in-flight microbatches per rank are those torch.distributed.pipelining's
    schedules hold, on pipelines of 2 and 4 gloo ranks."""
    from tests.distributed_utils import run_distributed

    run_distributed(_check_in_flight, 4, timeout=300)


def test_first_stage_memory_is_korthikanti_whole_model_activations():
    # s*b*h*L/t*(34 + 5as/h) on the first 1F1B stage: p microbatches of L/p layers each.
    s, b, h, a, L, p, m = 2048, 1, 4096, 32, 32, 4, 16
    per_layer = s * b * h * (34 + 5 * a * s / h)
    per_stage = per_layer * L / p
    assert PL.in_flight("1F1B", p, m, 0) * per_stage == pytest.approx(s * b * h * L * (34 + 5 * a * s / h))
    inter = PL.in_flight("Interleaved1F1B", p, m, 0) * per_stage
    assert inter == pytest.approx(s * b * h * L * (34 + 5 * a * s / h) * (1 + (p - 1) / (p * 2)))


def test_balance_is_optimal_against_brute_force():
    import itertools

    costs = [3.0, 1.0, 4.0, 1.0, 5.0, 9.0, 2.0, 6.0]
    for n in (2, 3, 4):
        starts = PL.balance(costs, 2.0, 7.0, n)
        got = _max_stage(costs, starts, 2.0, 7.0)
        best = min(_max_stage(costs, [0, *cut], 2.0, 7.0)
                   for cut in itertools.combinations(range(1, len(costs)), n - 1))
        assert starts[0] == 0 and len(starts) == n and got == best


def _max_stage(costs, starts, pre, post):
    bounds = list(zip(starts, starts[1:] + [len(costs)]))
    loads = [sum(costs[a:b]) for a, b in bounds]
    loads[0] += pre
    loads[-1] += post
    return max(loads)


def test_zbv_places_stages_in_a_v():
    assert [PL.rank_of_stage("ZBVZeroBubble", s, 4) for s in range(8)] == [0, 1, 2, 3, 3, 2, 1, 0]
    assert [PL.rank_of_stage("Interleaved1F1B", s, 4) for s in range(8)] == [0, 1, 2, 3, 0, 1, 2, 3]


def _stack_plan(layers=8, pp=2, **kw):
    with torch.device("meta"):
        model = Stack(256, 4, 1024, layers)
    x = torch.randn(64, 64, 256, device="meta")
    return autopar.plan(model, autopar.ClusterSpec.preset("16xH100"), (x,), mesh_shape=(pp, 16 // pp),
                        axis_names=("pp", "dp"), progress=False, **kw)


def test_pipeline_plan_records_stages_schedule_and_bubble(tmp_path):
    plan = _stack_plan(schedule="1F1B", microbatches=4)
    pipe = plan.pipeline
    assert pipe["schedule"] == "1F1B" and pipe["microbatches"] == 4 and len(pipe["stages"]) == 2
    # Identical layers split evenly; every layer is in exactly one stage, in order.
    layers = [inst for st in pipe["stages"] for inst in st["layers"]]
    assert layers == [f"blocks.{i}" for i in range(8)]
    assert [len(st["layers"]) for st in pipe["stages"]] == [4, 4]
    assert pipe["bubble_fraction"] == pytest.approx(1 / 4)
    b = plan.breakdown
    assert plan.step_time == pytest.approx(b["compute"] + sum(b["communication"].values()) + b["optimizer"]
                                           + b["bubble"])
    # The bubble is its fraction of the ideal time: every microbatch of the slowest rank (the gradient
    # sync runs once, after the last one).
    ideal = b["compute"] + sum(b["communication"].values()) - pipe["grad_sync_seconds"]
    assert b["bubble"] == pytest.approx(pipe["bubble_fraction"] * ideal)
    assert all(lay[0] == "R" for lay in plan.params.values())
    assert "pipeline: 2 stages" in plan.summary() and "bubble" in plan.summary()
    path = tmp_path / "plan.json"
    plan.save(path)
    again = autopar.Plan.load(path)
    assert again.pipeline == pipe and again.pipeline.to_dict() == json.loads(plan.to_json())["pipeline"]
    # A frozen typed record, its stages' and ranks' too, that reads as its JSON object.
    assert isinstance(pipe, PlanPipeline) and all(isinstance(st, PlanStage) for st in pipe.stages)
    assert all(isinstance(r, PlanRank) for r in pipe.ranks) and pipe.stages[1].layers == tuple(layers[4:])
    assert pipe.schedule == pipe["schedule"] and pipe["stages"][1]["layers"] == layers[4:]
    # A plan saved before the stages named their recompute and gradient sync loads without them.
    old = json.loads(plan.to_json())
    for st in old["pipeline"]["stages"]:
        for k in ("recompute", "recompute_seconds", "grad_sync_seconds"):
            st.pop(k)
    loaded = autopar.Plan.from_dict(old).pipeline
    assert loaded.stages[0].recompute is None and "recompute" not in loaded.stages[0]
    assert loaded.to_dict() == old["pipeline"]


def test_bf16_mixed_gradient_sync_runs_once_per_step_in_float32():
    """Under bf16-mixed a weight's data-parallel gradient is reduced through its bfloat16 copy; a pipeline
    sums the float32 ``.grad`` once per step instead (codegen/stages.py), so the plan prices that sync
    once, at the master's bytes, as under 32-true, whatever the microbatch count; with
    ``reduce_dtype="bfloat16"`` a linear layer's at half of them (its gradient narrowed for the sum). Priced in every
    microbatch, it made LLaMA-2-70B's pipeline meshes lose to dp x tp ones."""
    with torch.device("meta"):
        params = dict(Stack(256, 4, 1024, 8).named_parameters())
    n = sum(p.numel() for p in params.values())
    # The linear layers' weights and biases are read through their bfloat16 copies, the norms' in float32.
    copied = sum(p.numel() for name, p in params.items() if ".ln" not in name)
    # Replicated parameters and the batch split: data parallelism syncs every gradient.
    pins = {"blocks.*": ["R", "R"], "x": ["R", "S(0)"]}
    plans = {(prec, m): _stack_plan(schedule="1F1B", microbatches=m, precision=prec.split()[0], pins=pins,
                                    recompute=False, reduce_dtype=prec.split()[1] if " " in prec else None)
             for prec in ("32-true", "bf16-mixed", "bf16-mixed bfloat16") for m in (2, 8)}
    for (prec, m), plan in plans.items():
        syncs = [c for c in plan.collectives if c.get("step") == "grad_all_reduce" and c["axis"] == "dp"]
        nbytes = 4 * n - 2 * copied if prec.endswith("bfloat16") else 4 * n
        assert sum(c["bytes"] for c in syncs) == nbytes, f"{prec}, {m} microbatches: not every gradient once"
        sync = plan.pipeline["grad_sync_seconds"]
        assert sync == pytest.approx(plans[prec, 2].pipeline["grad_sync_seconds"]) and sync > 0, (prec, m)
        # No data-parallel communication in the microbatches: the sync is all of it.
        assert plan.breakdown["communication"]["dp"] == pytest.approx(sync), (prec, m)


def test_pipeline_stages_shard_optimizer_states_over_data_parallel_ranks():
    """ZeRO-1 inside the stages (Megatron-LM's distributed optimizer): a stage's Adam states sharded over
    its 8 data-parallel ranks, counted in each rank's memory (4 + 4 + 8/8 bytes per float32 parameter
    against 16); once per step the gradients are reduce-scattered instead of all-reduced and the updated
    shards all-gathered, the bytes of one all-reduce; under a budget that only fits so, the planner
    chooses it by itself."""
    pins = {"x": ["R", "S(0)"]}
    plans = {z: _stack_plan(schedule="1F1B", microbatches=4, recompute=False,
                            pins={**pins, "blocks.*": {"output": ["R", "R"], "zero": z}}) for z in (0, 1)}
    assert not plans[0].zero and {(z["stage"], z["axis"]) for z in plans[1].zero.values()} == {(1, "dp")}
    for r0, r1 in zip(plans[0].pipeline["ranks"], plans[1].pipeline["ranks"]):
        assert r1["static_bytes"] == pytest.approx(r0["static_bytes"] * 9 / 16)
    with torch.device("meta"):
        n = sum(p.numel() for p in Stack(256, 4, 1024, 8).parameters())
    for z, kinds in ((0, {"grad_all_reduce": "all_reduce"}),
                     (1, {"grad_all_reduce": "reduce_scatter", "zero1": "all_gather"})):
        for step, kind in kinds.items():
            done = [c for c in plans[z].collectives if c["step"] == step]
            assert {c["kind"] for c in done} == {kind} and sum(c["bytes"] for c in done) == 4 * n, (z, step)
    # (One latency per parameter and collective: this model's gradients are small.)
    assert plans[1].pipeline["grad_sync_seconds"] > plans[0].pipeline["grad_sync_seconds"]
    tail = plans[1].pipeline["ranks"][plans[1].pipeline["stages"][-1]["pp_rank"]]
    assert tail["optimizer_seconds"] < plans[0].pipeline["ranks"][tail["rank"]]["optimizer_seconds"]
    budget = (plans[0].memory["peak"] + plans[1].memory["peak"]) / 2
    with pytest.raises(autopar.InfeasiblePlanError):
        _stack_plan(schedule="1F1B", microbatches=4, recompute=False, memory_budget=budget,
                    pins={**pins, "blocks.*": {"output": ["R", "R"], "zero": 0}})
    free = _stack_plan(schedule="1F1B", microbatches=4, recompute=False, memory_budget=budget, pins=pins)
    assert free.zero and free.memory["peak"] <= budget


def test_zero2_inside_pipeline_stages_is_refused():
    with pytest.raises(autopar.AutoparError, match="ZeRO-2, which pipeline plans do not offer"):
        _stack_plan(schedule="1F1B", microbatches=4, pins={"blocks.*": {"output": ["R", "R"], "zero": 2}})


def test_planner_chooses_the_schedule_and_microbatches_by_predicted_time():
    plan = _stack_plan()
    pipe = plan.pipeline
    tried = [c for c in plan.solver["candidates"] if "pipeline" in c]
    times = [t for c in tried for t in c["pipeline"]["schedules"].values() if t is not None]
    assert plan.step_time == pytest.approx(min(times))
    assert pipe["schedule"] in PL.SCHEDULES and pipe["microbatches"] in {c["pipeline"]["microbatches"] for c in tried}


def test_in_flight_activations_are_in_the_memory_model():
    gpipe = _stack_plan(schedule="GPipe", microbatches=8)
    one_f = _stack_plan(schedule="1F1B", microbatches=8)
    # Same stages and layouts: GPipe keeps all 8 microbatches, 1F1B's first stage 2.
    act_g = gpipe.pipeline["ranks"][0]["activation_bytes"]
    act_1 = one_f.pipeline["ranks"][0]["activation_bytes"]
    assert act_g == pytest.approx(act_1 * 8 / 2)


def test_a_budget_below_the_in_flight_activations_rejects_gpipe():
    # Data parallelism inside the stages, weights and optimizer states whole: ZeRO or sharded weights
    # would free what the in-flight activations take.
    whole = {"blocks.*": {"output": ["R", "R"], "zero": 0}, "x": ["R", "S(0)"]}
    one_f = _stack_plan(schedule="1F1B", microbatches=8, pins=whole)
    budget = one_f.memory["peak"] * 1.01
    with pytest.raises(autopar.InfeasiblePlanError, match="pipeline stages"):
        _stack_plan(schedule="GPipe", microbatches=8, memory_budget=budget, recompute=False, pins=whole)
    # With the layouts free, GPipe fits by recomputing; 1F1B fits without, and is chosen.
    assert _stack_plan(schedule="GPipe", microbatches=8, memory_budget=budget).recompute["layers"]
    free = _stack_plan(microbatches=8, memory_budget=budget)
    assert free.memory["peak"] <= budget and not free.recompute["layers"]


def test_batch_that_does_not_split_into_the_microbatches_is_refused():
    with pytest.raises(autopar.AutoparError, match="64 does not split into 3 equal microbatches"):
        _stack_plan(microbatches=3)


class _Flat(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.a, self.b = torch.nn.Linear(64, 64), torch.nn.Linear(64, 64)

    def forward(self, x):
        return self.b(self.a(x)).pow(2).mean()


def test_model_without_repeated_layers_is_refused():
    with pytest.raises(autopar.AutoparError, match="has none"):
        autopar.plan(_Flat(), autopar.ClusterSpec.local_cpu(2), (torch.randn(4, 64),), mesh_shape=(2,),
                     axis_names=("pp",), progress=False)


class _NoLoss(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.blocks = Stack(64, 4, 128, 2).blocks

    def forward(self, x):
        for b in self.blocks:
            x = b(x)
        return x


def test_model_without_a_scalar_loss_is_refused():
    with torch.device("meta"):
        model = _NoLoss()
    with pytest.raises(autopar.AutoparError, match="needs the model to return a scalar loss"):
        autopar.plan(model, autopar.ClusterSpec.local_cpu(2), (torch.randn(4, 8, 64, device="meta"),),
                     mesh_shape=(2,), axis_names=("pp",), progress=False)


def test_pipeline_axis_larger_than_the_layers_is_refused():
    with torch.device("meta"):
        model = Stack(64, 4, 128, 2)
    with pytest.raises(autopar.AutoparError, match="'pp' has 4 ranks but the model has only 2 layers to cut "
                                                   "between; use a pipeline axis of at most 2"):
        autopar.plan(model, autopar.ClusterSpec.local_cpu(4), (torch.randn(4, 8, 64, device="meta"),),
                     mesh_shape=(4,), axis_names=("pp",), progress=False)


def test_a_pipeline_mesh_the_planner_adds_falls_back_to_the_others():
    """With the mesh left to the planner, a pipeline mesh the model cannot use is skipped with its reason
    (the same check that refuses a 'pp' axis given by the user), and the plan is the best of the others."""
    plan = autopar.plan(_Flat(), autopar.ClusterSpec.preset("16xH100"), (torch.randn(16, 64),), progress=False)
    assert plan.pipeline is None and "pp" not in plan.axis_names
    skipped = [c for c in plan.solver["candidates"] if c.get("status") == "skipped"]
    assert [c["mesh"] for c in skipped] == [[2, 8]] and "has none" in skipped[0]["reason"]


def test_schedule_with_more_stages_than_layers_is_refused():
    with torch.device("meta"):
        model = Stack(64, 4, 128, 2)
    with pytest.raises(autopar.AutoparError, match="only 2 layers to cut between; use a schedule of one stage"):
        autopar.plan(model, autopar.ClusterSpec.local_cpu(2), (torch.randn(4, 8, 64, device="meta"),),
                     mesh_shape=(2,), axis_names=("pp",), schedule="Interleaved1F1B", progress=False)


def test_a_budget_only_recompute_meets_recomputes_inside_the_stages():
    """Under a budget below every schedule's in-flight activations, each rank recomputes the fewest layers
    that fit; the plan lists them, prices their forward again and stays under the budget."""
    with torch.device("meta"):
        model = Stack(256, 4, 1024, 8)
    x = torch.randn(16, 256, 256, device="meta")
    cluster = autopar.ClusterSpec.local_cpu(2)
    free = autopar.plan(model, cluster, (x,), mesh_shape=(2,), axis_names=("pp",), schedule="1F1B",
                        microbatches=4, progress=False)
    assert not free.recompute["layers"] and free.breakdown["recompute"] == 0
    static = max(r["static_bytes"] for r in free.pipeline["ranks"])
    budget = static + 0.5 * (free.memory["peak"] - static)
    tight = autopar.plan(model, cluster, (x,), mesh_shape=(2,), axis_names=("pp",), schedule="1F1B",
                         microbatches=4, memory_budget=budget, progress=False)
    assert tight.recompute["layers"] and tight.memory["peak"] <= budget
    assert tight.breakdown["recompute"] > 0 and tight.step_time > free.step_time
    for st in tight.pipeline["stages"]:
        assert set(st["recompute"]) <= set(st["layers"])
    with pytest.raises(autopar.InfeasiblePlanError):
        autopar.plan(model, cluster, (x,), mesh_shape=(2,), axis_names=("pp",), schedule="1F1B",
                     microbatches=4, memory_budget=budget, recompute=False, progress=False)


def test_pipeline_axis_must_be_outermost():
    with pytest.raises(autopar.AutoparError, match="outermost"):
        with torch.device("meta"):
            model = Stack(256, 4, 1024, 4)
        autopar.plan(model, autopar.ClusterSpec.preset("16xH100"), (torch.randn(16, 64, 256, device="meta"),),
                     mesh_shape=(8, 2), axis_names=("dp", "pp"), progress=False)


def test_malformed_pipeline_entries_are_refused():
    plan = _stack_plan(schedule="1F1B", microbatches=4)
    d = json.loads(plan.to_json())
    d["pipeline"]["schedule"] = "Fancy"
    with pytest.raises(autopar.PlanFormatError, match="schedule"):
        autopar.Plan.from_dict(d)
    d = json.loads(plan.to_json())
    d["pipeline"]["stages"][1]["layers"].append("blocks.0")
    with pytest.raises(autopar.PlanFormatError, match="blocks.0"):
        autopar.Plan.from_dict(d)
    d = json.loads(plan.to_json())
    d["pipeline"]["stages"][0]["pp_rank"] = 5
    with pytest.raises(autopar.PlanFormatError, match="pp_rank"):
        autopar.Plan.from_dict(d)


def test_wide_stack_pipeline_is_balanced_on_8_layers():
    model = wide_stack(h=1024, heads=8, layers=8)
    x = torch.randn(32, 256, 1024, dtype=torch.bfloat16, device="meta")
    plan = autopar.plan(model, autopar.ClusterSpec.preset("32xH100"), (x,), mesh_shape=(4, 8),
                        axis_names=("pp", "tp"), progress=False, schedule="1F1B", microbatches=8)
    assert [len(s["layers"]) for s in plan.pipeline["stages"]] == [2, 2, 2, 2]
    assert math.isclose(plan.pipeline["bubble_fraction"], 3 / 8)


def test_multi_node_clusters_try_pipeline_meshes(monkeypatch):
    """Pipeline meshes join the search on clusters of several nodes; they are planned in forked child
    processes beside the other meshes, and the plan is the one planning them in this process gives."""
    import autopar.planner as planner
    from autopar.pipeline_search import pipeline_meshes

    assert pipeline_meshes(autopar.ClusterSpec.preset("1024xH100")) == [
        ((4, 32, 8), ("pp", "dp", "tp")), ((8, 16, 8), ("pp", "dp", "tp"))]
    assert pipeline_meshes(autopar.ClusterSpec.preset("16xH100")) == [((2, 8), ("pp", "tp"))]
    with torch.device("meta"):
        model = Stack(256, 4, 1024, 4)
    x = torch.randn(64, 64, 256, device="meta")
    thresholds = gc.get_threshold()
    plan = autopar.plan(model, autopar.ClusterSpec.preset("16xH100"), (x,), progress=False)
    assert gc.get_threshold() == thresholds       # planning collects garbage rarely, and restores the setting
    tried = [c for c in plan.solver["candidates"] if "pipeline" in c]
    assert [c["mesh"] for c in tried] and all(c["mesh"] == [2, 8] for c in tried)
    assert any(t is not None for c in tried for t in c["pipeline"]["schedules"].values())
    monkeypatch.setattr(planner, "FORK_PIPELINE_MESHES", False)
    assert _without_timings(plan) == _without_timings(autopar.plan(model, autopar.ClusterSpec.preset("16xH100"),
                                                                   (x,), progress=False))
    single = autopar.plan(model, autopar.ClusterSpec.preset("16xH100"), (x,), progress=False, pipeline=False)
    assert not any("pipeline" in c for c in single.solver["candidates"])


def _without_timings(p) -> dict:
    d = p.to_dict()
    for k in ("timings", "planning_seconds", "seconds", "passes"):
        d["solver"].pop(k, None)
    for c in d["solver"]["candidates"]:
        c.pop("seconds", None)
    return d


def test_explain_report_and_diff_show_the_pipeline(tmp_path):
    plan = _stack_plan(schedule="1F1B", microbatches=4)
    node = next(n["name"] for n in plan.nodes if n["layer"] == "blocks.6")
    text = plan.explain(node)
    assert "pipeline stage 1 of 2 (rank 1 of axis 'pp')" in text and "per microbatch" in text
    html_path = tmp_path / "plan.html"
    plan.to_html(html_path)
    html = html_path.read_text()
    assert 'id="pipeline"' in html and "pipeline bubble" in html and "blocks.4" in html
    from autopar.inspection import diff

    other = _stack_plan(schedule="GPipe", microbatches=4)
    assert "pipeline of 2 stages (GPipe, 4 microbatches" in str(diff(plan, other))


def test_cli_plans_a_pipeline_and_shows_the_bubble(tmp_path, capsys):
    from autopar.__main__ import main

    out = tmp_path / "plan.json"
    assert main(["plan", "--model", "llama-tiny", "--cluster", "16xH100", "--batch", "16", "--mesh", "2,8",
                 "--axes", "pp,dp", "--microbatches", "4", "--schedule", "1F1B", "--out", str(out)]) == 0
    stdout = capsys.readouterr().out
    assert "pipeline bubble" in stdout and "pipeline: 2 stages on 2 ranks of axis 'pp', schedule 1F1B" in stdout
    plan = autopar.Plan.load(out)
    assert plan.pipeline["microbatches"] == 4 and plan.mesh_shape == (2, 8)


@pytest.mark.parametrize("name", ["gpt2-tiny", "llama-tiny", "bert-tiny"])
def test_a_microbatch_program_derived_from_two_captures_is_the_capture_at_its_batch(name):
    from autopar import zoo
    from autopar.passes.capture import capture, rebatch

    model, args, kwargs = zoo.build(name, batch=8, device="cpu")
    caps = {m: (capture(model, *PL.microbatch_inputs(args, kwargs, m)), PL.microbatch_inputs(args, kwargs, m))
            for m in (1, 2, 4, 8)}
    (base, _), (other, _) = caps[1], caps[4]           # batches 8 and 2
    want, (mb_args, mb_kwargs) = caps[2]                # batch 4
    got = rebatch(base, other, mb_args, mb_kwargs)
    assert got is not None and got.input_shapes == want.input_shapes
    for a, b in zip(want.gm.graph.nodes, got.gm.graph.nodes, strict=True):
        assert (a.name, a.op, a.target, str(a.args), str(a.kwargs)) == (b.name, b.op, b.target, str(b.args),
                                                                           str(b.kwargs))
        va, vb = a.meta.get("val"), b.meta.get("val")
        if isinstance(va, torch.Tensor):
            assert (va.shape, va.stride(), va.dtype) == (vb.shape, vb.stride(), vb.dtype), a.name
    # export specializes a batch of 1 (fewer copies and expands): it is captured, never derived.
    assert rebatch(base, other, *caps[8][1]) is None


def test_pipeline_planning_derives_microbatch_programs_and_plans_the_same(monkeypatch):
    import autopar.planner as planner
    from autopar.passes import capture as capture_module

    # Four microbatch counts on a fixed pp mesh: the first two are captured, the others derived. (A
    # capture unrolled from a few layers is captured again instead: tests/test_unroll.py.)
    monkeypatch.setattr(capture_module, "unrolled_capture", lambda model, export: None)
    derived_batches = []
    rebatch = planner.rebatch

    def counted(base, other, args, kwargs):
        got = rebatch(base, other, args, kwargs)
        derived_batches.append(None if got is None else got.input_shapes[0][0])
        return got

    monkeypatch.setattr(planner, "rebatch", counted)
    derived = _without_timings(_stack_plan())
    assert derived_batches == [8, 4]
    monkeypatch.setattr(planner, "_derived", lambda *a, **k: None)
    assert derived == _without_timings(_stack_plan())
