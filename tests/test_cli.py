"""``python -m autopar plan`` and ``python -m autopar demo``."""
from __future__ import annotations

import math
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch.distributed as dist

from autopar import Plan
from autopar.__main__ import main
from autopar.models import GPT, GPTConfig

REPO = Path(__file__).resolve().parents[1]


def test_plan_gpt2_for_8xh100_saves_a_loadable_plan_and_prints_the_summary(tmp_path, capsys):
    out, report = tmp_path / "plan.json", tmp_path / "plan.html"
    assert main(["plan", "--model", "gpt2", "--cluster", "8xH100", "--out", str(out), "--html", str(report)]) == 0
    stdout = capsys.readouterr().out
    assert stdout.startswith("autopar plan: GPT2LMHeadModel (124,439,808 parameters) on 8xH100 devices")
    assert "step time:" in stdout and f"plan saved to {out}" in stdout
    plan = Plan.load(out)
    assert plan.model["class"] == "GPT2LMHeadModel" and plan.model["num_params"] == 124_439_808
    assert math.prod(plan.mesh_shape) == 8
    assert set(plan.params) >= {"transformer.wte.weight", "transformer.h.11.mlp.c_fc.weight"}
    assert 0 < plan.memory["peak"] <= 80e9 and plan.step_time > 0
    assert f"{plan.step_time * 1e3:.3f} ms" in stdout
    assert report.read_text().lstrip().lower().startswith("<!doctype html")


def test_plan_of_a_module_function_on_local_cpu(tmp_path, capsys):
    out = tmp_path / "p.json"
    argv = ["plan", "--model", "tests.test_zoo:small_gpt", "--cluster", "cpu:2", "--batch", "4", "--seq", "8",
            "--mesh", "2", "--out", str(out)]
    assert main(argv) == 0
    plan = Plan.load(out)
    assert plan.model["class"] == "GPT" and plan.mesh_shape == (2,) and plan.cluster["name"] == "2xcpu"
    assert "autopar plan: GPT" in capsys.readouterr().out
    assert not plan.sharded_outputs
    assert main(argv + ["--sharded-outputs"]) == 0
    assert Plan.load(out).sharded_outputs
    assert main(argv + ["--precision", "bf16-mixed", "--reduce-dtype", "float32"]) == 0
    assert Plan.load(out).reduce_dtype == "float32"
    assert "precision bf16-mixed, gradients summed in float32" in capsys.readouterr().out


@pytest.mark.parametrize("argv, message", [
    (["--model", "gpt5", "--cluster", "8xH100"], "unknown model 'gpt5'"),
    (["--model", "gpt2-tiny", "--cluster", "8xB300"], "unknown cluster preset '8xB300'"),
    (["--model", "gpt2-tiny", "--cluster", "cpu:two"], "write cpu:N"),
    (["--model", "gpt2-tiny", "--cluster", "8xH100", "--mesh", "3,3"], "multiplies to 9"),
    (["--model", "gpt2-tiny", "--cluster", "cpu:2", "--memory-budget", "1e-6"], "smallest feasible budget"),
    (["--model", "gpt2-tiny", "--cluster", "cpu:2", "--precision", "32-true", "--reduce-dtype", "bfloat16"],
     "only mixed precision has a choice"),
])
def test_bad_input_gives_one_error_line_and_exit_code_1(argv, message, capsys):
    assert main(["plan", *argv]) == 1
    captured = capsys.readouterr()
    assert captured.out == ""
    lines = captured.err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("autopar plan: error: ") and message in lines[0]


_STEP = re.compile(r"^\s*(\d+)\s+([\d.]+)\s+([\d.]+)\s+([\d.e+-]+)", re.M)


def _demo(*argv, cwd, pythonpath=None):
    env = dict(os.environ)
    if pythonpath:
        env["PYTHONPATH"] = pythonpath
    return subprocess.run([sys.executable, "-m", "autopar", "demo", *argv], cwd=cwd, env=env,
                          capture_output=True, text=True, timeout=300)


def test_demo_trains_with_matching_losses_from_any_directory(tmp_path):
    r = _demo("--steps", "3", cwd=tmp_path)
    assert r.returncode == 0, r.stderr
    assert r.stdout.startswith("autopar plan: GPT2LMHeadModel")
    assert "tolerance: relative 0.0001" in r.stdout
    steps = _STEP.findall(r.stdout)
    assert [int(s[0]) for s in steps] == [1, 2, 3]
    for _, loss, ref, _ in steps:
        assert math.isclose(float(loss), float(ref), rel_tol=1e-4)
    assert float(steps[-1][1]) < float(steps[0][1])        # it trains
    assert "PASS: all 3 losses match" in r.stdout


def gpt_with_dropout():
    # Dropout draws different masks in the sharded and the single-process run: the losses must differ.
    return GPT(GPTConfig(vocab_size=128, n_layer=2, n_head=4, d_model=64, d_ff=256, max_seq=64, dropout=0.1))


def gpt_failing_on_rank_1():
    if dist.get_rank() == 1:
        raise RuntimeError("rank 1 cannot build its model")
    return gpt_with_dropout()


def test_demo_fails_on_a_loss_mismatch(tmp_path):
    r = _demo("--steps", "1", "--model", "tests.test_cli:gpt_with_dropout", cwd=tmp_path, pythonpath=str(REPO))
    assert r.returncode == 1
    assert "MISMATCH" in r.stdout and "> tolerance 0.0001" in r.stdout


def test_demo_fails_when_a_rank_fails(tmp_path):
    r = _demo("--steps", "2", "--model", "tests.test_cli:gpt_failing_on_rank_1", cwd=tmp_path,
              pythonpath=str(REPO))
    assert r.returncode == 1
    assert "RuntimeError: rank 1 cannot build its model" in r.stderr
    assert r.stderr.strip().splitlines()[-1] == "autopar demo: error: rank 1 failed"


def test_demo_refuses_an_unknown_model(capsys):
    assert main(["demo", "--model", "gpt5"]) == 1
    assert "unknown model 'gpt5'" in capsys.readouterr().err
