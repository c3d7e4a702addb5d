"""Turn an annotated graph into the solver's abstract problem, folding repeated layers.

Decisions are made per *root* node (one that does not follow a producer). The root at position ``i``
of every instance of a layer class shares one decision, whose costs count once per instance; an
edge between two decisions sums the resharding costs of every graph edge it stands for.
"""
from __future__ import annotations

import fnmatch
from collections import defaultdict
from dataclasses import dataclass, field, replace

import torch.fx as fx

from autopar.layout import Placement, R
from autopar.passes.costs import INFEASIBLE, CostModel
from autopar.passes.exposure import HidingWindows
from autopar.plan import bucket_bytes
from autopar.passes.meta import is_param, meta_of
from autopar.passes.precision import sharded_master_option
from autopar.passes.strategies import MeshStrategies, Value, input_values, requires_grad, strategies_on
from autopar.solver import Choice, Edge, Problem, SharedEdge


def key_of(node: fx.Node):
    tag = meta_of(node).layer
    return ("L", tag.cls, tag.index) if tag is not None else ("N", node.name)


@dataclass
class ProblemIndex:
    """How the abstract problem's choices map back to the graph, on the mesh of ``strategies``."""

    strategies: MeshStrategies
    choice_of_key: dict = field(default_factory=dict)
    keys: list = field(default_factory=list)
    # layer class -> (choice index, per option: how many instances recompute whole, how many of the
    # next ones recompute their attention cores only, how many of the next ones offload their saved
    # activations to host memory)
    recompute: dict = field(default_factory=dict)
    roots_of_key: dict = field(default_factory=lambda: defaultdict(list))
    # the problem's edges priced by their hiding credits alone (build_problem's ``overlap``), or None
    credit: Problem | None = None

    def hiding_credit(self, assignment) -> float:
        """Seconds the objective counts as saved by hiding communication under an assignment."""
        return 0.0 if self.credit is None else self.credit.objective(assignment)

    def recompute_counts(self, assignment) -> dict:
        """Layer class -> how many of its instances recompute their activations in backward."""
        return {cls: counts[assignment[ci]] for cls, (ci, counts, _, _) in self.recompute.items()}

    def selective_counts(self, assignment) -> dict:
        """Layer class -> how many of its instances, after the wholly recomputed ones, recompute only
        their attention cores (passes.layers.attention_cores)."""
        return {cls: sel[assignment[ci]] for cls, (ci, _, sel, _) in self.recompute.items()}

    def offload_counts(self, assignment) -> dict:
        """Layer class -> how many of its instances, after the recomputed ones, keep their saved
        activations in host memory between forward and backward."""
        return {cls: off[assignment[ci]] for cls, (ci, _, _, off) in self.recompute.items()}

    def strategy_index(self, node: fx.Node, assignment) -> int:
        """The strategy index ``node`` takes under an assignment of the problem's choices."""
        root = self.strategies.root_of(node)
        return self.strategies.strategy_under_root(node, assignment[self.choice_of_key[key_of(root)]])

    def chosen(self, assignment) -> dict:
        """Every decided node -> the strategy it takes under an assignment, in graph order."""
        return {n: self.strategies[n][self.strategy_index(n, assignment)] for n in self.strategies}


def decision_name(node: fx.Node) -> str:
    """How users name a decision: a parameter's FQN, an input's name, or the node name."""
    role = meta_of(node).role
    return role.target if node.op == "placeholder" and role is not None else node.name


