"""Launch helpers shared by the kernel modules."""

import inspect
import os

import torch


def interpreting() -> bool:
    return os.environ.get("TRITON_INTERPRET") == "1"


def _squeeze_interpreter_index() -> None:
    """Lets `range(0, n, BLOCK)` over a runtime scalar `n` run under Triton 3.6's interpreter with
    NumPy >= 2.4. The interpreter holds a scalar argument as a 1-element array and its `__index__`
    does `int(array)`, which NumPy 2.4 refuses ("only 0-dimensional arrays can be converted to Python
    scalars"); later Triton (triton-lang/triton#9172) squeezes the array first, as this does."""
    try:
        from triton.runtime import interpreter
    except ImportError:
        return
    patch = getattr(interpreter, "_patch_lang_tensor", None)
    # Only the (tensor, scope) form that Triton 3.6 to 3.9 have, and only once.
    if patch is None or getattr(patch, "_autopar_squeezed", False) or \
            list(inspect.signature(patch).parameters) != ["tensor", "scope"]:
        return

    def patched(tensor, scope):
        patch(tensor, scope)
        scope.set_attr(tensor, "__index__", lambda self: int(self.handle.data.squeeze()))

    patched._autopar_squeezed = True
    interpreter._patch_lang_tensor = patched


if interpreting():
    _squeeze_interpreter_index()


def persistent_programs(device: torch.device, work: int, per_sm: int = 4) -> int:
    """Programs for a grid that loops over `work` items: a few per SM fill a GPU, and every
    program writes one partial row of a reduction, so more would only grow that buffer."""
    if device.type == "cuda" and not interpreting():
        return max(1, min(work, per_sm * torch.cuda.get_device_properties(device).multi_processor_count))
    return max(1, min(work, 4))


def dot_precision(dtype: torch.dtype) -> str:
    # tl.dot defaults to tf32 for fp32 operands on GPU; fp32 inputs ask for fp32 results.
    return "ieee" if dtype == torch.float32 else "tf32"
