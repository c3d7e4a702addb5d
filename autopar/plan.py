"""The Plan: a versioned, JSON-serializable record of how a model is laid out on a cluster.

The schema is documented in docs/plan-format.md. Loading validates the file and never unpickles.
"""
from __future__ import annotations

import copy
import json
import math
from collections.abc import Mapping
from dataclasses import MISSING, dataclass, field, fields
from pathlib import Path
from typing import Any, ClassVar

from autopar.errors import PlanFormatError, ShardingError
from autopar.layout import Placement

PLAN_VERSION = 1
# Lightning's names of the training precisions (autopar.passes.precision)
PRECISIONS = ("32-true", "bf16-mixed", "bf16-true")
# what mixed precision may sum gradients over ranks in (autopar.passes.precision.with_reduce_dtype)
REDUCE_DTYPES = ("float32", "bfloat16")
PHASES = ("forward", "backward", "optimizer")
KINDS = ("all_reduce", "all_gather", "reduce_scatter", "all_to_all", "send_recv")
MEMORY_KEYS = ("peak", "params", "grads", "optimizer", "activations")
# torch.distributed.pipelining schedules a pipeline plan may name
PIPELINE_SCHEDULES = ("GPipe", "1F1B", "Interleaved1F1B", "InterleavedZeroBubble", "ZBVZeroBubble")
# DDP's gradient bucket size (``bucket_cap_mb``): what a plan without ``bucket_mb`` runs and is priced at.
DDP_BUCKET_MB = 25


def bucket_bytes(bucket_mb: float | None) -> int:
    """The bytes of a gradient bucket of ``bucket_mb`` MiB (None: DDP's), as the runtime, the replay,
    the solver's hiding credits and the step memory model all take it."""
    return int((DDP_BUCKET_MB if bucket_mb is None else bucket_mb) * 2**20)


# --- typed entries -----------------------------------------------------------------------------
# A plan's per-node decisions, collectives, memory summary, alternatives, pipeline and ZeRO entries
# are frozen records. Their attributes
# are typed (a layout is a tuple of placement strings); indexing one reads its JSON object, so
# ``plan.memory["peak"]`` and ``node["inputs"]`` (lists, as in the file) keep working.

def _to_json(v):
    if isinstance(v, _Record):
        return v.to_dict()
    if isinstance(v, (tuple, list)):
        return [_to_json(x) for x in v]
    if isinstance(v, dict):
        return {k: _to_json(x) for k, x in v.items()}
    return v


def _layouts(v) -> tuple:
    return tuple(tuple(lay) for lay in v)


class _Record(Mapping):
    """A frozen plan entry that reads as its JSON object too (``Mapping``: ``[key]``, ``get``, ``items``)."""

    # fields left out of the JSON object while they hold their default
    OMITTED_AT_DEFAULT: ClassVar[frozenset] = frozenset()

    def _written(self, f) -> bool:
        if f.name not in self.OMITTED_AT_DEFAULT:
            return True
        default = f.default_factory() if f.default is MISSING else f.default
        return getattr(self, f.name) != default

    def to_dict(self) -> dict:
        return {f.name: _to_json(getattr(self, f.name)) for f in fields(self) if self._written(f)}

    def __getitem__(self, key):
        f = self.__dataclass_fields__.get(key) if isinstance(key, str) else None
        if f is None or not self._written(f):
            raise KeyError(key)
        return _to_json(getattr(self, key))

    def __iter__(self):
        return (f.name for f in fields(self) if self._written(f))

    def __len__(self) -> int:
        return sum(1 for _ in self)


@dataclass(frozen=True, eq=True)
class PlanNode(_Record):
    """The decision for one graph node: its layouts and what it costs per device."""

    name: str
    op: str                            # the ATen op's name, e.g. "mm.default"
    inputs: tuple                      # one layout per tensor input, e.g. (("S(0)", "R"), ("R", "S(1)"))
    outputs: tuple                     # one layout per tensor output
    split_axes: tuple                  # the mesh axes along which the op's work is divided
    compute_seconds: float             # forward + backward
    comm_seconds: float                # its inputs' reshardings and the collectives it runs itself
    activation_bytes: float            # kept for backward, per device
    layer: str | None = None           # the layer instance it belongs to
    layer_class: str | None = None
    follows: str | None = None         # the node whose decision fixes this one's
    shape: tuple | None = None         # the output's global shape

    @classmethod
    def from_dict(cls, d: Mapping) -> "PlanNode":
        return cls(d["name"], d["op"], _layouts(d["inputs"]), _layouts(d["outputs"]), tuple(d["split_axes"]),
                   d["compute_seconds"], d["comm_seconds"], d["activation_bytes"], d.get("layer"),
                   d.get("layer_class"), d.get("follows"), None if d.get("shape") is None else tuple(d["shape"]))


