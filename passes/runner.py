"""The one pass runner: runs passes in order, times them, lints the graph after each."""
from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field
from typing import Callable, Sequence

import torch.fx as fx

log = logging.getLogger("autopar.passes")

Pass = Callable[[fx.GraphModule], fx.GraphModule]


@dataclass
class PassRecord:
    name: str
    seconds: float
    skipped: bool = False


@dataclass
class PassRunner:
    passes: Sequence[Pass]
    skip: frozenset = frozenset()
    records: list[PassRecord] = field(default_factory=list)

    def __call__(self, gm: fx.GraphModule) -> fx.GraphModule:
        unknown = self.skip - {p.__name__ for p in self.passes}
        if unknown:
            raise ValueError(f"cannot skip unknown passes {sorted(unknown)}; passes are "
                             f"{[p.__name__ for p in self.passes]}")
        for p in self.passes:
            if p.__name__ in self.skip:
                self.records.append(PassRecord(p.__name__, 0.0, skipped=True))
                log.info("pass %s skipped", p.__name__)
                continue
            t0 = time.perf_counter()
            out = p(gm)
            gm = out if out is not None else gm
            gm.graph.lint()
            dt = time.perf_counter() - t0
            self.records.append(PassRecord(p.__name__, dt))
            log.info("pass %s: %.3fs", p.__name__, dt)
        return gm
