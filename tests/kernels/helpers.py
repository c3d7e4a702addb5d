"""Shared by the kernel tests: run a function forward and backward, and the tolerances."""

import torch
from torch.testing import assert_close

# fp32: the kernels accumulate in fp32 like eager, in a different order.
FP32 = dict(atol=1e-5, rtol=1e-5)
# bf16: the kernels' bf16 outputs against eager fp32 on the same (bf16-valued) inputs, so the
# margin covers bf16 rounding of outputs and of the tiles fed to matmuls.
BF16 = dict(atol=2e-2, rtol=2e-2)


def forward_backward(fn, inputs, grads):
    """Outputs of fn(*inputs) (a tensor or a tuple) and the gradients of its floating-point
    tensor inputs (None for one it does not use), for the loss sum(output * grad)."""
    leaves = [
        t.detach().clone().requires_grad_() if isinstance(t, torch.Tensor) and t.is_floating_point() else t
        for t in inputs
    ]
    outs = fn(*leaves)
    outs = outs if isinstance(outs, tuple) else (outs,)
    loss = sum((o.float() * g).sum() for o, g in zip(outs, grads, strict=True) if g is not None)
    loss.backward()
    grads_in = [t.grad for t in leaves if isinstance(t, torch.Tensor) and t.requires_grad]
    return [o.detach() for o in outs], grads_in


def assert_matches(kernel, reference, tol):
    """Pairwise close; nan matches nan (a mean over no valid target is nan for both)."""
    for got, want in zip(kernel, reference, strict=True):
        if got is None or want is None:
            assert got is None and want is None
        else:
            assert_close(got.float(), want.float(), equal_nan=True, **tol)
