"""ATen ops the local program calls in a form whose storage the memory model can know.

``flatten`` views its input where the strides allow and copies where they do not, and which one a
rank gets depends on layouts the plan does not fix: CPU's flash attention lays its output out like its
query (sequence-major where the query is a projection's view, head-major where a collective made it),
CUDA's always sequence-major. The memory model counts a flatten as a storage of its own
(passes/memory.py: it is not among the view ops); a view of a slice of a larger storage (a rank's rows
of an attention output kept whole) would keep the whole storage alive for as long as the flatten's
readers keep it, for the output projection until its backward. Here such a view is copied, so the
storage is always the flatten's own and no larger than its output.
"""
from __future__ import annotations

import torch


def flatten(x: torch.Tensor, start_dim: int = 0, end_dim: int = -1) -> torch.Tensor:
    """``x.flatten(start_dim, end_dim)`` in a storage no larger than it: copied where torch's view of
    ``x`` would keep a larger storage alive."""
    y = torch.ops.aten.flatten.using_ints(x, start_dim, end_dim)
    storage = y.untyped_storage()
    if storage.data_ptr() == x.untyped_storage().data_ptr() and y.numel() * y.element_size() < storage.nbytes():
        y = y.clone()
    return y
