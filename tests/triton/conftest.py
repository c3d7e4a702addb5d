"""Triton kernels run under the interpreter here (see tests/triton_interpreter.py)."""
from tests.triton_interpreter import _needs_triton  # noqa: F401  (sets TRITON_INTERPRET, skips without triton)