@dataclass(frozen=True, eq=True)
class PlanCollective(_Record):
    """One collective the generated program runs on one mesh axis, priced (passes/costs.py)."""

    OMITTED_AT_DEFAULT: ClassVar[frozenset] = frozenset({"value", "step", "recompute", "exposed"})

    kind: str                          # all_reduce, all_gather, reduce_scatter, all_to_all or send_recv
    axis: str                          # the mesh axis's name
    phase: str                         # forward, backward or optimizer
    bytes: float                       # per device (docs/plan-format.md)
    seconds: float
    node: str                          # the first consumer
    value: str | None = None           # the tensor moved
    step: str | None = None            # the runtime call that runs it, or the op that runs it itself
    recompute: bool = False            # a forward collective of a recomputed layer, run again in backward
    exposed: float | None = None       # the seconds of it that compute does not hide

    @classmethod
    def from_dict(cls, d: Mapping) -> "PlanCollective":
        return cls(d["kind"], d["axis"], d["phase"], d["bytes"], d["seconds"], d["node"], d.get("value"),
                   d.get("step"), d.get("recompute", False), d.get("exposed"))


@dataclass(frozen=True, eq=True)
class MemoryPoint(_Record):
    """Live bytes per device at one point of the step, per category (passes/memory.py: CATEGORIES)."""

    phase: str                         # forward, recompute, backward or optimizer
    node: str                          # the node, layer instance or parameter at that point
    params: float
    optimizer: float
    grads: float
    activations: float
    transient: float

    @classmethod
    def from_dict(cls, d: Mapping) -> "MemoryPoint":
        return cls(d["phase"], d["node"], d["params"], d["optimizer"], d["grads"], d["activations"], d["transient"])


@dataclass(frozen=True, eq=True)
class PlanMemory(_Record):
    """Bytes per device over one training step (docs/cost-model.md, "Memory")."""

    OMITTED_AT_DEFAULT: ClassVar[frozenset] = frozenset(
        {"memory_budget", "host", "by_param", "timeline", "peak_point", "peak_at"})

    peak: float                        # the step's highest point, never above memory_budget
    params: float
    grads: float
    optimizer: float
    activations: float                 # kept for backward at the end of forward
    memory_budget: float | None = None
    host: float | None = None          # host memory of offloaded optimizer states
    by_param: dict = field(default_factory=dict)    # FQN -> parameter + gradient + optimizer state
    timeline: tuple = ()               # MemoryPoints, sampled to about 200 keeping each window's highest
    peak_point: int | None = None      # the peak's index among the step's points
    peak_at: MemoryPoint | None = None

    @classmethod
    def from_dict(cls, d: Mapping) -> "PlanMemory":
        return cls(d["peak"], d["params"], d["grads"], d["optimizer"], d["activations"], d.get("memory_budget"),
                   d.get("host"), dict(d.get("by_param", {})),
                   tuple(MemoryPoint.from_dict(p) for p in d.get("timeline", ())), d.get("peak_point"),
                   None if d.get("peak_at") is None else MemoryPoint.from_dict(d["peak_at"]))


@dataclass(frozen=True, eq=True)
class AlternativeCollective(_Record):
    """A collective an alternative would run with one neighbour (held at its chosen layout); of kind
    "impossible", with no axis or price, where no resharding brings the value to what it reads."""

    OMITTED_AT_DEFAULT: ClassVar[frozenset] = frozenset({"axis", "phase", "bytes", "seconds"})

    kind: str
    neighbor: str                      # the node it is exchanged with
    value: str                         # the tensor moved
    axis: str | None = None
    phase: str | None = None
    bytes: float | None = None         # per device
    seconds: float | None = None

    @classmethod
    def from_dict(cls, d: Mapping) -> "AlternativeCollective":
        return cls(d["kind"], d["neighbor"], d["value"], d.get("axis"), d.get("phase"), d.get("bytes"),
                   d.get("seconds"))


