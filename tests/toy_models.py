"""Hand-built models for planner tests: a pre-LayerNorm transformer block with separate q, k, v."""
import torch
import torch.nn.functional as F
from torch import nn


class Block(nn.Module):
    def __init__(self, h, heads, ff):
        super().__init__()
        self.heads = heads
        self.ln1, self.ln2 = nn.LayerNorm(h), nn.LayerNorm(h)
        self.q, self.k, self.v, self.o = (nn.Linear(h, h) for _ in range(4))
        self.fc1, self.fc2 = nn.Linear(h, ff), nn.Linear(ff, h)

    def forward(self, x):
        b, t, h = x.shape
        y = self.ln1(x)
        q, k, v = (m(y).view(b, t, self.heads, h // self.heads).transpose(1, 2) for m in (self.q, self.k, self.v))
        a = F.scaled_dot_product_attention(q, k, v, is_causal=True).transpose(1, 2).reshape(b, t, h)
        x = x + self.o(a)
        return x + self.fc2(F.gelu(self.fc1(self.ln2(x))))


class Stack(nn.Module):
    """Blocks on an activation input, ending in a scalar loss."""

    def __init__(self, h, heads, ff, layers):
        super().__init__()
        self.blocks = nn.ModuleList(Block(h, heads, ff) for _ in range(layers))

    def forward(self, x):
        for b in self.blocks:
            x = b(x)
        return x.float().pow(2).mean()


def wide_stack(h=8192, heads=64, layers=2, dtype=torch.bfloat16):
    with torch.device("meta"):
        return Stack(h, heads, 4 * h, layers).to(dtype)
