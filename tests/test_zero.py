"""ZeRO-1 and ZeRO-2: optimizer states (and gradients) sharded where a parameter is replicated.

The memory model reproduces ZeRO's per-device formulas (REFERENCES.md) exactly; plans that shard
states train like single-device eager training under the user's own AdamW on 2 and 4 gloo ranks, save
and load checkpoints across stages, and their measured peaks are within 10% of the predicted ones.
"""
from __future__ import annotations

import copy
import json
import re

import pytest
import torch
from torch import nn

import autopar
from autopar.passes.costs import OptimizerSpec
from tests.distributed_utils import resumes_alike, run_distributed
from tests.eager_parity import LR, full_gradient, train_and_compare

PSI, N = 96000 * 78125, 64          # ZeRO's example: 7.5B parameters on 64 data-parallel devices


class _Wide(nn.Module):
    def __init__(self):
        super().__init__()
        self.proj = nn.Linear(78125, 96000, bias=False)

    def forward(self, x):
        return self.proj(x).float().square().mean()


@pytest.fixture(scope="module")
def zero_plans():
    """The 7.5B-parameter layer in bf16 with mixed-precision Adam (K = 12) on 64 devices, under each
    ZeRO stage, planned offline on the meta device."""
    with torch.device("meta"):
        model = _Wide().to(torch.bfloat16)
    x = torch.empty(64, 78125, dtype=torch.bfloat16, device="meta")
    cluster = autopar.ClusterSpec.preset("64xH100")
    pins = {"replicated": {"output": ["R"], "zero": 0}, "zero1": {"output": ["R"], "zero": 1},
            "zero2": {"output": ["R"], "zero": 2}, "zero3": ["S(0)"]}
    return {stage: autopar.plan(model, cluster, (x,), mesh_shape=(N,), memory_budget=1e15, progress=False,
                                optimizer=OptimizerSpec(12.0), recompute=False,
                                pins={"proj.weight": pin, "x": ["S(0)"], "linear": {"inputs": [["S(0)"], ["R"]]}})
            for stage, pin in pins.items()}


@pytest.mark.parametrize("stage, params, grads, optimizer, total", [
    ("replicated", 2 * PSI, 2 * PSI, 12 * PSI, 120e9),
    ("zero1", 2 * PSI, 2 * PSI, 12 * PSI / N, 31.40625e9),
    ("zero2", 2 * PSI, 2 * PSI / N, 12 * PSI / N, 16.640625e9),
    ("zero3", 2 * PSI / N, 2 * PSI / N, 12 * PSI / N, 1.875e9),
])
def test_step_memory_reproduces_zero_formulas(zero_plans, stage, params, grads, optimizer, total):
    p = zero_plans[stage]
    mem = p.memory
    assert (mem["params"], mem["grads"], mem["optimizer"]) == (params, grads, optimizer)
    # The step's timeline holds exactly these at the optimizer step, where every state is alive.
    at_step = [pt for pt in mem["timeline"] if pt["phase"] == "optimizer"][0]
    assert (at_step["params"], at_step["grads"], at_step["optimizer"]) == (params, grads, optimizer)
    assert params + grads + optimizer == total
    expected = {"replicated": None, "zero1": 1, "zero2": 2, "zero3": None}[stage]
    assert p.zero.get("proj.weight", {}).get("stage") == expected
    if stage != "replicated":
        assert f"ZeRO-{stage[-1]}" in p.summary() and f"ZeRO-{stage[-1]}" in p.explain("proj.weight")


def test_zero_entries_are_typed_records_that_round_trip(zero_plans):
    from autopar.plan import PlanZero

    p = zero_plans["zero2"]
    z = p.zero["proj.weight"]
    assert isinstance(z, PlanZero) and (z.stage, z.axis, z.dim) == (2, p.axis_names[0], z["dim"])
    again = autopar.Plan.from_dict(json.loads(p.to_json()))
    assert again.zero == p.zero and again.to_json() == p.to_json()