def _pinned_options(rep: fx.Node, opts, pins: dict, mesh_axes: int):
    """Options of ``rep`` allowed by the first matching pin, or None when no pin names it.

    A pin is the output layout (``["R", "S(1)"]``), or ``{"output": layout, "inputs": [layout per
    tensor input]}`` with either key, for ops whose strategies differ only in how they read. A
    parameter's pin may add ``"zero": 0, 1 or 2``: its optimizer state replicated (0), or sharded along
    an axis it is replicated on (ZeRO-1), with its gradient (ZeRO-2); and ``"offload": True or False``:
    its optimizer state kept and stepped in host memory, or on the device."""
    import fnmatch

    from autopar.errors import ShardingError
    from autopar.layout import format_layout

    name = decision_name(rep)
    for pattern, pin in pins.items():
        if not fnmatch.fnmatchcase(name, pattern):
            continue
        want = pin if isinstance(pin, dict) else {"output": pin}
        unknown = set(want) - {"output", "inputs", "zero", "offload"}
        if unknown:
            raise ShardingError(f"pin {pattern!r}: unknown keys {sorted(unknown)}; a pin gives 'output' and/or "
                                f"'inputs', and 'zero' or 'offload' for a parameter")
        offload = want.get("offload")
        if offload not in (None, True, False):
            raise ShardingError(f"pin {pattern!r}: offload must be True (optimizer state in host memory) or False, "
                                f"got {offload!r}")
        zero = want.get("zero")
        if zero not in (None, 0, 1, 2):
            raise ShardingError(f"pin {pattern!r}: zero must be 0 (state replicated), 1 (ZeRO-1) or 2 (ZeRO-2), got "
                                f"{zero!r}; ZeRO-3 is a sharded parameter layout (['S(0)'])")
        out = [str(p) for p in want["output"]] if "output" in want else None
        ins = [[str(p) for p in lay] for lay in want["inputs"]] if "inputs" in want else None
        for lay in ([out] if out is not None else []) + (ins or []):
            if len(lay) != mesh_axes:
                raise ShardingError(f"pin {pattern!r} -> {lay} gives {len(lay)} placements for a "
                                    f"{mesh_axes}-axis mesh")
        allowed = {o for o, s in enumerate(opts)
                   if (out is None or (s.outputs and format_layout(s.outputs[0]) == out))
                   and (ins is None or [format_layout(l) for l in s.inputs] == ins)
                   and (zero is None or (s.zero.stage if s.zero is not None else 0) == zero)
                   and (offload is None or s.offload == offload)}
        if not allowed and offload:
            raise ShardingError(f"pin {pattern!r} asks {name} to offload its optimizer state"
                                f"{f' with layout {out}' if out else ''}{f' and ZeRO-{zero}' if zero else ''}, which "
                                f"it cannot take: only a trained parameter offloads, and not with ZeRO-1/2")
        if not allowed and zero:
            raise ShardingError(f"pin {pattern!r} asks {name} for ZeRO-{zero}{f' with layout {out}' if out else ''}, "
                                f"which it cannot take here: a ZeRO-1/2 state is sharded along a mesh axis the "
                                f"parameter is replicated on, along a dim no other axis shards and that divides "
                                f"by that axis's size")
        refused = "".join(f"; refused: {r}" for r in meta_of(rep).refused[:8])
        if not allowed and any(Placement.parse(p).is_strided for p in out or ()):
            refused += ("; a strided layout S(d,k) is offered only where dim d is split or chunked into k "
                        "equal parts after the op (docs/sharding.md)")
        if not allowed and ins is None:
            offered = sorted({str(format_layout(s.outputs[0])) for s in opts if s.outputs})
            raise ShardingError(f"pin {pattern!r} asks {name} for layout {out}, which its op cannot "
                                f"produce here; it can take {offered}{refused}")
        if not allowed:
            offered = sorted({f"{[format_layout(l) for l in s.inputs]} -> {format_layout(s.outputs[0])}"
                              for s in opts if s.outputs})
            raise ShardingError(f"pin {pattern!r} asks {name} for {want}, which its op cannot do here; "
                                f"it can take (inputs -> output) {offered}{refused}")
        return allowed
    return None


def unmatched_pin_error(pattern: str, names):
    """The error for a pin whose glob names no decision: it would be silently ignored otherwise."""
    import difflib

    from autopar.errors import ShardingError

    close = difflib.get_close_matches(pattern, list(names), n=3, cutoff=0.5)
    hint = f"; close matches: {close}" if close else ""
    return ShardingError(f"pin {pattern!r} matches no parameter, input or node{hint}. Pins are globs over "
                         f"parameter FQNs (a tied parameter under its first name), input names and node names "
                         f"(plan.nodes, python -m autopar explain)")


def _unmatched(pattern, decided_names, strategies: MeshStrategies):
    """A pin that names only nodes without a decision of their own says which decision they follow."""
    followers = [n for n in strategies if n.op == "call_function" and strategies.root_of(n) is not n
                 and fnmatch.fnmatchcase(n.name, pattern)]
    if followers:
        from autopar.errors import ShardingError

        root = decision_name(strategies.root_of(followers[0]))
        return ShardingError(f"pin {pattern!r} names {followers[0].name}, whose layout follows {root}'s "
                             f"decision; pin {root!r} instead")
    return unmatched_pin_error(pattern, decided_names)


