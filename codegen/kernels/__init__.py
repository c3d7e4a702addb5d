"""Hand-written Triton kernels with forward and backward: norms, cross-entropy (plain and
vocab-parallel), attention with logsumexp, and rotary embedding.

Importing this package does not import Triton: the kernel modules are loaded on the first call,
after `available()` has checked that they can run. On CPU they run under the Triton interpreter
(`TRITON_INTERPRET=1`, set before the first call), which is how the tests check them.
"""

from __future__ import annotations

import functools
import importlib
import os

from ._combine import combine_attention

__all__ = [
    "available",
    "rms_norm",
    "layer_norm",
    "cross_entropy",
    "vocab_parallel_cross_entropy",
    "attention",
    "combine_attention",
    "ring_attention",
    "rotary_embedding",
]


@functools.cache
def available() -> tuple[bool, str]:
    """Whether the kernels can run here, and why (not). Probed once, then cached."""
    try:
        import triton  # noqa: F401
    except Exception as exc:  # a broken install fails in many ways; all mean "no Triton"
        return False, f"triton cannot be imported ({exc})"
    import torch

    if torch.cuda.is_available():
        return True, "triton with a CUDA device"
    if os.environ.get("TRITON_INTERPRET") == "1":
        return True, "triton interpreter on CPU (TRITON_INTERPRET=1)"
    return False, "no CUDA device and TRITON_INTERPRET is not set to 1"


def _impl(module: str):
    ok, reason = available()
    if not ok:
        raise RuntimeError(
            f"Triton kernels are unavailable: {reason}. Install triton (pip install triton), and "
            "on a machine without a CUDA GPU set TRITON_INTERPRET=1 before the first kernel call "
            "to run them on CPU under the Triton interpreter."
        )
    return importlib.import_module(f"{__name__}.{module}")


def rms_norm(x, weight=None, eps: float = 1e-6):
    """RMSNorm over the last dim: x / sqrt(mean(x^2) + eps) * weight. Any leading shape; fp32
    statistics; output in x's dtype. Gradients for x and weight."""
    return _impl("_norms").rms_norm(x, weight, eps)


def layer_norm(x, weight=None, bias=None, eps: float = 1e-5):
    """LayerNorm over the last dim, as torch.nn.functional.layer_norm(x, x.shape[-1:], ...).
    Gradients for x, weight and bias."""
    return _impl("_norms").layer_norm(x, weight, bias, eps)


def cross_entropy(logits, target, ignore_index: int = -100, reduction: str = "mean"):
    """Softmax cross-entropy over the last dim of 2-D logits [N, V], as
    torch.nn.functional.cross_entropy (a mean over no valid target is nan, as there). Targets
    must lie in [0, V) or equal ignore_index; unlike torch this is not checked, to avoid a sync."""
    return _impl("_cross_entropy").cross_entropy(logits, target, ignore_index, reduction)


def vocab_parallel_cross_entropy(
    logits_shard, target, group_name_or_group=None, ignore_index: int = -100, reduction: str = "mean"
):
    """Cross-entropy of logits sharded on the vocab dim over a process group: rank r holds the
    r-th of equal contiguous vocab slices, `target` holds global ids and is the same on every
    rank. The loss is the unsharded loss, on every rank; the backward gives each rank the
    gradient of its own shard, with no communication."""
    return _impl("_cross_entropy").vocab_parallel_cross_entropy(
        logits_shard, target, group_name_or_group, ignore_index, reduction
    )


def attention(q, k, v, *, causal: bool = False, mask=None, scale: float | None = None):
    """Softmax attention over q, k, v [B, H, S, D] (S_q may differ from S_kv); returns
    (out [B, H, Sq, D] in q's dtype, lse [B, H, Sq] in fp32).

    `causal` keeps key j for query i when j <= i (top-left aligned, as
    scaled_dot_product_attention's is_causal). `mask`, broadcastable to [B, H, Sq, Skv], is
    boolean (True = attend) or additive (added to the scaled scores); it is not differentiated.
    A query row with no key left gets out = 0 and lse = -inf, and zero gradients. The lse is
    differentiable, so results merged by `combine_attention` backpropagate exactly.
    """
    return _impl("_attention").attention(q, k, v, causal=causal, mask=mask, scale=scale)


def ring_attention(q, k, v, mask, is_causal: bool, scale, group: str):
    """``autopar.runtime.context_parallel.ring_attention`` (q, k, v split along the sequence over the
    group called ``group``) with each ring step's block on this library's flash attention, which
    returns the logsumexp the ring merges with; its backward uses the kernels' backward with the
    merged logsumexp."""
    from autopar.runtime.context_parallel import ring_attention as ring

    return ring(q, k, v, mask, is_causal, scale, group, blocks=_impl("_attention").RingBlocks)


def rotary_embedding(x, cos, sin):
    """x * cos + rotate_half(x) * sin (the LLaMA / Hugging Face convention) for x [B, H, S, D],
    with cos and sin broadcastable to x (e.g. [S, D] or [B, 1, S, D]). cos and sin are treated
    as constants: only x gets a gradient."""
    return _impl("_rotary").rotary_embedding(x, cos, sin)
