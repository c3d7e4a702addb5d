"""Activation checkpointing, and activations kept in host memory, for a region of the local program
(codegen/recompute.py)."""
from __future__ import annotations

import torch
from torch.utils.checkpoint import checkpoint, set_checkpoint_early_stop


def checkpointed(body: torch.nn.Module, *args):
    """``body(*args)``, keeping only ``args`` for backward and running ``body`` again there. The whole
    region runs again, collectives included: every rank repeats the same ones, and the plan lists them
    (stopping early would skip a region's trailing collectives on purpose, and the plan could not
    say which)."""
    with set_checkpoint_early_stop(False):
        return checkpoint(body, *args, use_reentrant=False)


def offloaded(body: torch.nn.Module, *args):
    """``body(*args)``, with every tensor it saves for backward copied to host memory (pinned on CUDA)
    as it is saved and brought back when backward reads it. On CPU processes the host copy is the
    tensor itself."""
    with torch.autograd.graph.save_on_cpu(pin_memory=torch.cuda.is_available()):
        return body(*args)


__all__ = ["checkpointed", "offloaded"]
