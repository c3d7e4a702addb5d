"""The one pass runner. Every pass of the pipeline (autopar/pass_pipeline.py) runs through it.

A pass is a plain function ``GraphModule -> GraphModule`` (or ``None`` for an analysis that only
writes ``node.meta``); options are bound with ``functools.partial``, and the pass's name is its
function's. The runner
- logs the ordered list of each stage and times every pass (``records``);
- lints the graph after each pass;
- skips passes by name (``skip``) and runs a user's passes right after a named one (``insert``);
- checks what a pass requires (``@requires("layers_pass")``): every named pass must have run before;
- wraps a failure with the passes already run;
- with ``AUTOPAR_DEBUG=passes`` writes the graph after each pass to a folder (``AUTOPAR_DEBUG_DIR``,
  default ``./autopar_debug``), one numbered file per pass.
"""
from __future__ import annotations

import functools
import logging
import os
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Iterable, Sequence

import torch.fx as fx

from autopar.errors import AutoparError

log = logging.getLogger("autopar.passes")

Pass = Callable[[fx.GraphModule], "fx.GraphModule | None"]


class PassError(AutoparError):
    """A pass failed, or cannot run because a pass it requires did not."""


def requires(*names: str):
    """Declare the passes that must have run before this one, by name."""
    def deco(fn):
        fn.requires = tuple(names)
        return fn
    return deco


def pass_name(p: Pass) -> str:
    while isinstance(p, functools.partial):
        p = p.func
    return p.__name__


def pass_requires(p: Pass) -> tuple[str, ...]:
    while isinstance(p, functools.partial):
        p = p.func
    return getattr(p, "requires", ())


@dataclass
class PassRecord:
    name: str
    stage: str
    seconds: float
    skipped: bool = False


def debug_dir_from_env() -> Path | None:
    """The folder ``AUTOPAR_DEBUG=passes`` asks for (a comma-separated list may name other topics)."""
    topics = {t.strip() for t in os.environ.get("AUTOPAR_DEBUG", "").split(",")}
    if "passes" not in topics:
        return None
    return Path(os.environ.get("AUTOPAR_DEBUG_DIR", "autopar_debug"))


@dataclass
class PassRunner:
    skip: frozenset = frozenset()
    insert: Sequence[tuple[str, Pass]] = ()        # (name of a pass, a pass to run right after it)
    debug_dir: Path | None = field(default_factory=debug_dir_from_env)
    records: list[PassRecord] = field(default_factory=list)

    def __post_init__(self):
        self.skip = frozenset(self.skip)
        self.insert = tuple(self.insert)
        if self.debug_dir is not None:
            self.debug_dir = Path(self.debug_dir)
            self.debug_dir.mkdir(parents=True, exist_ok=True)

    def check_names(self, known: Iterable[str]) -> None:
        """Refuse skips and insertion points that name no pass of the pipeline."""
        known = set(known) | {pass_name(p) for _, p in self.insert}
        unknown = sorted((self.skip | {after for after, _ in self.insert}) - known)
        if unknown:
            raise PassError(f"no pass is named {unknown}; the pipeline's passes are {sorted(known)}")

    @property
    def ran(self) -> list[str]:
        return [r.name for r in self.records if not r.skipped]

    def dump(self, gm: fx.GraphModule, name: str) -> None:
        if self.debug_dir is not None:
            path = self.debug_dir / f"{len(self.records):02d}_{name}.py"
            path.write_text(gm.print_readable(print_output=False))

    def run(self, passes: Sequence[Pass], gm: fx.GraphModule, stage: str) -> fx.GraphModule:
        """Run ``passes`` in order on ``gm``, with the user's insertions, and return the result."""
        order = []
        for p in passes:
            order.append(p)
            order += [extra for after, extra in self.insert if after == pass_name(p)]
        log.info("stage %s: %s", stage, ", ".join(pass_name(p) for p in order))
        for p in order:
            name = pass_name(p)
            if name in self.skip:
                self.records.append(PassRecord(name, stage, 0.0, skipped=True))
                log.info("pass %s skipped", name)
                continue
            missing = [r for r in pass_requires(p) if r not in self.ran]
            if missing:
                why = "skipped" if set(missing) & self.skip else "not run"
                raise PassError(f"pass {name} requires {missing}, which were {why}; passes run so far: "
                                f"{self.ran}. Do not skip {missing}, or skip {name} too")
            t0 = time.perf_counter()
            try:
                out = p(gm)
                gm = out if out is not None else gm
                gm.graph.lint()
            except AutoparError as e:       # a user-facing error keeps its type; say where it came from
                e.add_note(f"in pass {name} (stage {stage}), after {self.ran}")
                raise
            except Exception as e:
                raise PassError(f"pass {name} (stage {stage}) failed after {self.ran}: "
                                f"{type(e).__name__}: {e}") from e
            dt = time.perf_counter() - t0
            self.records.append(PassRecord(name, stage, dt))
            log.info("pass %s: %.3fs", name, dt)
            self.dump(gm, name)
        return gm
