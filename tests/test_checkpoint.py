"""autopar.checkpoint: a checkpoint saved under one plan loads under another (other layouts, another
mesh, another world size) and training goes on with the losses of an uninterrupted eager run (relative
1e-5, the parity promise of tests/test_parity.py); to_full gives a state dict the original model loads
strictly; an incomplete checkpoint is never taken."""
import copy
import json
from pathlib import Path

import pytest
import torch

from tests.distributed_utils import run_distributed
from tests.hf_models import MEGATRON, batch, build

STEPS, SAVE_AT, LR = 4, 2, 1e-3


def _plans(world):
    data = {"input_ids": ["S(0)"], "labels": ["S(0)"], "*.weight": ["R"], "*.bias": ["R"]}
    tp = {k: [v] for k, v in MEGATRON["gpt2"].items()}
    plans = {"data parallel": ((world,), data), "tensor split": ((world,), tp)}
    if world == 4:
        plans["2-D"] = ((2, 2), {**{k: ["R", v] for k, v in MEGATRON["gpt2"].items()},
                                 "input_ids": ["S(0)", "R"], "labels": ["S(0)", "R"]})
    return plans


def _compile(world, mesh, pins, seed):
    import autopar

    torch.manual_seed(seed)          # another initialization: the checkpoint must replace all of it
    ids, labels = batch()
    return autopar.compile(build("gpt2"), autopar.ClusterSpec.local_cpu(world), (ids,), {"labels": labels},
                           mesh_shape=mesh, pins=pins)


def _resume_and_compare(pm, ckpt, eager, where, lr=5 * LR):
    import autopar

    ids, labels = batch()
    opt = torch.optim.AdamW(pm.parameters(), lr=lr)        # the checkpoint restores lr too
    extra = autopar.checkpoint.load(ckpt, pm, opt)
    assert extra == {"step": SAVE_AT, "data": "position"}, where
    assert opt.param_groups[0]["lr"] == LR, where
    for step in range(extra["step"], STEPS):
        loss = pm.train_step(ids, labels=labels).item()
        opt.step(), opt.zero_grad()
        assert abs(loss - eager[step]) <= 1e-5 * abs(eager[step]), \
            f"{where}: step {step} loss {loss} vs uninterrupted eager {eager[step]}"


def _save_then_reshard(rank, world, root):
    import autopar

    eager = _eager_steps(STEPS)
    ids, labels = batch()
    mesh, pins = _plans(world)["data parallel"]
    pm = _compile(world, mesh, pins, seed=0)
    opt = torch.optim.AdamW(pm.parameters(), lr=LR)
    for step in range(SAVE_AT):
        pm.train_step(ids, labels=labels)
        opt.step(), opt.zero_grad()
    ckpt = Path(root) / f"step_{SAVE_AT:06d}"
    autopar.checkpoint.save(ckpt, pm, opt, extra={"step": SAVE_AT, "data": "position"})
    assert autopar.checkpoint.latest(root) == str(ckpt)
    saved = pm.full_state_dict()
    if rank == 0:
        full = autopar.checkpoint.to_full(ckpt)
        model = build("gpt2")
        model.load_state_dict(full)                          # strict: tied names and buffers are there
        assert set(full) == set(saved) and all(torch.equal(full[k], saved[k]) for k in full)
        Path(root, "eager.json").write_text(json.dumps(eager))
    for label, (mesh, pins) in list(_plans(world).items())[1:]:
        _resume_and_compare(_compile(world, mesh, pins, seed=1), ckpt, eager, f"{label} on mesh {mesh}")
    _pipeline_zero_checkpoint(world, root, eager)


def _pipeline_zero_checkpoint(world, root, eager):
    """pp=2 x dp=2 with ZeRO-1 inside the stages (each rank holds its stage's parameters, the optimizer
    steps their dp-th blocks): saved after SAVE_AT steps with eager's losses, resumed under the same
    plan and under data parallelism."""
    import autopar
    from tests.test_pipeline_parity import _dp_pins

    ids, labels = batch()

    def pipeline(seed):
        torch.manual_seed(seed)
        return autopar.compile(build("gpt2"), autopar.ClusterSpec.local_cpu(world), (ids,), {"labels": labels},
                               mesh_shape=(2, 2), axis_names=("pp", "dp"), schedule="1F1B", microbatches=2,
                               pins=_dp_pins("gpt2", zero=1))

    pm = pipeline(0)
    assert pm.plan.zero and {z["stage"] for z in pm.plan.zero.values()} == {1}
    opt = torch.optim.AdamW(pm.parameters(), lr=LR)
    for step in range(SAVE_AT):
        loss = pm.train_step(ids, labels=labels).item()
        opt.step(), opt.zero_grad()
        assert abs(loss - eager[step]) <= 1e-5 * abs(eager[step]), f"pipeline ZeRO-1: step {step} loss {loss}"
    ckpt = Path(root) / "pipeline_zero1"
    autopar.checkpoint.save(ckpt, pm, opt, extra={"step": SAVE_AT, "data": "position"})
    _resume_and_compare(pipeline(2), ckpt, eager, "pipeline plan with ZeRO-1 -> the same plan")
    mesh, pins = _plans(world)["data parallel"]
    _resume_and_compare(_compile(world, mesh, pins, seed=1), ckpt, eager, "pipeline plan with ZeRO-1 -> data parallel")


