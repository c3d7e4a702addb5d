"""The memory budget is a promise: the predicted peak per device matches the measured peak of live
tensors on real gloo ranks within 10%, and no returned plan's predicted peak exceeds its budget."""
from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import autopar
from autopar.errors import InfeasiblePlanError
from tests.distributed_utils import run_distributed

TOLERANCE = 0.10
# A case may end with options: "tokens" (sequence, batch) other than 32 x 4, and "strict": held to the
# 5% aim and, under a budget, measured within it (LLaMA's Megatron plan at 1.05x the smallest feasible budget,
# at 64 x 8 tokens, reads its logits through an all-to-all to the vocab-parallel loss's layout and a
# view of that copy, which the loss keeps: 1.052x its prediction and 1.037x its budget while the copy
# was counted as a transient), "within": a tolerance tighter still, "fits": measured within its budget
# (held to 10%), "zero": a ZeRO
# stage the plan must use (the case is there for it), "overlap" and "reduce_dtype": compile's (and plan's)
# options, and "kernels": the backend (ATen unless it says so).
AIM = 0.05


def _smallest(model, cluster, args, kwargs, opts) -> float:
    with pytest.raises(InfeasiblePlanError) as e:
        autopar.plan(model, cluster, args, kwargs, memory_budget=1.0, progress=False, **opts)
    return e.value.min_feasible_budget


def _measure(rank, world, cases):
    from tests.live_memory import step_peak_over_ranks
    from tests.memory_cases import build, options

    cluster = autopar.ClusterSpec.local_cpu(world)
    failures = []
    for arch, kind, factor, *extra in cases:
        case = next((e for e in extra if isinstance(e, dict)), {})
        precision = [e for e in extra if isinstance(e, str)]
        strict = case.get("strict", False)
        fits = (strict or case.get("fits", False)) and factor is not None
        model, args, kwargs = build(arch, *case.get("tokens", (32, 4)), "cpu")
        opts = options(arch, kind, world, model)
        if precision:
            opts = {**opts, "precision": precision[0]}
        if "overlap" in case:
            opts = {**opts, "overlap": case["overlap"]}
        if "reduce_dtype" in case:
            opts = {**opts, "reduce_dtype": case["reduce_dtype"]}
        opts = {**opts, "kernels": case.get("kernels", "aten")}
        budget = [None]
        if factor is not None and rank == 0:
            budget = [factor * _smallest(model, cluster, args, kwargs, opts)]
        dist.broadcast_object_list(budget, src=0)
        pm = autopar.compile(model, cluster, args, kwargs, memory_budget=budget[0], **opts)
        assert bool(pm.kernels) == (opts["kernels"] == "triton"), (arch, kind, opts["kernels"])
        opt = torch.optim.AdamW(pm.parameters(), lr=1e-3)

        def step():
            out = pm(*args, **kwargs)
            (out if isinstance(out, torch.Tensor) else out.loss).backward()
            opt.step()
            opt.zero_grad()

        step()
        peak = step_peak_over_ranks(pm, opt, step, inputs=(args, kwargs))
        predicted = pm.plan.memory["peak"]
        if budget[0] is not None:
            assert predicted <= budget[0], (arch, kind, predicted, budget[0])
        if "zero" in case:
            stages = {stage for stage, _ in pm.plan.zero_stages().values()}
            assert case["zero"] in stages, (arch, kind, budget[0], stages)
        if abs(peak / predicted - 1) > case.get("within", AIM if strict else TOLERANCE) or (fits and peak > budget[0]):
            failures.append(f"{arch} {kind} budget {budget[0]}: predicted {predicted:.0f} B, measured "
                            f"{peak:.0f} B ({peak / predicted:.3f}x)" + (f", {peak / budget[0]:.3f}x the budget"
                                                                          if budget[0] else ""))
    assert not failures, "\n".join(failures)


