"""Models and plan options for the memory-fidelity tests and bench/memory_fidelity.py: each plan kind
forced with pins on small configs of the architectures the tests cover."""
from __future__ import annotations

import torch

ARCHS = ("gpt2", "llama", "bert", "gpt", "gpt-probe", "gpt-vocab", "gpt-long", "gpt-seq", "llama-long", "qwen2")
KINDS = ("auto", "dp", "dp-bf16", "megatron", "zero3", "megatron-recompute", "zero3-recompute", "zero1", "zero1-bf16", "zero2-bf16", "zero2-recompute", "vocab",
         "vocab-sharded-outputs", "vocab-sliced",
         "recompute", "sharded-outputs", "2d", "ring", "heads")
# (tokens, batch) of the long-sequence architectures, whatever the caller asks: one sequence long
# enough, over a small vocabulary, that attention's buffers are most of the peak.
LONG_SEQUENCE = {"gpt-long": (2048, 1), "gpt-seq": (2048, 1), "llama-long": (1024, 1)}


def build(arch: str, seq: int, batch: int, device):
    """A small model of ``arch`` (random weights, on CPU: compile moves each rank's shards to its device)
    and its inputs (ids, labels) on ``device``."""
    vocab = 512
    seq, batch = LONG_SEQUENCE.get(arch, (seq, batch))
    torch.manual_seed(0)
    if arch in ("gpt2", "llama", "bert", "qwen2", "llama-long"):
        import transformers as tf
    if arch == "gpt2":
        model = tf.GPT2LMHeadModel(tf.GPT2Config(n_layer=2, n_embd=128, n_head=4, vocab_size=vocab, n_positions=seq,
                                                 use_cache=False, resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0))
    elif arch == "llama":
        model = tf.LlamaForCausalLM(tf.LlamaConfig(num_hidden_layers=2, hidden_size=128, num_attention_heads=4,
                                                   num_key_value_heads=2, intermediate_size=256, vocab_size=vocab,
                                                   max_position_embeddings=seq, use_cache=False))
    elif arch == "llama-long":     # one layer, its attention given a boolean causal mask
        vocab = 16
        model = tf.LlamaForCausalLM(tf.LlamaConfig(num_hidden_layers=1, hidden_size=128, num_attention_heads=4,
                                                   num_key_value_heads=2, intermediate_size=256, vocab_size=vocab,
                                                   max_position_embeddings=seq, use_cache=False))
    elif arch == "bert":
        model = tf.BertForMaskedLM(tf.BertConfig(num_hidden_layers=2, hidden_size=128, num_attention_heads=4,
                                                 intermediate_size=256, vocab_size=vocab, max_position_embeddings=seq,
                                                 hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0))
    elif arch == "qwen2":          # biased q, k, v projections, grouped-query attention, untied head
        model = tf.Qwen2ForCausalLM(tf.Qwen2Config(num_hidden_layers=2, hidden_size=128, num_attention_heads=4,
                                                   num_key_value_heads=2, intermediate_size=256, vocab_size=vocab,
                                                   max_position_embeddings=seq, use_cache=False,
                                                   tie_word_embeddings=False))
    elif arch == "gpt-long":
        from autopar.models import GPT, GPTConfig

        vocab = 16
        model = GPT(GPTConfig(vocab_size=vocab, n_layer=1, n_head=4, d_model=128, d_ff=256, max_seq=seq))
    elif arch == "gpt-seq":        # bench/long_seq.py's model: two layers, logits as large as a layer's activations
        from autopar.models import GPT, GPTConfig

        vocab = 256
        model = GPT(GPTConfig(vocab_size=vocab, n_layer=2, n_head=4, d_model=64, d_ff=256, max_seq=seq))
    elif arch == "gpt":
        from autopar.models import GPT, GPTConfig

        model = GPT(GPTConfig(vocab_size=vocab, n_layer=2, n_head=4, d_model=128, d_ff=256, max_seq=seq))
    elif arch == "gpt-vocab":      # a large vocabulary on a small model: the loss's buffers dominate
        from autopar.models import GPT, GPTConfig

        vocab = 32768
        model = GPT(GPTConfig(vocab_size=vocab, n_layer=1, n_head=2, d_model=32, d_ff=64, max_seq=seq))
    elif arch == "gpt-probe":      # bench/train_cpu.py's family at a size two CPU cores train quickly
        from autopar.models import GPT, GPTConfig

        vocab = 2048
        model = GPT(GPTConfig(vocab_size=vocab, n_layer=4, n_head=8, d_model=256, d_ff=1024, max_seq=seq))
    else:
        raise SystemExit(f"unknown architecture {arch!r}; choose from {', '.join(ARCHS)}")
    ids = torch.randint(0, vocab, (batch, seq), generator=torch.Generator().manual_seed(1)).to(device)
    if arch.startswith("gpt") and arch != "gpt2":
        return model, (ids, ids.clone()), {}
    return model, (ids,), {"labels": ids.clone()}


