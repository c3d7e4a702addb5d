"""Communication hidden behind compute (passes/exposure.py): the step replayed on a compute and a
communication stream as the generated program schedules it, checked on hand-timed graphs, and the plan's
breakdown of exposed and hidden communication."""
import dataclasses
import operator
from dataclasses import dataclass

import pytest
import torch
import torch.fx as fx

import autopar
from autopar.passes.exposure import exposure
from autopar.plan import PlanCollective
from autopar.passes.strategies import Strategy


@dataclass(frozen=True)
class _Plain:          # what exposure() reads of a Strategy
    zero: object = None
    offload: bool = False
    grad_scatter_axis = Strategy.grad_scatter_axis


class _Clock:
    """A cost model whose forward seconds are given per node name; backward costs twice the forward,
    and an all-reduce ``nbytes`` seconds (one byte a second, no latency)."""

    def __init__(self, forward: dict):
        self.forward = forward

    def forward_compute_seconds(self, node, s):
        return self.forward.get(node.name, 0.0)

    def compute_seconds(self, node, s):
        return 3 * self.forward.get(node.name, 0.0)

    def collective_seconds(self, kind, nbytes, axis):
        assert kind == "all_reduce"
        return float(nbytes)


def _chain(n_ops: int, weights: int = 0):
    """x -> op0 -> op1 -> ... (each op adds the previous value and its own weight w<i> when it has one)."""
    g = fx.Graph()
    x = g.placeholder("x")
    ws = [g.placeholder(f"w{i}") for i in range(weights)]
    v = x
    for i in range(n_ops):
        v = g.call_function(operator.add, (v, ws[i] if i < weights else v))
        v.name = f"op{i}"
    g.output(v)
    gm = fx.GraphModule(torch.nn.Module(), g)
    return gm, {n: _Plain() for n in gm.graph.nodes if n.op != "output"}


def _coll(kind, phase, value, node, seconds, nbytes=0, axis="dp"):
    return PlanCollective(kind, axis, phase, nbytes, seconds, node, value)


def test_forward_collective_hides_behind_the_compute_between_issue_and_first_use():
    gm, strategy = _chain(4)
    cm = _Clock({"op0": 1.0, "op1": 2.0, "op2": 3.0, "op3": 1.0})
    # x's collective is read by op3: issued before op0, it runs while op0..op2 compute (6 s).
    colls = [_coll("all_gather", "forward", "x", "op3", 4.0), _coll("all_gather", "forward", "op0", "op3", 4.0)]
    ex = exposure(gm, strategy, colls, cm, ["dp"], set())
    # The first hides entirely (4 s < 6 s). One is in flight at a time: the second is issued after the
    # first's wait, just before op3, so nothing hides it.
    assert ex.exposed == [0.0, 4.0]
    assert ex.hidden == pytest.approx(4.0)


def test_collectives_inside_a_recomputed_layer_hide_within_it_in_forward_and_in_its_run_again():
    """A recomputed layer is one call of its body (codegen/overlap.py): its collectives are issued once
    it starts, and a collective around it once it has ended; its run again in backward repeats its
    forward schedule."""
    gm, strategy = _chain(5)
    cm = _Clock({f"op{i}": 1.0 for i in range(5)})
    layer = {"op2": "L", "op3": "L"}
    inside = _coll("all_gather", "forward", "x", "op3", 1.5)
    after = _coll("all_gather", "forward", "x", "op4", 1.0)
    rerun = dataclasses.replace(inside, phase="backward", recompute=True)
    ex = exposure(gm, strategy, [inside, after, rerun], cm, ["dp"], {"op2", "op3"}, regions=layer)
    # Issued as the layer starts (2 s), not at x, it hides behind op2 (1 s): 0.5 s exposed, and so in the
    # run again. The one after the layer is issued when it ends (4.5 s), just before op4 reads it.
    assert ex.exposed == [0.5, 1.0, 0.5]
    # As one program with no layer call, both would hide whole behind the compute before their reader.
    assert exposure(gm, strategy, [inside, after], cm, ["dp"], set()).exposed == [0.0, 0.0]
    # A layer with no split collective holds nothing back.
    assert exposure(gm, strategy, [after], cm, ["dp"], {"op2", "op3"}, regions=layer).exposed == [0.0]