@pytest.mark.parametrize("cases", [
    [("gpt2", "dp", None), ("llama", "megatron", None), ("bert", "zero3", None), ("gpt", "megatron", None)],
    [("gpt", "vocab", None), ("gpt2", "recompute", None), ("llama", "sharded-outputs", None),
     ("qwen2", "zero3", None)],
    # ZeRO-2 matrices beside replicated biases in recomputed layers: a matrix's reduce-scatter is waited
    # at the next matrix's, which the model counted until backward's end where a bias came between
    # (0.893x).
    [("gpt2", "zero2-recompute", None, {"tokens": (64, 8), "strict": True})],
    [("llama", "megatron", 1.05, {"tokens": (64, 8), "strict": True}), ("gpt", "auto", 1.5), ("gpt2", "auto", 1.05),
     ("qwen2", "auto", 1.05)],
    # bench/train_cpu.py's built-in GPT (4 layers of width 256, vocabulary 2048, 8 x 128 tokens) at 1.05x
    # its smallest feasible budget: the solver's own plan shards the query, key and value weights'
    # gradients and states (ZeRO-2), the attention output projections and the position embedding
    # (ZeRO-3) and recomputes every layer; its peak is at the end of forward, the measured one in the
    # first layer's recomputation, at the MLP output's reduce-scatter.
    [("gpt-probe", "auto", 1.05, {"tokens": (128, 8), "strict": True, "zero": 2})],
    # GPT-2's own plan at 1.05x its smallest feasible budget, at 128 x 8 tokens: ZeRO-2 weights (at 64 x 8
    # it shards with ZeRO-1 and ZeRO-3 only, since the solver charges a bucketed ZeRO-1 gradient its share
    # of the bucket's latency). A ZeRO-2 reduce-scatter is waited at the next one's issue, so the whole
    # gradient and the all-to-all's output of a layer's attention weight stay through the next
    # recomputed layer's MLP backward: at 64 x 8, 1.020x its budget while the model freed them at the issue.
    [("gpt2", "auto", 1.05, {"tokens": (128, 8), "strict": True, "zero": 2})],
    # The built-in GPT's own plan at 1.05x its smallest feasible budget, at 64 x 8 tokens: every layer
    # recomputed. Its step peaks in the second layer's recomputation, at the MLP output's reduce-scatter
    # (on gloo an all-to-all of the stacked blocks): 1.015x its budget while the working set of a
    # recomputed layer's forward and a resharding's collective buffers were not counted.
    [("gpt", "auto", 1.05, {"tokens": (64, 8), "fits": True})],
    # Every layer recomputed under ZeRO-3 and Megatron pins, at 64 x 8 tokens: the copy of a layer norm's
    # output that the query, key and value projections share, and a value kept only where its reader
    # reads no copy, were held through forward, and the tied embedding's gradient block counted from the
    # head's backward, where it accumulates whole until the embedding's (the built-in GPT under ZeRO-3
    # 0.899x, LLaMA under Megatron 0.904x). An add's inputs that share its output's gradient were each
    # counted a gradient of their own (GPT 0.970x, BERT 0.954x). GPT measured 0.990x with that fixed; the
    # solver's credit for Megatron's "f" (4ac24ed) then moved its plan from a split batch to
    # column-parallel layers that gather their inputs (S(0) weights read in place), where the model
    # held a gathered value through its all-gather's contiguous copy and counted the reader's output
    # beside the collective's received blocks (0.974x); the wait drops the value and the blocks go
    # before the reader runs (1.000x). The planner now keeps the split batch, which the replay prices
    # faster than the column split the credits chose (mesh_search.replay_cheapest): 0.990x.
    [("gpt", "zero3-recompute", None, {"tokens": (64, 8), "within": 0.02}),
     ("bert", "zero3-recompute", None, {"tokens": (64, 8), "within": 0.04}),
     ("llama", "megatron-recompute", None, {"tokens": (64, 8), "strict": True})],
    # compile(overlap=False) makes no gradient bucket: bench/train_cpu.py's built-in GPT, data parallel,
    # measured 0.896x its prediction while the model counted one. Its gather of the vocab-parallel logits
    # waits where it is issued, holding its input through the contiguous copy of the gathered blocks:
    # 1.173x while the model dropped the input first, as the split collective's wait does.
    [("gpt-probe", "dp", None, {"tokens": (64, 8), "overlap": False}),
     ("gpt-vocab", "vocab", None, {"overlap": False, "strict": True})],
    # ZeRO-1 in float32: each whole gradient all-reduced in the runtime's buckets, the optimizer's block a
    # view of it (GPT-2's tied embedding, also read in chunks, keeps its reductions in the program).
    [("gpt", "zero1", None, {"tokens": (64, 8), "strict": True, "zero": 1}),
     ("gpt2", "zero1", 1.05, {"fits": True, "zero": 1})],
], ids=["no-budget-a", "no-budget-b", "zero-2-recompute", "tight-budget", "tight-budget-zero-2", "tight-budget-gpt2-zero-2",
        "tight-budget-gpt", "recomputed", "no-overlap", "zero-1"])
