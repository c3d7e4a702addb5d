"""Bad input gets a clear error or a reported, planned fallback, never a crash deep inside or a
silently different program: malformed plans (a fuzz test over corrupted valid plans), plans given with
other shapes or options, pins that name nothing, batches that do not divide by the mesh, the same
tensor passed for two arguments, and state dicts with tied weights and buffers."""
import copy
import functools
import json
import math

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from torch import nn

import autopar
from autopar.errors import AutoparError, PlanFormatError, ShapeMismatchError, ShardingError
from tests.distributed_utils import run_distributed
from tests.hf_models import batch, build


@functools.lru_cache(maxsize=None)
def _gpt2_plan_and_graph():
    """A valid plan of GPT-2 on a 2x2 mesh, and the graph code generation checks plans against."""
    from autopar.pass_pipeline import front_end, new_runner

    torch.manual_seed(0)
    model = build("gpt2")
    ids, labels = batch()
    plan = autopar.plan(model, autopar.ClusterSpec.local_cpu(4), (ids,), {"labels": labels}, mesh_shape=(2, 2),
                        progress=False)
    gm = front_end(model, (ids,), {"labels": labels}, new_runner()).gm
    return model, (ids,), {"labels": labels}, plan.to_json(), gm


def generate(gm, plan):
    """Code generation of one rank's program, without a process group (group names are only names)."""
    from autopar.codegen.local_program import local_program_pass

    return local_program_pass(gm, plan=plan, group_names=["g0", "g1"])


def _paths(d, prefix=()):
    """Every path into a JSON value, containers included."""
    out = [prefix]
    if isinstance(d, dict):
        for k, v in d.items():
            out += _paths(v, prefix + (k,))
    elif isinstance(d, list):
        for i, v in enumerate(d[:3]):          # a few entries of each list keep the space small
            out += _paths(v, prefix + (i,))
    return out


JUNK = [None, -1, 0, 7, 1.5, -2.5, math.nan, math.inf, True, "", "x", "S(99)", "S(-1)", "P", "R", [], ["R"],
        ["S(0)", "S(0)"], [["R"]], {}, {"x": 1}, 10**12]


@st.composite
def corruptions(draw):
    _, _, _, text, _ = _gpt2_plan_and_graph()
    d = json.loads(text)
    paths = [p for p in _paths(d) if p]
    path = draw(st.sampled_from(paths))
    parent = d
    for k in path[:-1]:
        parent = parent[k]
    if draw(st.booleans()) and isinstance(parent, dict):
        del parent[path[-1]]
        what = f"deleted {path}"
    else:
        value = draw(st.sampled_from(JUNK))
        parent[path[-1]] = copy.deepcopy(value)
        what = f"{path} = {value!r}"
    return _Case(d, path, what)


class _Case(tuple):
    """(plan dict, corrupted path, description), shown by its description when a case fails."""

    def __new__(cls, d, path, what):
        return super().__new__(cls, (d, path, what))

    def __repr__(self):
        return self[2]


@settings(max_examples=200, deadline=None, suppress_health_check=list(HealthCheck))
@given(corruptions())
def test_corrupted_plans_raise_plan_format_error_or_work(case):
    """A corrupted plan is refused with PlanFormatError naming the field, or it is still a plan that
    every consumer handles: the summary, a JSON round trip, and the checks and code generation that
    compile runs (which may refuse it only with an autopar error)."""
    from autopar.compiler import check_plan

    d, path, what = case
    model, args, kwargs, _, gm = _gpt2_plan_and_graph()
    try:
        plan = autopar.Plan.from_dict(d)
    except PlanFormatError as e:
        # The message names the field that is wrong: the one corrupted, or (for the mesh, which
        # every layout is read against) the first field that no longer fits it.
        if path[0] != "mesh":
            assert str(path[0]) in str(e), f"{what}: {e}"
        return
    plan.summary()
    text = plan.to_json()
    assert autopar.Plan.from_dict(json.loads(text)).to_json() == text
    try:
        check_plan(plan, model, args, kwargs, 4)
        generate(gm, plan)
    except AutoparError:
        pass


