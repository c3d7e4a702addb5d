"""Shared by the Triton test folders: kernels run on CPU under the Triton interpreter. The variable is
set on import, before anything imports triton, because triton reads it when kernels are defined."""

import importlib.util
import os

import pytest

os.environ["TRITON_INTERPRET"] = "1"

_NO_TRITON = importlib.util.find_spec("triton") is None


@pytest.fixture(autouse=True)
def _needs_triton():
    if _NO_TRITON:
        pytest.skip("triton is not installed (pip install triton); these tests run Triton kernels")
