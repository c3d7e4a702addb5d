"""Named models with example inputs, for offline planning, tests and demos.

``build(name)`` returns ``(model, example_args, example_kwargs)``. The models are random-weight
Hugging Face architectures built from their config classes (``transformers`` is imported only when
one is asked for), on the meta device by default so that planning even a 70B model needs no memory.
Dropout is 0 and causal LMs do not return their KV cache, as in training.

``name`` may also be ``"package.module:function"``: the function returns a model, or a
``(model, args, kwargs)`` tuple. For a bare model the inputs are ``batch x seq`` token ids in
``[0, model.config.vocab_size)`` (128 when the model has no config), with ``seq`` defaulting to
``min(128, the model's maximum positions)``.
"""
from __future__ import annotations

import importlib

import torch

from autopar.errors import AutoparError


class ZooError(AutoparError, ValueError):
    """An unknown model name, or a model function that cannot be loaded."""


def _hf(class_name: str, config_name: str, **config):
    def make():
        try:
            import transformers
        except ImportError as e:
            raise ImportError("the model zoo builds Hugging Face architectures: pip install transformers") from e
        cfg = getattr(transformers, config_name)(**config)
        model = getattr(transformers, class_name)(cfg)
        if class_name == "GPT2LMHeadModel":
            # transformers picks the loss from the class name, does not recognize this one, and falls
            # back to the same causal-LM loss with a warning; name it to keep outputs clean.
            model.loss_type = "ForCausalLM"
        return model
    return make


def _gpt2(n_embd, n_layer, n_head, vocab_size=50257, n_positions=1024):
    return _hf("GPT2LMHeadModel", "GPT2Config", n_embd=n_embd, n_layer=n_layer, n_head=n_head,
               vocab_size=vocab_size, n_positions=n_positions, use_cache=False,
               bos_token_id=vocab_size - 1, eos_token_id=vocab_size - 1,
               resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0)


def _llama(hidden, layers, heads, kv_heads, ffn, vocab, positions, rope_theta):
    return _hf("LlamaForCausalLM", "LlamaConfig", hidden_size=hidden, num_hidden_layers=layers,
               num_attention_heads=heads, num_key_value_heads=kv_heads, intermediate_size=ffn,
               vocab_size=vocab, max_position_embeddings=positions, rms_norm_eps=1e-5,
               rope_parameters={"rope_type": "default", "rope_theta": rope_theta},
               tie_word_embeddings=False, attention_dropout=0.0, use_cache=False)


def _bert(hidden, layers, heads, ffn, vocab=30522, positions=512):
    return _hf("BertForMaskedLM", "BertConfig", hidden_size=hidden, num_hidden_layers=layers,
               num_attention_heads=heads, intermediate_size=ffn, vocab_size=vocab,
               max_position_embeddings=positions, hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0,
               use_cache=False)


def _gpt_tiny():
    from autopar.models import GPT, GPTConfig

    return GPT(GPTConfig(vocab_size=128, n_layer=2, n_head=4, d_model=64, d_ff=256, max_seq=64))


# name -> (constructor, default sequence length)
_ZOO = {
    "gpt2": (_gpt2(768, 12, 12), 1024),
    "gpt2-xl": (_gpt2(1600, 48, 25), 1024),
    "llama3-8b": (_llama(4096, 32, 32, 8, 14336, 128256, 8192, 500000.0), 4096),
    "llama2-70b": (_llama(8192, 80, 64, 8, 28672, 32000, 4096, 10000.0), 4096),
    # Qwen2-7B's shape as a LLaMA (no q/k/v biases) at 128k tokens: 4 KV heads cap the head split at
    # 4 ways, so long context on 8 GPUs must split the sequence.
    "gqa-7b-128k": (_llama(3584, 28, 28, 4, 18944, 152064, 131072, 1000000.0), 131072),
    "bert-large": (_bert(1024, 24, 16, 4096), 512),
    "gpt2-tiny": (_gpt2(64, 2, 4, vocab_size=128, n_positions=64), 16),
    "llama-tiny": (_llama(64, 2, 4, 2, 128, 128, 64, 10000.0), 16),
    "bert-tiny": (_bert(64, 2, 4, 128, vocab=128, positions=64), 16),
    "gpt-tiny": (_gpt_tiny, 16),
}
NAMES = tuple(_ZOO)
# What the zoo's large models are trained in: bf16 compute over fp32 master weights.
DEFAULT_PRECISION = {"gpt2-xl": "bf16-mixed", "llama3-8b": "bf16-mixed", "llama2-70b": "bf16-mixed",
                     "gqa-7b-128k": "bf16-mixed"}


def build(name: str, *, batch: int = 8, seq: int | None = None, device="meta", dtype=None):
    """``(model, (input_ids,), {"labels": labels})`` for a zoo name or ``"package.module:function"``.

    ``dtype`` (default float32) is the parameters' dtype; the ids and labels are int64 on the
    model's device, two distinct tensors (export would otherwise fold them into one input). A
    function's ``(model, args, kwargs)`` is returned as it is.
    """
    if name in _ZOO:
        make, default_seq = _ZOO[name]
    else:
        make, default_seq = _load(name), None
    with torch.device(device):
        model = make()
    if isinstance(model, tuple):
        if len(model) != 3 or not isinstance(model[0], torch.nn.Module):
            raise ZooError(f"{name} returned a tuple of {len(model)} items; return a model or (model, args, kwargs)")
        return model
    if not isinstance(model, torch.nn.Module):
        raise ZooError(f"{name} returned a {type(model).__name__}; return an nn.Module or (model, args, kwargs)")
    if dtype is not None:
        model.to(dtype)
    cfg = getattr(model, "config", None)
    limit = next((v for v in (getattr(cfg, a, None) for a in ("max_position_embeddings", "n_positions", "max_seq"))
                  if isinstance(v, int)), None)
    seq = seq or default_seq or min(128, limit or 128)
    # On meta an out-of-range position index goes unnoticed: refuse it here instead.
    if limit is not None and seq > limit:
        raise ZooError(f"sequence length {seq} exceeds {name}'s {limit} positions")
    vocab = getattr(cfg, "vocab_size", None) or 128
    device = next((p.device for p in model.parameters()), torch.device(device))
    # Drawn on CPU with a fixed generator, so every call (and every rank) gets the same batch.
    ids = torch.randint(0, vocab, (batch, seq), generator=torch.Generator().manual_seed(0)).to(device)
    return model, (ids,), {"labels": ids.clone()}


def _load(name: str):
    if ":" not in name:
        raise ZooError(f"unknown model {name!r}; use one of {', '.join(NAMES)} or 'package.module:function'")
    module_name, _, fn_name = name.partition(":")
    try:
        fn = getattr(importlib.import_module(module_name), fn_name)
    except (ImportError, AttributeError) as e:
        raise ZooError(f"cannot load model function {name!r}: {e}") from e
    if not callable(fn):
        raise ZooError(f"{name} is a {type(fn).__name__}, not a function returning a model")
    return fn