@dataclass(frozen=True, eq=True)
class PlanAlternative(_Record):
    """One option of a decision, chosen or not, with its costs (``explain``; docs/plan-format.md). An
    impossible option's costs are infinite; plans saved before the costs were recorded have none."""

    OMITTED_AT_DEFAULT: ClassVar[frozenset] = frozenset(
        {"inputs", "own_seconds", "resharding_seconds", "total_seconds", "memory_bytes", "collectives"})

    layout: str                        # the option's label, e.g. "[S(0)]"
    chosen: bool
    inputs: tuple | None = None        # one layout per tensor input
    own_seconds: float | None = None   # compute and the op's own collectives
    resharding_seconds: float | None = None    # with its neighbours at their chosen layouts
    total_seconds: float | None = None
    memory_bytes: float | None = None  # kept for backward, per device
    collectives: tuple | None = None   # AlternativeCollectives

    @classmethod
    def from_dict(cls, d: Mapping) -> "PlanAlternative":
        return cls(d["layout"], d["chosen"], None if d.get("inputs") is None else _layouts(d["inputs"]),
                   d.get("own_seconds"), d.get("resharding_seconds"), d.get("total_seconds"), d.get("memory_bytes"),
                   None if d.get("collectives") is None
                   else tuple(AlternativeCollective.from_dict(c) for c in d["collectives"]))


@dataclass(frozen=True, eq=True)
class PlanZero(_Record):
    """A parameter replicated along ``axis`` whose optimizer state (ZeRO-1), and gradient too (ZeRO-2),
    are sharded along that axis, split on its dim ``dim`` (docs/cost-model.md). ``sharded_master``: its
    float32 master weight is sharded too, and each rank keeps whole only the bfloat16 copy the program
    reads (bf16-mixed ZeRO-1/2, Megatron-LM's distributed optimizer; runtime/zero.py)."""

    OMITTED_AT_DEFAULT: ClassVar[frozenset] = frozenset({"bucket", "sharded_master"})

    stage: int                         # 1 or 2
    axis: str
    dim: int
    bucket: int | None = None          # the bucket its updated shard is all-gathered in (runtime/zero.py)
    sharded_master: bool = False

    @classmethod
    def from_dict(cls, d: Mapping) -> "PlanZero":
        return cls(d["stage"], d["axis"], d["dim"], d.get("bucket"), d.get("sharded_master", False))


def _optional_tuple(v):
    return None if v is None else tuple(v)


@dataclass(frozen=True, eq=True)
class PlanStage(_Record):
    """One pipeline stage: its layers and what one microbatch costs on it (autopar/pipelining.py)."""

    OMITTED_AT_DEFAULT: ClassVar[frozenset] = frozenset(
        {"compute_seconds", "comm_seconds", "grad_sync_seconds", "p2p_seconds", "recompute", "recompute_seconds",
         "optimizer_seconds", "param_bytes", "send_bytes"})

    index: int
    pp_rank: int                       # the rank of the pipeline axis that runs it
    layers: tuple                      # layer instances, in order
    seconds: float                     # one microbatch's forward and backward, transfers and recompute
    activations: float                 # one microbatch's, per device
    in_flight: float                   # microbatches whose activations its rank holds at once
    compute_seconds: float | None = None
    comm_seconds: dict | None = None   # axis -> seconds per microbatch
    grad_sync_seconds: dict | None = None   # axis -> seconds of the gradient sync, once per step
    p2p_seconds: float | None = None   # the send to the next stage and the gradient back
    recompute: tuple | None = None     # its layers that recompute their activations in backward
    recompute_seconds: float | None = None
    optimizer_seconds: float | None = None
    param_bytes: float | None = None   # parameters, gradients and optimizer states
    send_bytes: float | None = None    # the activation it sends to the next stage

    @classmethod
    def from_dict(cls, d: Mapping) -> "PlanStage":
        return cls(d["index"], d["pp_rank"], tuple(d["layers"]), d["seconds"], d["activations"], d["in_flight"],
                   d.get("compute_seconds"), d.get("comm_seconds"), d.get("grad_sync_seconds"), d.get("p2p_seconds"),
                   _optional_tuple(d.get("recompute")), d.get("recompute_seconds"), d.get("optimizer_seconds"),
                   d.get("param_bytes"), d.get("send_bytes"))


@dataclass(frozen=True, eq=True)
class PlanRank(_Record):
    """One rank of the pipeline axis: the stages it runs, summed, and its memory at its peak."""

    OMITTED_AT_DEFAULT: ClassVar[frozenset] = frozenset(
        {"seconds_per_microbatch", "in_flight", "compute_seconds", "comm_seconds", "grad_sync_seconds", "p2p_seconds",
         "recompute_seconds", "activation_bytes", "static_bytes", "peak", "optimizer_seconds"})

    rank: int
    seconds_per_microbatch: float | None = None
    in_flight: float | None = None
    compute_seconds: float | None = None
    comm_seconds: dict | None = None
    grad_sync_seconds: dict | None = None
    p2p_seconds: float | None = None
    recompute_seconds: float | None = None
    activation_bytes: float | None = None   # at its peak: the in-flight microbatches' and a recompute's
    static_bytes: float | None = None       # parameters, gradients and optimizer states
    peak: float | None = None
    optimizer_seconds: float | None = None

    @classmethod
    def from_dict(cls, d: Mapping) -> "PlanRank":
        return cls(d["rank"], d.get("seconds_per_microbatch"), d.get("in_flight"), d.get("compute_seconds"),
                   d.get("comm_seconds"), d.get("grad_sync_seconds"), d.get("p2p_seconds"), d.get("recompute_seconds"),
                   d.get("activation_bytes"), d.get("static_bytes"), d.get("peak"), d.get("optimizer_seconds"))


