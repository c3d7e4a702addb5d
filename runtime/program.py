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
