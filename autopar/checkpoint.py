"""Checkpoints that survive a change of plan, on torch.distributed.checkpoint (DCP).

    autopar.checkpoint.save("ckpt/step_000100", pmodel, optimizer, extra={"step": 100})
    extra = autopar.checkpoint.load(autopar.checkpoint.latest("ckpt"), pmodel, optimizer)
    full = autopar.checkpoint.to_full("ckpt/step_000100")        # loads into the original model

Parameters, persistent buffers and the optimizer's per-parameter state are saved as DTensors in the
layouts of the plan that saved them; DCP reshards them on load into the layouts of whatever plan loads
them (another mesh, other layouts, another world size). Scalar optimizer state (Adam's step) is saved
once. The optimizer's hyperparameters (lr after a schedule, betas, ...) and the user's ``extra`` go in
a small JSON file, ``autopar.json``, beside DCP's files: no pickled object is ever read back.

A strided shard (``S(d,k)``) is not one block of the full tensor, and DCP describes a rank's part by
one offset and size per dim: such a tensor is saved and loaded replicated along that mesh axis
(gathered over it for the moment of saving or loading), so any plan reads it back.

A checkpoint is complete only once every rank has written its part: it is written under
``<path>.partial`` and renamed to ``<path>`` after that, with ``autopar.json`` last, so a run that dies
while saving leaves a ``.partial`` directory that ``load`` and ``latest`` never take.
"""
from __future__ import annotations

import json
import math
import os
import shutil
import tempfile
import time
from pathlib import Path

import torch
import torch.distributed as dist

from autopar.errors import AutoparError
from autopar.layout import global_shape

MARKER = "autopar.json"
FORMAT = 1


class CheckpointError(AutoparError):
    """A checkpoint is missing, incomplete, or does not fit the module or optimizer loading it."""


def save(path, pmodel, optimizer=None, extra=None) -> None:
    """Save ``pmodel`` (a ParallelModule), ``optimizer`` (any torch optimizer over its parameters) and
    ``extra`` (JSON-serializable: step, data position) to the directory ``path``. Every rank calls it."""
    path = Path(path)
    partial = path.with_name(path.name + ".partial")
    try:
        extra_text = json.dumps(extra)
    except TypeError as e:
        raise CheckpointError(f"extra must be JSON-serializable (step, data position, ...): {e}") from e
    rank0 = _rank() == 0
    if rank0 and partial.exists():
        shutil.rmtree(partial)
    _barrier()
    state = {"model": pmodel.state_dict()}
    groups = None
    if optimizer is not None:
        state["optim"], groups = _optimizer_state(pmodel, optimizer)
    state = _without_strided(state)
    import torch.distributed.checkpoint as dcp

    dcp.save(state, checkpoint_id=str(partial), no_dist=not _distributed())
    _barrier()                                  # every rank's shards are on disk
    if rank0:
        optim = None if optimizer is None else {"class": type(optimizer).__qualname__, "param_groups": groups}
        marker = {"format": FORMAT, "saved_at": time.time(), "extra": json.loads(extra_text),
                  "aliases": pmodel.aliases, "optimizer": optim,
                  "mesh": {"shape": list(pmodel.plan.mesh_shape), "axes": list(pmodel.plan.axis_names)}}
        tmp = partial / (MARKER + ".tmp")
        tmp.write_text(json.dumps(marker, indent=1))
        os.replace(tmp, partial / MARKER)
        if path.exists():
            old = path.with_name(path.name + ".old")
            if old.exists():
                shutil.rmtree(old)
            os.replace(path, old)
            os.replace(partial, path)
            shutil.rmtree(old)
        else:
            os.replace(partial, path)
    _barrier()


def load(path, pmodel, optimizer=None):
    """Load a checkpoint saved under any plan into ``pmodel`` (and ``optimizer``), resharding every
    tensor into this plan's layouts; returns the ``extra`` it was saved with. Every rank calls it."""
    import torch.distributed.checkpoint as dcp

    path = Path(path)
    marker = read_marker(path)
    state = {"model": pmodel.state_dict()}      # DTensors on this rank's storage: DCP loads in place
    if optimizer is not None:
        if marker["optimizer"] is None:
            raise CheckpointError(f"{path} holds no optimizer state; load it without an optimizer")
        _init_optimizer_state(optimizer)
        state["optim"], _ = _optimizer_state(pmodel, optimizer)
    contiguous = _without_strided(state)
    dcp.load(contiguous, checkpoint_id=str(path), no_dist=not _distributed())
    state = _restrided(contiguous, state)
    with torch.no_grad():
        for fqn in _held(pmodel, state["model"]):
            local = pmodel.saved_tensor(fqn)[0]
            loaded = state["model"][fqn]
            loaded = loaded.to_local() if hasattr(loaded, "to_local") else loaded
            if loaded.data_ptr() != local.data_ptr():
                local.copy_(loaded)
    pmodel.load_state_dict({k: v for k, v in state["model"].items() if k not in pmodel.plan.params}, strict=False)
    if optimizer is not None:
        _restore_optimizer(pmodel, optimizer, state["optim"], marker["optimizer"], path)
    return marker["extra"]


