"""A small, dependency-free GPT in plain torch.nn, for tests and demos.

``attn.q``, ``attn.k``, ``attn.v`` and the output projection ``attn.o`` are separate ``nn.Linear``
layers (not one fused ``c_attn``), so a plan can split attention by heads without splitting through a
fused weight.

``forward`` returns ``GPTOutput``, a NamedTuple: torch's pytree flattens NamedTuples natively, so
``torch.export`` (and autopar's capture) give back the same structure with no registration, and
``out.loss`` / ``out.logits`` read like a Hugging Face ModelOutput.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import NamedTuple, Optional

import torch
import torch.nn as nn
import torch.nn.functional as F


@dataclass
class GPTConfig:
    vocab_size: int
    n_layer: int
    n_head: int
    d_model: int
    d_ff: int
    max_seq: int
    dropout: float = 0.0
    tie_embeddings: bool = True


class GPTOutput(NamedTuple):
    loss: Optional[torch.Tensor]   # None when no labels are given
    logits: torch.Tensor


class Attention(nn.Module):
    def __init__(self, cfg: GPTConfig):
        super().__init__()
        if cfg.d_model % cfg.n_head:
            raise ValueError(f"d_model {cfg.d_model} is not divisible by n_head {cfg.n_head}")
        self.n_head, self.dropout = cfg.n_head, cfg.dropout
        self.q, self.k, self.v, self.o = (nn.Linear(cfg.d_model, cfg.d_model) for _ in range(4))

    def forward(self, x):
        b, t, _ = x.shape
        # Sizes come from the projections, not from x: under hand-written tensor parallelism each rank
        # holds n_head / tp heads of the full head size.
        q, k, v = (p(x).unflatten(-1, (self.n_head, -1)).transpose(1, 2) for p in (self.q, self.k, self.v))
        y = F.scaled_dot_product_attention(q, k, v, dropout_p=self.dropout if self.training else 0.0,
                                           is_causal=True)
        return self.o(y.transpose(1, 2).flatten(2))


class MLP(nn.Module):
    def __init__(self, cfg: GPTConfig):
        super().__init__()
        self.fc1 = nn.Linear(cfg.d_model, cfg.d_ff)
        self.fc2 = nn.Linear(cfg.d_ff, cfg.d_model)

    def forward(self, x):
        return self.fc2(F.gelu(self.fc1(x)))


class Block(nn.Module):
    def __init__(self, cfg: GPTConfig):
        super().__init__()
        self.ln1, self.attn = nn.LayerNorm(cfg.d_model), Attention(cfg)
        self.ln2, self.mlp = nn.LayerNorm(cfg.d_model), MLP(cfg)
        self.drop = nn.Dropout(cfg.dropout)

    def forward(self, x):
        x = x + self.drop(self.attn(self.ln1(x)))
        return x + self.drop(self.mlp(self.ln2(x)))


class GPT(nn.Module):
    def __init__(self, cfg: GPTConfig):
        super().__init__()
        self.config = cfg
        self.tok_emb = nn.Embedding(cfg.vocab_size, cfg.d_model)
        self.pos_emb = nn.Embedding(cfg.max_seq, cfg.d_model)
        self.drop = nn.Dropout(cfg.dropout)
        self.blocks = nn.ModuleList(Block(cfg) for _ in range(cfg.n_layer))
        self.ln_f = nn.LayerNorm(cfg.d_model)
        self.lm_head = nn.Linear(cfg.d_model, cfg.vocab_size, bias=False)
        self.apply(self._init)
        if cfg.tie_embeddings:
            self.lm_head.weight = self.tok_emb.weight

    @staticmethod
    def _init(m):
        # GPT-2's initialization; PyTorch's defaults give an embedding of std 1, which starts the
        # loss far above log(vocab).
        if isinstance(m, (nn.Linear, nn.Embedding)):
            nn.init.normal_(m.weight, std=0.02)
        if isinstance(m, nn.Linear) and m.bias is not None:
            nn.init.zeros_(m.bias)

    def forward(self, input_ids: torch.Tensor, labels: torch.Tensor | None = None) -> GPTOutput:
        t = input_ids.shape[1]
        if t > self.config.max_seq:
            raise ValueError(f"sequence length {t} exceeds max_seq {self.config.max_seq}")
        pos = torch.arange(t, device=input_ids.device)
        x = self.drop(self.tok_emb(input_ids) + self.pos_emb(pos))
        for block in self.blocks:
            x = block(x)
        logits = self.lm_head(self.ln_f(x))
        loss = None
        if labels is not None:
            # Position i predicts token i + 1.
            loss = F.cross_entropy(logits[:, :-1].reshape(-1, logits.shape[-1]), labels[:, 1:].reshape(-1))
        return GPTOutput(loss, logits)