def options(arch: str, kind: str, ranks: int, model) -> dict | None:
    """plan() options that force ``kind``, or None where it does not apply."""
    from tests.hf_models import MEGATRON, VOCAB_PARALLEL, VOCAB_PARALLEL_NODES

    key = arch.split("-")[0] if arch.split("-")[0] in ("gpt", "llama") else arch
    params_r = {name: ["R"] for name, _ in model.named_parameters()}
    if kind in ("megatron", "megatron-recompute", "vocab", "vocab-sharded-outputs", "2d") and (key not in MEGATRON
                                                                        or key not in VOCAB_PARALLEL):
        return None       # no hand-written tensor-parallel pins for this architecture
    if kind == "auto":
        return {}
    if kind == "dp":
        return {"mesh_shape": (ranks,), "pins": params_r, "recompute": False}
    if kind == "dp-bf16":     # the batch split under bf16-mixed: the weights' gradients reduced in buckets
        if key not in ("gpt", "llama"):
            return None
        pins = {**{name: {"output": ["R"], "zero": 0} for name, _ in model.named_parameters()},
                "input_ids": ["S(0)"], "labels": ["S(0)"], "linear*": ["S(0)"]}
        return {"mesh_shape": (ranks,), "pins": pins, "recompute": False, "precision": "bf16-mixed"}
    if kind in ("megatron", "zero3", "megatron-recompute", "zero3-recompute"):   # the last two: every layer
        #                                                                          recomputed
        recompute = {"*": "all"} if kind.endswith("recompute") else False
        if kind.startswith("megatron"):
            return {"mesh_shape": (ranks,), "pins": {k: [v] for k, v in MEGATRON[key].items()}, "recompute": recompute}
        pins = {name: ["S(0)"] if p.shape[0] % ranks == 0 else ["R"] for name, p in model.named_parameters()}
        return {"mesh_shape": (ranks,), "pins": pins, "recompute": recompute}
    if kind == "zero1":        # ZeRO-1 everywhere: each whole gradient all-reduced in the runtime's buckets
        pins = {name: {"output": ["R"], "zero": 1} for name, _ in model.named_parameters()}
        return {"mesh_shape": (ranks,), "pins": pins, "recompute": False}
    if kind == "zero1-bf16":   # ZeRO-1 everywhere under bf16-mixed: the float32 masters of the weights read
        #                        only through their bfloat16 copies are sharded
        pins = {name: {"output": ["R"], "zero": 1} for name, _ in model.named_parameters()}
        return {"mesh_shape": (ranks,), "pins": pins, "recompute": False, "precision": "bf16-mixed"}
    if kind == "zero2-bf16":   # ZeRO-2 layer matrices under bf16-mixed: each copy's gradient reduce-scattered
        #                        into its sharded float32 master's block; embeddings, biases, norms replicated
        if key not in ("gpt", "llama"):
            return None
        pins = {name: {"output": ["R"], "zero": 2 if p.dim() > 1 and "emb" not in name else 0}
                for name, p in model.named_parameters()}
        return {"mesh_shape": (ranks,), "pins": pins, "recompute": False, "precision": "bf16-mixed"}
    if kind == "zero2-recompute":     # ZeRO-2 matrices, replicated biases and norms, every layer recomputed
        pins = {name: {"output": ["R"], "zero": 2 if p.dim() > 1 else 0} for name, p in model.named_parameters()}
        return {"mesh_shape": (ranks,), "pins": pins, "recompute": {"*": "all"}}
    if kind in ("vocab", "vocab-sharded-outputs"):
        if key == "bert":
            return None
        pins = {**{k: [v] for k, v in VOCAB_PARALLEL[key].items()}, **VOCAB_PARALLEL_NODES}
        return {"mesh_shape": (ranks,), "pins": pins, "recompute": False,
                **({"sharded_outputs": True} if kind == "vocab-sharded-outputs" else {})}
    if kind == "vocab-sliced":        # the logits made whole, then sliced (local_chunk) to the loss
        if arch != "gpt-vocab":
            return None
        pins = {**{k: [v] for k, v in VOCAB_PARALLEL[key].items()}, **VOCAB_PARALLEL_NODES,
                "linear_6": {"inputs": [["R"], ["R"]]}, "slice_1": {"inputs": [["S(2)"]]}}
        return {"mesh_shape": (ranks,), "pins": pins, "recompute": False}
    if kind == "recompute":
        return {"mesh_shape": (ranks,), "pins": params_r, "recompute": {"*": "all"}}
    if kind == "sharded-outputs":
        return {"sharded_outputs": True, "recompute": False}
    if kind == "2d":
        if ranks != 4:
            return None
        pins = {k: ["R", v] for k, v in MEGATRON[key].items()}
        return {"mesh_shape": (2, 2), "axis_names": ("dp", "tp"), "pins": pins, "recompute": False}
    if kind == "ring":      # every activation split along the sequence, attention as a ring
        if arch not in LONG_SEQUENCE:
            return None
        mask = [["S(2)"]] if arch == "llama-long" else []
        pins = {"input_ids": ["S(1)"], "labels": ["S(1)"], **params_r,
                "scaled_dot_product_attention*": {"inputs": [["S(2)"]] * 3 + mask}}
        return {"mesh_shape": (ranks,), "pins": pins, "recompute": False}
    if kind == "heads":     # attention split by heads, its inputs gathered along the sequence
        if arch not in LONG_SEQUENCE:
            return None
        mask = [["R"]] if arch == "llama-long" else []
        pins = {"scaled_dot_product_attention*": {"inputs": [["S(1)"]] * 3 + mask}}
        return {"mesh_shape": (ranks,), "pins": pins, "recompute": False}
    raise SystemExit(f"unknown plan kind {kind!r}; choose from {', '.join(KINDS)}")
