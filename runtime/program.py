"""What the runtime runs: a finished per-rank program, handed over by ``autopar.compile``.

The runtime knows nothing of capture, planning or code generation; it only needs the program, how to
call it (which placeholder takes which parameter, buffer, constant or input) and how to give back
its outputs.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
import torch.fx as fx

from autopar.plan import DDP_BUCKET_MB, bucket_bytes


@dataclass(frozen=True)
class Program:
    gm: fx.GraphModule            # this rank's local program, collectives and kernels included
    placeholders: tuple           # (kind, target) per placeholder, in call order; kind is param, buffer,
                                  # constant or input
    output_layouts: tuple         # per returned tensor: its layout (all-R unless kept sharded)
    in_spec: Any                  # pytree spec of the model's (args, kwargs)
    out_spec: Any                 # pytree spec of the model's outputs
    input_shapes: tuple           # shapes of the flattened inputs the program was made for
    constants: dict[str, torch.Tensor]
    kernels: dict[str, str]       # generated kernel name -> source (empty with ATen kernels)
    grad_reductions: tuple = ()   # (parameter, group name, uses, reduce dtype) per gradient to all-reduce in buckets
                                  # during backward, in the order the gradients become ready
    bucket_bytes: int = bucket_bytes(DDP_BUCKET_MB)  # bucket size of those reductions (the plan's)
    overlap: bool = True          # ZeRO-2 gradients reduce-scattered during backward, waited later
                                  # (runtime/zero.py); off with compile(overlap=False) and in pipelines
    sharded_states: tuple = ()    # (parameter, ZeRO stage, group name, dim, gather bucket, dtype of the whole
                                  # copy where its float32 master is sharded too, else None, the dtype a
                                  # sharded master's gradient is reduce-scattered in where not the copy's,
                                  # else None) per parameter whose optimizer state, and gradient at stage
                                  # 2, is sharded along the group
    stages: tuple = ()            # pipeline plans: this rank's StagePrograms (gm is then the whole
                                  # microbatch program the stages were cut from)


@dataclass(frozen=True)
class StageProgram:
    """One pipeline stage of a rank's program (codegen/stages.py), for one microbatch."""

    index: int                    # the stage's position in the pipeline
    gm: fx.GraphModule
    placeholders: tuple           # (kind, target) per placeholder; kind "recv" takes the next activation
                                  # received from the previous stage, in order
    sends: tuple                  # names of the values returned to the next stage (empty on the last
                                  # stage, which returns the loss)
    grad_sums: tuple = ()         # (parameter FQN, mesh axis, dtype to sum in or None for its own): sum its
                                  # gradient over the axis once per step, after the last microbatch