@functools.lru_cache(maxsize=None)
def _pipeline_plan_text():
    torch.manual_seed(0)
    ids, labels = batch()
    return autopar.plan(build("gpt2"), autopar.ClusterSpec.local_cpu(2), (ids,), {"labels": labels},
                        mesh_shape=(2,), axis_names=("pp",), schedule="GPipe", microbatches=2,
                        progress=False).to_json()


@settings(max_examples=100, deadline=None, suppress_health_check=list(HealthCheck))
@given(st.data())
def test_corrupted_pipeline_entries_raise_plan_format_error_or_work(data):
    """The same for a pipeline plan's own entry (stages, ranks, schedule), read by the summary."""
    d = json.loads(_pipeline_plan_text())
    path = data.draw(st.sampled_from([p for p in _paths(d) if p and p[0] == "pipeline"]), label="path")
    parent = d
    for k in path[:-1]:
        parent = parent[k]
    if data.draw(st.booleans(), label="delete") and isinstance(parent, dict):
        del parent[path[-1]]
    else:
        parent[path[-1]] = copy.deepcopy(data.draw(st.sampled_from(JUNK), label="value"))
    try:
        plan = autopar.Plan.from_dict(d)
    except PlanFormatError as e:
        assert "pipeline" in str(e), e
        return
    plan.summary()
    text = plan.to_json()
    assert autopar.Plan.from_dict(json.loads(text)).to_json() == text


def test_plan_format_errors_name_the_field():
    _, _, _, text, _ = _gpt2_plan_and_graph()
    cases = [
        (lambda d: d["params"].update({"transformer.wte.weight": ["S(0)", "P"]}), r"params\.transformer\.wte\.weight"),
        (lambda d: d["nodes"][3].update(compute_seconds="fast"), r"nodes\[3\]\.compute_seconds"),
        (lambda d: d["memory"].update(peak=math.nan), r"memory\.peak"),
        (lambda d: d["collectives"][0].update(axis="zz"), r"collectives\[0\]\.axis"),
        (lambda d: d["model"].pop("fingerprint"), r"model: is missing \['fingerprint'\]"),
        (lambda d: d.update(surprise=1), r"unknown fields \['surprise'\]"),
        (lambda d: d["mesh"].update(axes=["dp", "dp"]), "distinct"),
        (lambda d: d["params"].update({"transformer.wte.weight": ["S(0)", "S(0)"]}), "along two mesh axes"),
    ]
    for mutate, pattern in cases:
        d = json.loads(text)
        mutate(d)
        with pytest.raises(PlanFormatError, match=pattern):
            autopar.Plan.from_dict(d)


def test_plan_layout_out_of_range_is_refused_before_code_generation():
    _, _, _, text, gm = _gpt2_plan_and_graph()
    d = json.loads(text)
    d["params"]["transformer.wte.weight"] = ["S(99)", "R"]
    with pytest.raises(PlanFormatError, match=r"params\['transformer.wte.weight'\].*S\(99\).*only 2 dims"):
        generate(gm, autopar.Plan.from_dict(d))
    d = json.loads(text)
    node = next(n for n in d["nodes"] if n["op"] == "mm.default")
    node.update(inputs=[["R", "R"], ["R", "R"]], outputs=[["P", "R"]], split_axes=[])   # a sum out of nothing
    with pytest.raises(PlanFormatError, match=f"plan node '{node['name']}'.*not a strategy of its op"):
        generate(gm, autopar.Plan.from_dict(d))


def test_plan_given_with_other_shapes_or_options():
    from autopar.compiler import check_plan

    model, args, kwargs, text, _ = _gpt2_plan_and_graph()
    plan = autopar.Plan.from_dict(json.loads(text))
    ids = args[0]
    with pytest.raises(ShapeMismatchError, match=r"made for inputs of shapes \[\[8, 16\], \[8, 16\]\].*\[\[4, 16\]"):
        check_plan(plan, model, (ids[:4],), {"labels": ids[:4]}, 4)
    with pytest.raises(autopar.InfeasiblePlanError, match="exceeds memory_budget=1000"):
        check_plan(plan, model, args, kwargs, 4, memory_budget=1000)
    check_plan(plan, model, args, kwargs, 4, memory_budget=plan.memory["peak"])
    wte = plan.params["transformer.wte.weight"]
    check_plan(plan, model, args, kwargs, 4, pins={"transformer.wte.weight": wte})
    other = ["R", "R"] if wte != ["R", "R"] else ["S(0)", "R"]
    with pytest.raises(PlanFormatError, match="asks transformer.wte.weight for output"):
        check_plan(plan, model, args, kwargs, 4, pins={"transformer.wte.weight": other})
    with pytest.raises(ShardingError, match="close matches"):
        check_plan(plan, model, args, kwargs, 4, pins={"transformer.wte.weights": wte})
    with pytest.raises(PlanFormatError, match=r"\['recompute', 'time_limit'\] only apply when planning"):
        check_plan(plan, model, args, kwargs, 4, time_limit=5, recompute=False)
    with pytest.raises(PlanFormatError, match="mesh_shape"):
        check_plan(plan, model, args, kwargs, 4, mesh_shape=(4,))


