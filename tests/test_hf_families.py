"""A sweep over Hugging Face model families: small configs built from their config classes (random
weights, no downloads). Every family plans on 2 devices, or fails with a clear error that names the
reason; a handful of structurally different ones (alternating attention, mixture of experts, ALiBi,
encoder-decoder) also train 2 AdamW steps on 2 gloo ranks with losses equal to eager (relative 1e-5,
as tests/test_parity.py)."""
import copy

import pytest
import torch

from tests.distributed_utils import run_distributed

VOCAB, BATCH, SEQ = 128, 4, 16

CAUSAL = ["gpt2", "gpt_neo", "gpt_neox", "gptj", "codegen", "opt", "bloom", "falcon", "llama", "mistral",
          "mixtral", "qwen2", "qwen2_moe", "qwen3", "phi", "phi3", "gemma", "gemma2", "gemma3_text", "stablelm",
          "starcoder2", "mpt", "olmo", "olmo2", "cohere", "granite", "biogpt", "xglm", "persimmon", "glm",
          "helium", "smollm3"]
SEQ2SEQ = ["t5", "mt5", "bart", "mbart", "pegasus", "marian", "blenderbot", "bigbird_pegasus"]
# Families that cannot be captured, and the reason the error must give.
REFUSED = {"led": "data-dependent"}       # LED's global-attention padding branches on tensor values
PARITY = ["gemma2", "mixtral", "bloom", "t5"]

# Per-family settings that the common small sizes do not cover (rotary width, layer patterns).
_EXTRA = {"gpt_neo": {"attention_types": [[["global", "local"], 1]], "num_layers": 2, "window_size": 8},
          "gptj": {"rotary_dim": 8}, "codegen": {"rotary_dim": 8}}


def build(family: str, layers: int = 2, **config):
    import transformers as tf

    cfg = tf.AutoConfig.for_model(family, hidden_size=64, num_hidden_layers=layers, num_attention_heads=4,
                                  intermediate_size=128, vocab_size=VOCAB, max_position_embeddings=64,
                                  use_cache=False, **{**_EXTRA.get(family, {}), **config})
    for key, value in (("num_key_value_heads", 2), ("head_dim", 16), ("pad_token_id", 0), ("bos_token_id", 0),
                       ("eos_token_id", 0), ("decoder_start_token_id", 0)):
        if getattr(cfg, key, None) is not None and not isinstance(getattr(type(cfg), key, None), property):
            setattr(cfg, key, value)       # a property (Falcon's head_dim) is derived from the sizes above
    for key in ("dropout", "attention_dropout", "hidden_dropout", "resid_pdrop", "embd_pdrop", "attn_pdrop",
                "dropout_rate", "hidden_dropout_prob", "attention_probs_dropout_prob", "activation_dropout"):
        if isinstance(getattr(cfg, key, None), float):
            setattr(cfg, key, 0.0)
    auto = tf.AutoModelForSeq2SeqLM if cfg.is_encoder_decoder else tf.AutoModelForCausalLM
    return auto.from_config(cfg)


def inputs(model):
    ids = torch.randint(0, VOCAB, (BATCH, SEQ), generator=torch.Generator().manual_seed(0))
    kwargs = {"labels": ids}
    if model.config.is_encoder_decoder:
        kwargs["decoder_input_ids"] = ids
    return (ids,), kwargs


@pytest.mark.parametrize("family", CAUSAL + SEQ2SEQ)
def test_family_plans(family):
    import autopar

    torch.manual_seed(0)
    model = build(family)
    args, kwargs = inputs(model)
    plan = autopar.plan(model, autopar.ClusterSpec.local_cpu(2), args, kwargs, progress=False, time_limit=20)
    assert plan.params and plan.memory["peak"] <= plan.memory["memory_budget"]


@pytest.mark.parametrize("family", sorted(REFUSED))
def test_family_refused_with_reason(family):
    import autopar

    model = build(family)
    args, kwargs = inputs(model)
    with pytest.raises(autopar.CaptureError, match=REFUSED[family]):
        autopar.plan(model, autopar.ClusterSpec.local_cpu(2), args, kwargs, progress=False)


def _train_families(rank, world, families, layers=2):
    import autopar

    for family in families:
        torch.manual_seed(0)
        model = build(family, layers)
        ref = copy.deepcopy(model)
        args, kwargs = inputs(model)
        # The batch split across the ranks (the solver may keep so small a model whole on each rank).
        pins = {name: ["S(0)"] for name in ("input_ids", "labels", "decoder_input_ids") if name == "input_ids"
                or name in kwargs}
        pm = autopar.compile(model, autopar.ClusterSpec.local_cpu(world), args, kwargs, pins=pins)
        assert all(pm.plan.inputs[name] == ["S(0)"] for name in pins), (family, pm.plan.inputs)
        opt = torch.optim.AdamW(pm.parameters(), lr=1e-3)
        ref_opt = torch.optim.AdamW(ref.parameters(), lr=1e-3)
        for step in range(2):
            loss = pm.train_step(*args, **kwargs)
            ref_loss = ref(*args, **kwargs).loss
            ref_loss.backward()
            assert torch.allclose(loss, ref_loss.detach(), rtol=1e-5, atol=0), \
                f"{family}, mesh {pm.plan.mesh_shape}: step {step} loss {loss.item()} vs eager {ref_loss.item()}"
            opt.step(), ref_opt.step()
            opt.zero_grad(), ref_opt.zero_grad()


def test_families_train_with_parity():
    run_distributed(_train_families, 2, PARITY, timeout=600)