def test_bucketed_gradients_hide_behind_the_rest_of_backward():
    gm, strategy = _chain(3, weights=3)
    cm = _Clock({"op0": 1.0, "op1": 1.0, "op2": 1.0})        # backward: 2 s per op, op2 first
    # Each weight's gradient is all-reduced in backward; w2's is ready first (after op2's backward).
    colls = [_coll("all_reduce", "backward", f"w{i}", f"op{i}", 9.0, nbytes=3) for i in range(3)]
    one_each = exposure(gm, strategy, colls, cm, ["dp"], set(), bucket_bytes=1)
    # Buckets of one gradient, 3 s each on one stream: w2 at 2-5 s, w1 at 5-8 s, w0 at 8-11 s; backward
    # ends at 6 s, so 5 s are exposed: the last bucket's 3 and 2 of the middle one's.
    assert one_each.seconds == [3.0, 3.0, 3.0]
    assert one_each.exposed == pytest.approx([3.0, 2.0, 0.0])
    # One bucket of all three: 9 s from the end of backward, all exposed.
    whole = exposure(gm, strategy, colls, cm, ["dp"], set(), bucket_bytes=100)
    assert sum(whole.exposed) == pytest.approx(9.0) and whole.hidden == pytest.approx(0.0)


def test_a_gradient_reduced_by_some_readers_only_waits_at_once():
    gm, strategy = _chain(2, weights=1)
    g = gm.graph
    w0 = next(n for n in g.nodes if n.name == "w0")
    op1 = next(n for n in g.nodes if n.name == "op1")
    op1.args = (op1.args[0], w0)                    # w0 read by op0 (reduced) and op1 (not)
    gm.recompile()
    cm = _Clock({"op0": 1.0, "op1": 1.0})
    colls = [_coll("all_reduce", "backward", "w0", "op0", 0.5, nbytes=1)]
    assert exposure(gm, strategy, colls, cm, ["dp"], set()).exposed == [0.5]


def test_a_resharding_shared_by_two_readers_is_bucketed_once():
    gm, strategy = _chain(3, weights=1)
    nodes = {n.name: n for n in gm.graph.nodes}
    nodes["op0"].args = (nodes["x"], nodes["x"])
    nodes["op1"].args = (nodes["op0"], nodes["w0"])
    nodes["op2"].args = (nodes["op1"], nodes["w0"])        # w0 read by op1 and op2 through one resharding
    gm.recompile()
    cm = _Clock({"op0": 1.0, "op1": 1.0, "op2": 1.0})
    colls = [_coll("all_reduce", "backward", "w0", "op1", 1.5, nbytes=1)]   # listed at its first reader
    # Bucketed: ready after op1's backward, it hides behind op0's (2 s).
    assert exposure(gm, strategy, colls, cm, ["dp"], set(), resharded_for={"w0": {"op1", "op2"}}).exposed == [0.0]
    # Known to reach op1 alone, op2's use is not reduced: it waits where it is issued.
    assert exposure(gm, strategy, colls, cm, ["dp"], set(), resharded_for={"w0": {"op1"}}).exposed == [1.5]


def test_an_input_gradients_all_reduce_hides_behind_its_readers_weight_gradients():
    """Megatron's "f" read by linear layers alone (runtime/collectives.py ``column_linears``): backward
    issues it once the input's gradient is summed and waits after the readers' weight gradients, whose
    compute is their forward's."""
    gm, strategy = _chain(3)
    cm = _Clock({"op0": 1.0, "op1": 2.0, "op2": 1.0})
    f = _coll("all_reduce", "backward", "op0", "op1", 2.5)
    # Read by op1 and op2, it runs behind their weight gradients (3 s): nothing exposed.
    assert exposure(gm, strategy, [f], cm, ["dp"], set(), behind_weight_grads={("op0", "op1"): ["op1", "op2"]}
                    ).exposed == [0.0]
    # Read by op1 alone: 0.5 s of it is exposed; not hidden so, it waits where it is issued.
    assert exposure(gm, strategy, [f], cm, ["dp"], set(), behind_weight_grads={("op0", "op1"): ["op1"]}
                    ).exposed == pytest.approx([0.5])
    assert exposure(gm, strategy, [f], cm, ["dp"], set()).exposed == [2.5]