def test_pin_that_matches_nothing_names_the_glob_and_close_matches():
    torch.manual_seed(0)
    model = build("gpt2")
    ids, labels = batch()
    cluster = autopar.ClusterSpec.local_cpu(2)
    with pytest.raises(ShardingError, match=r"pin '\*\.mlp\.c_fc\.weigth' matches no.*close matches"):
        autopar.plan(model, cluster, (ids,), {"labels": labels}, pins={"*.mlp.c_fc.weigth": ["S(1)"]}, progress=False)


def test_batch_that_does_not_divide_is_reported():
    torch.manual_seed(0)
    model = build("gpt2")
    ids = torch.randint(0, 128, (3, 16))
    cluster = autopar.ClusterSpec.local_cpu(2)
    with pytest.warns(autopar.AutoparWarning, match=r"batch dim of input_ids \(3\), labels \(3\) does not divide by 2"):
        plan = autopar.plan(model, cluster, (ids,), {"labels": ids}, progress=False)
    assert plan.extra["warnings"] and "warning: the batch dim" in plan.summary()
    assert autopar.Plan.from_dict(json.loads(plan.to_json())).extra == plan.extra
    plan = autopar.plan(model, cluster, (ids[:2],), {"labels": ids[:2]}, progress=False)
    assert not any("batch dim" in w for w in plan.extra["warnings"])


def test_same_tensor_for_two_arguments_plans_them_apart():
    """Hugging Face's own examples call a causal LM with labels=input_ids (one tensor object)."""
    torch.manual_seed(0)
    model = build("gpt2")
    ids, _ = batch()
    plan = autopar.plan(model, autopar.ClusterSpec.local_cpu(2), (ids,), {"labels": ids}, progress=False)
    assert set(plan.inputs) == {"input_ids", "labels"}


class _Scaled(nn.Module):
    """A tied weight and a persistent buffer, as a state dict round trip must keep both."""

    def __init__(self):
        super().__init__()
        self.emb = nn.Embedding(16, 8)
        self.head = nn.Linear(8, 16, bias=False)
        self.head.weight = self.emb.weight
        self.register_buffer("scale", torch.full((8,), 0.5))
        self.register_buffer("scratch", torch.ones(8), persistent=False)

    def forward(self, ids):
        return (self.head(self.emb(ids) * self.scale * self.scratch) ** 2).mean()


def _state_dicts(rank, world):
    torch.manual_seed(0)
    model = _Scaled()
    with torch.no_grad():
        model.scale.fill_(0.25)
    ids = torch.randint(0, 16, (4, 6))
    pm = autopar.compile(model, autopar.ClusterSpec.local_cpu(world), (ids,))
    state = pm.state_dict()
    assert set(state) == {"emb.weight", "scale"}                      # DTensors for DCP, buffer included
    assert type(state["scale"]).__name__ == "DTensor" and torch.equal(state["scale"].full_tensor(), model.scale)
    full = pm.full_state_dict()
    assert set(full) == set(model.state_dict()) == {"emb.weight", "head.weight", "scale"}
    fresh = _Scaled()
    fresh.load_state_dict(full)                                       # strict
    assert torch.equal(fresh.scale, model.scale) and torch.equal(fresh.head.weight, model.emb.weight)
    other = autopar.compile(_Scaled(), autopar.ClusterSpec.local_cpu(world), (ids,), plan=pm.plan)
    other.load_state_dict(full)                                       # tied names accepted
    assert torch.equal(other(ids), pm(ids))


def test_state_dicts_hold_tied_names_and_buffers():
    run_distributed(_state_dicts, 2, timeout=300)
