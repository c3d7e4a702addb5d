"""Every Python example in docs/extending.md runs as it stands, each in its own interpreter (they
register ops and rules globally)."""
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
EXAMPLES = re.findall(r"```python\n(.*?)```", (ROOT / "docs" / "extending.md").read_text(), re.S)


def test_the_page_has_the_three_examples():
    assert len(EXAMPLES) == 3
    assert "register_rule" in EXAMPLES[0] and "insert_passes" in EXAMPLES[1] and "cost_model" in EXAMPLES[2]


@pytest.mark.parametrize("k", range(len(EXAMPLES)), ids=["custom_op_rule", "inserted_pass", "cost_model"])
def test_example_runs(k, tmp_path):
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    r = subprocess.run([sys.executable, "-c", EXAMPLES[k]], cwd=tmp_path, env=env, capture_output=True, text=True,
                       timeout=600)
    assert r.returncode == 0, r.stderr[-3000:]
