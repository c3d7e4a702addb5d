"""Why a node or parameter got its layout: ``explain(plan, name)`` (docs/inspection.md)."""
from __future__ import annotations

import difflib
import re
from collections import Counter

from autopar.inspection.index import PlanIndex, placeholder_name
from autopar.report import _b, _s

_MATMULS = {"mm.default", "addmm.default", "linear.default", "matmul.default"}
_PLACEMENT = re.compile(r"S\(\d+\)|R|P")


def layout_text(layout) -> str:
    return "[" + ",".join(layout) + "]"


def _role(op: str, label: str, shape, axes) -> str:
    """For a matmul, name each mesh axis's split the way Megatron does (from the output layout alone:
    a Partial output means the contracted dim is split)."""
    if op not in _MATMULS or not shape or label.count("[") != 1:
        return ""
    parts = []
    for axis, p in zip(axes, _PLACEMENT.findall(label)):
        if p == "P":
            parts.append(f"row-parallel over {axis}")
        elif p == f"S({len(shape) - 1})":
            parts.append(f"column-parallel over {axis}")
        elif p == "S(0)":
            parts.append(f"batch-split over {axis}")
        elif p.startswith("S"):
            parts.append(f"split on dim {p[2:-1]} over {axis}")
    return ", ".join(parts) or "replicated"


def _coll(c, ix: PlanIndex, here: str) -> str:
    if c.kind == "impossible":
        return f"no resharding exists for {ix.value_name(c.value)} -> {c.neighbor}"
    src = ix.value_name(c.value)
    # The planner names an input edge's neighbour after the value it reads; an output edge after its consumer.
    edge = f"{src} -> {here}" if c.neighbor == c.value else f"{src} -> {c.neighbor}"
    return f"{c.kind}({c.axis}, {c.phase}) {_b(c.bytes)} {_s(c.seconds)}  {edge}"


def _coll_key(c):
    return (c.kind, c.axis, c.phase, c.value, c.neighbor)


def _decision_lines(ix: PlanIndex, key: str) -> list[str]:
    """The options table of decision ``key``, each option's resharding, and why the chosen one wins."""
    if not ix.plan.alternatives:
        return ["this plan records no alternatives; plan the model again with this autopar to see them."]
    entries = ix.plan.alternatives.get(key)
    if not entries:
        return [f"decision {key}: only one layout was possible here, so there was nothing to choose."]
    node = ix.nodes.get(key)            # None for a parameter's or an input's decision
    op, shape = (node.op, node.shape) if node is not None else ("", None)
    axes = ix.plan.axis_names
    lines = [(f"options for {key} (costs per layer instance, neighbours held at their chosen layouts; own = compute "
              f"and optimizer step; memory = bytes held at the end of forward):"),
             f"      {'layout':<22} {'total':>10} {'own':>10} {'resharding':>11} {'memory':>11}  vs chosen"]
    chosen = entries[0]

    def name(e):
        role = _role(op, e.layout, shape, axes)
        return e.layout + (f" ({role})" if role else "")

    for e in entries:
        delta = "" if e.chosen else f"{'+' if e.total_seconds >= chosen.total_seconds else '-'}" \
                                    f"{_s(abs(e.total_seconds - chosen.total_seconds))}"
        lines.append(f"  {'*' if e.chosen else ' '}   {e.layout:<22} {_s(e.total_seconds):>10} "
                     f"{_s(e.own_seconds):>10} {_s(e.resharding_seconds):>11} {_b(e.memory_bytes):>11}  {delta}")
    lines.append("resharding each option causes with its neighbours:")
    for e in entries:
        lines.append(f"  {'*' if e.chosen else ' '} {name(e)}{' (chosen)' if e.chosen else ''}:")
        lines += [f"      {_coll(c, ix, key)}" for c in e.collectives] or ["      none"]
    lines.append(f"why {name(chosen)}:")
    mine = Counter(_coll_key(c) for c in chosen.collectives)
    for e in entries[1:]:
        d = e.total_seconds - chosen.total_seconds
        if d > 0:
            head = f"{_s(d)} slower per instance"
        else:
            head = (f"{_s(-d)} faster with its neighbours held fixed, but the solver weighs the whole graph "
                    f"(neighbours that would change with it) and the memory budget")
        dm = e.memory_bytes - chosen.memory_bytes
        if abs(dm) > 0.005 * max(chosen.memory_bytes, 1):
            head += f"; memory {'+' if dm > 0 else '-'}{_b(abs(dm))}"
        do = e.own_seconds - chosen.own_seconds
        if abs(do) > 1e-9:
            head += f"; own cost {'+' if do > 0 else '-'}{_s(abs(do))}"
        lines.append(f"  - {name(e)}: {head}")
        theirs = Counter(_coll_key(c) for c in e.collectives)
        by_key = {_coll_key(c): c for c in chosen.collectives + e.collectives}
        needs = [by_key[k] for k in (theirs - mine).elements()]
        avoids = [by_key[k] for k in (mine - theirs).elements()]
        if needs:
            lines.append(f"      needs, where {chosen.layout} does not:")
            lines += [f"        {_coll(c, ix, key)}" for c in needs]
        if avoids:
            lines.append(f"      avoids, where {chosen.layout} needs:")
            lines += [f"        {_coll(c, ix, key)}" for c in avoids]
    return lines


