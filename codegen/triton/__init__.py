"""Generated Triton kernels for fused regions of a rank's local program, and the backend choice.

    backend = resolve_kernels("auto", "cuda")        # "triton" or "aten"
    fuse_pass(local_gm, backend=backend, example_inputs=local_args)

Importing this package does not import Triton; compiling the first kernel does. The functions that
generated programs call (one per kernel, named after it) are attributes of this package.
"""
import importlib.util
import os

from autopar.codegen.triton.fuse import fuse_pass, record_meta
from autopar.errors import AutoparError

BACKENDS = ("auto", "triton", "aten")


def resolve_kernels(kernels: str, device_type: str) -> str:
    """The backend that ``kernels=`` selects on ``device_type`` ("cuda" or "cpu"): "triton" or "aten".

    "auto" is Triton on CUDA (when Triton is installed) and ATen elsewhere. "triton" on CPU runs the
    kernels under the Triton interpreter, which needs ``TRITON_INTERPRET=1``."""
    if kernels not in BACKENDS:
        raise AutoparError(f"kernels must be one of {', '.join(map(repr, BACKENDS))}, got {kernels!r}")
    if kernels == "aten":
        return "aten"
    has_triton = importlib.util.find_spec("triton") is not None
    if kernels == "auto":
        return "triton" if device_type == "cuda" and has_triton else "aten"
    if not has_triton:
        raise AutoparError("kernels='triton' needs Triton, which is not installed: pip install triton, or "
                           "use kernels='aten'")
    if device_type != "cuda" and os.environ.get("TRITON_INTERPRET") != "1":
        raise AutoparError(f"kernels='triton' on {device_type} runs the Triton kernels under the Triton "
                           f"interpreter, which is off: set TRITON_INTERPRET=1 in the environment before "
                           f"starting Python, or use kernels='aten' (or 'auto', which picks ATen here)")
    return "triton"


__all__ = ["BACKENDS", "resolve_kernels", "fuse_pass", "record_meta"]
