"""A training run that checkpoints every other step and resumes from the newest complete checkpoint,
as the README's recipe: run under ``torchrun --max-restarts N``. With ``--die-at S``, on the first
attempt, the last rank exits with ``os._exit`` once it has written its part of the checkpoint of step
S and before the checkpoint is complete; torchrun then restarts every rank. Each step's loss goes to
``<dir>/losses.jsonl`` with the attempt number and the checkpoint the attempt resumed from."""
import argparse
import json
import os
from pathlib import Path

import torch
import torch.distributed as dist

import autopar
from tests.hf_models import batch, build


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("dir")
    ap.add_argument("--steps", type=int, default=8)
    ap.add_argument("--die-at", type=int, default=None)
    args = ap.parse_args()
    torch.set_num_threads(1)
    attempt = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", 0))
    cluster = autopar.ClusterSpec.from_env()
    rank, world = dist.get_rank(), dist.get_world_size()
    torch.manual_seed(0)
    ids, labels = batch()
    pm = autopar.compile(build("gpt2"), cluster, (ids,), {"labels": labels},
                         pins={"input_ids": ["S(0)"], "labels": ["S(0)"], "*.weight": ["R"], "*.bias": ["R"]})
    opt = torch.optim.AdamW(pm.parameters(), lr=1e-3)
    ckpts = Path(args.dir) / "ckpt"
    start = 0
    latest = autopar.checkpoint.latest(ckpts)
    if latest is not None:
        start = autopar.checkpoint.load(latest, pm, opt)["step"]
    if attempt == 0 and args.die_at is not None and rank == world - 1:
        _die_after_writing(args.die_at)
    for step in range(start, args.steps):
        if step % 2 == 0 and step > 0:
            autopar.checkpoint.save(ckpts / f"step_{step:06d}", pm, opt, extra={"step": step})
        loss = pm.train_step(ids, labels=labels).item()
        opt.step()
        opt.zero_grad()
        if rank == 0:
            with open(Path(args.dir) / "losses.jsonl", "a") as f:
                f.write(json.dumps({"attempt": attempt, "step": step, "loss": loss, "resumed_from": latest}) + "\n")
    dist.destroy_process_group()


def _die_after_writing(step):
    """Make this rank exit right after its part of the checkpoint of ``step`` is on disk (DCP's own
    files, .metadata included, are then complete), before autopar marks the checkpoint complete."""
    import torch.distributed.checkpoint as dcp

    real = dcp.save

    def save(state, *, checkpoint_id, **kwargs):
        out = real(state, checkpoint_id=checkpoint_id, **kwargs)
        if Path(checkpoint_id).name.startswith(f"step_{step:06d}"):
            os._exit(1)
        return out

    dcp.save = save


if __name__ == "__main__":
    main()
