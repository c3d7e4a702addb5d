import os
import subprocess
import sys
import textwrap

from autopar.codegen import kernels


def test_available_under_the_interpreter_and_cached():
    ok, reason = kernels.available()
    assert ok, reason
    assert kernels.available() is kernels.available()


def test_import_is_lazy_and_unavailable_call_says_what_to_do():
    script = textwrap.dedent(
        """
        import sys
        import torch
        import autopar.codegen.kernels as kernels
        assert "triton" not in sys.modules, "importing the package imported triton"
        ok, reason = kernels.available()
        assert not ok and "TRITON_INTERPRET" in reason, reason
        try:
            kernels.rms_norm(torch.randn(2, 3), None)
        except RuntimeError as exc:
            assert "pip install triton" in str(exc) and "TRITON_INTERPRET=1" in str(exc), exc
        else:
            raise AssertionError("no RuntimeError")
        """
    )
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["CUDA_VISIBLE_DEVICES"] = ""  # also without a GPU where one exists
    result = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True, text=True)
    assert result.returncode == 0, result.stderr