def build_problem(gm: fx.GraphModule, cm: CostModel, memory_budget: float | None,
                  pins: dict | None = None, sharded_outputs: bool = False,
                  recompute: bool | dict = True, overlap: bool = True,
                  sharded_masters: bool = True, bucket_mb: float | None = None) -> tuple[Problem, ProblemIndex]:
    """``pins`` maps a glob over decision names (parameter FQNs, input names, node names) to a layout
    that decision must take. A pin on one copy of a repeated layer applies to every copy. With
    ``sharded_outputs`` only scalar user outputs are priced as gathered (passes.reshard_plan). With
    ``recompute``, each layer class gets a decision of how many of its instances recompute their
    activations in backward (``_recompute_choices``); a dict fixes it for the classes it names. With
    ``overlap``, each resharding costs its seconds less a *hiding credit*, what hiding the part of it
    the compute in its window can hide saves (``passes.exposure.HidingWindows``; ``CostModel
    .overlap_saving``: all of it but the device's contention share), so the solver prefers layouts whose
    communication hides; ``idx.credit`` holds the credits alone, so that ``objective + credit`` is the
    serial step time. Without it the objective is the serial step time; ``bucket_mb`` is the gradient
    bucket size the credits pack buckets at (None: DDP's, before the plan chooses one). The strategies are those
    ``strategies_pass`` made for the cost model's mesh. With ``sharded_masters`` (not a pipeline's
    stages) a ZeRO-1/2 weight read through its bfloat16 copy shards its float32 master: its copy is
    gathered in bfloat16 and its cast does not run (``passes.precision.sharded_master_copy``)."""
    strategies = strategies_on(gm, cm.mesh_shape)
    nodes = list(strategies)
    root_of = strategies.root_of
    idx = ProblemIndex(strategies)
    members = defaultdict(list)
    for n in nodes:
        root = root_of(n)
        members[root].append(n)
        if root is n:
            idx.roots_of_key[key_of(n)].append(n)

    prob = Problem(memory_budget=memory_budget)
    forward = {}         # choice -> forward seconds of one copy, per option (what recomputing costs)
    saved = {}           # choice -> bytes one copy saves for backward, per option (what offloading moves)
    core_forward = {}    # choice -> the part of it in the layer's attention cores
    in_core = _attention_core_nodes(gm)
    decided_names = set()
    for key, roots in idx.roots_of_key.items():
        rep = roots[0]
        opts = strategies[rep]
        costs, fwd, core, kept = [], [], [], []
        for o in range(len(opts)):
            c, f, fc, a = 0.0, 0.0, 0.0, 0.0
            copy = sharded_master_option(rep, o, strategies) if sharded_masters and is_param(rep) else None
            for m in members[rep]:
                s = strategies.strategy_of(m, o)
                if m is copy:           # the program reads the whole copy in place of the cast
                    continue
                c += cm.compute_seconds(m, s) + cm.op_comm_seconds(m, s)
                f += cm.forward_seconds(m, s)
                a += cm.activation_bytes(m, s)
                if m in in_core:
                    fc += cm.forward_seconds(m, s)
                if is_param(m):
                    c += (cm.optimizer_seconds(m, s.outputs[0], s.zero, s.offload)
                          + cm.zero_seconds(m, s.outputs[0], s.zero, None if copy is None else copy.meta["val"].dtype))
            costs.append(c)
            fwd.append(f)
            core.append(fc)
            kept.append(a)
        allowed = None
        decided_names.update(decision_name(r) for r in roots)
        for r in roots:
            allowed = _pinned_options(r, opts, pins or {}, len(cm.mesh_shape))
            if allowed is not None:
                break
        if allowed is not None:
            costs = [c if o in allowed else INFEASIBLE for o, c in enumerate(costs)]
        ci = prob.add_choice(Choice(str(key), tuple(costs), count=len(roots),
                                    labels=tuple(s.label() for s in opts)))
        idx.choice_of_key[key] = ci
        idx.keys.append(key)
        forward[ci] = tuple(fwd)
        core_forward[ci] = tuple(core)
        saved[ci] = tuple(kept)
    for pattern in pins or {}:
        if not any(fnmatch.fnmatchcase(name, pattern) for name in decided_names):
            raise _unmatched(pattern, decided_names, strategies)
    if recompute:
        _recompute_choices(gm, prob, idx, forward, core_forward, recompute, saved, cm.cluster)

    # A value read outside its own decision by one reader is a plain edge (a tight formulation); a value
    # read by several is a shared edge, where each distinct way its readers ask for it (target layout,
    # gradient reduction) is paid once, as codegen reshards once per request. Values of repeated layers
    # with the same readers share one edge, counted once per copy.
    readers = defaultdict(list)
    for c in list(nodes) + [n for n in gm.graph.nodes if n.op == "output"]:
        values = input_values(c) if c.op == "call_function" else _output_values(c, sharded_outputs)
        for k, v in enumerate(values):
            rc = root_of(c) if c.op != "output" else None
            if root_of(v.node) is not rc:
                readers[v].append((c, k, rc))
    boundaries: dict = {}           # reader -> its first input read from another decision
    for rs in readers.values():
        for c, k, rc in rs:
            if rc is not None:
                boundaries[c] = min(k, boundaries.get(c, k))
    windows = HidingWindows(gm, strategies, cm, boundaries, bucket_bytes(bucket_mb)) if overlap else None
    groups = defaultdict(list)
    for v, rs in readers.items():
        signature = (key_of(v.node), v.index, tuple(sorted((str(key_of(c)) if rc is not None else "output", k)
                                                           for c, k, rc in rs)))
        groups[signature].append(v)
    edges = [_shared_edge(values[0], readers[values[0]], len(values), idx, cm, windows)
             for values in groups.values()]
    if windows is not None:
        idx.credit = Problem([Choice(c.name, (0.0,) * len(c.costs), c.count) for c in prob.choices])
        _add_edges(idx.credit, [credit for _, credit in edges])
    _add_edges(prob, [e for e, _ in edges])
    prob.validate()
    return prob, idx