def test_a_sharded_parameters_gradient_reduce_scatter_waits_at_the_next_one_or_at_the_end():
    """ZeRO-3's and ZeRO-2's gradient reduce-scatters (runtime/collectives.py: defer_reduce_scatter)."""
    from autopar.passes.meta import Role, set_meta
    from autopar.passes.strategies import ZeroState

    gm, strategy = _chain(3, weights=3)
    for n in gm.graph.nodes:
        if n.name.startswith("w"):
            set_meta(n, role=Role("param", n.name))
    cm = _Clock({"op0": 1.0, "op1": 1.0, "op2": 1.0})        # backward: 2 s per op, op2 first
    # ZeRO-3: each weight gathered for its op in forward, its gradient reduce-scattered in backward.
    colls = [c for i in range(3) for c in (_coll("all_gather", "forward", f"w{i}", f"op{i}", 1.5),
                                           _coll("reduce_scatter", "backward", f"w{i}", f"op{i}", 1.5))]
    backward = [5, 3, 1]          # w2's, w1's, w0's reduce-scatter, in the order backward issues them
    # w2's runs 1.5 s from the end of op2's backward, waited at w1's issue 2 s later; so is w1's; w0's
    # is waited when backward ends, right after its issue.
    assert [exposure(gm, strategy, colls, cm, ["dp"], set()).exposed[i] for i in backward] == [0.0, 0.0, 1.5]
    # A parameter whose gradient the runtime reduces in a hook (ZeRO-1/2 along another axis) waits at once.
    hooked = {**strategy, **{n: _Plain(zero=ZeroState(1, 0, 0)) for n in gm.graph.nodes if n.name.startswith("w")}}
    assert [exposure(gm, hooked, colls, cm, ["dp"], set()).exposed[i] for i in backward] == [1.5, 1.5, 1.5]
    # ZeRO-2: the hook issues the reduce-scatter once the gradient is accumulated (after its reader's
    # backward), and it is waited as ZeRO-3's is.
    zero2 = {**strategy, **{n: _Plain(zero=ZeroState(2, 0, 0)) for n in gm.graph.nodes if n.name.startswith("w")}}
    scatters = [_coll("reduce_scatter", "backward", f"w{i}", f"w{i}", 1.5) for i in range(3)]
    assert exposure(gm, zero2, scatters, cm, ["dp"], set()).exposed == [1.5, 0.0, 0.0]


def test_a_gradient_gathered_from_chunks_waits_at_the_next_one_inside_recomputed_layers_too():
    """A replicated parameter read in chunks (runtime/collectives.py: param_chunk, placed in recomputed
    layers' bodies too by codegen/overlap.py) all-gathers its gradient at its reader's backward, waited
    at the next such issue or when backward ends."""
    from autopar.passes.meta import Role, set_meta

    gm, strategy = _chain(3, weights=3)
    for n in gm.graph.nodes:
        if n.name.startswith("w"):
            set_meta(n, role=Role("param", n.name))
    cm = _Clock({"op0": 1.0, "op1": 1.0, "op2": 1.0})        # backward: 2 s per op, 3 s recomputed
    colls = [_coll("all_gather", "backward", f"w{i}", f"op{i}", 1.5) for i in range(3)]
    # w2's runs 1.5 s from the end of op2's backward and is waited at w1's issue 2 s (3 s) later; so is
    # w1's; w0's is waited when backward ends, right after its issue.
    for recomputed in (set(), {"op0", "op1", "op2"}):
        assert exposure(gm, strategy, colls, cm, ["dp"], recomputed).exposed == [1.5, 0.0, 0.0], recomputed


