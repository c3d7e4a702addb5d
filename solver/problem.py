"""The abstract layout problem the planner hands to the solver. It knows nothing of torch.fx.

Every decision is a ``Choice`` among ``len(costs)`` options. Identical repeated layers share one
decision: the caller folds them together and sets ``count`` to the number of copies, so the problem's
size does not grow with depth. An ``Edge`` charges ``cost[i][j]`` seconds when its source takes option
``i`` and its destination option ``j`` (resharding), times ``count``. A ``MemoryConstraint`` is one
moment of the training step: ``constant + sum(terms[d][choice_d]) + sum(pairs[a, b][choice_a][choice_b])
+ sum(shared) <= memory_budget`` bytes per device; a pair term is memory that depends on two decisions at
once (how many copies of a layer recompute their activations, and the layout that sizes them), and a
``SharedBytes`` term the copies one value is resharded into, one per distinct request its readers make.
A ``SharedEdge`` is one value read by several decisions: each reader's option names the *request*
it makes of the value (a target layout), and every distinct request is paid once, whatever the number
of readers making it, at ``cost[request][source option]`` seconds, times ``count``.

A cost of ``math.inf`` forbids that option, pair of options or request: the solver turns it into a
constraint rather than a number, so that huge costs never drown the real ones in its tolerances.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Sequence


@dataclass(frozen=True)
class Choice:
    name: str
    costs: tuple[float, ...]          # seconds per option (compute + internal communication)
    count: int = 1                    # how many identical copies this decision stands for
    labels: tuple[str, ...] = ()      # human-readable option names, for progress and errors

    def __post_init__(self):
        if not self.costs:
            raise ValueError(f"choice {self.name!r} has no options")
        if self.labels and len(self.labels) != len(self.costs):
            raise ValueError(f"choice {self.name!r}: {len(self.labels)} labels for {len(self.costs)} options")
        if self.count < 1:
            raise ValueError(f"choice {self.name!r}: count must be >= 1, got {self.count}")


@dataclass(frozen=True)
class Edge:
    src: int
    dst: int
    cost: tuple[tuple[float, ...], ...]   # [src option][dst option], seconds
    count: int = 1


def _requests(readers, always, assignment: Sequence[int]) -> set[int]:
    """The requests an assignment makes of a value: ``always``, and each reader's option's."""
    made = set(always)
    for c, reqs in readers:
        if reqs[assignment[c]] >= 0:
            made.add(reqs[assignment[c]])
    return made


@dataclass(frozen=True)
class SharedEdge:
    src: int
    readers: tuple[tuple[int, tuple[int, ...]], ...]   # (choice, request id per option, -1 for none)
    cost: tuple[tuple[float, ...], ...]                # [request][src option], seconds
    always: tuple[int, ...] = ()                       # requests made whatever the choices (an output)
    count: int = 1

    def requests(self, assignment: Sequence[int]) -> set[int]:
        return _requests(self.readers, self.always, assignment)

    def seconds(self, assignment: Sequence[int]) -> float:
        i = assignment[self.src]
        return self.count * sum(self.cost[r][i] for r in self.requests(assignment))


@dataclass(frozen=True)
class SharedBytes:
    """Memory of one value's resharded copies, the memory side of a ``SharedEdge``: each distinct request
    made by a reader's option (or ``always``) holds ``bytes[request][src option]`` once, however many
    readers make it. ``src`` None: the value's layout is fixed, and ``bytes`` has one column. Bytes are
    never negative (the solver bounds the indicator of a request from below only)."""

    src: int | None
    readers: tuple[tuple[int, tuple[int, ...]], ...]   # (choice, request id per option, -1 for none)
    bytes: tuple[tuple[float, ...], ...]               # [request][src option]
    always: tuple[int, ...] = ()

    def requests(self, assignment: Sequence[int]) -> set[int]:
        return _requests(self.readers, self.always, assignment)

    def at(self, assignment: Sequence[int]) -> float:
        i = 0 if self.src is None else assignment[self.src]
        return sum(self.bytes[r][i] for r in self.requests(assignment))

    def choices(self) -> set[int]:
        return {c for c, _ in self.readers} | ({self.src} if self.src is not None else set())


@dataclass(frozen=True)
class MemoryConstraint:
    name: str
    terms: tuple[tuple[int, tuple[float, ...]], ...]   # (choice index, bytes per option)
    constant: float = 0.0
    pairs: tuple[tuple[int, int, tuple[tuple[float, ...], ...]], ...] = ()   # (a, b, bytes[a option][b option])
    shared: tuple[SharedBytes, ...] = ()

    def bytes_at(self, assignment: Sequence[int]) -> float:
        return (self.constant + sum(per[assignment[i]] for i, per in self.terms)
                + sum(per[assignment[a]][assignment[b]] for a, b, per in self.pairs)
                + sum(s.at(assignment) for s in self.shared))


@dataclass
class Problem:
    choices: list[Choice] = field(default_factory=list)
    edges: list[Edge] = field(default_factory=list)
    shared: list[SharedEdge] = field(default_factory=list)
    memory: list[MemoryConstraint] = field(default_factory=list)
    memory_budget: float | None = None          # bytes per device; None: unconstrained

    def add_choice(self, choice: Choice) -> int:
        self.choices.append(choice)
        return len(self.choices) - 1

    def validate(self) -> None:
        n = len(self.choices)
        for e in self.edges:
            if not (0 <= e.src < n and 0 <= e.dst < n):
                raise ValueError(f"edge {e.src}->{e.dst} names a choice out of range 0..{n - 1}")
            rows, cols = len(self.choices[e.src].costs), len(self.choices[e.dst].costs)
            if len(e.cost) != rows or any(len(r) != cols for r in e.cost):
                raise ValueError(f"edge {self.choices[e.src].name}->{self.choices[e.dst].name}: cost "
                                 f"matrix must be {rows}x{cols}")
        names = [m.name for m in self.memory]
        if len(set(names)) != len(names):   # memory_usage() is keyed by name: a duplicate would hide one
            raise ValueError(f"memory constraint names must be unique, got {sorted(names)}")
        for e in self.shared:
            if not 0 <= e.src < n:
                raise ValueError(f"shared edge source {e.src} is out of range 0..{n - 1}")
            for c, reqs in e.readers:
                if not 0 <= c < n or len(reqs) != len(self.choices[c].costs):
                    raise ValueError(f"shared edge from {self.choices[e.src].name}: reader {c} needs one "
                                     f"request per option")
                if any(not -1 <= r < len(e.cost) for r in reqs):
                    raise ValueError(f"shared edge from {self.choices[e.src].name}: request out of range")
            if any(len(row) != len(self.choices[e.src].costs) for row in e.cost):
                raise ValueError(f"shared edge from {self.choices[e.src].name}: cost rows need one entry per "
                                 f"source option")
        for m in self.memory:
            for idx, per_option in m.terms:
                if not 0 <= idx < n:   # a negative index would silently wrap around
                    raise ValueError(f"memory constraint {m.name!r} names choice {idx}, out of range 0..{n - 1}")
                if len(per_option) != len(self.choices[idx].costs):
                    raise ValueError(f"memory constraint {m.name!r}: term for {self.choices[idx].name!r} "
                                     f"has {len(per_option)} entries for {len(self.choices[idx].costs)} options")
            for a, b, per in m.pairs:
                if not (0 <= a < n and 0 <= b < n):
                    raise ValueError(f"memory constraint {m.name!r} pairs choices {a} and {b}, out of range "
                                     f"0..{n - 1}")
                rows, cols = len(self.choices[a].costs), len(self.choices[b].costs)
                if len(per) != rows or any(len(r) != cols for r in per):
                    raise ValueError(f"memory constraint {m.name!r}: pair term {self.choices[a].name!r} x "
                                     f"{self.choices[b].name!r} must be {rows}x{cols}")
            for sb in m.shared:
                if any(not 0 <= c < n for c in sb.choices()):
                    raise ValueError(f"memory constraint {m.name!r}: a shared term names a choice out of range "
                                     f"0..{n - 1}")
                cols = 1 if sb.src is None else len(self.choices[sb.src].costs)
                if any(len(row) != cols for row in sb.bytes) or any(v < 0 for row in sb.bytes for v in row):
                    raise ValueError(f"memory constraint {m.name!r}: a shared term needs {cols} bytes, none negative, "
                                     f"per request")
                for c, reqs in sb.readers:
                    if len(reqs) != len(self.choices[c].costs) or any(not -1 <= r < len(sb.bytes) for r in reqs):
                        raise ValueError(f"memory constraint {m.name!r}: shared term reader {self.choices[c].name!r} "
                                         f"needs one request in range per option")

    def objective(self, assignment: Sequence[int]) -> float:
        """Total seconds of an assignment: the function every solver minimizes."""
        total = sum(c.count * c.costs[a] for c, a in zip(self.choices, assignment))
        total += sum(e.count * e.cost[assignment[e.src]][assignment[e.dst]] for e in self.edges)
        total += sum(e.seconds(assignment) for e in self.shared)
        return total

    def lower_bound(self) -> float:
        """A bound no assignment's objective goes below, cheap to compute: every choice at its cheapest
        option and every edge at its cheapest pair, memory ignored. The planner skips a mesh whose bound
        is no better than a plan it already has."""
        total = sum(c.count * min(c.costs) for c in self.choices)
        total += sum(e.count * min(min(row) for row in e.cost) for e in self.edges)
        for e in self.shared:
            for r, row in enumerate(e.cost):
                low = e.count * min(row)
                total += low if r in e.always else min(low, 0.0)
        return total

    def memory_usage(self, assignment: Sequence[int]) -> dict[str, float]:
        return {m.name: m.bytes_at(assignment) for m in self.memory}

    def feasible(self, assignment: Sequence[int]) -> bool:
        if self.memory_budget is None:
            return True
        return all(v <= self.memory_budget * (1 + 1e-9) for v in self.memory_usage(assignment).values())


@dataclass(frozen=True)
class Solution:
    assignment: tuple[int, ...]
    objective: float
    status: str                  # "optimal", "feasible" (time limit hit with an incumbent), "infeasible",
    #                              "bounded" (nothing cheaper than the bound the caller gave exists)
    seconds: float
    num_variables: int
    num_constraints: int
    backend: str
    gap: float | None = None     # relative gap the solver proved (objective vs its lower bound); None: unknown
