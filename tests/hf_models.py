"""Small configs of real Hugging Face architectures, with random weights and no dropout, for parity."""
import torch

VOCAB, BATCH, SEQ = 128, 8, 16


def build(name: str, layers: int = 2) -> torch.nn.Module:
    """A tiny model of the family ``name`` with ``layers`` repeated layers (a pipeline of p stages needs
    p of them, 2p under the interleaved and zero-bubble V schedules)."""
    import transformers as tf

    if name == "gpt2":
        cfg = tf.GPT2Config(n_layer=layers, n_embd=64, n_head=4, vocab_size=VOCAB, n_positions=32, use_cache=False,
                            resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0, bos_token_id=0, eos_token_id=0)
        return tf.GPT2LMHeadModel(cfg)
    if name == "llama":
        cfg = tf.LlamaConfig(num_hidden_layers=layers, hidden_size=64, num_attention_heads=4, num_key_value_heads=2,
                             intermediate_size=128, vocab_size=VOCAB, max_position_embeddings=32, use_cache=False)
        return tf.LlamaForCausalLM(cfg)
    if name == "bert":
        cfg = tf.BertConfig(num_hidden_layers=layers, hidden_size=64, num_attention_heads=4, intermediate_size=128,
                            vocab_size=VOCAB, max_position_embeddings=32, hidden_dropout_prob=0.0,
                            attention_probs_dropout_prob=0.0)
        return tf.BertForMaskedLM(cfg)
    if name == "gpt":
        from autopar.models import GPT, GPTConfig

        return GPT(GPTConfig(vocab_size=VOCAB, n_layer=layers, n_head=4, d_model=64, d_ff=128, max_seq=32))
    raise KeyError(name)


def batch(seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, VOCAB, (BATCH, SEQ), generator=g)
    return ids, ids.clone()


# Megatron column -> row tensor parallelism, per architecture, on one mesh axis. nn.Linear keeps weights
# as [out, in] (column = S(0), row = S(1)); GPT-2's Conv1D as [in, out]. GPT-2 fuses q, k and v in one
# matrix that is split after the matmul: its columns are strided in 3 groups (S(1,3)), so that every
# rank holds its heads of each of q, k and v.
MEGATRON = {
    "gpt2": {"*.attn.c_attn.weight": "S(1,3)", "*.attn.c_attn.bias": "S(0,3)", "*.attn.c_proj.weight": "S(0)",
             "*.mlp.c_fc.weight": "S(1)", "*.mlp.c_fc.bias": "S(0)", "*.mlp.c_proj.weight": "S(0)"},
    "llama": {"*.q_proj.weight": "S(0)", "*.k_proj.weight": "S(0)", "*.v_proj.weight": "S(0)",
              "*.o_proj.weight": "S(1)", "*.gate_proj.weight": "S(0)", "*.up_proj.weight": "S(0)",
              "*.down_proj.weight": "S(1)"},
    "bert": {"*.attention.self.query.weight": "S(0)", "*.attention.self.key.weight": "S(0)",
             "*.attention.self.value.weight": "S(0)", "*.attention.output.dense.weight": "S(1)",
             "*.intermediate.dense.weight": "S(0)", "*.output.dense.weight": "S(1)"},
    "gpt": {"*.q.weight": "S(0)", "*.k.weight": "S(0)", "*.v.weight": "S(0)", "*.o.weight": "S(1)",
            "*.fc1.weight": "S(0)", "*.fc2.weight": "S(1)"},
}

# Megatron's vocab parallelism on one mesh axis: the token embedding (tied to the LM head where the model
# ties them) split by vocabulary rows, looked up by the vocab-parallel embedding, and the loss computed
# by the vocab-parallel cross-entropy (pinned by what it reads: logits split on the vocabulary).
VOCAB_PARALLEL = {
    "gpt2": {"transformer.wte.weight": "S(0)"},
    "llama": {"model.embed_tokens.weight": "S(0)", "lm_head.weight": "S(0)"},
    "bert": {"bert.embeddings.word_embeddings.weight": "S(0)"},
    "gpt": {"tok_emb.weight": "S(0)"},
}
VOCAB_PARALLEL_NODES = {"embedding": {"inputs": [["S(0)"], ["R"]]},
                        "cross_entropy_loss_default": {"inputs": [["S(1)"], ["R"]]}}