def test_plan_reports_exposed_and_hidden_communication():
    from tests.memory_cases import build, options

    model, args, kwargs = build("gpt", seq=32, batch=4, device="cpu")
    cluster = autopar.ClusterSpec.local_cpu(2)
    dp = autopar.plan(model, cluster, args, kwargs, progress=False, **options("gpt", "dp", 2, model))
    b = dp.breakdown
    total = sum(b["communication"].values())
    assert b["hidden"] > 0 and b["exposed"] + b["hidden"] == pytest.approx(total)
    assert dp.step_time == pytest.approx(b["compute"] + b["recompute"] + b["exposed"] + b["optimizer"])
    assert b["serial"] >= dp.step_time
    assert all(0.0 <= c["exposed"] <= c["seconds"] * (1 + 1e-9) for c in dp.collectives)
    assert "hidden behind compute" in dp.summary()
    # ZeRO-3: each weight's all-gather is prefetched behind the compute before its first use.
    zero3 = autopar.plan(model, cluster, args, kwargs, progress=False, **options("gpt", "zero3", 2, model))
    gathers = [c for c in zero3.collectives if c["phase"] == "forward" and c["kind"] == "all_gather"]
    assert gathers and sum(c["seconds"] - c["exposed"] for c in gathers) > 0


def test_a_zero_3_plans_recomputed_layers_hide_their_gathers_in_forward_and_in_their_run_again():
    from tests.hf_models import batch, build

    ids, labels = batch()
    # The projections split the batch, so their sharded weights are gathered whole (FSDP's pattern).
    pins = {"*.weight": ["S(0)"], "input_ids": ["S(0)"], "labels": ["S(0)"], "mm_default*": ["S(0)"]}
    plan = autopar.plan(build("gpt2"), autopar.ClusterSpec.local_cpu(2), (ids,), {"labels": labels},
                        progress=False, mesh_shape=(2,), pins=pins, recompute={"*": "all"})
    assert plan.recompute["layers"]
    again = [c for c in plan.collectives if c.recompute]
    key = lambda c: (c.node, c.value, c.kind, c.step)      # noqa: E731
    rerun = {key(c) for c in again}
    inside = [c for c in plan.collectives if c.phase == "forward" and c.kind == "all_gather" and key(c) in rerun]
    # Each layer's weights are gathered behind the layer's compute before their reader, and its run
    # again in backward repeats that schedule.
    assert inside and sum(c.seconds - c.exposed for c in inside) > 0
    twin = {key(c): c.exposed for c in plan.collectives if c.phase == "forward"}
    assert all(c.exposed == twin[key(c)] for c in again)


def test_hidden_communication_costs_the_devices_contention_share():
    from tests.memory_cases import build, options

    model, args, kwargs = build("gpt", seq=32, batch=4, device="cpu")
    free = autopar.ClusterSpec.local_cpu(2)
    contended = dataclasses.replace(free, device=dataclasses.replace(free.device, comm_contention=0.6))
    a, b = (autopar.plan(model, c, args, kwargs, progress=False, **options("gpt", "dp", 2, model))
            for c in (free, contended))
    assert a.params == b.params and a.recompute == b.recompute
    ba, bb = a.breakdown, b.breakdown
    # The replay is the same: what hides is a property of the schedule, not of the device.
    assert bb["hidden"] == pytest.approx(ba["hidden"]) and ba["hidden"] > 0
    assert bb["exposed"] + bb["hidden"] == pytest.approx(sum(bb["communication"].values()))
    assert "contention" not in ba and bb["contention"] == pytest.approx(0.6 * bb["hidden"])
    assert b.step_time == pytest.approx(bb["compute"] + bb["recompute"] + bb["exposed"] + bb["contention"]
                                        + bb["optimizer"])
    assert a.step_time < b.step_time <= bb["serial"] == pytest.approx(ba["serial"])
    # The solver's credits save the same share of what they count hidden.
    assert bb["credit"] == pytest.approx(0.4 * ba["credit"])
    assert "contention with compute" in b.summary()
    # Contention 1: hiding saves nothing, and the step pays every collective whole.
    whole = dataclasses.replace(free, device=dataclasses.replace(free.device, comm_contention=1.0))
    c = autopar.plan(model, whole, args, kwargs, progress=False, **options("gpt", "dp", 2, model))
    bc = c.breakdown
    assert c.step_time == pytest.approx(bc["compute"] + bc["recompute"] + sum(bc["communication"].values())
                                        + bc["optimizer"])
    assert bc.get("credit", 0.0) == 0.0