def test_predicted_peak_matches_measured_on_two_ranks(cases):
    run_distributed(_measure, 2, cases, timeout=600)


def test_two_d_plan_under_a_tight_budget_is_predicted_within_10_percent_on_four_ranks():
    """A 2 x 2 mesh (data parallel over Megatron pins) of the built-in GPT at 1.05x its smallest feasible
    budget: the plan's predicted peak is within the budget, the measured peak within 10% of it and
    within the budget."""
    run_distributed(_measure, 4, [("gpt", "2d", 1.05, {"fits": True})], timeout=600)


def test_bf16_mixed_and_the_vocab_parallel_loss_predicted_peaks_match_measured_on_two_ranks():
    """bf16-mixed: fp32 master weights, gradients and Adam states, bf16 copies of the weights and bf16
    activations. A vocabulary of 32768 on a one-layer model: the vocab-parallel loss's logits, their
    gradient and the loss's buffers are most of the peak, with the logits kept sharded or gathered
    (their all-gather, issued when they are computed, holds its input until its wait, where the
    contiguous copy is made), or made whole and sliced to the loss (the slice's backward gathers their
    gradient along the vocabulary). The loss reads a copy of its logits (a reshape of the shifted rows,
    and under bf16-mixed the fp32 upcast of it) and keeps that copy, no log-softmax, for backward.
    Data parallel over a split batch ("dp-bf16") summing in bfloat16: the weights' bfloat16 gradients in
    the runtime's buckets, each float32 gradient let go while its bucket is in flight."""
    run_distributed(_measure, 2, [("gpt2", "dp", None, "bf16-mixed"), ("llama", "megatron", None, "bf16-mixed"),
                                  ("gpt", "dp-bf16", None, {"strict": True, "reduce_dtype": "bfloat16"}),
                                  ("llama", "dp-bf16", None, {"strict": True, "reduce_dtype": "bfloat16"}),
                                  ("gpt", "zero3", 1.05, "bf16-mixed"), ("gpt-vocab", "vocab-sharded-outputs", None),
                                  ("gpt-vocab", "vocab-sharded-outputs", None, "bf16-mixed"),
                                  ("gpt-vocab", "vocab", None, "bf16-mixed"), ("gpt-vocab", "vocab-sliced", None)],
                    timeout=600)


def test_bf16_mixed_zero1_and_zero2_with_sharded_masters_predicted_peaks_match_measured_on_two_ranks():
    """bf16-mixed ZeRO-1 whose weights are read only through their bfloat16 copies: each rank holds the
    copies whole and the float32 masters, Adam's states and the gradients at half (2 + 12/N + 4/N bytes
    per parameter); a model that held the masters whole (4 + 4 + 8/N, and the copies beside them in the
    step) predicts a peak about 1.3x the measured one. ZeRO-2 holds the same, and reduce-scatters each
    copy's bfloat16 gradient in backward (held, with the collective's output, until the next one's
    issue). All summing in bfloat16 (``reduce_dtype``; float32 below)."""
    bf16 = {"reduce_dtype": "bfloat16"}
    run_distributed(_measure, 2, [("gpt", "zero1-bf16", None, {"strict": True, **bf16}),
                                  ("llama", "zero1-bf16", None, {"strict": True, **bf16}),
                                  ("gpt2", "zero1-bf16", 1.05, {"fits": True, **bf16}),
                                  ("gpt", "zero2-bf16", None, {"strict": True, "zero": 2, **bf16}),
                                  ("llama", "zero2-bf16", None, {"tokens": (128, 8), "strict": True, "zero": 2, **bf16})],
                    timeout=600)


