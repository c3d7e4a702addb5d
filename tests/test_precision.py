"""Mixed precision ("bf16-mixed"): autocast's casts written into the graph, checked against CPU autocast
itself; training on gloo ranks against eager single-process training under ``torch.autocast``; the
memory and cost models' view of each copy; bad names."""
from __future__ import annotations

import copy
import dataclasses
import json

import pytest
import torch
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.utils._python_dispatch import TorchDispatchMode

import autopar
from autopar.passes.precision import autocast_dtypes
from tests.distributed_utils import run_distributed
from tests.hf_models import MEGATRON, batch, build

aten = torch.ops.aten
STEPS = 4
# The promise for bf16-mixed losses against eager autocast over several steps.
LOSS_RTOL = 0.02
# bf16 keeps 8 significant bits (a relative rounding of 2^-9). A sharded plan sums partial products in
# another order and reduces partial gradients in bf16, so an entry may differ from eager autocast's by
# a few roundings of the largest entry: 2^-6 of it.
GRAD_TOL = 2.0 ** -6


class _Casts(TorchDispatchMode):
    """The dtype each of an op's tensor arguments is cast to by autocast, seen at dispatch."""

    def __init__(self, args):
        super().__init__()
        self.position = {id(a): k for k, a in enumerate(args)}
        self.casts = {}

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func is aten._to_copy.default and id(args[0]) in self.position:
            self.casts.setdefault(self.position[id(args[0])], (kwargs or {}).get("dtype"))
        return func(*args, **(kwargs or {}))


# Casts themselves (what they copy is no autocast cast) and export's checks.
_NOT_AUTOCAST = {aten._assert_tensor_metadata.default, aten._to_copy.default, aten.to.dtype, aten.to.dtype_layout,
                 aten.type_as.default}


def _converts_dtype(node):
    """An op given its output dtype (``to(device, dtype)``, ``_to_copy(dtype=)``): a conversion of its
    own, which autocast leaves alone, whether the dtype is passed by keyword or position."""
    for i, arg in enumerate(node.target._schema.arguments):
        if arg.name == "dtype":
            given = node.args[i] if i < len(node.args) else node.kwargs.get("dtype")
            return given is not None
    return False


@pytest.mark.parametrize("model_name", ["gpt", "gpt2", "llama", "bert"])
def test_the_cpu_casts_are_cpu_autocasts(model_name):
    """Every op of the captured model, run on fake tensors in bf16 and fp32 mixes under CPU autocast:
    the casts autocast makes are the ones the pass writes."""
    from autopar.passes.capture import capture

    model = build(model_name)
    ids, labels = batch()
    gm = capture(model, (ids,), {"labels": labels}).gm
    checked = 0
    with FakeTensorMode(allow_non_fake_inputs=True):
        for node in gm.graph.nodes:
            if node.op != "call_function" or not hasattr(node.target, "_schema"):
                continue
            if node.target in _NOT_AUTOCAST or _converts_dtype(node):
                continue
            tensors = [a for a in node.args if isinstance(a, torch.fx.Node) and isinstance(a.meta.get("val"), torch.Tensor)]
            if not any(t.meta["val"].is_floating_point() for t in tensors):
                continue
            for low in (False, True):      # every floating input fp32, then bf16
                def val(a):
                    if not isinstance(a, torch.fx.Node):
                        return a
                    v = a.meta["val"]
                    v = torch.empty(v.shape, dtype=v.dtype)
                    return v.to(torch.bfloat16) if low and v.is_floating_point() else v

                args = torch.fx.node.map_aggregate(node.args, val)
                kwargs = torch.fx.node.map_aggregate(node.kwargs, val)
                flat = [a for a in args if isinstance(a, torch.Tensor)]
                mode = _Casts(flat)
                with torch.autocast("cpu", torch.bfloat16), mode:
                    node.target(*args, **kwargs)
                have = [a.dtype if a.is_floating_point() else None for a in flat]
                want = autocast_dtypes(node.target, have, "cpu", torch.bfloat16)
                seen = [mode.casts.get(k, d) for k, d in enumerate(have)]
                assert seen == want, f"{node.format_node()}: autocast casts {seen}, the pass {want}"
                checked += 1
    assert checked > 20