class _Windowed(_Clock):
    """``_Clock`` as HidingWindows reads a cost model: one mesh axis, no fused kernels."""

    fused = False
    mesh_shape = (2,)


def _column_linears(weight_after_first=False, second_reader=torch.ops.aten.linear.default):
    """x -> op0 -> two readers of op0 (linears by default: Megatron's q and k, whose "f" is one
    all-reduce of op0's gradient) -> op3 -> op4, each linear with its own weight, and a weight w2
    read by op4 whose gradient is ready before op0's readers' backward."""
    from autopar.passes.meta import Role, set_meta

    g = fx.Graph()
    x = g.placeholder("x")
    w0, w1, w2 = (g.placeholder(f"w{i}") for i in range(3))
    op0 = g.call_function(operator.mul, (x, x))
    op1 = g.call_function(torch.ops.aten.linear.default, (op0, w0))
    op2 = g.call_function(second_reader, (op0, w1))
    op3 = g.call_function(operator.add, (op1, op2))
    op4 = g.call_function(operator.mul, (op3, w2))
    g.output(op4)
    for i, n in enumerate((op0, op1, op2, op3, op4)):
        n.name = f"op{i}"
    if weight_after_first:           # w1 computed between the readers: codegen cannot make one call of them
        with g.inserting_before(op2):
            late = g.call_function(operator.neg, (w1,))
        late.name = "late"
        op2.args = (op0, late)
    for w in (w0, w1, w2):
        w.meta["val"] = torch.empty(2, dtype=torch.float32)           # 8 bytes: 8 s of all-reduce
        set_meta(w, role=Role("param", w.name), requires_grad=True)
    gm = fx.GraphModule(torch.nn.Module(), g)
    strategies = {n: [_Plain()] for n in gm.graph.nodes if n.op == "call_function"}
    return gm, strategies, {n.name: n for n in gm.graph.nodes}


def test_the_solvers_credit_hides_an_input_gradients_all_reduce_behind_its_linear_readers_weight_gradients():
    """passes/exposure.py HidingWindows.behind_weight_grads: the window of Megatron's "f" before linear
    layers (runtime/collectives.py ``column_linears``) is one reader's weight gradient, its forward
    compute, less the all-reduces of the gradient buckets launched before it, as the replay prices
    it: never more than the replay hides."""
    from autopar.passes.exposure import HidingWindows

    cm = _Windowed({"op0": 1.0, "op1": 20.0, "op2": 12.0, "op3": 1.0, "op4": 1.0})
    gm, strategies, n = _column_linears()
    reads = [(n["op1"], 0), (n["op2"], 0)]
    # w2's bucket (8 s on the stream) is launched at op4's backward, before op0's readers' backward
    # issues the all-reduce: the least reader's 12 s less those 8.
    assert HidingWindows(gm, strategies, cm, {}, bucket_bytes=1).behind_weight_grads(n["op0"], reads) == 4.0
    # On a mesh of two axes the readers' weights may be bucketed along the other one: w1's bucket,
    # launched at op2's backward, may hold the stream too.
    two_axes = _Windowed(cm.forward)
    two_axes.mesh_shape = (2, 2)
    assert HidingWindows(gm, strategies, two_axes, {}, bucket_bytes=1).behind_weight_grads(n["op0"], reads) == 0.0
    # A reader that is not a linear layer, or a weight computed after the first reader: no call of
    # them all, so the all-reduce waits where it is issued.
    for case in ({"second_reader": torch.ops.aten.mm.default}, {"weight_after_first": True}):
        gm, strategies, n = _column_linears(**case)
        assert HidingWindows(gm, strategies, cm, {}, bucket_bytes=1).behind_weight_grads(
            n["op0"], [(n["op1"], 0), (n["op2"], 0)]) == 0.0, case

    # The replay of the same step, its all-reduce of 5 s read by both linears, hides it whole: the
    # credit is a lower estimate of it.
    gm, strategies, n = _column_linears()
    f = _coll("all_reduce", "backward", "op0", "op1", 5.0)
    w2 = _coll("all_reduce", "backward", "w2", "op4", 8.0, nbytes=8)
    ex = exposure(gm, {k: v[0] for k, v in strategies.items()} | {n[f"w{i}"]: _Plain() for i in range(3)},
                  [f, w2], cm, ["dp"], set(), bucket_bytes=1, behind_weight_grads={("op0", "op1"): ["op1", "op2"]})
    assert ex.exposed[0] == 0.0
    credit = min(5.0, HidingWindows(gm, strategies, cm, {}, bucket_bytes=1).behind_weight_grads(
        n["op0"], [(n["op1"], 0), (n["op2"], 0)]))
    assert 0.0 < credit <= ex.seconds[0] - ex.exposed[0]