def serial_objective(prob: Problem, idx: ProblemIndex) -> Problem:
    """``prob`` with its hiding credits added back: every resharding at its serial seconds."""
    credit = idx.credit

    def plus(a, b):
        return tuple(plus(x, y) for x, y in zip(a, b)) if isinstance(a, tuple) else a + b

    # The credits' edges are the layout edges, which build_problem adds after the recompute decisions'
    # (``_recompute_choices``), in the same order (``_add_edges``).
    first = len(prob.edges) - len(credit.edges)
    edges = list(prob.edges[:first])
    for e, k in zip(prob.edges[first:], credit.edges):
        assert (e.src, e.dst) == (k.src, k.dst), (e.src, e.dst, k.src, k.dst)
        edges.append(replace(e, cost=plus(e.cost, k.cost)))
    return replace(
        prob, memory=[], edges=edges,
        choices=[replace(c, costs=plus(c.costs, k.costs)) for c, k in zip(prob.choices, credit.choices)],
        shared=[replace(e, cost=plus(e.cost, k.cost)) for e, k in zip(prob.shared, credit.shared)])


def _add_edges(prob: Problem, edges: list[SharedEdge]) -> None:
    """Add each value's edge to ``prob``: a shared edge where several requests can be made of it, a
    cost of its source's option where only a user output reads it, else a plain edge (the edges between
    one pair of decisions summed into one)."""
    matrices = {}
    for e in edges:
        if len(e.readers) + len(e.always) > 1:
            prob.shared.append(e)
        elif e.always:                       # only a user output reads it: a cost of the source's option
            ch = prob.choices[e.src]
            extra = [e.count * e.cost[e.always[0]][i] / ch.count for i in range(len(ch.costs))]
            prob.choices[e.src] = Choice(ch.name, tuple(a + b for a, b in zip(ch.costs, extra)), ch.count, ch.labels)
        else:
            (dst, reqs), = e.readers
            mat = [[e.count * e.cost[r][i] if r >= 0 else 0.0 for r in reqs] for i in range(len(e.cost[0]))]
            acc = matrices.get((e.src, dst))
            matrices[(e.src, dst)] = mat if acc is None else [[a + b for a, b in zip(r1, r2)]
                                                              for r1, r2 in zip(acc, mat)]
    for (s, d), mat in matrices.items():
        prob.edges.append(Edge(s, d, tuple(tuple(r) for r in mat)))