def test_an_unknown_precision_is_refused_with_the_names():
    model = build("gpt")
    ids, labels = batch()
    with pytest.raises(ValueError, match=r"'fp8'.*'32-true', 'bf16-mixed', 'bf16-true'"):
        autopar.plan(model, autopar.ClusterSpec.local_cpu(2), (ids,), {"labels": labels}, precision="fp8",
                     progress=False)
    with pytest.raises(ValueError, match=r"float32 master weights|build the model in float32"):
        autopar.plan(copy.deepcopy(model).to(torch.bfloat16), autopar.ClusterSpec.local_cpu(2), (ids,),
                     {"labels": labels}, precision="bf16-mixed", progress=False)


def test_the_models_count_the_master_and_the_bf16_copy():
    """Offline: under bf16-mixed the parameters, gradients and Adam states are fp32 (4 + 4 + 8 bytes per
    parameter), matmuls are priced at bf16 FLOP/s, and bf16 activations make the saved bytes fewer."""
    model = build("llama")
    ids, labels = batch()
    cluster = autopar.ClusterSpec.preset("8xH100")
    n = sum(p.numel() for p in model.parameters())
    kw = dict(mesh_shape=(8,), pins={name: ["R"] for name, _ in model.named_parameters()}, progress=False,
              recompute=False)
    fp32 = autopar.plan(model, cluster, (ids,), {"labels": labels}, **kw)
    mixed = autopar.plan(model, cluster, (ids,), {"labels": labels}, precision="bf16-mixed", **kw)
    assert mixed.precision == "bf16-mixed" and fp32.precision == "32-true"
    assert (mixed.memory["params"], mixed.memory["grads"], mixed.memory["optimizer"]) == (4 * n, 4 * n, 8 * n)
    assert mixed.memory["activations"] < fp32.memory["activations"]
    mm = [x for x in mixed.nodes if x["op"] == "linear.default"]
    ref = {x["name"]: x for x in fp32.nodes}
    assert mm and all(x["compute_seconds"] < ref[x["name"]]["compute_seconds"] for x in mm)


