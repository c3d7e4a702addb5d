"""The alternatives a plan records for ``explain``: for every decision, the chosen layout and the
cheapest others, each with its own cost, the resharding it would cause with its neighbours (held at
their chosen layouts) and its memory (docs/inspection.md)."""
from __future__ import annotations

from autopar.layout import format_layout
from autopar.plan import AlternativeCollective, PlanAlternative
from autopar.passes.costs import CostModel
from autopar.passes.meta import meta_of
from autopar.passes.ilp_build import ProblemIndex
from autopar.passes.strategies import requires_grad


def alternatives(prob, idx: ProblemIndex, assignment, cm: CostModel, axis_names,
                 top: int = 3) -> dict[str, tuple[PlanAlternative, ...]]:
    """For every decision: the chosen option and the ``top`` cheapest others, each with its own cost,
    the resharding it would cause with its neighbours (held at their chosen layouts) and its memory."""
    from autopar.passes.strategies import input_values

    strategies = idx.strategies
    root_of = strategies.root_of
    chosen = idx.chosen(assignment)
    members: dict = {}
    for n in chosen:
        members.setdefault(root_of(n), []).append(n)
    fwd_mem = {ci: per for ci, per in prob.memory[0].terms} if prob.memory else {}
    touching: dict = {}      # choice -> the shared values it produces or reads
    for e in prob.shared:
        for c in {e.src, *(c for c, _ in e.readers)}:
            touching.setdefault(c, []).append(e)
    pairs: dict = {}         # choice -> the plain edges it is an end of
    for e in prob.edges:
        for c in {e.src, e.dst}:
            pairs.setdefault(c, []).append(e)
    out = {}
    for key, roots in idx.roots_of_key.items():
        rep = roots[0]
        ci = idx.choice_of_key[key]
        choice = prob.choices[ci]
        if len(choice.costs) < 2:
            continue
        scored = []
        for o in range(len(choice.costs)):
            trial = list(assignment)
            trial[ci] = o
            edge = sum(e.seconds(trial) for e in touching.get(ci, ()))
            edge += sum(e.count * e.cost[trial[e.src]][trial[e.dst]] for e in pairs.get(ci, ()))
            scored.append((choice.costs[o] + edge / choice.count, o, edge / choice.count))
        scored.sort()
        keep = [o for _, o, _ in scored if o == assignment[ci]] + [o for _, o, _ in scored if o != assignment[ci]][:top]
        entries = []
        for o in keep:
            total, _, edge = next(x for x in scored if x[1] == o)
            colls = []
            for m in members.get(rep, []):
                s = strategies.strategy_of(m, o)
                colls += _op_collectives(cm, m, s, axis_names)
                if m.op == "call_function":
                    for k, v in enumerate(input_values(m)):
                        if root_of(v.node) is not rep and v.node in chosen:
                            colls += _edge_collectives(cm, v, chosen[v.node], s, k, v.node.name, axis_names)
                for c in m.users:
                    if c.op != "call_function" or root_of(c) is rep or c not in chosen:
                        continue
                    for k, v in enumerate(input_values(c)):
                        if v.node is m:
                            colls += _edge_collectives(cm, v, s, chosen[c], k, c.name, axis_names)
            mem = fwd_mem.get(ci, [0.0] * len(choice.costs))[o] / choice.count
            rs = strategies[rep][o]
            entries.append(PlanAlternative(choice.labels[o] if choice.labels else str(o), o == assignment[ci],
                                           tuple(tuple(format_layout(l)) for l in rs.inputs), choice.costs[o], edge,
                                           total, mem, tuple(colls)))
        name = meta_of(rep).role.target if rep.op == "placeholder" else rep.name
        out[name] = tuple(entries)
    return out


def _op_collectives(cm, node, s, axis_names):
    return [c.alternative_entry(axis_names, node.name, node.name) for c in cm.priced_op_collectives(node, s)]


def _edge_collectives(cm, v, src, dst_strategy, k, neighbor, axis_names):
    from autopar.passes.precision import reduce_itemsize
    from autopar.passes.strategies import value_info

    steps = cm.resharding(v, src, dst_strategy, k)
    if steps is None:
        return [AlternativeCollective("impossible", neighbor, v.node.name)]
    priced = cm.priced_steps(steps, value_info(v).dtype.itemsize, requires_grad(v.node), reduce_itemsize(v.node))
    return [c.alternative_entry(axis_names, neighbor, v.node.name) for _, c in priced]
