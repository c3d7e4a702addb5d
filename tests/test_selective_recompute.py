"""Selective recompute (Korthikanti et al.): the attention core of a layer runs again in backward
instead of keeping its s x s tensors, priced by its forward time and the bytes it frees."""
from __future__ import annotations

import copy

import pytest
import torch

import autopar
from tests.distributed_utils import run_distributed
from tests.eager_parity import train_and_compare


def _gpt2_eager(s, h, a, layers=2, vocab=1024, dropout=0.1):
    import transformers as tf

    cfg = tf.GPT2Config(n_layer=layers, n_embd=h, n_head=a, vocab_size=vocab, n_positions=s, use_cache=False,
                        activation_function="gelu", attn_implementation="eager", attn_pdrop=dropout,
                        resid_pdrop=dropout, embd_pdrop=dropout, bos_token_id=0, eos_token_id=0)
    return tf.GPT2LMHeadModel(cfg)


@pytest.fixture(scope="module")
def korthikanti():
    # Korthikanti's regime, where the attention core is a small part of a layer's time (s/6h of its
    # FLOPs) and most of its memory (5as/h against 34).
    s, b, h, a = 1024, 8, 4096, 32
    with torch.device("meta"):
        model = _gpt2_eager(s, h, a).to(torch.bfloat16)
    ids = torch.randint(0, 1024, (b, s))
    cluster = autopar.ClusterSpec.preset("1xH100")
    plans = {name: autopar.plan(model, cluster, (ids,), {"labels": ids.clone()}, progress=False, recompute=how)
             for name, how in (("none", False), ("attention", {"*": "attention"}), ("whole", {"*": "all"}))}
    return (s, b, h, a), model, ids, cluster, plans


def test_attention_recompute_frees_the_quadratic_term(korthikanti):
    """Korthikanti et al.: recomputing the attention core frees 5*a*s^2*b bytes per layer and keeps
    34*s*b*h; it costs the core's forward once more."""
    (s, b, h, a), _, _, _, plans = korthikanti
    none, selective = plans["none"], plans["attention"]
    regions = selective.recompute["attention"]["regions"]
    assert set(regions) == {"transformer.h.0:attention", "transformer.h.1:attention"}
    assert any(name.startswith("softmax") for name in regions["transformer.h.0:attention"])
    freed = (none.memory["activations"] - selective.memory["activations"]) / 2
    assert abs(freed / (5 * a * s * s * b) - 1) < 0.05, freed
    # What a layer keeps (q, k and v stay: the core's checkpoint keeps its inputs): 34*s*b*h.
    kept = sum(n["activation_bytes"] for n in selective.nodes if n["layer"] == "transformer.h.0") - freed
    assert abs(kept / (34 * s * b * h) - 1) < 0.10, kept
    assert selective.step_time > none.step_time and selective.breakdown["recompute"] > 0
    assert "attention core recomputed" in selective.summary()


def test_the_solver_takes_selective_recompute_where_it_is_cheapest(korthikanti):
    """A budget that only recomputing (attention cores, or whole layers) meets: the attention cores
    free the most bytes for the least time, and the solver takes them over whole layers."""
    _, model, ids, cluster, plans = korthikanti
    selective, whole = plans["attention"], plans["whole"]
    budget = selective.memory["peak"] * 1.001
    assert plans["none"].memory["peak"] > budget
    p = autopar.plan(model, cluster, (ids,), {"labels": ids.clone()}, progress=False, memory_budget=budget)
    assert p.memory["peak"] <= budget
    assert p.recompute.get("attention", {}).get("layers"), p.recompute
    assert p.step_time < whole.step_time


# --- on gloo ranks -------------------------------------------------------------------------------

def _selective_parity(rank, world):
    from tests.hf_models import MEGATRON, batch
    from tests.live_memory import step_peak_over_ranks
    from tests.test_codegen import check_collectives

    torch.manual_seed(0)
    model = _gpt2_eager(16, 64, 4, vocab=128, dropout=0.0)
    ref = copy.deepcopy(model)
    ids, labels = batch()
    pins = {k: [v] for k, v in MEGATRON["gpt2"].items()}
    pm = autopar.compile(model, autopar.ClusterSpec.local_cpu(world), (ids,), {"labels": labels}, pins=pins,
                         mesh_shape=(world,), recompute={"*": "attention"})
    assert len(pm.plan.recompute["attention"]["regions"]) == 2 and not pm.plan.recompute["layers"]
    assert pm.code.count("checkpointed(") == 2
    check_collectives(pm, ids, labels)
    opt = train_and_compare(pm, ref, ids, labels, f"selective recompute on {world} ranks")

    def step():
        pm(ids, labels=labels).loss.backward()
        opt.step()
        opt.zero_grad()

    peak = step_peak_over_ranks(pm, opt, step, inputs=(ids, labels))
    predicted = pm.plan.memory["peak"]
    assert abs(peak / predicted - 1) <= 0.10, (peak, predicted)


@pytest.mark.parametrize("world", [2, 4])
def test_selective_recompute_trains_like_eager_with_the_planned_collectives(world):
    run_distributed(_selective_parity, world, timeout=300)


def _core_gathered_in_its_checkpoint(rank, world):
    from autopar.models import GPT, GPTConfig
    from tests.live_memory import step_peak_over_ranks

    torch.manual_seed(0)
    model = GPT(GPTConfig(vocab_size=64, n_layer=2, n_head=4, d_model=32, d_ff=64, max_seq=64))
    ref = copy.deepcopy(model)
    ids = torch.randint(0, 64, (1, 64), generator=torch.Generator().manual_seed(1))
    pins = {"input_ids": ["S(1)"], "labels": ["S(1)"], "scaled_dot_product_attention*": {"inputs": [["R"]] * 3},
            **{name: ["R"] for name, _ in model.named_parameters()}, "linear*": ["S(1)"]}
    pm = autopar.compile(model, autopar.ClusterSpec.local_cpu(world), (ids, ids.clone()), mesh_shape=(world,),
                         pins=pins, recompute={"*": "attention"})
    assert len(pm.plan.recompute["attention"]["regions"]) == 2
    assert pm.code.count("checkpointed(") == 2
    opt = train_and_compare(pm, ref, None, None, f"sequence-split attention core recomputed on {world} ranks",
                            call=lambda m: m(ids, ids.clone()).loss)

    def step():
        pm(ids, ids.clone()).loss.backward()
        opt.step()
        opt.zero_grad()

    peak = step_peak_over_ranks(pm, opt, step, inputs=(ids,))
    assert abs(peak / pm.plan.memory["peak"] - 1) <= 0.10, (peak, pm.plan.memory["peak"])


def test_an_attention_core_whose_inputs_are_gathered_for_it_recomputes_the_gathers():
    """Attention kept whole over a sequence split elsewhere: the all-gathers of its query, key and value
    are emitted for the core, so its checkpoint runs them again in backward; trains like eager."""
    run_distributed(_core_gathered_in_its_checkpoint, 2, timeout=300)