def test_bf16_mixed_gradients_summed_in_float32_predicted_peaks_match_measured_on_two_ranks():
    """Gradients summed in float32, bf16-mixed's default: the runtime's buckets hold the weights' float32
    gradients as they are (no bfloat16 copy of them, no widening after), ZeRO-2 widens each copy's
    bfloat16 gradient before its reduce-scatter, whose buffers are then float32, and ZeRO-1 over
    sharded masters widens around each copy's all-reduce."""
    run_distributed(_measure, 2, [("gpt", "dp-bf16", None, {"strict": True}),
                                  ("llama", "dp-bf16", None, {"strict": True}),
                                  ("gpt", "zero1-bf16", 1.05, {"fits": True}),
                                  ("llama", "zero2-bf16", None, {"tokens": (128, 8), "strict": True, "zero": 2})],
                    timeout=600)


def _ring_working_sets(rank, world, cases):
    from autopar.layout import S
    from autopar.passes.rules import context_for
    from autopar.passes.rules.nn import _ring_peaks
    from autopar.runtime.context_parallel import ring_attention
    from tests.live_memory import LiveBytes
    from tests.reference_executor import single_op_node

    failures = []
    for heads, kv_heads, form, dtype in cases:
        batch, seq, dim, local = 2, 256, 16, 256 // world
        g = torch.Generator().manual_seed(rank)
        # As a model gives them: views of [B, S, H, D] projections, the output gradient likewise.
        q, k, v = (torch.randn(batch, local, h, dim, generator=g).to(dtype).requires_grad_()
                   for h in (heads, kv_heads, kv_heads))
        mask = torch.ones(batch, 1, local, seq, dtype=torch.bool).tril(rank * local) if form == "mask" else None
        dout = torch.randn(batch, local, heads, dim, generator=g).to(dtype).transpose(1, 2)
        mode = LiveBytes()
        with mode:
            mode.hold(q, k, v, mask, dout)
            start = mode.live
            out = ring_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), mask, form == "causal",
                                 None, dist.group.WORLD.group_name)
            forward = mode.peak - start
            mode.peak = before = mode.live
            torch.autograd.grad(out, (q, k, v), dout)
            backward = mode.peak - before
        measured = torch.tensor([forward, backward], dtype=torch.float64)
        dist.all_reduce(measured, op=dist.ReduceOp.MAX)

        meta = [torch.empty(batch, h, seq, dim, dtype=dtype, device="meta") for h in (heads, kv_heads, kv_heads)]
        extra = (torch.empty(batch, 1, seq, seq, dtype=torch.bool, device="meta"),) if form == "mask" else \
            (None, 0.0, form == "causal")
        node = single_op_node(torch.ops.aten.scaled_dot_product_attention.default, (*meta, *extra),
                              {"enable_gqa": heads != kv_heads})
        predicted = _ring_peaks(context_for(node), [(S(2),)] * (4 if form == "mask" else 3), (world,))
        for phase, m, p in zip(("forward", "backward"), measured.tolist(), predicted):
            if abs(m / p - 1) > 0.05:
                failures.append(f"{heads} heads, {kv_heads} KV heads, {form}, {dtype}: {phase} predicted {p:.0f} B, "
                                f"measured {m:.0f} B ({m / p:.3f}x)")
    assert not failures, "\n".join(failures)


def _ring_memory(rank, world, working_sets, steps):
    _ring_working_sets(rank, world, working_sets)
    _measure(rank, world, steps)


RING_WORKING_SETS = [(4, 4, "causal", torch.float32), (4, 2, "causal", torch.bfloat16), (4, 2, "mask", torch.float32),
                     (4, 1, "mask", torch.float32), (4, 4, "none", torch.float32), (4, 1, "causal", torch.float32)]


