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


def _pass_cpu_arguments_as_they_are() -> None:
    """Lets a kernel's CPU tensor arguments be freed when their last user drops them, as on a GPU.

    Before each launch the interpreter copies every tensor argument's storage to the host and after
    it copies them back, through nested functions that call themselves (`_to_cpu`, `_from_cpu`): each
    is a reference cycle with its closure, which holds the argument storages until Python's cyclic
    collector runs, often many launches later. A step then keeps every tensor a kernel ever read
    (measured: the logits and their gradient of the library's loss live on through the backward of
    the layers before it). On CPU the host copy is the argument's own storage (`UntypedStorage.cpu()`
    returns it), so handing the arguments over as they are launches the same kernel on the same
    memory, with no cycle and no copy back onto itself."""
    try:
        from triton.runtime.interpreter import GridExecutor
        from triton.tools.tensor_descriptor import TensorDescriptor
    except ImportError:
        return
    # Another Triton's interpreter may name its copies otherwise: it then keeps its own behaviour.
    init = getattr(GridExecutor, "_init_args_hst", None)
    restore = getattr(GridExecutor, "_restore_args_dev", None)
    if init is None or restore is None or getattr(init, "_autopar_in_place", False):
        return

    def as_they_are(values) -> bool:
        # A CPU tensor (a parameter too), or what the interpreter hands over unchanged: no tuple, no tensor
        # descriptor, nothing with a data_ptr (a tensor on another device, a reinterpreted one).
        return all((isinstance(v, torch.Tensor) and v.device.type == "cpu")
                   or not (isinstance(v, (tuple, TensorDescriptor)) or hasattr(v, "data_ptr"))
                   for v in values)

    def init_args(self, args_dev, kwargs):
        if as_they_are(args_dev) and as_they_are(kwargs.values()):
            return list(args_dev), dict(kwargs)
        return init(self, args_dev, kwargs)

    def restore_args(self, args_dev, args_hst, kwargs, kwargs_hst):
        if all(h is d for h, d in zip(args_hst, args_dev)) and all(kwargs_hst[k] is v for k, v in kwargs.items()):
            return
        restore(self, args_dev, args_hst, kwargs, kwargs_hst)

    init_args._autopar_in_place = True
    GridExecutor._init_args_hst, GridExecutor._restore_args_dev = init_args, restore_args


def patch_interpreter() -> None:
    """The interpreter's fixes above, once, when kernels run under it (generated kernels call this
    before their first launch; the library's modules import this one)."""
    if interpreting():
        _squeeze_interpreter_index()
        _pass_cpu_arguments_as_they_are()


patch_interpreter()


def persistent_programs(device: torch.device, work: int, per_sm: int = 4) -> int:
    """Programs for a grid that loops over `work` items: a few per SM fill a GPU, and every
    program writes one partial row of a reduction, so more would only grow that buffer."""
    if device.type == "cuda" and not interpreting():
        return max(1, min(work, per_sm * torch.cuda.get_device_properties(device).multi_processor_count))
    return max(1, min(work, 4))


def dot_precision(dtype: torch.dtype) -> str:
    # tl.dot defaults to tf32 for fp32 operands on GPU; fp32 inputs ask for fp32 results.
    return "ieee" if dtype == torch.float32 else "tf32"
