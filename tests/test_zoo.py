"""The model zoo and the built-in GPT: real sizes on meta, tiny configs that run and export, and the
built-in GPT training with parity on 2 gloo ranks."""
from __future__ import annotations

import copy
import math
import sys

import pytest
import torch
import torch.nn.functional as F

import autopar
from autopar import zoo
from autopar.models import GPT, GPTConfig, GPTOutput
from tests.distributed_utils import run_distributed
from tests.hf_models import MEGATRON

# Published parameter counts of the real architectures (tied embeddings counted once).
FULL_SIZE = {
    "gpt2": (124_439_808, 1024),
    "gpt2-xl": (1_557_611_200, 1024),
    "llama3-8b": (8_030_261_248, 4096),
    "llama2-70b": (68_976_648_192, 4096),
    "gqa-7b-128k": (7_615_487_488, 131072),     # Qwen2-7B's 7,615,616,512 less its q/k/v biases
    "bert-large": (335_174_458, 512),
}
TINY = ("gpt2-tiny", "llama-tiny", "bert-tiny", "gpt-tiny")


def test_names_cover_full_size_and_tiny_models():
    assert set(zoo.NAMES) == set(FULL_SIZE) | set(TINY)


@pytest.mark.parametrize("name", zoo.NAMES)
def test_every_name_builds_on_meta(name):
    model, args, kwargs = zoo.build(name, batch=4)
    assert all(p.is_meta for p in model.parameters())
    ids, labels = args[0], kwargs["labels"]
    expected_params, seq = FULL_SIZE.get(name, (None, 16))
    assert ids.shape == labels.shape == (4, seq)
    assert ids.dtype == labels.dtype == torch.int64 and ids.is_meta and labels.is_meta
    assert ids is not labels
    if expected_params is not None:
        assert sum(p.numel() for p in model.parameters()) == expected_params
    assert getattr(model.config, "use_cache", False) is False


def test_llama3_8b_architecture():
    c = zoo.build("llama3-8b")[0].config
    assert (c.hidden_size, c.num_hidden_layers, c.num_attention_heads, c.num_key_value_heads,
            c.intermediate_size, c.vocab_size) == (4096, 32, 32, 8, 14336, 128256)
    assert c.rope_parameters["rope_theta"] == 500000.0


@pytest.mark.parametrize("name", TINY)
def test_tiny_models_run_on_cpu_and_export(name):
    torch.manual_seed(0)
    model, args, kwargs = zoo.build(name, device="cpu")
    ids, labels = args[0], kwargs["labels"]
    assert ids.device.type == "cpu" and ids.min() >= 0 and ids.max() < 128
    assert torch.equal(ids, labels) and ids.data_ptr() != labels.data_ptr()
    eager = model(*args, **kwargs)
    # Random weights: the loss starts near log(vocab).
    assert abs(eager.loss.item() - math.log(128)) < 0.3
    exported = torch.export.export(model, args, kwargs).module()(*args, **kwargs)
    torch.testing.assert_close(exported.loss, eager.loss)
    torch.testing.assert_close(exported.logits, eager.logits)


def test_same_call_gives_same_batch():
    a = zoo.build("gpt-tiny", device="cpu")[1][0]
    b = zoo.build("gpt-tiny", device="cpu", batch=8, seq=16)[1][0]
    assert torch.equal(a, b)


def small_gpt():
    return GPT(GPTConfig(vocab_size=50, n_layer=1, n_head=2, d_model=16, d_ff=32, max_seq=20))


def small_gpt_with_inputs():
    ids = torch.zeros(2, 5, dtype=torch.int64)
    return small_gpt(), (ids,), {"labels": ids + 1}


def test_module_function_returning_a_model():
    model, args, kwargs = zoo.build("tests.test_zoo:small_gpt", batch=3, device="cpu")
    assert isinstance(model, GPT)
    # seq is min(128, the model's max positions); ids span the model's vocab.
    assert args[0].shape == (3, 20) and args[0].max() < 50
    assert model(*args, **kwargs).loss.shape == ()


def test_module_function_returning_model_and_inputs():
    model, args, kwargs = zoo.build("tests.test_zoo:small_gpt_with_inputs", device="cpu")
    assert args[0].shape == (2, 5) and torch.equal(kwargs["labels"], torch.ones(2, 5, dtype=torch.int64))


@pytest.mark.parametrize("name, message", [
    ("gpt3", "unknown model 'gpt3'"),
    ("tests.test_zoo:no_such_function", "cannot load model function"),
    ("no_such_package.models:make", "cannot load model function"),
    ("math:pi", "is a float, not a function"),
])
def test_bad_names_raise_a_clear_error(name, message):
    with pytest.raises(zoo.ZooError, match=message) as info:
        zoo.build(name)
    assert isinstance(info.value, autopar.AutoparError)


def test_missing_transformers_says_how_to_install(monkeypatch):
    monkeypatch.setitem(sys.modules, "transformers", None)     # makes `import transformers` fail
    with pytest.raises(ImportError, match="pip install transformers"):
        zoo.build("gpt2")
    assert isinstance(zoo.build("gpt-tiny")[0], GPT)             # the built-in GPT needs nothing


# --- the built-in GPT ---------------------------------------------------------------------------

