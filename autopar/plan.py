"""The Plan: a versioned, JSON-serializable record of how a model is laid out on a cluster.

The schema is documented in docs/plan-format.md. Loading validates the file and never unpickles.
"""
from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from autopar.errors import PlanFormatError, ShardingError
from autopar.layout import Placement

PLAN_VERSION = 1
PHASES = ("forward", "backward", "optimizer")
KINDS = ("all_reduce", "all_gather", "reduce_scatter", "all_to_all", "send_recv")
MEMORY_KEYS = ("peak", "params", "grads", "optimizer", "activations")
# torch.distributed.pipelining schedules a pipeline plan may name
PIPELINE_SCHEDULES = ("GPipe", "1F1B", "Interleaved1F1B", "InterleavedZeroBubble", "ZBVZeroBubble")


@dataclass
class Plan:
    model: dict                      # class, fingerprint, num_params
    cluster: dict                    # ClusterSpec.to_dict()
    mesh: dict                       # {"shape": [...], "axes": [...]}
    params: dict                     # FQN -> layout strings, one per mesh axis
    inputs: dict                     # user input name -> layout strings
    nodes: list                      # per-node entries (see docs/plan-format.md)
    collectives: list                # per-collective entries
    memory: dict                     # bytes per device: peak, params, grads, optimizer, activations, ...
    step_time: float                 # predicted seconds per training step
    breakdown: dict                  # seconds: compute, communication per axis, optimizer
    solver: dict                     # status, seconds, variables, constraints, backend, candidates
    # node name or parameter FQN -> the chosen layout and the best alternatives, with their costs and
    # the collectives each would cause with its neighbours (see docs/plan-format.md)
    alternatives: dict = field(default_factory=dict)
    sharded_outputs: bool = False    # non-scalar outputs are returned as computed, not gathered
    # layer instances whose activations are recomputed in backward: {"classes": {class: {"count",
    # "of", "layers"}}, "layers": [instance, ...]}
    recompute: dict = field(default_factory=lambda: {"classes": {}, "layers": []})
    # pipeline plans: {"axis", "schedule", "microbatches", "virtual_stages", "bubble_fraction",
    # "bubble_seconds", "stages": [{"index", "pp_rank", "layers", "seconds", ...}], "ranks": [...]}
    pipeline: dict | None = None
    version: int = PLAN_VERSION
    extra: dict = field(default_factory=dict)

    # --- serialization -------------------------------------------------------------------------
    def to_dict(self) -> dict:
        return asdict(self)

    def to_json(self) -> str:
        return json.dumps(self.to_dict(), indent=1, sort_keys=True)

    def save(self, path) -> None:
        Path(path).write_text(self.to_json())

    @classmethod
    def from_dict(cls, d: Any) -> "Plan":
        _validate(d)
        return cls(**{k: d[k] for k in cls.__dataclass_fields__ if k in d})

    @classmethod
    def load(cls, path) -> "Plan":
        try:
            d = json.loads(Path(path).read_text())
        except json.JSONDecodeError as e:
            raise PlanFormatError(f"{path}: not a JSON plan file ({e})") from e
        try:
            return cls.from_dict(d)
        except PlanFormatError as e:
            raise PlanFormatError(f"{path}: {e}") from e

    # --- views ---------------------------------------------------------------------------------
    @property
    def mesh_shape(self) -> tuple[int, ...]:
        return tuple(self.mesh["shape"])

    @property
    def axis_names(self) -> tuple[str, ...]:
        return tuple(self.mesh["axes"])

    def node(self, name: str) -> dict:
        for n in self.nodes:
            if n["name"] == name:
                return n
        raise KeyError(f"plan has no node {name!r}")

    def collective_counts(self) -> dict:
        """{(kind, axis, phase): count}."""
        out: dict = {}
        for c in self.collectives:
            k = (c["kind"], c["axis"], c["phase"])
            out[k] = out.get(k, 0) + 1
        return out

    def explain(self, name: str) -> str:
        """Why ``name`` (a node or a parameter FQN) has its layout: the alternatives and their costs."""
        from autopar.inspection import explain

        return explain(self, name)

    def to_html(self, path) -> None:
        """Write a self-contained HTML report of this plan."""
        from autopar.inspection import to_html

        to_html(self, path)

    def summary(self) -> str:
        from autopar.report import summary

        return summary(self)

    def __str__(self) -> str:
        return self.summary()