def recompute_counts_for(n: int) -> tuple[int, ...]:
    """The recompute counts offered for a class of ``n`` layers: none, all, and eighths in between."""
    return tuple(sorted({0, n, *(round(n * k / 8) for k in range(1, 8))}))


def forced_recompute(cls: str, n: int, recompute) -> int | str | None:
    """The count ``recompute`` fixes for layer class ``cls`` of ``n`` instances: a dict maps a glob over
    class names (``model.layers.*``; the ``#k`` suffix that tells apart classes of one pattern is
    optional) to a count, "all", "attention" (every instance recomputes its attention cores only) or
    "offload" (every instance keeps its saved activations in host memory)."""
    import fnmatch

    from autopar.errors import AutoparError

    if not isinstance(recompute, dict):
        return None
    for pattern, count in recompute.items():
        if fnmatch.fnmatchcase(cls, pattern) or fnmatch.fnmatchcase(cls.split("#")[0], pattern):
            count = n if count == "all" else count
            if count in ("attention", "offload"):
                return count
            if not isinstance(count, int) or isinstance(count, bool) or not 0 <= count <= n:
                raise AutoparError(f"recompute {pattern!r} -> {count!r}: give a count from 0 to {n} (the "
                                   f"instances of {cls}), 'all', 'attention' or 'offload'")
            return count
    return None


def _attention_core_nodes(gm) -> set:
    from autopar.passes.layers import attention_cores, layer_instances

    return {n for insts in layer_instances(gm).values() for nodes in insts.values()
            for core in attention_cores(nodes) for n in core}


def _recompute_choices(gm, prob: Problem, idx: ProblemIndex, forward: dict, core_forward: dict, recompute,
                       saved: dict, cluster) -> None:
    """One decision per layer class: how many instances (the first ones) run under activation
    checkpointing, and whether the others recompute their attention cores only (Korthikanti et al.'s
    selective recompute; ``passes.layers.attention_cores``) or keep their saved activations in host
    memory (``torch.autograd.graph.save_on_cpu``). Recomputing ``r`` instances whole and ``s`` cores
    costs ``r`` times the layer's forward seconds and ``s`` times its cores'; offloading ``f`` instances
    costs ``f`` times the bytes the layer saves, down in forward and up in backward over the host link
    (an edge to each of the layer's layout decisions); what it saves in memory is in the step's memory
    model (passes.memory.StepMemory). Reshardings inside the recomputed regions run again too; the ILP
    leaves them out, and the plan's step time counts them. Offload is offered where the host is not the
    devices' memory and its figures are known, and wherever ``recompute`` forces it."""
    from autopar.errors import AutoparError
    from autopar.passes.layers import attention_cores, layer_instances

    by_class = defaultdict(list)
    for key, ci in idx.choice_of_key.items():
        if key[0] == "L":
            by_class[key[1]].append(ci)
    offer = cluster.has_host_figures and not cluster.host_is_device
    for cls, instances in layer_instances(gm).items():
        n = len(instances)
        forced = forced_recompute(cls, n, recompute)
        cores = attention_cores(next(iter(instances.values())))
        if forced == "attention":
            if not cores:
                raise AutoparError(f"recompute asks {cls} to recompute its attention only, but its layers have "
                                   f"no attention core (a fused attention op, or two activation matmuls with the "
                                   f"softmax between them); recompute whole layers ('all' or a count) instead")
            options = [(0, n, 0)]
        elif forced == "offload":
            cluster.require_host_figures(f"recompute {cls} -> 'offload' (activations in host memory)")
            options = [(0, 0, n)]
        elif forced is not None:
            options = [(forced, 0, 0)]
        else:
            counts = recompute_counts_for(n)
            options = [(r, 0, 0) for r in counts] + ([(r, n - r, 0) for r in counts if r < n] if cores else [])
            if offer:
                options += [(r, 0, n - r) for r in counts if r < n]
                options += [(0, 0, f) for f in counts if 0 < f < n]
        if cls not in by_class or options == [(0, 0, 0)]:
            continue
        full, sel, off = (tuple(o[i] for o in options) for i in range(3))
        labels = tuple(f"recompute {r} of {n}" + (f", attention of {k}" if k else "") + (f", offload {f}" if f else "")
                       for r, k, f in options)
        ri = prob.add_choice(Choice(f"recompute {cls}", (0.0,) * len(options), labels=labels))
        idx.recompute[cls] = (ri, full, sel, off)
        link = cluster.host_link_bandwidth if any(off) else None
        for ci in by_class[cls]:
            fwd, fc, kept = forward[ci], core_forward[ci], saved[ci]
            if any(fwd) or (link and any(kept)):
                prob.edges.append(Edge(ci, ri, tuple(tuple(r * f + k * c + (q * 2 * a / link if q else 0.0)
                                                           for r, k, q in options)
                                                     for f, c, a in zip(fwd, fc, kept))))