@pytest.mark.parametrize("world", [2, 4])
def test_ring_attention_predicted_memory_matches_measured(world):
    """Ring attention's working sets: what it allocates beyond its inputs at its forward and backward
    peaks (the rule's memory hooks' figures, before the timeline subtracts what it counts itself)
    against live bytes on gloo ranks within 5%, causal (balanced), explicit mask and no mask, with GQA
    and MQA, fp32 and bf16. Then a whole step of one long sequence split over the ranks with the
    built-in GPT's causal attention as a ring (load-balanced half-chunks), whose peak is in the ring's
    backward, within 10%. And attention split by heads: on 2 ranks LLaMA's, given a boolean mask,
    keeps a copy of it made additive in the query's dtype; on 4 the built-in GPT's q, k and v
    projections keep one all-gathered input between them (one copy, as the runtime shares it)."""
    heads = ("llama-long", "heads", None) if world == 2 else ("gpt-long", "heads", None)
    run_distributed(_ring_memory, world, RING_WORKING_SETS, [("gpt-long", "ring", None), heads], timeout=600)


def test_a_loss_reading_the_gathered_logits_reads_the_returned_copy():
    """bench/long_seq.py's GPT (vocabulary 256, one sequence of 2048 tokens split over 2 ranks, attention
    as a ring): the logits are gathered whole once, returned and read by the loss; the model counted a
    copy for each (0.885x measured over predicted), one now, within 2%."""
    run_distributed(_measure, 2, [("gpt-seq", "ring", None, {"strict": True})], timeout=600)


@pytest.fixture(scope="module")
def gpt2_bounds():
    """A small GPT-2 on 4 CPU ranks: its smallest feasible budget and its peak with no budget."""
    from tests.memory_cases import build

    model, args, kwargs = build("gpt2", 64, 8, "cpu")
    cluster = autopar.ClusterSpec.local_cpu(4)
    smallest = _smallest(model, cluster, args, kwargs, {})
    free = autopar.plan(model, cluster, args, kwargs, progress=False, kernels="aten")
    return model, args, kwargs, cluster, smallest, free.memory["peak"]