def test_alternatives_leave_a_zero2_gradient_to_its_reduce_scatter(zero_plans):
    """The plan's alternatives report lists a ZeRO-2 parameter's edges as the plan runs them: its reader
    does not all-reduce the gradient (the parameter's own reduce-scatter reduces it), while the same
    parameter's replicated and ZeRO-1 options do."""
    options = {a.layout: a for a in zero_plans["zero2"].alternatives["proj.weight"]}

    def all_reduces(option):
        return [c for c in option.collectives if c.kind == "all_reduce"]

    assert options["[R] ZeRO-2@0"].chosen and not all_reduces(options["[R] ZeRO-2@0"])
    assert all_reduces(options["[R]"]) and all_reduces(options["[R] ZeRO-1@0"])


def test_zero_communication_matches_data_parallel_volume(zero_plans):
    """ZeRO-2 moves the same bytes as data parallelism (2 Psi: a reduce-scatter and an all-gather in
    place of an all-reduce); ZeRO-1 as built here all-reduces and all-gathers (3 Psi, docs/cost-model.md)."""
    def volume(p):
        factor = {"all_reduce": 2, "all_gather": 1, "reduce_scatter": 1}
        return sum(factor[c["kind"]] * c["bytes"] * (N - 1) / N for c in p.collectives
                   if c["value"] == "p_proj_weight")
    dp = volume(zero_plans["replicated"])
    assert dp == pytest.approx(2 * 2 * PSI * (N - 1) / N)
    assert volume(zero_plans["zero2"]) == pytest.approx(dp)
    assert volume(zero_plans["zero1"]) == pytest.approx(1.5 * dp)


def test_replicated_pins_under_a_small_budget_shard_optimizer_states():
    """Every parameter pinned replicated and a budget below the least peak of any plan that keeps whole
    optimizer states: the plan shards optimizer states (and gradients) instead of failing."""
    from tests.memory_cases import build

    model, args, kwargs = build("gpt2", 32, 4, "cpu")
    cluster = autopar.ClusterSpec.local_cpu(2)
    pins = {name: {"output": ["R"], "zero": 0} for name, _ in model.named_parameters()}
    with pytest.raises(autopar.InfeasiblePlanError) as without_zero:
        autopar.plan(model, cluster, args, kwargs, mesh_shape=(2,), pins=pins, recompute=False, progress=False,
                     memory_budget=1.0)
    budget = without_zero.value.min_feasible_budget * 0.95
    replicated = {name: ["R"] for name, _ in model.named_parameters()}
    p = autopar.plan(model, cluster, args, kwargs, mesh_shape=(2,), pins=replicated, recompute=False,
                     progress=False, memory_budget=budget)
    assert p.memory["peak"] <= budget
    assert all(lay == ["R"] for lay in p.params.values())
    adam_states = 8 * sum(w.numel() for w in model.parameters())      # two fp32 states per element
    assert p.zero and p.memory["optimizer"] < adam_states


# --- on gloo ranks -------------------------------------------------------------------------------


def _pins(model, mesh_axes, stage, tp=None):
    pins = {name: {"output": ["R"] * mesh_axes, "zero": stage} for name, _ in model.named_parameters()}
    for name, lay in (tp or {}).items():
        pins[name] = {"output": ["R"] * (mesh_axes - 1) + [lay], "zero": stage}
    data = ["S(0)"] + ["R"] * (mesh_axes - 1)
    return {**pins, "input_ids": data, "labels": data}


def _gathers_in_buckets_as_one_by_one(pm, model, cluster, ids, labels, mesh, where):
    """The plan's parameters after two steps are bitwise those of the same plan gathering each
    parameter alone after the optimizer step."""
    assert len({z["bucket"] for z in pm.plan.zero.values()}) < len(pm.plan.zero), f"{where}: no bucket holds two"
    alone = pm.plan.to_dict()
    for i, z in enumerate(alone["zero"].values()):
        z["bucket"] = i
    runs = []
    for plan in (pm.plan, autopar.Plan.from_dict(alone)):
        pm_run = autopar.compile(model, cluster, (ids,), {"labels": labels}, mesh_shape=mesh, plan=plan)
        opt = torch.optim.AdamW(pm_run.parameters(), lr=LR)
        for _ in range(2):
            pm_run(ids, labels=labels).loss.backward()
            opt.step()
            opt.zero_grad()
        runs.append({fqn: pm_run.local_tensor(fqn) for fqn in plan.params})
    for fqn, t in runs[0].items():
        assert torch.equal(t, runs[1][fqn]), f"{where}: {fqn} gathered in buckets differs from gathered alone"