def latest(directory):
    """The newest complete checkpoint in ``directory`` (by the time it was saved), or None. Directories
    being written (``.partial``) or without a finished marker are never taken. Under a process group
    rank 0 decides, so every rank gets the same answer."""
    found = [None]
    if _rank() == 0:
        best = None
        root = Path(directory)
        for d in (root.iterdir() if root.is_dir() else ()):
            if d.suffix in (".partial", ".old") or not d.is_dir():
                continue
            try:
                marker = read_marker(d)
            except CheckpointError:
                continue
            if best is None or marker["saved_at"] > best[0]:
                best = (marker["saved_at"], str(d))
        found = [None if best is None else best[1]]
    if _distributed():
        dist.broadcast_object_list(found, src=0)
    return found[0]


def to_full(path, out=None) -> dict:
    """The checkpoint's model as one plain state dict of full tensors, under every name the original
    model's state dict has (tied parameters under each), so ``model.load_state_dict(to_full(path))``
    is strict. Needs no process group; with ``out`` it is also written there with torch.save."""
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

    path = Path(path)
    marker = read_marker(path)
    with tempfile.TemporaryDirectory() as tmp:
        single = Path(tmp) / "full.pt"
        dcp_to_torch_save(str(path), str(single))
        everything = torch.load(single, weights_only=True)
    full = dict(everything["model"])
    for name, canonical in marker["aliases"].items():
        full[name] = full[canonical]
    if out is not None:
        torch.save(full, out)
    return full


def read_marker(path) -> dict:
    """The checkpoint's ``autopar.json``, checked; CheckpointError when the checkpoint is incomplete."""
    path = Path(path)
    if path.suffix == ".partial":
        raise CheckpointError(f"{path} was never completed (a rank stopped while saving); load an earlier one")
    f = path / MARKER
    if not f.is_file() or not (path / ".metadata").is_file():
        raise CheckpointError(f"{path} is not a complete autopar checkpoint (no {MARKER} or DCP .metadata); "
                              f"autopar.checkpoint.latest(directory) finds the newest complete one")
    try:
        marker = json.loads(f.read_text())
    except json.JSONDecodeError as e:
        raise CheckpointError(f"{f}: not JSON ({e})") from e
    if not isinstance(marker, dict) or marker.get("format") != FORMAT or not isinstance(marker.get("saved_at"),
                                                                                          (int, float)):
        raise CheckpointError(f"{f}: checkpoint format {marker.get('format') if isinstance(marker, dict) else None!r} "
                              f"is not the one this autopar reads ({FORMAT})")
    return marker


def _strided_to_replicated(t):
    """A DTensor with strided shards, replicated along their axes instead (a gather); others as they are."""
    from torch.distributed.tensor import DTensor, Replicate
    from torch.distributed.tensor.placement_types import _StridedShard

    if not isinstance(t, DTensor) or not any(isinstance(p, _StridedShard) for p in t.placements):
        return t
    return t.redistribute(placements=[Replicate() if isinstance(p, _StridedShard) else p for p in t.placements])


def _without_strided(state: dict) -> dict:
    """``state`` (nested dicts of tensors) with every strided DTensor replicated along its strided axes."""
    return {k: _without_strided(v) if isinstance(v, dict) else _strided_to_replicated(v) for k, v in state.items()}


def _restrided(loaded: dict, like: dict) -> dict:
    """``loaded`` (what DCP filled, from ``_without_strided(like)``) in the placements of ``like``: this
    rank's blocks of the strided tensors, cut locally."""
    out = {}
    for k, v in loaded.items():
        if isinstance(v, dict):
            out[k] = _restrided(v, like[k])
        elif v is not like[k]:
            out[k] = v.redistribute(placements=like[k].placements)
        else:
            out[k] = v
    return out


# --- optimizer state ------------------------------------------------------------------------------

def _held(pmodel, model_state: dict) -> list:
    """The planned parameters this rank holds (a pipeline rank holds its stages' only)."""
    return [fqn for fqn in pmodel.plan.params if fqn in model_state]


def _fqn_of_params(pmodel) -> dict:
    return {id(pmodel.local_parameter(fqn)): fqn for fqn in _held(pmodel, pmodel.state_dict())}


