"""Plans shared by the inspection tests: planned once per session and saved as JSON, because planning
LLaMA on 64 or 512 GPUs takes seconds to tens of seconds on a 2-core machine."""
from __future__ import annotations

import logging

import pytest
import torch

import autopar

transformers = pytest.importorskip("transformers")


def _gpt2(**cfg):
    # Dropout off and no KV cache, as in training; bos/eos inside the vocabulary to keep the config quiet.
    cfg = {"n_embd": 768, "n_layer": 12, "n_head": 12, "vocab_size": 50257, "n_positions": 1024, **cfg}
    config = transformers.GPT2Config(use_cache=False, resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0,
                                     bos_token_id=cfg["vocab_size"] - 1, eos_token_id=cfg["vocab_size"] - 1, **cfg)
    with torch.device("meta"):
        model = transformers.GPT2LMHeadModel(config)
    model.loss_type = "ForCausalLM"
    return model, config.vocab_size


def _llama(hidden, layers, heads, kv_heads, ffn, vocab):
    config = transformers.LlamaConfig(hidden_size=hidden, num_hidden_layers=layers, num_attention_heads=heads,
                                      num_key_value_heads=kv_heads, intermediate_size=ffn, vocab_size=vocab,
                                      tie_word_embeddings=False, use_cache=False)
    with torch.device("meta"):
        return transformers.LlamaForCausalLM(config), vocab


def _plan(built, cluster, batch, seq, **options):
    model, vocab = built
    ids = torch.randint(0, vocab, (batch, seq))
    logging.getLogger("autopar").setLevel(logging.ERROR)
    return autopar.plan(model, autopar.ClusterSpec.preset(cluster), (ids,), {"labels": ids.clone()},
                        progress=False, **options)


@pytest.fixture(scope="session")
def plan_dir(tmp_path_factory):
    return tmp_path_factory.mktemp("plans")


def _saved(plan_dir, name, make):
    plan = make()
    plan.save(plan_dir / f"{name}.json")
    return plan


@pytest.fixture(scope="session")
def gpt2_8(plan_dir):
    return _saved(plan_dir, "gpt2_8xH100", lambda: _plan(_gpt2(), "8xH100", 8, 1024))


@pytest.fixture(scope="session")
def gpt2_16(plan_dir):
    return _saved(plan_dir, "gpt2_16xH100", lambda: _plan(_gpt2(), "16xH100", 8, 1024))


# The LLaMA plans are made on the 3-D pipeline meshes the mesh search picks for them, given as the
# mesh: the reports of these large pipeline plans are what the tests read, and searching the other
# candidate meshes again would take most of the planning time.
@pytest.fixture(scope="session")
def llama3_8b(plan_dir):
    return _saved(plan_dir, "llama3-8b_64xH100",
                  lambda: _plan(_llama(4096, 32, 32, 8, 14336, 128256), "64xH100", 8, 4096,
                                mesh_shape=(4, 2, 8), axis_names=("pp", "dp", "tp")))


@pytest.fixture(scope="session")
def llama2_70b(plan_dir):
    return _saved(plan_dir, "llama2-70b_512xH100",
                  lambda: _plan(_llama(8192, 80, 64, 8, 28672, 32000), "512xH100", 8, 4096,
                                mesh_shape=(8, 8, 8), axis_names=("pp", "dp", "tp")))


@pytest.fixture(scope="session")
def wide_gpt(plan_dir):
    """The planner issue's wide GPT block: one layer, hidden 8192, a small batch, one 8-GPU node used as
    a single tensor-parallel axis."""
    return _saved(plan_dir, "wide_gpt_8xH100",
                  lambda: _plan(_gpt2(n_embd=8192, n_layer=1, n_head=64, vocab_size=1024, n_positions=512),
                                "8xH100", 4, 512, mesh_shape=(8,), axis_names=("tp",)))