@dataclass(frozen=True, eq=True)
class PlanPipeline(_Record):
    """A pipeline plan's stages, schedule and bubble (docs/pipeline.md)."""

    OMITTED_AT_DEFAULT: ClassVar[frozenset] = frozenset({"virtual_stages", "grad_sync_seconds", "ranks"})

    axis: str                          # the mesh axis the stages are cut along
    schedule: str                      # one of PIPELINE_SCHEDULES
    microbatches: int
    stages: tuple                      # PlanStages, by index
    bubble_fraction: float             # of the ideal time
    bubble_seconds: float
    virtual_stages: int | None = None  # stages per rank
    grad_sync_seconds: float | None = None  # the slowest rank's gradient sync, once per step
    ranks: tuple | None = None         # PlanRanks, by rank

    @classmethod
    def from_dict(cls, d: Mapping) -> "PlanPipeline":
        return cls(d["axis"], d["schedule"], d["microbatches"], tuple(PlanStage.from_dict(s) for s in d["stages"]),
                   d["bubble_fraction"], d["bubble_seconds"], d.get("virtual_stages"), d.get("grad_sync_seconds"),
                   None if d.get("ranks") is None else tuple(PlanRank.from_dict(r) for r in d["ranks"]))


def pack_buckets(items, nbytes, bucket_bytes: float, key=None) -> list[list]:
    """``items``, in order, packed into buckets as DDP packs gradients: one bucket open per ``key`` (an
    item's group and dtype), closed once it holds ``bucket_bytes`` or more, so that items of
    another key between them (bf16-mixed's float32 norms among its bfloat16-reduced weights) do not cut
    a bucket short. The buckets come in the order their last items do: the order in which they fill
    when the items become ready in order. One rule for the runtime's gradient buckets
    (runtime/grad_buckets.py), the replay that prices them and the solver's hiding windows
    (passes/exposure.py), and the ZeRO gather buckets the plan names (passes/memory.py)."""
    done: list[tuple[int, list]] = []     # (index of its last item, bucket)
    filling: dict = {}                     # key -> (bucket, bytes, index of its last item)
    for i, item in enumerate(items):
        k = key(item) if key is not None else None
        if k in filling and filling[k][1] >= bucket_bytes:
            bucket, _, last = filling.pop(k)
            done.append((last, bucket))
        bucket, size, _ = filling.get(k, ([], 0.0, i))
        bucket.append(item)
        filling[k] = (bucket, size + nbytes(item), i)
    done += [(last, bucket) for bucket, _, last in filling.values()]
    return [bucket for _, bucket in sorted(done, key=lambda e: e[0])]