def _resume_on_other_world(rank, world, root):
    eager = json.loads(Path(root, "eager.json").read_text())
    mesh, pins = _plans(world)["tensor split"]
    _resume_and_compare(_compile(world, mesh, pins, seed=2), Path(root) / f"step_{SAVE_AT:06d}", eager,
                        f"tensor split on {world} ranks")


def test_checkpoint_reshards_across_plans_meshes_and_world_sizes(tmp_path):
    """Saved under data parallelism on 4 ranks; resumed under a tensor split and a 2-D mesh on 4 ranks,
    and under a tensor split on 2 ranks. In the same 4-rank launch, a pipeline plan with ZeRO-1 inside
    its stages saves and resumes (``_pipeline_zero_checkpoint``)."""
    run_distributed(_save_then_reshard, 4, str(tmp_path), timeout=600)
    run_distributed(_resume_on_other_world, 2, str(tmp_path), timeout=300)


def test_incomplete_checkpoints_are_never_taken(tmp_path):
    import autopar
    from autopar.checkpoint import CheckpointError

    assert autopar.checkpoint.latest(tmp_path) is None
    (tmp_path / "step_000010.partial").mkdir()                 # a save that a dying rank interrupted
    (tmp_path / "step_000010.partial" / ".metadata").write_bytes(b"")
    (tmp_path / "step_000020").mkdir()                         # DCP files but no autopar marker
    (tmp_path / "step_000020" / ".metadata").write_bytes(b"")
    assert autopar.checkpoint.latest(tmp_path) is None
    with pytest.raises(CheckpointError, match="never completed"):
        autopar.checkpoint.to_full(tmp_path / "step_000010.partial")
    with pytest.raises(CheckpointError, match="not a complete autopar checkpoint"):
        autopar.checkpoint.to_full(tmp_path / "step_000020")


def test_run_resumes_after_a_rank_dies_under_torchrun(tmp_path):
    """torchrun --max-restarts; the last rank dies (os._exit) after writing its part of the step-6
    checkpoint. The restarted run resumes from step 4, the newest complete checkpoint, never from the
    step-6 one, and repeats steps 4 and 5 with bit-identical losses; every loss matches eager training.
    One restart suffices: the restarted ranks connect at once (their store keys are their attempt's)."""
    import os
    import subprocess
    import sys

    root = Path(__file__).resolve().parents[1]
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
           "--max-restarts", "3", "--monitor-interval", "0.5", "-m", "tests.scripts.train_resumable",
           str(tmp_path), "--steps", "8", "--die-at", "6"]
    # A rank killed by a signal prints its Python stacks to the output kept below.
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(root), "PYTHONFAULTHANDLER": "1"}
    run = subprocess.run(cmd, cwd=root, env=env, capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-6000:]
    rows = [json.loads(line) for line in (tmp_path / "losses.jsonl").read_text().splitlines()]
    first = [r["step"] for r in rows if r["attempt"] == 0]
    assert first == list(range(6)), rows                      # died saving step 6
    assert {r["attempt"] for r in rows} == {0, 1}, f"{rows}\n{run.stderr[-8000:]}"
    resumed = [r for r in rows if r["attempt"] > 0]
    assert resumed and Path(resumed[0]["resumed_from"]).name == "step_000004", rows
    assert resumed[0]["step"] == 4, rows
    losses: dict = {}
    for r in rows:
        losses.setdefault(r["step"], set()).add(r["loss"])
    assert sorted(losses) == list(range(8)), rows
    assert all(len(v) == 1 for v in losses.values()), f"a repeated step gave another loss: {losses}"
    eager = _eager_steps(8)
    for step, (loss,) in losses.items():
        assert abs(loss - eager[step]) <= 1e-5 * abs(eager[step]), (step, loss, eager[step])
    assert not list((tmp_path / "ckpt").glob("*.partial"))      # the restarted run saved step 6 again


def _eager_steps(n):
    torch.manual_seed(0)
    model = build("gpt2")
    ids, labels = batch()
    opt = torch.optim.AdamW(model.parameters(), lr=LR)
    out = []
    for _ in range(n):
        loss = model(ids, labels=labels).loss
        loss.backward()
        opt.step(), opt.zero_grad()
        out.append(loss.item())
    return out