def _optimizer_state(pmodel, optimizer):
    """{fqn: {state key: DTensor in the parameter's layout, or a plain scalar tensor}} and the
    param groups' hyperparameters."""
    from torch.distributed.tensor import DTensor

    fqn_of = _fqn_of_params(pmodel)
    groups = []
    for g in optimizer.param_groups:
        for p in g["params"]:
            if id(p) not in fqn_of:
                raise CheckpointError(f"the optimizer holds a tensor of shape {tuple(p.shape)} that is not a "
                                      f"parameter of this ParallelModule; build it from pmodel.parameters()")
        # Hyperparameters only: which parameters a group holds on a rank depends on the plan.
        groups.append({k: _json_value(v) for k, v in g.items() if k != "params"})
    out = {}
    for p, st in optimizer.state.items():
        fqn = fqn_of.get(id(p))
        if fqn is None:
            continue
        layout = pmodel.state_layout(fqn)       # a ZeRO-1/2 parameter's state is sharded where it is not
        shape = torch.Size(global_shape(p.shape, layout, pmodel.plan.mesh_shape))
        entry = {}
        for key, value in st.items():
            if not isinstance(value, torch.Tensor):
                raise CheckpointError(f"optimizer state {key!r} of {fqn} is a {type(value).__name__}, not a tensor; "
                                      f"autopar.checkpoint saves tensor state only")
            if value.shape == p.shape and value.dim() > 0:
                entry[key] = DTensor.from_local(value, pmodel.mesh, [x.to_dtensor() for x in layout],
                                                run_check=False, shape=shape,
                                                stride=torch.empty(shape, device="meta").stride())
            elif value.numel() == 1:
                entry[key] = value            # a scalar (Adam's step): the same on every rank
            else:
                raise CheckpointError(f"optimizer state {key!r} of {fqn} has shape {tuple(value.shape)}, neither "
                                      f"the parameter's local shape {tuple(p.shape)} nor a scalar; it cannot be "
                                      f"resharded to another plan")
        out[fqn] = entry
    return out, groups


def _init_optimizer_state(optimizer) -> None:
    """Make an optimizer's lazily created state exist (a step with zero gradients and a zero learning
    rate, which leaves the parameters as they are), so a checkpoint can be loaded into it."""
    if optimizer.state:
        return
    params = [p for g in optimizer.param_groups for p in g["params"] if p.requires_grad]
    if any(p.grad is not None for p in params):
        raise CheckpointError("load the optimizer's checkpoint before its first backward (gradients are set)")
    saved = [g["lr"] for g in optimizer.param_groups]
    for p in params:
        p.grad = torch.zeros_like(p)
    for g in optimizer.param_groups:
        g["lr"] = 0.0
    optimizer.step()
    for g, lr in zip(optimizer.param_groups, saved):
        g["lr"] = lr
    optimizer.zero_grad(set_to_none=True)


def _restore_optimizer(pmodel, optimizer, loaded: dict, saved: dict, path) -> None:
    fqn_of = _fqn_of_params(pmodel)
    if type(optimizer).__qualname__ != saved["class"]:
        raise CheckpointError(f"{path} holds the state of a {saved['class']}, not of a {type(optimizer).__qualname__}")
    with torch.no_grad():
        for p, st in optimizer.state.items():
            fqn = fqn_of.get(id(p))
            if fqn not in loaded:
                continue
            for key, value in loaded[fqn].items():
                value = value.to_local() if hasattr(value, "to_local") else value
                if st[key].data_ptr() != value.data_ptr():
                    st[key].copy_(value)
    current = optimizer.param_groups
    if len(current) != len(saved["param_groups"]):
        raise CheckpointError(f"{path} was saved with {len(saved['param_groups'])} parameter groups, this optimizer "
                              f"has {len(current)}")
    for g, s in zip(current, saved["param_groups"]):
        for k, v in s.items():
            if k in g and v is not None and not isinstance(g[k], torch.Tensor):
                g[k] = tuple(v) if isinstance(g[k], tuple) else v


def _json_value(v):
    """A hyperparameter as JSON (None where it is not a plain value: it is then left as it is)."""
    if isinstance(v, torch.Tensor) and v.numel() == 1:
        v = v.item()
    if isinstance(v, float) and not math.isfinite(v):
        return None
    if isinstance(v, (bool, int, float, str)) or v is None:
        return v
    if isinstance(v, (list, tuple)) and all(isinstance(x, (bool, int, float, str)) for x in v):
        return list(v)
    return None


def _distributed() -> bool:
    return dist.is_available() and dist.is_initialized()


def _rank() -> int:
    return dist.get_rank() if _distributed() else 0


def _barrier() -> None:
    if _distributed():
        dist.barrier()