@dataclass
class Plan:
    model: dict                      # class, fingerprint, num_params
    cluster: dict                    # ClusterSpec.to_dict()
    mesh: dict                       # {"shape": [...], "axes": [...]}
    params: dict                     # FQN -> layout strings, one per mesh axis
    inputs: dict                     # user input name -> layout strings
    nodes: list[PlanNode]            # one per graph node, in execution order
    collectives: list[PlanCollective]
    memory: PlanMemory               # bytes per device: peak, params, grads, optimizer, activations, ...
    step_time: float                 # predicted seconds per training step
    breakdown: dict                  # seconds: compute, communication per axis, optimizer
    solver: dict                     # status, seconds, variables, constraints, backend, candidates
    # node name or parameter FQN -> the chosen layout and the best alternatives, with their costs and
    # the collectives each would cause with its neighbours (see docs/plan-format.md)
    alternatives: dict[str, tuple[PlanAlternative, ...]] = field(default_factory=dict)
    sharded_outputs: bool = False    # non-scalar outputs are returned as computed, not gathered
    # layer instances whose activations are recomputed in backward: {"classes": {class: {"count",
    # "of", "layers"}}, "layers": [instance, ...]}, and where attention cores alone are (selective
    # recompute), "attention": {"classes": ..., "layers": [...], "regions": {region: [node, ...]}}, and
    # where saved activations go to host memory, "offload": {"classes": ..., "layers": [...], "bytes"}
    recompute: dict = field(default_factory=lambda: {"classes": {}, "layers": []})
    # pipeline plans: the stages, the schedule, the microbatches and the bubble
    pipeline: PlanPipeline | None = None
    # the training precision, by Lightning's name (autopar.passes.precision.PRECISIONS)
    precision: str = "32-true"
    # mixed precision: the dtype the weights' gradients are summed over ranks in, "float32" or "bfloat16";
    # None where the plan has no choice (not mixed) or predates the field (bfloat16 then)
    reduce_dtype: str | None = None
    # parameters whose optimizer state (ZeRO-1), and gradient too (ZeRO-2), are sharded along an axis
    # the parameter is replicated on
    zero: dict[str, PlanZero] = field(default_factory=dict)
    # parameters whose optimizer state, the gradient it reads and the copy of the parameter it steps
    # live in host memory, stepped there: FQN -> {"host_bytes", "device_bytes_freed"} per device
    offload: dict = field(default_factory=dict)
    # the size in MiB of the buckets data-parallel gradients are all-reduced in during backward, chosen
    # by the replay (passes/exposure.py) or given; None where the program makes no bucket (pipelines,
    # ``overlap=False``) or the plan predates the field: DDP's 25 then
    bucket_mb: float | None = None
    version: int = PLAN_VERSION
    extra: dict = field(default_factory=dict)

    # --- serialization -------------------------------------------------------------------------
    def to_dict(self) -> dict:
        return copy.deepcopy({f.name: _to_json(getattr(self, f.name)) for f in fields(self)})

    def to_json(self) -> str:
        return json.dumps(self.to_dict(), indent=1, sort_keys=True)

    def save(self, path) -> None:
        Path(path).write_text(self.to_json())

    @classmethod
    def from_dict(cls, d: Any) -> "Plan":
        d = _renamed_keys(d)
        _validate(d)
        entries = {"nodes": [PlanNode.from_dict(n) for n in d["nodes"]],
                   "collectives": [PlanCollective.from_dict(c) for c in d["collectives"]],
                   "memory": PlanMemory.from_dict(d["memory"]),
                   "alternatives": {k: tuple(PlanAlternative.from_dict(a) for a in v)
                                    for k, v in d.get("alternatives", {}).items()},
                   "pipeline": None if d.get("pipeline") is None else PlanPipeline.from_dict(d["pipeline"]),
                   "zero": {k: PlanZero.from_dict(z) for k, z in d.get("zero", {}).items()}}
        return cls(**{k: entries.get(k, d[k]) for k in cls.__dataclass_fields__ if k in d})

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

    def node(self, name: str) -> PlanNode:
        for n in self.nodes:
            if n.name == name:
                return n
        raise KeyError(f"plan has no node {name!r}")

    def collective_counts(self) -> dict:
        """{(kind, axis, phase): count}."""
        out: dict = {}
        for c in self.collectives:
            k = (c.kind, c.axis, c.phase)
            out[k] = out.get(k, 0) + 1
        return out

    def zero_stages(self) -> dict:
        """Parameter FQN -> (ZeRO stage, mesh axis) for every parameter whose state is sharded: 1 or 2
        from ``zero``, 3 where the parameter itself is sharded along an axis its readers gather it on."""
        out = {fqn: (z.stage, z.axis) for fqn, z in self.zero.items()}
        gathered = {(c.value, c.axis) for c in self.collectives if c.kind == "all_gather" and c.phase == "forward"}
        for fqn, lay in self.params.items():
            value = "p_" + fqn.replace(".", "_")          # torch.export's name for the parameter
            for axis, p in zip(self.axis_names, lay):
                if fqn not in out and p != "R" and (value, axis) in gathered:
                    out[fqn] = (3, axis)
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


# --- schema ------------------------------------------------------------------------------------
# Every field is checked before a Plan is made, so a malformed file fails here, naming the field,
# and never later inside code generation. A check is a function (value, where) that raises.

def _fail(where, message):
    raise PlanFormatError(f"plan field {where}: {message}")


def _number(v, where):
    if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v) or v < 0:
        _fail(where, f"must be a finite non-negative number, got {v!r}")


def _cost(v, where):
    """Seconds or bytes of an alternative, where an impossible option is priced infinite."""
    if isinstance(v, bool) or not isinstance(v, (int, float)) or math.isnan(v) or v < 0:
        _fail(where, f"must be a non-negative number or Infinity, got {v!r}")


def _integer(low=0):
    def check(v, where):
        if isinstance(v, bool) or not isinstance(v, int) or v < low:
            _fail(where, f"must be an integer >= {low}, got {v!r}")
    return check


def _string(v, where):
    if not isinstance(v, str) or not v:
        _fail(where, f"must be a non-empty string, got {v!r}")