def _validate(d: Any) -> None:
    if not isinstance(d, dict):
        raise PlanFormatError(f"a plan is a JSON object, got {type(d).__name__}")
    version = d.get("version")
    if version != PLAN_VERSION:
        raise PlanFormatError(f"plan format version {version!r} is not supported (this autopar reads "
                              f"version {PLAN_VERSION}); plan the model again with this version")
    required = [k for k, f in Plan.__dataclass_fields__.items() if k not in ("version", "extra", "alternatives",
                                                                                   "sharded_outputs", "recompute",
                                                                                   "pipeline")]
    missing = [k for k in required if k not in d]
    if missing:
        raise PlanFormatError(f"plan is missing fields {missing}")
    mesh = d["mesh"]
    if not (isinstance(mesh, dict) and isinstance(mesh.get("shape"), list) and isinstance(mesh.get("axes"), list)
            and len(mesh["shape"]) == len(mesh["axes"]) and all(isinstance(s, int) and s > 0 for s in mesh["shape"])):
        raise PlanFormatError(f"plan mesh must be {{'shape': [ints > 0], 'axes': [names]}} of equal length, got {mesh!r}")
    nax = len(mesh["shape"])

    def check_layout(where, lay):
        if not isinstance(lay, list) or len(lay) != nax:
            raise PlanFormatError(f"{where}: layout {lay!r} must list one placement per mesh axis ({nax})")
        for p in lay:
            try:
                Placement.parse(p)
            except (ShardingError, AttributeError) as e:
                raise PlanFormatError(f"{where}: {e}") from e

    if not isinstance(d["params"], dict):
        raise PlanFormatError("plan 'params' must map parameter names to layouts")
    for fqn, lay in d["params"].items():
        check_layout(f"param {fqn}", lay)
    if not isinstance(d["nodes"], list):
        raise PlanFormatError("plan 'nodes' must be a list")
    for n in d["nodes"]:
        if not isinstance(n, dict) or not {"name", "op", "inputs", "outputs"} <= n.keys():
            raise PlanFormatError(f"plan node entry {n!r} needs name, op, inputs and outputs")
        for lay in n["inputs"] + n["outputs"]:
            check_layout(f"node {n['name']}", lay)
    for c in d["collectives"]:
        if not isinstance(c, dict) or c.get("kind") not in KINDS or c.get("phase") not in PHASES \
                or c.get("axis") not in mesh["axes"]:
            raise PlanFormatError(f"plan collective {c!r}: kind must be one of {KINDS}, phase one of {PHASES}, "
                                  f"axis one of {mesh['axes']}")
    if not isinstance(d["memory"], dict) or any(k not in d["memory"] for k in MEMORY_KEYS):
        raise PlanFormatError(f"plan memory must give {MEMORY_KEYS}")
    rc = d.get("recompute", {"classes": {}, "layers": []})
    if not (isinstance(rc, dict) and isinstance(rc.get("layers"), list) and isinstance(rc.get("classes"), dict)
            and all(isinstance(x, str) for x in rc["layers"])):
        raise PlanFormatError(f"plan recompute must be {{'classes': {{...}}, 'layers': [layer names]}}, got {rc!r}")
    if not isinstance(d.get("sharded_outputs", False), bool):
        raise PlanFormatError(f"plan sharded_outputs must be true or false, got {d['sharded_outputs']!r}")
    if d.get("pipeline") is not None:
        _validate_pipeline(d["pipeline"], mesh)
    if not isinstance(d["step_time"], (int, float)) or d["step_time"] < 0:
        raise PlanFormatError(f"plan step_time must be a non-negative number, got {d['step_time']!r}")


def _validate_pipeline(pipe: Any, mesh: dict) -> None:
    if not isinstance(pipe, dict) or not {"axis", "schedule", "microbatches", "stages"} <= pipe.keys():
        raise PlanFormatError("plan pipeline must be null or {'axis', 'schedule', 'microbatches', 'stages', ...}")
    if pipe["axis"] not in mesh["axes"]:
        raise PlanFormatError(f"plan pipeline axis {pipe['axis']!r} is not a mesh axis {mesh['axes']}")
    if pipe["schedule"] not in PIPELINE_SCHEDULES:
        raise PlanFormatError(f"plan pipeline schedule {pipe['schedule']!r} must be one of {PIPELINE_SCHEDULES}")
    m = pipe["microbatches"]
    if not isinstance(m, int) or isinstance(m, bool) or m < 1:
        raise PlanFormatError(f"plan pipeline microbatches must be an integer >= 1, got {m!r}")
    size = mesh["shape"][mesh["axes"].index(pipe["axis"])]
    stages = pipe["stages"]
    if not isinstance(stages, list) or not stages:
        raise PlanFormatError("plan pipeline stages must be a non-empty list")
    seen: dict = {}
    for k, st in enumerate(stages):
        if not isinstance(st, dict) or st.get("index") != k:
            raise PlanFormatError(f"plan pipeline stage {k} must be an object with index {k}, got {st!r}")
        r = st.get("pp_rank")
        if not isinstance(r, int) or not 0 <= r < size:
            raise PlanFormatError(f"plan pipeline stage {k}: pp_rank {r!r} must be a rank of axis "
                                  f"{pipe['axis']!r} (0 to {size - 1})")
        layers = st.get("layers")
        if not isinstance(layers, list) or not layers or not all(isinstance(x, str) for x in layers):
            raise PlanFormatError(f"plan pipeline stage {k}: layers must be a non-empty list of layer names")
        for x in layers:
            if x in seen:
                raise PlanFormatError(f"plan pipeline: layer {x} is in stages {seen[x]} and {k}")
            seen[x] = k
    if {st["pp_rank"] for st in stages} != set(range(size)):
        raise PlanFormatError(f"plan pipeline: every rank of axis {pipe['axis']!r} (size {size}) must hold a stage")