def test_the_planner_chooses_the_gradient_bucket_size_its_replay_prices_fastest(tmp_path):
    """The bucket size is a plan decision (plan.bucket_mb): priced by the replay at each of
    BUCKET_CANDIDATES_MB on the solved layout, the fastest kept; a given size is priced as given; the
    plan file keeps it and refuses a bad one."""
    from torch import nn

    from autopar.passes.exposure import BUCKET_CANDIDATES_MB

    torch.manual_seed(0)
    model = nn.Sequential(*(nn.Linear(1024, 1024) for _ in range(4)), nn.MSELoss())

    class Loss(nn.Module):
        def __init__(self):
            super().__init__()
            self.layers = model[:4]

        def forward(self, x, y):
            return ((self.layers(x) - y) ** 2).mean()

    net = Loss()
    args = (torch.randn(256, 1024), torch.randn(256, 1024))
    cluster = autopar.ClusterSpec.local_cpu(2)
    whole = {"output": ["R"], "zero": 0}
    dp = {"*.weight": whole, "*.bias": whole, "x": ["S(0)"], "y": ["S(0)"], "linear*": ["S(0)"], "add*": ["S(0)"]}
    chosen = autopar.plan(net, cluster, args, pins=dp, recompute=False, progress=False)
    priced = chosen.solver["buckets"]
    assert set(priced) == {f"{mb:g}" for mb in BUCKET_CANDIDATES_MB}
    # Four 4 MiB weights: one 25 MiB bucket waits for the last gradient, smaller ones hide behind the
    # earlier layers' backward.
    assert chosen.bucket_mb < 25 and chosen.step_time == priced[f"{chosen.bucket_mb:g}"] == min(priced.values())
    assert priced["25"] > chosen.step_time
    given = autopar.plan(net, cluster, args, pins=dp, recompute=False, progress=False, bucket_mb=25)
    assert given.bucket_mb == 25 and given.params == chosen.params
    assert given.step_time == pytest.approx(priced["25"], rel=1e-9)
    assert f"gradient buckets: {chosen.bucket_mb:g} MiB" in chosen.summary()

    # The step memory model counts a bucket's copy at the bucket's size: with one 25 MiB bucket the last
    # copy holds every gradient beside its buffer, with 1 MiB ones a weight's at a time.
    small = autopar.plan(net, cluster, args, pins=dp, recompute=False, progress=False, bucket_mb=1)

    def copies(p):
        return [pt.transient for pt in p.memory.timeline if pt.node.startswith("gradient buckets after")]

    weight = 1024 * 1025 * 4         # a weight's gradient and its bias's, one bucket of 1 MiB or more
    assert max(copies(given)) - max(copies(small)) >= 2 * weight

    with pytest.raises(autopar.AutoparError, match="bucket_mb=-1"):
        autopar.plan(net, cluster, args, pins=dp, progress=False, bucket_mb=-1)

    path = tmp_path / "plan.json"
    chosen.save(path)
    assert autopar.Plan.load(path).bucket_mb == chosen.bucket_mb
    for bad in (-1, "6", True, float("nan")):
        d = chosen.to_dict()
        d["bucket_mb"] = bad
        with pytest.raises(autopar.PlanFormatError, match="bucket_mb"):
            autopar.Plan.from_dict(d)