def _boolean(v, where):
    if not isinstance(v, bool):
        _fail(where, f"must be true or false, got {v!r}")


def _one_of(options):
    def check(v, where):
        if not isinstance(v, str) or v not in options:
            _fail(where, f"must be one of {list(options)}, got {v!r}")
    return check


def _zero_stage(v, where):
    if v not in (1, 2) or isinstance(v, bool):
        _fail(where, f"must be 1 (ZeRO-1) or 2 (ZeRO-2), got {v!r}")


def _optional(check):
    def inner(v, where):
        if v is not None:
            check(v, where)
    return inner


def _list_of(check):
    def inner(v, where):
        if not isinstance(v, list):
            _fail(where, f"must be a list, got {type(v).__name__}")
        for i, x in enumerate(v):
            check(x, f"{where}[{i}]")
    return inner


def _dict_of(check):
    def inner(v, where):
        if not isinstance(v, dict):
            _fail(where, f"must be an object, got {type(v).__name__}")
        for k, x in v.items():
            if not isinstance(k, str) or not k:
                _fail(where, f"keys must be non-empty strings, got {k!r}")
            check(x, f"{where}.{k}")
    return inner


def _object(required: dict, optional: dict | None = None, *, open_ended: bool = True):
    """An object with ``required`` and ``optional`` fields; ``open_ended`` allows other keys."""
    optional = optional or {}

    def inner(v, where):
        if not isinstance(v, dict):
            _fail(where, f"must be an object, got {type(v).__name__}")
        missing = [k for k in required if k not in v]
        if missing:
            _fail(where, f"is missing {missing}")
        if not open_ended:
            unknown = sorted(set(map(str, v)) - set(required) - set(optional))
            if unknown:
                _fail(where, f"has unknown fields {unknown}")
        for k, check in {**required, **optional}.items():
            if k in v:
                check(v[k], f"{where}.{k}")
    return inner


def _layout(axes, *, partial_ok=True):
    def check(v, where):
        if not isinstance(v, list) or len(v) != len(axes):
            _fail(where, f"layout {v!r} must list one placement per mesh axis {list(axes)}")
        dims = []
        for x in v:
            if not isinstance(x, str):
                _fail(where, f"placement {x!r} must be a string 'R', 'P', 'S(<dim>)' or 'S(<dim>,<groups>)'")
            try:
                p = Placement.parse(x)
            except ShardingError as e:
                _fail(where, str(e))
            if p.is_partial and not partial_ok:
                _fail(where, f"layout {v} is a partial sum, which a parameter or an input cannot be")
            if p.is_shard:
                if p.dim in dims:
                    _fail(where, f"layout {v} shards dim {p.dim} along two mesh axes")
                dims.append(p.dim)
    return check


def _mesh(v, where):
    _object({"shape": _list_of(_integer(1)), "axes": _list_of(_string)}, open_ended=False)(v, where)
    if not v["shape"] or len(v["shape"]) != len(v["axes"]):
        _fail(where, f"shape {v['shape']} and axes {v['axes']} must be non-empty and of equal length")
    if len(set(v["axes"])) != len(v["axes"]):
        _fail(where, f"axis names {v['axes']} must be distinct")


def _cluster(v, where):
    from autopar.cluster import ClusterSpec

    try:
        ClusterSpec.from_dict(v)
    except PlanFormatError as e:
        _fail(where, str(e))
    except Exception as e:           # a wrong type reaching ClusterSpec's own checks
        _fail(where, f"{type(e).__name__}: {e}")


def _node(axes):
    layout = _layout(axes)

    def check(v, where):
        _object({"name": _string, "op": _string, "inputs": _list_of(layout), "outputs": _list_of(layout),
                 "split_axes": _list_of(_one_of(axes)), "compute_seconds": _number, "comm_seconds": _number,
                 "activation_bytes": _number, "layer": _optional(_string), "layer_class": _optional(_string),
                 "follows": _optional(_string), "shape": _optional(_list_of(_integer(0)))})(v, where)
        shape = v.get("shape")
        if shape is not None and v["outputs"]:
            for x in v["outputs"][0]:
                p = Placement.parse(x)
                if p.is_shard and p.dim >= len(shape):
                    _fail(f"{where}.outputs", f"S({p.dim}) for a tensor of shape {shape}")
    return check