def test_sequence_longer_than_the_positions_is_refused():
    with pytest.raises(zoo.ZooError, match="sequence length 2048 exceeds gpt2's 1024 positions"):
        zoo.build("gpt2", seq=2048)


def test_gpt_ties_and_unties_embeddings():
    cfg = dict(vocab_size=32, n_layer=1, n_head=2, d_model=8, d_ff=16, max_seq=8)
    tied, untied = GPT(GPTConfig(**cfg)), GPT(GPTConfig(**cfg, tie_embeddings=False))
    assert tied.lm_head.weight is tied.tok_emb.weight
    assert untied.lm_head.weight is not untied.tok_emb.weight
    assert sum(p.numel() for p in untied.parameters()) - sum(p.numel() for p in tied.parameters()) == 32 * 8


def test_gpt_is_causal_and_its_loss_is_next_token_cross_entropy():
    torch.manual_seed(0)
    model = GPT(GPTConfig(vocab_size=32, n_layer=2, n_head=2, d_model=16, d_ff=32, max_seq=8))
    ids = torch.randint(0, 32, (2, 8))
    out = model(ids, labels=ids.clone())
    assert isinstance(out, GPTOutput) and model(ids).loss is None
    changed = ids.clone()
    changed[:, -1] = (ids[:, -1] + 1) % 32
    torch.testing.assert_close(model(changed).logits[:, :-1], out.logits[:, :-1])
    assert not torch.allclose(model(changed).logits[:, -1], out.logits[:, -1])
    manual = torch.stack([F.cross_entropy(out.logits[b, t], ids[b, t + 1]) for b in range(2) for t in range(7)])
    torch.testing.assert_close(out.loss, manual.mean())


def test_gpt_rejects_too_long_sequences():
    model = GPT(GPTConfig(vocab_size=32, n_layer=1, n_head=2, d_model=8, d_ff=16, max_seq=8))
    with pytest.raises(ValueError, match="exceeds max_seq 8"):
        model(torch.zeros(1, 9, dtype=torch.int64))


def test_gpt_plans_offline_with_one_tied_weight():
    model, args, kwargs = zoo.build("gpt-tiny")
    plan = autopar.plan(model, autopar.ClusterSpec.local_cpu(2), args, kwargs, progress=False)
    assert plan.model["num_params"] == 112_384
    assert "blocks.1.attn.q.weight" in plan.params and "tok_emb.weight" in plan.params
    assert "lm_head.weight" not in plan.params         # tied to tok_emb: one parameter, one layout
    assert plan.step_time > 0 and plan.memory["peak"] > 0


def _gpt_parity(rank, world):
    from autopar.runtime.module import shard_of

    torch.manual_seed(0)
    model, args, kwargs = zoo.build("gpt-tiny", device="cpu")
    ref = copy.deepcopy(model)
    # Megatron's split of the projections, so that the gradients compared below are really shards: left
    # free on local_cpu(2), the planner replicates every parameter and splits the batch, the plan the
    # replay prices faster.
    pins = {k: [v] for k, v in MEGATRON["gpt"].items()}
    pm = autopar.compile(model, autopar.ClusterSpec.local_cpu(world), args, kwargs, pins=pins)
    assert any("S(" in str(lay) for lay in pm.plan.params.values())   # something really is sharded
    opt = torch.optim.AdamW(pm.parameters(), lr=1e-3)
    ref_opt = torch.optim.AdamW(ref.parameters(), lr=1e-3)
    ref_params = dict(ref.named_parameters())
    coords = tuple(pm.mesh.get_coordinate())
    for step in range(3):
        loss = pm.train_step(*args, **kwargs)
        ref_loss = ref(*args, **kwargs).loss
        ref_loss.backward()
        torch.testing.assert_close(loss, ref_loss.detach(), rtol=1e-5, atol=0)
        if step == 0:   # each rank's gradient shard equals the same slice of the one-process gradient
            # The absolute tolerance scales with the largest gradient: k.bias's true gradient is
            # exactly 0 (softmax ignores a shift shared by all keys), so its values are rounding noise.
            scale = max(p.grad.abs().max().item() for p in ref_params.values())
            for fqn in pm.plan.params:
                expected = shard_of(ref_params[fqn].grad, pm.state_layout(fqn), pm.plan.mesh_shape, coords)
                torch.testing.assert_close(pm.local_parameter(fqn).grad, expected, rtol=1e-5, atol=1e-5 * scale,
                                           msg=fqn)
        opt.step()
        opt.zero_grad()
        ref_opt.step()
        ref_opt.zero_grad()
    full = pm.full_state_dict()
    assert "lm_head.weight" not in pm.plan.params and set(full) == set(ref.state_dict())   # tied name too
    copy.deepcopy(ref).load_state_dict(full)                     # strict
    for fqn, value in full.items():
        # Adam divides by sqrt(v) + 1e-8: where a gradient element is within ~1e-7 of zero, the 1e-9
        # rounding difference of a sharded sum changes that element's step by a few percent of lr
        # (1e-3). Three steps stay far below 1e-4; a wrong shard moves elements by ~lr per step.
        torch.testing.assert_close(value, ref.state_dict()[fqn], rtol=1e-5, atol=1e-4, msg=fqn)


def test_builtin_gpt_trains_with_parity_on_two_ranks():
    run_distributed(_gpt_parity, 2)