def _stage_lines(plan, layer, node_name) -> list[str]:
    """Where a pipeline plan runs a node: its stage and the rank of the pipeline axis."""
    pipe = plan.pipeline
    if not pipe:
        return []
    stages = pipe.stages
    st = next((s for s in stages if layer in s.layers), None)
    if st is None:           # outside the layers: before the first one (embedding) or after the last
        names = [n.name for n in plan.nodes]
        first = next((n.name for n in plan.nodes if n.layer), None)
        st = stages[0] if first is not None and names.index(node_name) < names.index(first) else stages[-1]
    return [f"  pipeline stage {st.index} of {len(stages)} (rank {st.pp_rank} of axis '{pipe.axis}'), "
            f"schedule {pipe.schedule} over {pipe.microbatches} microbatches; the figures below are "
            f"per microbatch"]


def _node_lines(ix: PlanIndex, name: str) -> list[str]:
    plan, n = ix.plan, ix.nodes[name]
    lines = [f"node {name}: {n.op}" + (f", output shape {list(n.shape)}" if n.shape is not None else "")]
    if n.layer:
        lines.append(f"  {ix.instances_note(n.layer)}")
    lines += _stage_lines(ix.plan, n.layer, n.name)
    ins = " ".join(layout_text(l) for l in n.inputs)
    outs = " ".join(layout_text(l) for l in n.outputs)
    role = _role(n.op, ",".join(layout_text(l) for l in n.outputs), n.shape, plan.axis_names)
    lines.append(f"  chosen: inputs {ins} -> outputs {outs}" + (f" ({role})" if role else "")
                 + (f"; work split over {', '.join(n.split_axes)}" if n.split_axes else "; work not split"))
    lines.append(f"  here: compute {_s(n.compute_seconds)}, communication {_s(n.comm_seconds)}, "
                 f"saved activations {_b(n.activation_bytes)}")
    for c in ix.colls_at.get(name, []):
        hidden = c.seconds - (c.seconds if c.exposed is None else c.exposed)
        lines.append(f"    runs {c.kind}({c.axis}, {c.phase}) {_b(c.bytes)} {_s(c.seconds)} "
                     f"on {ix.value_name(c.value)}" + (f", {_s(hidden)} of it hidden behind compute" if hidden > 0 else ""))
    key = ix.decision_of(name)
    if key != name:
        why = "follows " + n.follows + " (its layout is fixed by that decision)" if n.follows else \
            "has the same position in the first instance"
        lines.append(f"  decided by {key}: this node {why}")
    return lines + _decision_lines(ix, key)


