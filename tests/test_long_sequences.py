"""Long sequences: ring attention (context parallel), Ulysses and their combination with tensor
parallel, compiled and trained on real gloo ranks against single-device eager (test_parity's
tolerances); the bad sizes; and the solver's choice of a sequence split where memory demands it."""
import copy
import dataclasses

import pytest
import torch

from tests.distributed_utils import run_distributed
from tests.hf_models import batch, build
from tests.eager_parity import train_and_compare

# Every activation split along the sequence: the inputs by tokens, weights whole.
SEQUENCE = {"input_ids": ["S(1)"], "labels": ["S(1)"], "*.weight": ["R"], "*.bias": ["R"]}


def _sdpa_pin(model_name, layout, mask=None):
    """Pin every attention call to read q, k, v in ``layout`` (and the mask, which HF LLaMA passes
    explicitly, [B, 1, S, S], in ``mask``); a pin on one layer's copy holds for every copy."""
    hf = model_name in ("llama", "qwen2")
    return {"scaled_dot_product_attention*": {"inputs": [layout] * 3 + ([mask or layout] if hf else [])}}


def _plans(model_name, mesh):
    if len(mesh) == 1:
        ring = {**SEQUENCE, **_sdpa_pin(model_name, ["S(2)"])}
        yield "ring attention", ring, "ring_attention"
        if model_name == "gpt":
            # Checkpointed layers run the ring's forward (and its transfers) again in backward.
            yield "ring attention, every layer recomputed", (ring, {"recompute": {"*": "all"}}), "ring_attention"
        if model_name == "llama":
            # Ulysses: attention split by heads while its neighbors stay split by the sequence; the
            # resharding between them is the all-to-all.
            # q, k, v and o projections stay sequence-split (LLaMA's first layer: linear .. linear_3).
            projections = {"linear": ["S(1)"], "linear_1": ["S(1)"], "linear_2": ["S(1)"],
                           "linear_3": {"inputs": [["S(1)"], ["R"]]}}
            yield "ulysses", {**SEQUENCE, **projections,
                              "scaled_dot_product_attention*": {"inputs": [["S(1)"]] * 3 + [["R"]]}}, "all_to_all"
    else:
        # Heads on axis 0 (Megatron's attention split), ring on axis 1.
        tp = {"input_ids": ["R", "S(1)"], "labels": ["R", "S(1)"], "*.weight": ["R", "R"], "*.bias": ["R", "R"],
              "*.q_proj.weight": ["S(0)", "R"], "*.k_proj.weight": ["S(0)", "R"], "*.v_proj.weight": ["S(0)", "R"],
              "*.o_proj.weight": ["S(1)", "R"]}
        yield "heads x ring", {**tp, **_sdpa_pin(model_name, ["S(1)", "S(2)"], ["R", "S(2)"])}, "ring_attention"


def _check(rank, world, model_name, mesh):
    import autopar

    torch.manual_seed(0)
    if model_name == "qwen2":
        from tests.test_hf_families import build as build_family

        model = build_family(model_name)
    else:
        model = build(model_name)
    ref = copy.deepcopy(model)
    ids, labels = batch()
    cluster = autopar.ClusterSpec.local_cpu(world)
    has_bias = any(name.endswith(".bias") for name, _ in model.named_parameters())
    for label, pins, marker in _plans(model_name, mesh):
        pins, options = pins if isinstance(pins, tuple) else (pins, {})
        if not has_bias:            # a pin that matches nothing is an error (LLaMA has no biases)
            pins = {k: v for k, v in pins.items() if k != "*.bias"}
        pm = autopar.compile(model, cluster, (ids,), {"labels": labels}, mesh_shape=mesh, pins=pins, **options)
        where = f"{model_name} / {label} on mesh {mesh}"
        assert marker in pm.code, f"{where}: the program does not call {marker}"
        if "recomputed" in label:
            assert pm.plan.recompute["layers"] and "checkpointed" in pm.code, where
        train_and_compare(pm, copy.deepcopy(ref), ids, labels, where)