def test_gradients_summed_in_float32_are_priced_and_recorded_so():
    """Offline, LLaMA on 2 ranks under bf16-mixed, the batch split: summed in float32 (the default) each
    weight's gradient all-reduce moves its float32 bytes, twice what ``reduce_dtype="bfloat16"`` moves;
    the other reductions and the forward do not change; the plan records the choice, and its JSON
    keeps it."""
    from tests.memory_cases import build as build_case, options

    model, args, kwargs = build_case("llama", 32, 4, "cpu")
    kw = {**options("llama", "dp-bf16", 2, model), "progress": False}
    cluster = autopar.ClusterSpec.local_cpu(2)
    plans = {rd: autopar.plan(model, cluster, args, kwargs, reduce_dtype=rd, **kw)
             for rd in (None, "bfloat16", "float32")}
    assert [p.reduce_dtype for p in plans.values()] == ["float32", "bfloat16", "float32"]
    assert plans[None].collectives == plans["float32"].collectives

    def by_value(plan, phase):
        return {(c.value, c.kind): c.bytes for c in plan.collectives if c.phase == phase}

    bf16, fp32 = by_value(plans["bfloat16"], "backward"), by_value(plans["float32"], "backward")
    graph_copies = {c.value for c in plans["float32"].collectives if c.value.startswith("_to_copy")}
    assert graph_copies and bf16.keys() == fp32.keys()
    for key, nbytes in fp32.items():
        assert nbytes == (2 if key[0] in graph_copies else 1) * bf16[key], key
    # Each projection's weight, read by its matmul only through its bfloat16 copy, is reduced once,
    # in float32: 4 bytes per element.
    projections = [p.numel() for f, p in model.named_parameters() if f.endswith(("proj.weight", "lm_head.weight"))]
    assert sorted(fp32[key] // 4 for key in fp32 if key[0] in graph_copies) == sorted(projections)
    assert by_value(plans["bfloat16"], "forward") == by_value(plans["float32"], "forward")
    assert autopar.Plan.from_dict(json.loads(plans["float32"].to_json())).reduce_dtype == "float32"
    assert "gradients summed in float32" in plans["float32"].summary()


def test_a_reduce_dtype_a_precision_does_not_offer_is_refused_with_the_choices():
    model = build("gpt")
    ids, labels = batch()
    cluster = autopar.ClusterSpec.local_cpu(2)
    with pytest.raises(ValueError, match=r"reduce_dtype='float16'.*'float32' or 'bfloat16'"):
        autopar.plan(model, cluster, (ids,), {"labels": labels}, precision="bf16-mixed", reduce_dtype="float16",
                     progress=False)
    with pytest.raises(ValueError, match=r"reduce_dtype='bfloat16'.*in 'float32' \(only mixed precision"):
        autopar.plan(model, cluster, (ids,), {"labels": labels}, reduce_dtype="bfloat16", progress=False)


def _llama_sharded_masters(stage: int, reduce_dtype=None):
    """Offline, LLaMA on 8xH100 under bf16-mixed with every parameter ZeRO-``stage``: (the plan, the
    parameters' sizes, those whose float32 master it shards, their elements, the others' elements)."""
    model = build("llama")
    ids, labels = batch()
    pins = {name: {"output": ["R"], "zero": stage} for name, _ in model.named_parameters()}
    plan = autopar.plan(model, autopar.ClusterSpec.preset("8xH100"), (ids,), {"labels": labels}, mesh_shape=(8,),
                        pins=pins, progress=False, recompute=False, precision="bf16-mixed", reduce_dtype=reduce_dtype)
    sizes = dict((name, p.numel()) for name, p in model.named_parameters())
    assert {z.stage for z in plan.zero.values()} == {stage}
    sharded = {f for f, z in plan.zero.items() if z.sharded_master}
    assert {f for f in sizes if f.endswith(("proj.weight", "lm_head.weight"))} <= sharded
    assert not any("norm" in f for f in sharded)
    for f in sharded:
        assert plan.memory["by_param"][f] == (2 + 12 / 8 + 4 / 8) * sizes[f], f
    n_s = sum(sizes[f] for f in sharded)
    return plan, sizes, sharded, n_s, sum(sizes.values()) - n_s


def test_zero1_shards_the_float32_master_of_each_weight_read_through_its_copy():
    """Offline, LLaMA on 8xH100 under bf16-mixed ZeRO-1: a weight read only through its bfloat16 copy
    holds that copy whole and its float32 master, Adam's states and its gradient at 1/8 (2 + 12/N bytes
    per parameter with the master among ZeRO's K = 12, and a 4/N float32 gradient block), and its updated
    blocks are all-gathered in bfloat16; the norms, read in float32 on a GPU, keep their weight whole
    (4 + 4 + 8/N). The plan's memory model counts every rank's bytes so."""
    plan, sizes, sharded, n_s, n_w = _llama_sharded_masters(1)
    assert (plan.memory["params"], plan.memory["grads"], plan.memory["optimizer"]) == \
        (2 * n_s + 4 * n_s / 8 + 4 * n_w, 4 * n_s / 8 + 4 * n_w, 8 * (n_s + n_w) / 8)
    gathered = sum(c["bytes"] for c in plan.collectives if c["step"] == "zero1")
    assert gathered == 2 * n_s + 4 * n_w


def test_zero2_reduce_scatters_the_bf16_gradient_of_each_weight_read_through_its_copy():
    """Offline, LLaMA on 8xH100 under bf16-mixed ZeRO-2 (Megatron-LM's distributed optimizer with its
    gradients reduce-scattered): a weight read only through its bfloat16 copy holds what it holds under
    ZeRO-1 (2 + 12/N + 4/N bytes per parameter); its copy's gradient is reduce-scattered in float32 (the
    default) or, with ``reduce_dtype="bfloat16"``, in bfloat16 (half the bytes), in place of any
    all-reduce, and the updated blocks all-gathered in bfloat16. The norms, read in float32 on a GPU,
    are ZeRO-2 over their float32 weight, held whole (4 + 4/N + 8/N bytes), and reduce-scatter its
    float32 gradient."""
    for reduce_dtype, copies_bytes in (("bfloat16", 2), (None, 4)):
        plan, sizes, sharded, n_s, n_w = _llama_sharded_masters(2, reduce_dtype)
        assert (plan.memory["params"], plan.memory["grads"], plan.memory["optimizer"]) == \
            (2 * n_s + 4 * n_s / 8 + 4 * n_w, 4 * (n_s + n_w) / 8, 8 * (n_s + n_w) / 8)
        scattered = {c["value"]: c["bytes"] for c in plan.collectives
                     if c["step"] == "zero2" and c["kind"] == "reduce_scatter"}
        for f in sizes:
            assert scattered["p_" + f.replace(".", "_")] == (copies_bytes if f in sharded else 4) * sizes[f], f
    assert not [c for c in plan.collectives if c["kind"] == "all_reduce" and c["phase"] == "backward"]
    gathered = sum(c["bytes"] for c in plan.collectives if c["step"] == "zero2" and c["kind"] == "all_gather")
    assert gathered == 2 * n_s + 4 * n_w


def _train(rank, world, cases):
    import autopar
    from autopar.errors import PlanFormatError
    from torch.distributed.tensor import DTensor

    for model_name, kind, mesh, *reduce in cases:
        reduce_dtype = reduce[0] if reduce else None
        cluster = autopar.ClusterSpec.local_cpu(world)
        if kind in ("dp buckets", "megatron x dp"):
            # Links fast enough that splitting the batch pays: every weight's gradient is synced.
            cluster = dataclasses.replace(cluster, intra_node_bandwidth=1e13, intra_node_latency=1e-9)
        torch.manual_seed(0)
        model = build(model_name)
        ref = copy.deepcopy(model)
        ids, labels = batch()
        params = dict(model.named_parameters())
        pins = {"dp": {n: ["R"] * len(mesh) for n in params},
                "megatron": {k: [v] for k, v in MEGATRON[model_name].items()},
                # Megatron's layout on the second axis, the batch split on the first: the weights'
                # gradients are reduced over dp, in bfloat16, in the runtime's buckets.
                "megatron x dp": {**{k: {"output": ["R", v], "zero": 0} for k, v in MEGATRON[model_name].items()},
                                  "input_ids": ["S(0)", "R"], "labels": ["S(0)", "R"]},
                "zero3": {n: ["S(0)"] if p.shape[0] % world == 0 else ["R"] for n, p in params.items()},
                # ZeRO-1 everywhere: the float32 masters of the weights read only through their
                # bfloat16 copy are sharded (Megatron's distributed optimizer).
                "zero1": {n: {"output": ["R"] * len(mesh), "zero": 1} for n in params},
                # ZeRO-2 layer matrices: the bfloat16 gradient of each copy is reduce-scattered into the
                # block of its float32 master; the embeddings (read by a lookup whose work is not split
                # on the batch), biases and norms plain data parallel.
                "zero2": {n: {"output": ["R"] * len(mesh), "zero": 2 if p.dim() > 1 and "emb" not in n else 0}
                          for n, p in params.items()},
                "auto": {},
                # Plain data parallelism, the batch split: each weight read through its bfloat16 copy
                # has its gradient reduced once, in bfloat16, in the runtime's buckets.
                "dp buckets": {"*.weight": {"output": ["R"], "zero": 0}, "*.bias": {"output": ["R"], "zero": 0},
                               "input_ids": ["S(0)"], "labels": ["S(0)"], "linear*": ["S(0)"],
                               "layer_norm*": ["S(0)"]},
                # Replicated weights, the batch split on dp: every gradient is synced over dp.
                "pp x dp": {"*.weight": ["R", "R"], "input_ids": ["R", "S(0)"], "labels": ["R", "S(0)"],
                            "embedding": ["R", "S(0)"], "linear*": ["R", "S(0)"]}}[kind]
        pipeline = {"axis_names": ("pp", "dp"), "microbatches": 2, "schedule": "1F1B"} if kind == "pp x dp" else {}
        summed_in = reduce_dtype or "float32"
        where = f"{model_name} {kind} on mesh {mesh}, gradients summed in {summed_in}"
        pm = autopar.compile(model, cluster, (ids,), {"labels": labels}, mesh_shape=mesh, pins=pins,
                             precision="bf16-mixed", kernels="aten", recompute=False, reduce_dtype=reduce_dtype,
                             **pipeline)
        assert pm.plan.reduce_dtype == summed_in, where
        if summed_in == "float32":
            _check_summed_in_float32(pm, kind, where)
            with pytest.raises(PlanFormatError, match="reduce_dtype='bfloat16' but the plan sums gradients in float32"):
                autopar.compile(ref, cluster, (ids,), {"labels": labels}, plan=pm.plan, reduce_dtype="bfloat16")
        if pipeline:
            _check_gradient_sync_once_per_step(pm, where)
        else:
            assert "torch.bfloat16" in pm.code, where
        assert all(p.dtype == torch.float32 for p in pm.parameters()), f"{where}: master weights are fp32"
        if kind in ("zero1", "zero2"):
            _check_sharded_masters(pm, world, where)
        if kind in ("dp buckets", "megatron x dp") and summed_in == "bfloat16":
            narrowed = [t for t, _, _, dtype in pm._program.grad_reductions if dtype == torch.bfloat16]
            mlp = ".mlp.up_proj.weight" if model_name == "llama" else ".mlp.fc1.weight"
            assert any(t.endswith(mlp) for t in narrowed), f"{where}: {pm._program.grad_reductions}"
        opt = torch.optim.AdamW(pm.parameters(), lr=1e-3)
        ref_opt = torch.optim.AdamW(ref.parameters(), lr=1e-3)
        for step in range(STEPS):
            if pipeline:
                loss = pm.train_step(ids, labels=labels)
            else:
                out = pm(ids, labels=labels)
                out.loss.backward()
                loss = out.loss
            with torch.autocast("cpu", torch.bfloat16):
                ref_out = ref(ids, labels=labels)
            ref_out.loss.backward()
            assert pipeline or out.logits.dtype == ref_out.logits.dtype == torch.bfloat16, where
            assert abs(loss.item() / ref_out.loss.item() - 1) <= LOSS_RTOL, \
                f"{where}: step {step} loss {loss.item()} vs eager autocast {ref_out.loss.item()}"
            if step == 0:
                scale = max(p.grad.abs().max().item() for p in ref.parameters())
                mesh_of = pm._stage_mesh() if pipeline else pm.mesh
                for fqn, p in ref.named_parameters():
                    if pipeline and fqn not in pm._held:
                        continue          # on another rank's stage
                    local = pm.local_parameter(fqn)
                    assert local.grad.dtype == torch.float32, where
                    lay = [x.to_dtensor() for i, x in enumerate(pm.state_layout(fqn)) if not pipeline or i != pm.pp_axis]
                    grad = DTensor.from_local(local.grad, mesh_of, lay, run_check=False).full_tensor()
                    err = (grad - p.grad).abs().max().item()
                    assert err <= GRAD_TOL * scale, f"{where}: gradient of {fqn} off by {err} (largest {scale})"
            opt.step(), ref_opt.step()
            opt.zero_grad(), ref_opt.zero_grad()


def _check_summed_in_float32(pm, kind, where):
    """With ``reduce_dtype="float32"`` no weight's gradient is summed in bfloat16: the buckets hold the
    float32 gradients as they are, a reduction the program keeps (ZeRO-1 over a sharded master) widens
    its copy's gradient around the collective, and ZeRO-2 widens a copy's gradient before its
    reduce-scatter."""
    from autopar.runtime.collectives import all_gather, grad_all_reduce

    assert all(dtype is None for *_, dtype in pm._program.grad_reductions), f"{where}: {pm._program.grad_reductions}"
    reductions = [n for n in pm._program.gm.graph.nodes if n.op == "call_function"
                  and n.target in (grad_all_reduce, all_gather) and n.kwargs.get("reduce_dtype") is not None]
    assert all(n.kwargs["reduce_dtype"] == torch.float32 for n in reductions), where
    if kind == "dp buckets":
        mlp = [t for t, *_ in pm._program.grad_reductions if t.endswith(".mlp.fc1.weight")]
        assert mlp, f"{where}: {pm._program.grad_reductions}"
    if kind == "zero1":
        assert reductions, f"{where}: no reduction of a copy's gradient is widened\n{pm.code}"
    if kind == "zero2":
        widened = [s.fqn for s in pm._sharded_states.states if s.reduce_dtype == torch.float32]
        assert any(f.endswith("mlp.fc1.weight") for f in widened), f"{where}: {widened}"


def _check_sharded_masters(pm, world, where):
    """Each weight read only through its bfloat16 copy keeps that copy whole and its float32 master at
    1/world of it (the block the optimizer steps); the others (norms, read in float32 on CPU, and the
    tied embedding) keep their float32 weight whole."""
    sharded = [fqn for fqn, z in pm.plan.zero.items() if z.sharded_master]
    assert any(fqn.endswith("mlp.fc1.weight") for fqn in sharded), f"{where}: {sharded}"
    for fqn in pm.plan.params:
        whole, master = pm.local_tensor(fqn), pm.local_parameter(fqn)
        if fqn in sharded:
            assert whole.dtype == torch.bfloat16 and master.dtype == torch.float32, where
            assert master.numel() * world == whole.numel(), f"{where}: {fqn}'s master is held whole"
            assert master.untyped_storage().data_ptr() != whole.untyped_storage().data_ptr(), where
        else:
            assert whole.dtype == torch.float32, where


def _check_gradient_sync_once_per_step(pm, where):
    """A pipeline's stages reduce no parameter's gradient (nor its bfloat16 copy's) over dp in each
    microbatch: each weight's float32 gradient is summed once per step."""
    from autopar.passes.precision import cast_source
    from autopar.runtime.collectives import grad_all_reduce

    for st in pm._stage_programs:
        params = {n for n, (kind, _) in zip(st.gm.graph.find_nodes(op="placeholder"), st.placeholders)
                  if kind == "param"}
        reduced = [n.args[0] for n in st.gm.graph.nodes if n.op == "call_function" and n.target is grad_all_reduce]
        copies = [v for v in reduced if v in params or cast_source(v) in params]
        assert not copies, f"{where}: stage {st.index} reduces {copies} in every microbatch"
        held = {fqn for kind, fqn in st.placeholders if kind == "param" and fqn.endswith(".weight")}
        assert held <= {fqn for fqn, axis, _ in st.grad_sums if axis == "dp"}, f"{where}: stage {st.index}"


def test_bf16_mixed_trains_like_eager_autocast_on_two_ranks():
    """Gradients summed in bfloat16 (``reduce_dtype``): the weights' bfloat16 gradients in the runtime's
    buckets, each copy's reduced in the program."""
    run_distributed(_train, 2, [("gpt", "dp", (2,), "bfloat16"), ("gpt", "dp buckets", (2,), "bfloat16"),
                                ("llama", "megatron", (2,), "bfloat16"), ("gpt2", "zero3", (2,), "bfloat16")],
                    timeout=600)


def test_bf16_mixed_zero1_and_zero2_shard_the_master_weights_and_train_like_eager_autocast_on_two_ranks():
    """Summed in bfloat16: ZeRO-1's copies all-reduced, ZeRO-2's reduce-scattered, in bfloat16."""
    run_distributed(_train, 2, [("gpt", "zero1", (2,), "bfloat16"), ("gpt", "zero2", (2,), "bfloat16")], timeout=600)


def test_bf16_mixed_trains_like_eager_autocast_on_four_ranks():
    run_distributed(_train, 4, [("llama", "auto", (2, 2)), ("llama", "pp x dp", (2, 2)), ("gpt", "zero1", (4,))],
                    timeout=600)


def test_bf16_mixed_bucketed_zero2_and_megatron_x_dp_train_like_eager_autocast_on_four_ranks():
    """Data parallelism with the weights' bfloat16 gradients in the runtime's buckets, ZeRO-2 over
    sharded float32 masters, Megatron's layout beside data parallelism and a pipeline beside it (its
    once-a-step sync narrowed) on a 2 x 2 mesh, all summing in bfloat16."""
    run_distributed(_train, 4, [("gpt", "dp buckets", (4,), "bfloat16"), ("gpt", "zero2", (4,), "bfloat16"),
                                ("llama", "megatron x dp", (2, 2), "bfloat16"), ("llama", "pp x dp", (2, 2), "bfloat16")],
                    timeout=600)


def test_bf16_mixed_gradients_summed_in_float32_train_like_eager_autocast_on_two_ranks():
    """Gradients summed in float32, the default (Megatron-LM's and torchtitan's choice): data
    parallelism's buckets hold the weights' float32 gradients, ZeRO-1 over sharded masters widens each
    copy's gradient around its all-reduce, ZeRO-2 before its reduce-scatter, ZeRO-3 and Megatron's
    layout around theirs."""
    run_distributed(_train, 2, [("gpt", "dp buckets", (2,)), ("gpt", "zero1", (2,)), ("gpt", "zero2", (2,)),
                                ("gpt2", "zero3", (2,), "float32"), ("llama", "megatron", (2,))], timeout=600)