def _param_lines(ix: PlanIndex, fqn: str) -> list[str]:
    plan = ix.plan
    rep = ix.rep_param(fqn)
    mesh = " x ".join(f"{a}={s}" for a, s in zip(plan.axis_names, plan.mesh_shape))
    lines = [f"parameter {fqn}: chosen {layout_text(plan.params[fqn])} on mesh {mesh}"]
    stage = plan.zero_stages().get(fqn)
    if stage is None:
        lines.append("  optimizer state and gradient: replicated with the parameter (no ZeRO sharding)")
    else:
        what = {1: "optimizer state sharded, gradient and parameter replicated",
                2: "optimizer state and gradient sharded, parameter replicated",
                3: "parameter, gradient and optimizer state sharded, the parameter gathered for its readers"}
        lines.append(f"  ZeRO-{stage[0]} along {stage[1]}: {what[stage[0]]}")
    value = "p_" + fqn.replace(".", "_")          # torch.export's name for the parameter
    if plan.bucket_mb is not None and any(c.kind == "all_reduce" and c.phase == "backward" and c.value == value
                                          for c in plan.collectives):
        lines.append(f"  gradient all-reduced in the plan's buckets of {plan.bucket_mb:g} MiB (plan.bucket_mb), "
                     f"launched during backward, where every reader reduces it")
    if fqn in plan.offload:
        lines.append(f"  optimizer state, its gradient and the copy it steps in host memory "
                     f"({_b(plan.offload[fqn]['host_bytes'])}), stepped there and uploaded after each step")
    held = plan.memory.by_param.get(fqn)
    if held is not None:
        lines.append(f"  per device: {_b(held)} of parameter, gradient and optimizer state")
    if rep != fqn:
        lines.append(f"  the same decision as {rep}: layer instances share each decision")
    placeholder = placeholder_name(rep)
    # The plan records no graph edges; a parameter's consumers are the nodes its collectives (chosen or
    # alternative) are exchanged with.
    consumers = {c.node for c in plan.collectives if c.value == placeholder and c.node in ix.nodes}
    consumers |= {c.neighbor for e in plan.alternatives.get(rep, ()) for c in e.collectives
                  if c.value == placeholder and c.neighbor in ix.nodes}
    lines += _decision_lines(ix, rep)
    order = {n: i for i, n in enumerate(ix.nodes)}
    for cname in sorted(consumers, key=order.__getitem__):
        c = ix.nodes[cname]
        key = ix.decision_of(cname)
        role = _role(c.op, ",".join(layout_text(l) for l in c.outputs), c.shape, plan.axis_names)
        lines.append("")
        lines.append(f"consumed by {cname} ({c.op}): inputs {' '.join(layout_text(l) for l in c.inputs)} -> "
                     f"outputs {' '.join(layout_text(l) for l in c.outputs)}" + (f" ({role})" if role else ""))
        lines += ["  " + x for x in _decision_lines(ix, key)]
    return lines


def _input_lines(ix: PlanIndex, name: str) -> list[str]:
    return [f"input {name}: chosen {layout_text(ix.plan.inputs[name])}"] + _decision_lines(ix, name)


def explain_in(ix: PlanIndex, name: str) -> str:
    if name in ix.nodes:
        lines = _node_lines(ix, name)
    elif name in ix.plan.params or name in ix.param_of:
        lines = _param_lines(ix, ix.param_of.get(name, name))
    elif name in ix.plan.inputs:
        lines = _input_lines(ix, name)
    else:
        known = list(ix.nodes) + list(ix.plan.params) + list(ix.plan.inputs)
        close = difflib.get_close_matches(name, known, n=5, cutoff=0.6)
        hint = f"; did you mean {', '.join(close)}?" if close else \
            "; give a node name (see the report's table) or a parameter FQN"
        raise KeyError(f"plan has no node, parameter or input {name!r}{hint}")
    return "\n".join(lines)


def explain(plan, name: str) -> str:
    """Why ``name`` (a node, a parameter FQN or a user input) has its layout: the chosen layout, the best
    alternatives with their own, resharding and memory costs, and the collectives each would cause
    with its neighbours. Unknown names raise KeyError with close matches."""
    return explain_in(PlanIndex(plan), name)