@pytest.mark.parametrize("model_name, world, mesh", [
    ("llama", 2, (2,)),         # explicit causal mask, GQA (4 heads, 2 KV heads); and Ulysses
    ("llama", 4, (4,)),         # the same on 4 ranks
    ("gpt", 4, (4,)),           # is_causal=True: load-balanced half-chunks
    ("llama", 4, (2, 2)),       # tensor parallel heads x ring
    ("qwen2", 2, (2,)),         # q, k, v biases, GQA, explicit mask
])
def test_sequence_split_attention_trains_like_eager(model_name, world, mesh):
    run_distributed(_check, world, model_name, mesh, timeout=600)


def test_long_context_7b_on_one_node_splits_every_attention_along_the_sequence():
    """Qwen2-7B's shape (28 heads, 4 KV heads) at 131072 tokens, batch 1, bf16-mixed (fp32 master
    weights, gradients and Adam states; bf16 compute and activations), on one 8xH100 node: 4 KV heads
    allow at most a 4-way head split, so the plan that fits splits every attention call along the
    sequence, and fits in the device's 80 GB less its reserve."""
    import autopar
    from autopar import zoo

    model, args, kwargs = zoo.build("gqa-7b-128k", batch=1)
    cluster = autopar.ClusterSpec.preset("8xH100")
    p = autopar.plan(model, cluster, args, kwargs, mesh_shape=(8,), sharded_outputs=True, precision="bf16-mixed",
                     progress=False)
    assert p.precision == "bf16-mixed"
    n = p.model["num_params"]
    # 16 bytes a parameter (fp32 master, gradient, two Adam states) over 8 ranks, and a whole bf16 copy
    # of each weight whose master ZeRO shards beside it (Megatron's distributed optimizer).
    numel = {fqn: t.numel() for fqn, t in model.named_parameters()}
    whole_copies = sum(numel[fqn] for fqn, z in (p.zero or {}).items() if z.sharded_master)
    assert p.memory["params"] + p.memory["grads"] + p.memory["optimizer"] == pytest.approx(
        16 * n / 8 + 2 * whole_copies, rel=1e-3)
    attention = [n for n in p.nodes if n["op"] == "scaled_dot_product_attention.default"]
    assert len(attention) == 28
    for n in attention:
        assert all("S(2)" in lay for lay in n["inputs"][:3]), f"{n['name']} reads q, k, v as {n['inputs'][:3]}"
    assert p.memory["peak"] <= cluster.usable_memory


def _causal_pin_error(world, seq, heads, pin, match):
    import autopar
    from autopar.errors import ShardingError
    from autopar.models import GPT, GPTConfig

    model = GPT(GPTConfig(vocab_size=64, n_layer=1, n_head=heads, d_model=8 * heads, d_ff=32, max_seq=seq))
    ids = torch.zeros(2, seq, dtype=torch.long)
    with pytest.raises(ShardingError, match=match):
        autopar.plan(model, autopar.ClusterSpec.preset(f"{world}xH100"), (ids,), {"labels": ids.clone()},
                     mesh_shape=(world,), pins={"scaled_dot_product_attention": {"inputs": [pin] * 3}},
                     progress=False)


def test_causal_ring_that_cannot_halve_each_rank_is_refused_with_the_sizes():
    # 12 tokens on 4 ranks: 3 each, which do not split into two load-balanced halves.
    _causal_pin_error(4, 12, 4, ["S(2)"], r"load-balanced half-chunks.*has 3 elements, which does not divide by 2")


def test_head_split_beyond_the_heads_is_refused_with_the_sizes():
    # Ulysses on 4 ranks needs 4 heads; the model has 2.
    _causal_pin_error(4, 16, 2, ["S(1)"], r"shape \(2, 2, 16, 8\) cannot take \['S\(1\)'\]")