def _schema(axes) -> dict:
    """The check of every top-level field, for a mesh of these axis names."""
    collective = _object({"kind": _one_of(KINDS), "axis": _one_of(axes), "phase": _one_of(PHASES),
                          "bytes": _number, "seconds": _number, "node": _string},
                         {"value": _string, "step": _string, "recompute": _boolean, "exposed": _number})
    alternative = _object({"layout": _string, "chosen": _boolean},
                          {"inputs": _list_of(_layout(axes)), "own_seconds": _cost, "resharding_seconds": _cost,
                           "total_seconds": _cost, "memory_bytes": _cost,
                           "collectives": _list_of(_object(
                               {"kind": _string, "neighbor": _string, "value": _string},
                               {"axis": _one_of(axes), "phase": _one_of(PHASES), "bytes": _number,
                                "seconds": _number}))})
    memory_phases = ("forward", "recompute", "backward", "optimizer")
    point = _object({"phase": _one_of(memory_phases), "node": _string, "params": _number,
                     "optimizer": _number, "grads": _number, "activations": _number, "transient": _number})
    return {
        "model": _object({"class": _string, "fingerprint": _string, "num_params": _integer(0)},
                         {"input_shapes": _list_of(_optional(_list_of(_integer(0)))),
                          "layers": _dict_of(_integer(1))}),
        "cluster": _cluster,
        "mesh": _mesh,
        "params": _dict_of(_layout(axes, partial_ok=False)),
        "inputs": _dict_of(_layout(axes, partial_ok=False)),
        "nodes": _list_of(_node(axes)),
        "collectives": _list_of(collective),
        "memory": _object({k: _number for k in MEMORY_KEYS},
                          {"memory_budget": _number, "host": _number, "by_param": _dict_of(_number), "timeline": _list_of(point),
                           "peak_point": _integer(0), "peak_at": point}),
        "step_time": _number,
        "breakdown": _object({"compute": _number, "communication": _dict_of(_number), "optimizer": _number},
                             {"recompute": _number, "offload": _number, "exposed": _number, "hidden": _number,
                              "serial": _number, "credit": _number}),
        "solver": _object({}, {"status": _string, "seconds": _number, "variables": _integer(0),
                               "constraints": _integer(0), "backend": _string, "planning_seconds": _number,
                               "candidates": _list_of(_object({"mesh": _list_of(_integer(1)), "status": _string},
                                                              {"objective": _optional(_cost)})),
                               "passes": _list_of(_object({"name": _string, "seconds": _number,
                                                           "skipped": _boolean})),
                               "buckets": _dict_of(_number)}),
        "alternatives": _dict_of(_list_of(alternative)),
        "sharded_outputs": _boolean,
        "precision": _one_of(PRECISIONS),
        "reduce_dtype": _optional(_one_of(REDUCE_DTYPES)),
        "recompute": _object({"classes": _dict_of(_object({"count": _integer(0), "of": _integer(1),
                                                            "layers": _list_of(_string)})),
                              "layers": _list_of(_string)},
                             {"attention": _object({"classes": _dict_of(_object({"count": _integer(0),
                                                                                 "of": _integer(1),
                                                                                 "layers": _list_of(_string)})),
                                                    "layers": _list_of(_string),
                                                    "regions": _dict_of(_list_of(_string))}, open_ended=False),
                              "offload": _object({"classes": _dict_of(_object({"count": _integer(0),
                                                                               "of": _integer(1),
                                                                               "layers": _list_of(_string)})),
                                                  "layers": _list_of(_string)}, {"bytes": _number},
                                                 open_ended=False)},
                             open_ended=False),
        "extra": _object({}, {"warnings": _list_of(_string)}),
        "pipeline": _optional(_pipeline(axes)),
        "zero": _dict_of(_object({"stage": _zero_stage, "axis": _one_of(axes), "dim": _integer(0)},
                                 {"bucket": _integer(0), "sharded_master": _boolean}, open_ended=False)),
        "offload": _dict_of(_object({"host_bytes": _number, "device_bytes_freed": _number}, open_ended=False)),
        "bucket_mb": _optional(_number),
    }


def _pipeline(axes):
    """The pipeline entry's fields; _validate_pipeline checks how the stages fit the mesh."""
    stage = _object({"index": _integer(0), "pp_rank": _integer(0), "layers": _list_of(_string), "seconds": _number,
                     "activations": _number, "in_flight": _number},
                    {"compute_seconds": _number, "comm_seconds": _dict_of(_number),
                     "grad_sync_seconds": _dict_of(_number), "p2p_seconds": _number, "recompute": _list_of(_string),
                     "recompute_seconds": _number, "optimizer_seconds": _number, "param_bytes": _number,
                     "send_bytes": _number})
    rank = _object({"rank": _integer(0)},
                   {"seconds_per_microbatch": _number, "in_flight": _number, "activation_bytes": _number,
                    "static_bytes": _number, "peak": _number, "compute_seconds": _number,
                    "comm_seconds": _dict_of(_number), "grad_sync_seconds": _dict_of(_number), "p2p_seconds": _number,
                    "recompute_seconds": _number, "optimizer_seconds": _number})
    return _object({"axis": _one_of(axes), "schedule": _one_of(PIPELINE_SCHEDULES), "microbatches": _integer(1),
                    "stages": _list_of(stage), "bubble_fraction": _number, "bubble_seconds": _number},
                   {"virtual_stages": _integer(1), "grad_sync_seconds": _number, "ranks": _list_of(rank)})