def _compute_after_first_reduce_scatter(pm, ids, labels) -> float:
    """The share of backward's ATen compute ops (not views) that run after its first reduce-scatter is
    issued: high when each is issued once its gradient is accumulated, near 0 when all wait for the end."""
    from torch.utils._python_dispatch import TorchDispatchMode

    c10d = torch.ops._c10d_functional
    issues = (c10d.reduce_scatter_tensor.default, c10d.all_to_all_single.default)    # on CPU: all-to-all + sum
    events = []

    class Log(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            if func in issues:
                events.append("issue")
            elif func.namespace == "aten" and not func.is_view:
                events.append("compute")
            return func(*args, **(kwargs or {}))

    loss = pm(ids, labels=labels).loss
    with Log():
        loss.backward()
    pm.zero_grad(set_to_none=True)
    after = events[events.index("issue"):]
    return after.count("compute") / events.count("compute")


def _reduce_scatters_overlap_backward(pm, ids, labels, where):
    """ZeRO-2's gradient reduce-scatters are waited after later backward compute has run, and give the
    gradients they give waited at once (what ``compile(overlap=False)`` runs), bitwise."""
    from tests.test_codegen import _reduce_scatters_waited_after_compute

    assert pm._sharded_states.defer, where
    assert _compute_after_first_reduce_scatter(pm, ids, labels) >= 0.5, \
        f"{where}: the reduce-scatters are issued after most of backward, not as gradients are ready"
    between = _reduce_scatters_waited_after_compute(pm, ids, labels)
    assert len(between) >= len(pm.plan.zero) and sum(n > 0 for n in between) >= len(between) // 4, \
        f"{where}: ops between each reduce-scatter's issue and its wait: {between}"
    grads = []
    for defer in (True, False):
        pm._sharded_states.defer = defer
        pm(ids, labels=labels).loss.backward()
        grads.append({name: p.grad for name, p in pm.named_parameters()})
        pm.zero_grad(set_to_none=True)
    pm._sharded_states.defer = True
    for name, g in grads[0].items():
        assert torch.equal(g, grads[1][name]), f"{where}: {name}'s gradient differs when waited at once"


def _autograd_grad_gives_the_blocks(pm, ref_grads, ids, labels, where):
    """With overlap on, ``torch.autograd.grad`` over the module's parameters returns this rank's blocks of
    the single-device gradients and leaves every ``.grad`` as an earlier backward left it (no deferred
    reduce-scatter writes one); ``backward(inputs=...)`` fills the named parameters' ``.grad`` only."""
    assert pm._program.overlap, where
    pm.zero_grad(set_to_none=True)
    scale = max(g.abs().max().item() for g in ref_grads.values())

    def check(fqn, local_grad, how):
        assert local_grad is not None, f"{where}: {how} gave no gradient for {fqn}"
        full = full_gradient(pm, fqn, local_grad)
        assert (full - ref_grads[fqn]).abs().max().item() <= 1e-5 * scale, f"{where}: {how}, gradient of {fqn}"

    fqns = list(pm.plan.params)
    params = [pm.local_parameter(f) for f in fqns]
    pm(ids, labels=labels).loss.backward()
    before = [p.grad.clone() for p in params]
    grads = torch.autograd.grad(pm(ids, labels=labels).loss, params)
    for fqn, g in zip(fqns, grads):
        check(fqn, g, "torch.autograd.grad")
    assert all(torch.equal(p.grad, b) for p, b in zip(params, before)), f"{where}: torch.autograd.grad changed a .grad"
    pm.zero_grad(set_to_none=True)
    named = fqns[::2]
    pm(ids, labels=labels).loss.backward(inputs=[pm.local_parameter(f) for f in named])
    for fqn in fqns:
        if fqn in named:
            check(fqn, pm.local_parameter(fqn).grad, "backward(inputs=...)")
        else:
            assert pm.local_parameter(fqn).grad is None, f"{where}: backward(inputs=...) wrote {fqn}'s .grad"
    pm.zero_grad(set_to_none=True)


def _zero1_gradient_asked_alone_is_refused(pm, ids, labels, where):
    """A ZeRO-1 gradient is reduced only where backward accumulates it: ``torch.autograd.grad`` over a
    ZeRO-1 parameter, or ``backward(inputs=...)`` naming it, raises autopar's error naming it."""
    fqn = next(iter(pm.plan.zero))
    param = pm.local_parameter(fqn)
    pm.zero_grad(set_to_none=True)
    for how, run in (("torch.autograd.grad", lambda loss: torch.autograd.grad(loss, [param])),
                     ("backward(inputs=...)", lambda loss: loss.backward(inputs=[param]))):
        with pytest.raises(NotImplementedError, match=f"ZeRO-1 parameter '{re.escape(fqn)}'.*loss.backward"):
            run(pm(ids, labels=labels).loss)
        assert param.grad is None, f"{where}: {how} wrote {fqn}'s .grad"
    pm.zero_grad(set_to_none=True)


def _check_sharded_states(rank, world, mesh, checkpoint_dir):
    from tests.hf_models import MEGATRON, batch, build
    from tests.live_memory import step_peak_over_ranks

    torch.manual_seed(0)
    model = build("gpt2")
    ref = copy.deepcopy(model)
    ids, labels = batch()
    cluster = autopar.ClusterSpec.local_cpu(world)
    tp = {k: v for k, v in MEGATRON["gpt2"].items()} if len(mesh) == 2 else None
    ref_grads = dict(zip([f for f, _ in ref.named_parameters()],
                         torch.autograd.grad(ref(ids, labels=labels).loss, list(ref.parameters()))))
    if len(mesh) == 1:
        zero3 = {"*.weight": ["S(0)"], "input_ids": ["S(0)"], "labels": ["S(0)"], "mm_default*": ["S(0)"]}
        pm = autopar.compile(model, cluster, (ids,), {"labels": labels}, mesh_shape=mesh, pins=zero3,
                             recompute=False)
        assert "grad = 'reduce_scatter'" in pm.code and "all_gather_start(" in pm.code
        _autograd_grad_gives_the_blocks(pm, ref_grads, ids, labels, "ZeRO-3")
    pms = {}
    for stage in (1, 2):
        pm = autopar.compile(model, cluster, (ids,), {"labels": labels}, mesh_shape=mesh,
                             pins=_pins(model, len(mesh), stage, tp), recompute=False)
        where = f"ZeRO-{stage} on mesh {mesh}"
        assert pm.plan.zero and {z["stage"] for z in pm.plan.zero.values()} == {stage}, where
        # The optimizer sees this rank's blocks: its states are a world-th of the replicated size.
        sharded = pm.local_parameter(next(iter(pm.plan.zero)))
        assert sharded.numel() * mesh[0] == pm.local_tensor(next(iter(pm.plan.zero))).numel()
        if stage == 2:
            _autograd_grad_gives_the_blocks(pm, ref_grads, ids, labels, where)
        else:
            _zero1_gradient_asked_alone_is_refused(pm, ids, labels, where)
        opt = train_and_compare(pm, copy.deepcopy(ref), ids, labels, where)
        pms[stage] = (pm, opt)

        def step():
            pm(ids, labels=labels).loss.backward()
            opt.step()
            opt.zero_grad()

        peak = step_peak_over_ranks(pm, opt, step, inputs=(ids, labels))
        predicted = pm.plan.memory["peak"]
        assert abs(peak / predicted - 1) <= 0.10, f"{where}: measured {peak} vs predicted {predicted}"
        if stage == 2:
            _gathers_in_buckets_as_one_by_one(pm, model, cluster, ids, labels, mesh, where)
            _reduce_scatters_overlap_backward(pm, ids, labels, where)

    # A checkpoint of the ZeRO-2 run resumes under ZeRO-1 with the losses the ZeRO-2 run goes on with.
    if checkpoint_dir is not None:
        pm2, opt2 = pms[2]
        pm1 = autopar.compile(model, cluster, (ids,), {"labels": labels}, mesh_shape=mesh,
                              pins=_pins(model, len(mesh), 1, tp), recompute=False)
        opt1 = torch.optim.AdamW(pm1.parameters(), lr=LR)
        resumes_alike(f"{checkpoint_dir}/zero2", pm2, opt2, pm1, opt1, ids, labels)


def test_zero_plans_train_save_and_load_on_two_ranks(tmp_path):
    run_distributed(_check_sharded_states, 2, (2,), str(tmp_path), timeout=600)


def test_zero_plans_train_on_four_ranks_with_tensor_parallel():
    run_distributed(_check_sharded_states, 4, (2, 2), None, timeout=600)