def _shared_edge(v: Value, rs, count: int, idx: ProblemIndex, cm: CostModel,
                 windows: HidingWindows | None) -> tuple[SharedEdge, SharedEdge]:
    """The edge of value ``v`` read by ``rs``, its requests priced less their hiding credits, and the
    same edge priced by the credits alone (all zero without ``windows``)."""
    from autopar.passes.resharding import grad_partial_axes

    strategies = idx.strategies
    rp = strategies.root_of(v.node)
    n_src = len(strategies[rp])
    grad = requires_grad(v.node)
    requests: dict = {}

    def request(dst, partial):
        return requests.setdefault((tuple(dst), partial), len(requests))

    reader_rows, always = [], set()
    for c, k, rc in rs:
        if rc is None:                       # a user output: returned replicated
            always.add(request(tuple(R for _ in cm.mesh_shape), frozenset()))
            continue
        row = []
        for j in range(len(strategies[rc])):
            st = strategies.strategy_of(c, j)
            dst = st.inputs[k]
            partial = grad_partial_axes(dst, st.splits_work, grad)
            row.append(request(dst, partial))
        reader_rows.append((idx.choice_of_key[key_of(rc)], tuple(row)))
    first = min(((windows.position[c], k, c) for c, k, rc in rs if rc is not None), default=None) \
        if windows is not None else None
    forward_window = windows.forward(v.node, first[2], first[1]) if first is not None else 0.0
    backward_window = windows.backward(v.node) if windows is not None and is_param(v.node) else 0.0
    # Megatron's "f" before column-parallel linears hides behind their weight gradients.
    f_window = windows.behind_weight_grads(v.node, [(c, k) for c, k, rc in rs if rc is not None]) \
        if windows is not None and all(rc is not None for _, _, rc in rs) else 0.0
    cost, credit = [], []
    for dst, partial in requests:
        cost_row, credit_row = [], []
        for i in range(n_src):
            src = strategies.strategy_of(v.node, i)
            phases = cm.param_transition_phase_seconds(v, src, dst, partial)
            if phases is None:
                cost_row.append(INFEASIBLE)
                credit_row.append(0.0)
                continue
            fwd, bwd = phases
            hidden = min(fwd, forward_window)
            if fwd == 0.0 and partial and f_window:
                hidden += min(bwd, f_window)
            elif cm.bucketed_gradient(src, fwd):
                hidden += min(bwd, backward_window)
            saved = cm.overlap_saving(hidden)
            cost_row.append(fwd + bwd - saved)
            credit_row.append(saved)
        cost.append(tuple(cost_row))
        credit.append(tuple(credit_row))
    src_choice = idx.choice_of_key[key_of(rp)]
    return (SharedEdge(src_choice, tuple(reader_rows), tuple(cost), tuple(sorted(always)), count),
            SharedEdge(src_choice, tuple(reader_rows), tuple(credit), tuple(sorted(always)), count))


def _output_values(out_node: fx.Node, sharded_outputs: bool) -> list[Value]:
    """The user outputs that are returned replicated (passes.reshard_plan.gathered_output)."""
    import torch

    from autopar.passes.reshard_plan import gathered_output

    leaves = torch.utils._pytree.tree_leaves(out_node.args)
    return [Value(a) for a in leaves if isinstance(a, fx.Node) and isinstance(a.meta.get("val"), torch.Tensor)
            and gathered_output(a, sharded_outputs)]