def _renamed_keys(d: Any) -> Any:
    """A plan saved before ``memory.budget`` took the API's name, ``memory_budget``, with the new name."""
    memory = d.get("memory") if isinstance(d, dict) else None
    if isinstance(memory, dict) and "budget" in memory and "memory_budget" not in memory:
        memory = {("memory_budget" if k == "budget" else k): v for k, v in memory.items()}
        return {**d, "memory": memory}
    return d


def _validate(d: Any) -> None:
    if not isinstance(d, dict):
        raise PlanFormatError(f"a plan is a JSON object, got {type(d).__name__}")
    version = d.get("version")
    if version != PLAN_VERSION:
        raise PlanFormatError(f"plan format version {version!r} is not supported (this autopar reads "
                              f"version {PLAN_VERSION}); plan the model again with this version")
    optional = ("version", "extra", "alternatives", "sharded_outputs", "recompute", "pipeline", "precision",
                "reduce_dtype", "zero", "offload", "bucket_mb")
    missing = [k for k in Plan.__dataclass_fields__ if k not in optional and k not in d]
    if missing:
        raise PlanFormatError(f"plan is missing fields {missing}")
    unknown = sorted(set(map(str, d)) - set(Plan.__dataclass_fields__))
    if unknown:
        raise PlanFormatError(f"plan has unknown fields {unknown}; a plan of another autopar version?")
    _mesh(d["mesh"], "mesh")
    schema = _schema(tuple(d["mesh"]["axes"]))
    for key, check in schema.items():
        if key in d:
            check(d[key], key)
    names = [n["name"] for n in d["nodes"]]
    if len(set(names)) != len(names):
        _fail("nodes", "node names must be unique")
    if set(d["breakdown"]["communication"]) - set(d["mesh"]["axes"]):
        _fail("breakdown.communication", f"names axes {sorted(d['breakdown']['communication'])} outside the "
                                         f"mesh's {d['mesh']['axes']}")
    rc = d.get("recompute")
    if rc is not None:
        listed = {x for c in rc["classes"].values() for x in c["layers"]}
        for cls, c in rc["classes"].items():
            if c["count"] > c["of"] or len(c["layers"]) != c["count"]:
                _fail(f"recompute.classes.{cls}", f"count {c['count']} of {c['of']} with {len(c['layers'])} layers")
        if set(rc["layers"]) != listed:
            _fail("recompute.layers", f"{rc['layers']} must be the layers its classes list ({sorted(listed)})")
    if d.get("pipeline") is not None:
        _validate_pipeline(d["pipeline"], d["mesh"])
    for fqn, z in (d.get("zero") or {}).items():
        lay = d["params"].get(fqn)
        if lay is None:
            _fail(f"zero.{fqn}", "names no parameter of the plan")
        if lay[d["mesh"]["axes"].index(z["axis"])] != "R":
            _fail(f"zero.{fqn}", f"shards the state along axis {z['axis']!r}, where the parameter is not replicated "
                                 f"({lay})")
        if any(p == f"S({z['dim']})" for p in lay):
            _fail(f"zero.{fqn}", f"shards dim {z['dim']}, which the parameter's layout {lay} shards already")
        if d.get("pipeline") is not None and z["stage"] != 1:
            _fail(f"zero.{fqn}", f"ZeRO-{z['stage']}: pipeline plans shard optimizer states (ZeRO-1) only, their "
                                 f"gradients accumulate whole over the microbatches")
        if z.get("sharded_master") and d.get("pipeline") is not None:
            _fail(f"zero.{fqn}", "sharded_master: only a ZeRO-1/2 parameter of a plan without a pipeline shards its "
                                 "float32 master")
    for fqn in d.get("offload") or {}:
        if fqn not in d["params"]:
            _fail(f"offload.{fqn}", "names no parameter of the plan")
        if fqn in (d.get("zero") or {}):
            _fail(f"offload.{fqn}", "an offloaded optimizer state is not also sharded by ZeRO-1/2")
        if d.get("pipeline") is not None:
            _fail(f"offload.{fqn}", "pipeline plans do not offload optimizer states")
    if d.get("bucket_mb") is not None and d.get("pipeline") is not None:
        _fail("bucket_mb", "pipeline plans make no gradient bucket (their gradients are summed once per step)")


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
