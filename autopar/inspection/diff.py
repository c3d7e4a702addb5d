"""What differs between two plans: ``diff(a, b)`` (docs/inspection.md)."""
from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass, field

from autopar.inspection.index import PlanIndex
from autopar.report import _b, _s

@dataclass
class LayoutChange:
    name: str            # node name or parameter FQN (first instance, for repeated layers)
    instances: int       # how many layer instances change the same way
    a: str | None        # layout in plan a (see _axis_layout); None when absent there
    b: str | None


@dataclass
class CollectiveChange:
    kind: str
    axis: str
    phase: str
    count_a: int
    count_b: int
    bytes_a: float
    bytes_b: float
    seconds_a: float
    seconds_b: float

    @property
    def change(self) -> str:
        return "added" if not self.count_a else "removed" if not self.count_b else "changed"


@dataclass
class PlanDiff:
    a: str                        # a one-line description of each plan
    b: str
    same_model: bool
    params: list[LayoutChange] = field(default_factory=list)
    nodes: list[LayoutChange] = field(default_factory=list)
    collectives: list[CollectiveChange] = field(default_factory=list)
    step_time: tuple[float, float] = (0.0, 0.0)
    peak_memory: tuple[float, float] = (0.0, 0.0)
    num_params: int = 0
    num_nodes: int = 0

    @property
    def added(self) -> list[CollectiveChange]:
        return [c for c in self.collectives if c.change == "added"]

    @property
    def removed(self) -> list[CollectiveChange]:
        return [c for c in self.collectives if c.change == "removed"]

    def __str__(self) -> str:
        def delta(x, y, fmt):
            rel = f", {100 * (y - x) / x:+.1f}%" if x else ""
            return f"{fmt(x)} -> {fmt(y)} ({'+' if y >= x else '-'}{fmt(abs(y - x))}{rel})"

        lines = [f"a: {self.a}", f"b: {self.b}"]
        if not self.same_model:
            lines.append("warning: the plans are of different models; layouts are matched by name")
        lines.append(f"step time: {delta(*self.step_time, _s)}")
        lines.append(f"peak memory per device: {delta(*self.peak_memory, _b)}")
        for title, items, total in (("parameters", self.params, self.num_params), ("nodes", self.nodes, self.num_nodes)):
            lines.append(f"{title} with different layouts: {sum(c.instances for c in items)} of {total}")
            for c in items:
                many = f" (x{c.instances})" if c.instances > 1 else ""
                lines.append(f"  {c.name + many:<48} {c.a or 'absent'}  =>  {c.b or 'absent'}")
        lines.append("collectives (count, bytes and seconds per step):")
        if not self.collectives:
            lines.append("  the same")
        for c in self.collectives:
            lines.append(f"  {c.change:<8} {c.kind}({c.axis}, {c.phase}): x{c.count_a} {_b(c.bytes_a)} {_s(c.seconds_a)}"
                         f" -> x{c.count_b} {_b(c.bytes_b)} {_s(c.seconds_b)}")
        return "\n".join(lines)


def _describe(plan) -> str:
    mesh = " x ".join(f"{a}={s}" for a, s in zip(plan.axis_names, plan.mesh_shape))
    pipe = plan.pipeline
    stages = (f", pipeline of {len(pipe.stages)} stages ({pipe.schedule}, {pipe.microbatches} microbatches, "
              f"bubble {_s(pipe.bubble_seconds)})") if pipe else ""
    return (f"{plan.model['class']} on {plan.cluster.get('name') or plan.cluster.get('num_devices')} "
            f"(mesh {mesh}{stages}), step {_s(plan.step_time)}, peak {_b(plan.memory.peak)}")


def _axis_layout(layout, plan) -> str:
    """A layout that compares across meshes: each split with its axis and size (``dp8:S(0)``), and
    replicated axes left out, so that replicated reads the same on any mesh."""
    parts = [f"{a}{n}:{p}" for a, n, p in zip(plan.axis_names, plan.mesh_shape, layout) if p != "R"]
    return "[" + ", ".join(parts) + "]" if parts else "[R]"


def _param_state(fqn, layout, plan) -> str:
    """A parameter's layout, and where its optimizer state lives when that differs from the layout:
    sharded by ZeRO-1/2 along an axis (``ZeRO-2 dp8``), or offloaded to host memory."""
    text = _axis_layout(layout, plan)
    zero = plan.zero.get(fqn)
    if zero:
        size = dict(zip(plan.axis_names, plan.mesh_shape))[zero.axis]
        text += f" ZeRO-{zero.stage} {zero.axis}{size}"
    if fqn in plan.offload:
        text += " offloaded"
    return text


def _group_changes(changes: dict, key_of) -> list[LayoutChange]:
    """Fold changes that repeat in every instance of a layer into one line, named by the first."""
    groups: dict = {}
    for name, (a, b) in changes.items():
        k = (key_of(name), a, b)
        if k in groups:
            groups[k].instances += 1
        else:
            groups[k] = LayoutChange(name, 1, a, b)
    return list(groups.values())


def diff(a, b) -> PlanDiff:
    """What differs between plans ``a`` and ``b``: layouts of parameters and nodes (repeated layers
    folded), collectives added, removed or changed by (kind, axis, phase), step time and peak memory."""
    ia, ib = PlanIndex(a), PlanIndex(b)

    def params(plan):
        # Sorted, because a saved plan's params come back in key order rather than the graph's.
        return {f: _param_state(f, lay, plan) for f, lay in sorted(plan.params.items())}

    def nodes(plan):
        def side(lays):
            return " ".join(_axis_layout(lay, plan) for lay in lays)
        return {n.name: f"{side(n.inputs)} -> {side(n.outputs)}" for n in plan.nodes}

    def changed(x, y):
        return {k: (x.get(k), y.get(k)) for k in list(x) + [k for k in y if k not in x] if x.get(k) != y.get(k)}

    pa, pb, na, nb = params(a), params(b), nodes(a), nodes(b)
    tot = defaultdict(lambda: [0, 0, 0.0, 0.0, 0.0, 0.0])
    for i, plan in enumerate((a, b)):
        for c in plan.collectives:
            t = tot[(c.kind, c.axis, c.phase)]
            t[i] += 1
            t[2 + i] += c.bytes
            t[4 + i] += c.seconds
    colls = [CollectiveChange(k, ax, ph, *v) for (k, ax, ph), v in sorted(tot.items())
             if v[0] != v[1] or abs(v[4] - v[5]) > 1e-12]
    return PlanDiff(
        a=_describe(a), b=_describe(b), same_model=a.model.get("fingerprint") == b.model.get("fingerprint"),
        params=_group_changes(changed(pa, pb), lambda f: (ia if f in a.params else ib).rep_param(f)),
        nodes=_group_changes(changed(na, nb), lambda n: (ia if n in ia.nodes else ib).rep_node(n)),
        collectives=colls, step_time=(a.step_time, b.step_time),
        peak_memory=(a.memory.peak, b.memory.peak),
        num_params=len(set(a.params) | set(b.params)), num_nodes=len(set(na) | set(nb)))