def _budget_demands_a_sequence_split(rank, world):
    import autopar
    from autopar.models import GPT, GPTConfig

    torch.manual_seed(0)
    seq = 256
    # One head and one sequence: attention can split neither heads nor batch, only the sequence.
    model = GPT(GPTConfig(vocab_size=64, n_layer=2, n_head=1, d_model=32, d_ff=64, max_seq=seq))
    ref = copy.deepcopy(model)
    ids = torch.randint(0, 64, (1, seq), generator=torch.Generator().manual_seed(1))
    cluster = autopar.ClusterSpec.local_cpu(world)
    with pytest.raises(autopar.InfeasiblePlanError) as e:
        autopar.plan(model, cluster, (ids,), {"labels": ids.clone()}, mesh_shape=(world,), memory_budget=1.0,
                     pins={"scaled_dot_product_attention*": ["R"]}, progress=False)
    # Below anything that keeps attention whole; the ring's least peak is 0.96x that one (it splits q, k,
    # v and the output, and keeps a second, load-balanced copy of the output).
    budget = 0.97 * e.value.min_feasible_budget
    pm = autopar.compile(model, cluster, (ids,), {"labels": ids.clone()}, mesh_shape=(world,), memory_budget=budget)
    for n in pm.plan.nodes:
        if n["op"] == "scaled_dot_product_attention.default":
            assert n["inputs"][:3] == [["S(2)"]] * 3, f"{n['name']} reads q, k, v as {n['inputs'][:3]}"
    train_and_compare(pm, ref, ids, ids.clone(), f"free plan under a {budget / 2**20:.2f} MiB budget")


def test_a_budget_below_whole_attention_makes_the_solver_split_the_sequence():
    run_distributed(_budget_demands_a_sequence_split, 2, timeout=300)


@pytest.mark.parametrize("seq", [512, 262144])
def test_ring_steps_cost_the_larger_of_compute_and_transfer(seq):
    """Each of the n-1 forward ring steps costs max(block compute, block transfer); the compute is in
    the op's FLOPs, so the plan charges only the transfer beyond it: all of it for short sequences
    (little compute per block), none for long ones (attention's compute grows as s^2, its transfer
    as s)."""
    from autopar.passes.costs import CostModel
    from autopar.passes.resharding import collective_seconds
    from autopar.passes.strategies import node_strategies
    from autopar.layout import S
    from tests.reference_executor import single_op_node

    import autopar

    n, b, h, hkv, d = 8, 1, 8, 2, 128
    q, k = torch.empty(b, h, seq, d, device="meta"), torch.empty(b, hkv, seq, d, device="meta")
    node = single_op_node(torch.ops.aten.scaled_dot_product_attention.default, (q, k, k.clone()),
                          {"enable_gqa": True})
    ring = next(s for s in node_strategies(node, (n,)) if s.inputs == ((S(2),),) * 3)
    cluster = autopar.ClusterSpec.preset("8xH100")
    cm = CostModel(cluster, (n,))
    forward = next(oc for oc in cm.op_collectives(node, ring) if oc.phase == "forward")
    block_bytes = 2 * b * hkv * (seq // n) * d * 4
    assert (forward.kind, forward.steps, forward.nbytes) == ("send_recv", n - 1, (n - 1) * block_bytes)
    bw, lat = cluster.axis_link((n,), 0)
    transfer = collective_seconds("send_recv", block_bytes, n, bw, lat)
    compute = 4.0 * b * h * (seq // n) ** 2 * d / cluster.device.peak_flops(torch.float32)
    assert cm.op_collective_seconds(forward) == pytest.approx((n - 1) * max(0.0, transfer - compute))
    assert (compute < transfer) == (seq == 512)
    # A device whose collectives slow its compute pays that share of the part the compute hides.
    contended = dataclasses.replace(cluster, device=dataclasses.replace(cluster.device, comm_contention=0.25))
    assert CostModel(contended, (n,)).op_collective_seconds(forward) == pytest.approx(
        (n - 1) * (max(0.0, transfer - compute) + 0.25 * min(transfer, compute)))