def _pipeline_checkpoint(rank, world, root):
    import autopar

    eager = _eager_steps(STEPS)
    ids, labels = batch()
    cluster = autopar.ClusterSpec.local_cpu(world)

    def pipeline(seed):
        torch.manual_seed(seed)
        return autopar.compile(build("gpt2"), cluster, (ids,), {"labels": labels}, mesh_shape=(world,),
                               axis_names=("pp",), schedule="GPipe", microbatches=2)

    pm = pipeline(0)
    opt = torch.optim.AdamW(pm.parameters(), lr=LR)
    for _ in range(SAVE_AT):
        pm.train_step(ids, labels=labels)
        opt.step(), opt.zero_grad()
    ckpt = Path(root) / "pipeline"
    autopar.checkpoint.save(ckpt, pm, opt, extra={"step": SAVE_AT, "data": "position"})
    mesh, pins = _plans(world)["data parallel"]
    _resume_and_compare(_compile(world, mesh, pins, seed=1), ckpt, eager, "pipeline plan -> data parallel")
    _resume_and_compare(pipeline(2), ckpt, eager, "pipeline plan -> pipeline plan")


def test_checkpoint_of_a_pipeline_plan_loads_under_another_plan(tmp_path):
    """Saved by the two stages of a pipeline plan (each rank holds half the parameters); resumed under
    data parallelism and under the pipeline plan again."""
    run_distributed(_pipeline_checkpoint, 2, str(tmp_path), timeout=600)


def _bf16_zero1_checkpoint(rank, world, root):
    """bf16-mixed ZeRO-1 with sharded float32 masters: the checkpoint holds the masters (float32, not
    their bfloat16 copies), and a run resumed from it, under the same plan or under data parallelism
    with whole masters, or under ZeRO-2 layer matrices (their masters sharded too, their gradients
    reduce-scattered), continues with the losses of the uninterrupted run."""
    import autopar

    ids, labels = batch()
    params = {n: p.dim() for n, p in build("gpt2").named_parameters()}

    def compile_(seed, zero):
        torch.manual_seed(seed)
        # ZeRO-2 for the layers' matrices (the embeddings' lookups split no work on the batch).
        pins = {n: {"output": ["R"], "zero": zero if zero < 2 or (dim > 1 and ".h." in n) else 0}
                for n, dim in params.items()}
        return autopar.compile(build("gpt2"), autopar.ClusterSpec.local_cpu(world), (ids,), {"labels": labels},
                               mesh_shape=(world,), pins=pins, precision="bf16-mixed", recompute=False)

    pm = compile_(0, 1)
    assert any(z.sharded_master for z in pm.plan.zero.values())
    opt = torch.optim.AdamW(pm.parameters(), lr=LR)
    losses = []
    ckpt = Path(root) / "bf16_zero1"
    for step in range(STEPS):
        if step == SAVE_AT:
            autopar.checkpoint.save(ckpt, pm, opt, extra={"step": SAVE_AT, "data": "position"})
        losses.append(pm.train_step(ids, labels=labels).item())
        opt.step(), opt.zero_grad()
    if rank == 0:
        full = autopar.checkpoint.to_full(ckpt)
        sharded = [f for f, z in pm.plan.zero.items() if z.sharded_master]
        assert all(full[f].dtype == torch.float32 for f in sharded)
        assert any(not torch.equal(full[f], full[f].bfloat16().float()) for f in sharded), \
            "the checkpoint holds the bfloat16 copies, not the float32 masters"
    # A full state dict carries the float32 masters: loaded under the same plan, they are the blocks
    # stepped, and the copies the program reads are made from them.
    loaded = compile_(1, 1)
    loaded.load_state_dict(pm.full_state_dict())
    for fqn in pm.plan.params:
        assert torch.equal(loaded.local_parameter(fqn), pm.local_parameter(fqn)), fqn
        assert torch.equal(loaded.local_tensor(fqn), pm.local_tensor(fqn)), fqn
    # ZeRO-2 needs its matrices' readers to split the batch, a plan whose bfloat16 activations round
    # otherwise: its losses are held to bfloat16's rounding (2^-9 relative).
    for label, zero, rtol in (("the same plan", 1, 1e-5), ("data parallel", 0, 1e-5), ("ZeRO-2", 2, 2.0 ** -9)):
        resumed = compile_(1, zero)
        opt = torch.optim.AdamW(resumed.parameters(), lr=5 * LR)
        assert autopar.checkpoint.load(ckpt, resumed, opt)["step"] == SAVE_AT
        for step in range(SAVE_AT, STEPS):
            loss = resumed.train_step(ids, labels=labels).item()
            opt.step(), opt.zero_grad()
            assert abs(loss - losses[step]) <= rtol * abs(losses[step]), \
                f"bf16-mixed ZeRO-1 -> {label}: step {step} loss {loss} vs uninterrupted {losses[step]}"


def test_checkpoint_of_bf16_mixed_zero1_holds_the_sharded_float32_masters(tmp_path):
    run_distributed(_bf16_zero1_checkpoint, 2, str(tmp_path), timeout=600)