@settings(max_examples=6, deadline=None, derandomize=True, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(fraction=st.floats(0.0, 1.0))
def test_every_plan_under_a_budget_predicts_a_peak_within_it(gpt2_bounds, fraction):
    model, args, kwargs, cluster, smallest, free_peak = gpt2_bounds
    assert smallest <= free_peak
    budget = smallest * (1 + 1e-6) + fraction * (free_peak - smallest)
    p = autopar.plan(model, cluster, args, kwargs, memory_budget=budget, progress=False, kernels="aten")
    assert p.memory["peak"] <= budget
    # The timeline is the same walk: its highest point is the peak, and no category is ever negative.
    assert all(v >= 0 for pt in p.memory["timeline"] for v in pt.values() if isinstance(v, float))
    top = max(sum(v for k, v in pt.items() if isinstance(v, float)) for pt in p.memory["timeline"])
    assert top == pytest.approx(p.memory["peak"], rel=1e-9)


def test_a_budget_below_the_smallest_feasible_one_is_refused(gpt2_bounds):
    model, args, kwargs, cluster, smallest, _ = gpt2_bounds
    with pytest.raises(InfeasiblePlanError) as e:
        autopar.plan(model, cluster, args, kwargs, memory_budget=smallest * 0.98, progress=False, kernels="aten")
    assert e.value.min_feasible_budget == pytest.approx(smallest, rel=1e-6)
    assert e.value.largest_consumers


def test_a_storage_every_recomputed_layer_reads_is_kept_once():
    """LLaMA's attention mask and rotary tables are made once and read by every layer: with every
    layer recomputed they are kept once until the first layer's backward, so two more layers keep
    only two more layer inputs at the end of forward, however large the mask (seq x seq)."""
    import transformers as tf

    seq, hidden, batch = 256, 16, 2

    def end_of_forward(layers):
        torch.manual_seed(0)
        model = tf.LlamaForCausalLM(tf.LlamaConfig(num_hidden_layers=layers, hidden_size=hidden, num_attention_heads=2,
                                                   num_key_value_heads=1, intermediate_size=32, vocab_size=64,
                                                   max_position_embeddings=seq, use_cache=False))
        ids = torch.zeros(batch, seq, dtype=torch.long)
        p = autopar.plan(model, autopar.ClusterSpec.local_cpu(1), (ids,), {"labels": ids.clone()}, progress=False,
                         kernels="aten", recompute={"model.layers.*": "all"})
        assert len(p.recompute["layers"]) == layers
        return p.memory["activations"]

    layer_input = batch * seq * hidden * 4
    assert end_of_forward(4) - end_of_forward(2) == pytest.approx(2 * layer_input)


def _smallest_budget_plan(rank, world):
    from tests.live_memory import step_peak_over_ranks
    from tests.memory_cases import build

    model, args, kwargs = build("gpt", 32, 4, "cpu")
    cluster = autopar.ClusterSpec.local_cpu(world)
    budget = [_smallest(model, cluster, args, kwargs, {}) if rank == 0 else None]
    dist.broadcast_object_list(budget, src=0)
    pm = autopar.compile(model, cluster, args, kwargs, memory_budget=budget[0], kernels="aten")
    stages = {stage for stage, _ in pm.plan.zero_stages().values()}
    recomputed = sum(r["count"] for r in pm.plan.recompute["classes"].values())
    assert 3 in stages and recomputed, (stages, pm.plan.recompute["classes"])
    opt = torch.optim.AdamW(pm.parameters(), lr=1e-3)
    predicted = pm.plan.memory["peak"]

    def step(keep_outputs: bool):
        out = pm(*args, **kwargs)
        out.loss.backward()
        logits = out.logits.untyped_storage().nbytes()
        if not keep_outputs:
            out = None
        opt.step()
        opt.zero_grad()
        return logits

    logits = step(True)
    held = step_peak_over_ranks(pm, opt, lambda: step(True), inputs=(args, kwargs))
    assert abs(held / predicted - 1) <= TOLERANCE, f"measured {held:.0f} B, predicted {predicted:.0f} B"
    # A loop that keeps only the loss frees the logits after forward: the model, which holds the
    # outputs through the step, is then above the measured peak (the safe side), by at most the logits.
    loss_only = step_peak_over_ranks(pm, opt, lambda: step(False), inputs=(args, kwargs))
    assert held - logits <= loss_only <= held, (held, loss_only, logits)


def test_smallest_budget_plan_of_zero_3_and_recompute_is_predicted_within_10_percent():
    """The plan at the smallest feasible budget shards parameters (ZeRO-3) and recomputes layers: its
    measured peak is its prediction's within 10%. (It sharded states by ZeRO-2 too while a ZeRO-2
    reduce-scatter was counted as freeing the whole gradient at its issue; the tight-budget cases of
    test_predicted_peak_matches_measured_on_two_ranks hold ZeRO-2 plans.)"""
    run_distributed(_smallest_budget_plan, 2, timeout=300)


@pytest.mark.parametrize("name", ["llama", "gpt2"])
def test_saved_activations_of_folded_layers_are_those_of_running_every_layer(name, monkeypatch):
    """The saved-activations pass runs a repeated layer's first three instances and gives the later ones
    the third's records: every node's record equals the one running every layer gives."""
    from autopar.pass_pipeline import FRONT_END
    from autopar.passes import memory
    from autopar.passes.capture import capture
    from autopar.passes.meta import meta_of, set_meta
    from tests import hf_models

    gm = capture(hf_models.build(name, layers=5), (hf_models.batch()[0],), {}).gm
    for p in FRONT_END:
        gm = p(gm)
    calls = [n for n in gm.graph.nodes if n.op == "call_function"]
    attributed = []
    attribute = memory._attribute
    monkeypatch.setattr(memory, "_attribute", lambda node, *a: attributed.append(node) or attribute(node, *a))
    records = []
    for fold in (False, True):
        for n in calls:
            set_meta(n, saved=None, copies=False)
        memory.saved_activations_pass(gm, fold=fold)
        records.append([(n.name, meta_of(n).saved, meta_of(n).copies) for n in calls])
    assert records[0] == records[1]
    # Layers 3 and 4 of 5 were not run.
    per_layer = sum(meta_of(n).layer is not None and meta_of(n).layer.layer.endswith(".1") for n in calls)
    assert len(attributed) == 2 * len(calls) - 2 * per_layer > len(calls)


@pytest.mark.parametrize("keys_broadcast", [True, False])
def test_attention_under_a_mask_broadcast_along_the_keys_is_priced_as_cuda_runs_it(keys_broadcast):
    """CUDA's fused attention kernels refuse a mask whose last dimension has stride 0 (BERT's per-query
    mask), and torch runs the math kernel, which keeps the s x s probabilities and whose backward holds
    about three s x s float32 buffers (seen on an H200: bench/README.md). For a CUDA target the record is
    that kernel's under such a mask and the fused kernel's (no s x s buffer) under a causal one; on CPU,
    whose fused kernel takes both masks, it is the fused kernel's either way."""
    import torch.nn.functional as F
    from autopar.pass_pipeline import FRONT_END
    from autopar.passes import memory
    from autopar.passes.capture import capture
    from autopar.passes.meta import meta_of, set_meta

    B, H, S, D = 2, 4, 64, 8

    class Attention(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.qkv = torch.nn.Linear(H * D, 3 * H * D)

        def forward(self, x):
            q, k, v = self.qkv(x).view(B, S, 3, H, D).permute(2, 0, 3, 1, 4)
            if keys_broadcast:
                mask = (torch.arange(S, device=x.device)[None, None, :, None] >= 0).expand(B, 1, S, S)
            else:
                mask = torch.ones(S, S, dtype=torch.bool, device=x.device).tril()[None, None].expand(B, 1, S, S)
            return F.scaled_dot_product_attention(q, k, v, attn_mask=mask).sum()

    gm = capture(Attention(), (torch.randn(B, S, H * D),), {}).gm
    for p in FRONT_END:
        gm = p(gm)
    node = next(n for n in gm.graph.nodes if n.target is torch.ops.aten.scaled_dot_product_attention.default)
    scores = B * H * S * S * 4
    for device in ("cuda", "cpu"):
        set_meta(node, saved=None)
        memory.saved_activations_pass(gm, target_device=device)
        saved = meta_of(node).saved
        if device == "cuda" and keys_broadcast:
            assert saved.outputs + saved.internal >= scores
            assert saved.backward >= 3 * scores
        else:
            assert saved.internal == B * H * S * 4          # the logsumexp
            assert saved.backward == 0


def _step_memory(model, args, cluster, mesh_shape, kwargs=None):
    from autopar.passes.costs import CostModel
    from autopar.passes.ilp_build import build_problem
    from autopar.passes.memory import StepMemory
    from autopar.passes.strategies import strategies_pass
    from autopar.planner import default_optimizer, prepare

    prep = prepare(model, args, kwargs or {}, cluster)
    strategies_pass(prep.gm, mesh_shape)
    cm = CostModel(cluster, mesh_shape, default_optimizer(model))
    prob, idx = build_problem(prep.gm, cm, None)
    return prep.gm, prob, lambda: StepMemory(prep.gm, cm, idx, [len(c.costs) for c in prob.choices])


def test_an_adds_inputs_share_the_gradient_of_its_output():
    """A residual add hands its output's gradient tensor to both inputs (autograd makes no copy), and the
    branch's bias add and reshape hand it on to the branch's matmul: at the add's backward nothing is
    made, and through the branch's backward one [tokens, width] gradient fewer is live than when each
    input's gradient is a tensor of its own, until the branch's matmul has read it."""
    import dataclasses

    from autopar.passes.meta import meta_of, set_meta

    tokens, width = 64, 32

    class Residual(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.inner = torch.nn.Linear(width, width, bias=False)
            self.branch = torch.nn.Linear(width, width)

        def forward(self, x):
            h = self.inner(x)
            y = h + self.branch(h)
            return (y * y).sum()

    torch.manual_seed(0)
    gm, prob, step_memory = _step_memory(Residual(), (torch.randn(2, tokens // 2, width),),
                                         autopar.ClusterSpec.local_cpu(1), (1,))
    adds = [n for n in gm.graph.nodes if n.target is torch.ops.aten.add.Tensor]
    residual = next(n for n in adds if all(a.op == "call_function" for a in n.args))
    assert meta_of(residual).saved.passed == (True, True)
    shared = step_memory()
    for n in gm.graph.nodes:
        saved = meta_of(n).saved if n.op == "call_function" else None
        if saved is not None and saved.passed:
            set_meta(n, saved=dataclasses.replace(saved, passed=()))
    own = step_memory()
    assignment = [0] * len(prob.choices)
    names = [name for _, _, name in shared.points]
    assert names == [name for _, _, name in own.points]
    walks = [[p.total for p in sm.walk(assignment)] for sm in (shared, own)]
    backward = [k for k, (_, phase, _) in enumerate(shared.points) if phase == "backward"]
    at_add = next(k for k in backward if names[k] == residual.name)
    # The branch's matmul: the reader of the input the branch's bias add is folded into.
    matmul = next(k for k in backward if k > at_add and names[k].startswith(("mm", "addmm", "linear")))
    grad = tokens * width * 4
    assert walks[1][at_add] - walks[0][at_add] == pytest.approx(2 * grad)
    assert walks[1][matmul] - walks[0][matmul] == pytest.approx(grad)
    assert all(o >= s - 1e-6 for s, o in zip(*walks))
    assert walks[0][-1] == pytest.approx(walks[1][-1])


def test_the_solver_bounds_the_walk_where_gradients_are_shared():
    """Where two inputs of an add share its output's gradient under three decisions (the inputs' layouts
    and the add's: the built-in GPT's residual adds on 2 devices), the walk counts it once; the solver's memory constraints hold a bound of two
    decisions below the bytes taken off, so under random layouts every point's constraint is at least
    the walk's bytes there, and above it at some."""
    import random

    from autopar.passes.memory import _Product
    from tests.memory_cases import build

    model, args, _ = build("gpt", 32, 4, "cpu")
    _, prob, step_memory = _step_memory(model, args, autopar.ClusterSpec.local_cpu(2), (2,))
    sm = step_memory()
    assert any(isinstance(q, _Product) for _, _, q in sm.events)
    ks = list(range(len(sm.points)))
    constraints = sm.constraints(ks)
    rng = random.Random(0)
    above = False
    for _ in range(10):
        assignment = [rng.randrange(len(c.costs)) for c in prob.choices]
        walk = sm.walk(assignment)
        for k in ks:
            bound = constraints[k].bytes_at(assignment)
            assert bound >= walk[k].total * (1 - 1e-9) - 1e-6, (sm.points[k], bound, walk[k].total)
            above |= bound > walk[k].total * (1 + 1e-9) + 1
    assert above


def test_a_recomputed_layer_runs_again_when_its_backward_first_reads_what_it_saved():
    """Non-reentrant checkpointing runs a layer's forward again when autograd first unpacks a tensor the
    layer saved: the backward of its last ops that save nothing (the residual add) runs before, and the
    gradients they make are live through the run again (the built-in GPT, every layer recomputed)."""
    from autopar.passes.layers import layer_instances
    from autopar.passes.memory import _keeps
    from autopar.passes.meta import meta_of
    from tests.memory_cases import build

    model, args, _ = build("gpt", 32, 4, "cpu")
    gm, _, step_memory = _step_memory(model, args, autopar.ClusterSpec.local_cpu(2), (2,))
    sm = step_memory()
    points = [(phase, name) for _, phase, name in sm.points]
    (instances,) = layer_instances(gm).values()
    last, nodes = list(instances.items())[-1]
    again = points.index(("recompute", last))
    first_back = points.index(("backward", nodes[-1].name))
    before = [n for n in nodes if ("backward", n.name) in points[first_back:again]]
    assert first_back < again and before
    assert not any(_keeps(meta_of(n).saved) for n in before)
    assert any(("backward", n.name) in points[again:] for n in nodes if _keeps(meta_of(n).saved))
