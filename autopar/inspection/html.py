"""A self-contained HTML report of one plan: ``to_html(plan, path)`` (docs/inspection.md)."""
from __future__ import annotations

import html
import json
from collections import Counter, defaultdict
from pathlib import Path

from autopar.inspection.explain import explain_in, layout_text
from autopar.inspection.index import PlanIndex
from autopar.report import _b, _s

_PALETTE = ("#4e79a7", "#f28e2b", "#59a14f", "#b07aa1", "#edc948", "#76b7b2", "#ff9da7", "#9c755f",
            "#e15759", "#86bcb6", "#d4a6c8", "#a0cbe8")
_KIND_COLORS = {"all_reduce": "#e15759", "all_gather": "#4e79a7", "reduce_scatter": "#f28e2b",
                "all_to_all": "#b07aa1", "send_recv": "#59a14f"}
_MEM_COLORS = {"params": "#4e79a7", "optimizer": "#9c755f", "grads": "#f28e2b", "activations": "#59a14f",
               "transient": "#edc948"}
_SECTIONS = (("summary", "Summary"), ("graph", "Model graph"), ("ops", "Per-op layouts"),
             ("params", "Parameters"), ("memory", "Memory over one step"), ("comm", "Communication"))


def _e(x) -> str:
    return html.escape(str(x), quote=True)


def _shown(ix: PlanIndex, layer) -> bool:
    """Rows are kept for nodes outside layers and for the first instance of each layer class; the other
    instances have the same layouts and are summarised."""
    return not layer or ix.first[ix.cls_of[layer]] == layer


def _stacked_bar(parts, total, width=640) -> str:
    x, out = 0.0, []
    for label, value, color in parts:
        w = width * value / total if total else 0
        out.append(f'<rect x="{x:.1f}" y="0" width="{w:.1f}" height="22" fill="{color}">'
                   f'<title>{_e(label)}</title></rect>')
        x += w
    return f'<svg class="bar" width="{width}" height="22" viewBox="0 0 {width} 22">{"".join(out)}</svg>'


def _legend(items) -> str:
    return '<div class="legend">' + "".join(
        f'<span><i style="background:{c}"></i>{_e(t)}</span>' for t, c in items) + "</div>"


def _summary_html(plan) -> str:
    bd = plan.breakdown
    comm = bd["communication"]
    parts = [(f"compute {_s(bd['compute'])}", bd["compute"], "#59a14f")]
    # The bar adds up to the step: each axis's communication less what compute hides of it.
    hidden = {a: 0.0 for a in comm}
    for c in plan.collectives if bd.get("hidden") else ():
        hidden[c.axis] = hidden.get(c.axis, 0.0) + c.seconds - (c.seconds if c.exposed is None else c.exposed)
    parts += [(f"exposed communication on {a} {_s(t - hidden.get(a, 0.0))}", max(t - hidden.get(a, 0.0), 0.0),
               _PALETTE[i % len(_PALETTE)]) for i, (a, t) in enumerate(comm.items())]
    if bd.get("contention"):      # what the hidden communication still takes from the compute
        parts.append((f"contention of hidden communication {_s(bd['contention'])}", bd["contention"], "#e15759"))
    parts.append((f"optimizer {_s(bd['optimizer'])}", bd["optimizer"], "#9c755f"))
    if bd.get("bubble"):
        parts.append((f"pipeline bubble {_s(bd['bubble'])}", bd["bubble"], "#bab0ac"))
    total_comm = sum(comm.values())
    exposed = bd.get("exposed", total_comm)
    m = plan.memory
    budget = m.memory_budget or 0.0
    frac = m.peak / budget if budget else 0.0
    mem_parts = [(f"{k} {_b(getattr(m, k))}", getattr(m, k), _MEM_COLORS[k])
                 for k in ("params", "grads", "optimizer", "activations")]
    mesh = " &times; ".join(f"{_e(a)}={s}" for a, s in zip(plan.axis_names, plan.mesh_shape))
    c = plan.cluster
    dev = c.get("device", {})
    sv = plan.solver or {}
    return f"""
<dl class="facts">
 <dt>Model</dt><dd>{_e(plan.model.get('class'))}, {plan.model.get('num_params', 0):,} parameters,
   inputs {_e(plan.model.get('input_shapes', ''))}</dd>
 <dt>Cluster</dt><dd>{_e(c.get('name') or '')} &mdash; {c.get('num_devices')} &times; {_e(dev.get('name', '?'))},
   {c.get('devices_per_node')} per node</dd>
 <dt>Mesh</dt><dd id="mesh">{mesh}</dd>
 <dt>Solver</dt><dd>{_e(sv.get('status', '?'))} ({_e(sv.get('backend', '?'))}), {sv.get('variables', '?')} variables,
   planning took {sv.get('planning_seconds', 0):.1f} s</dd>
</dl>
<h3>Predicted step time: {_s(plan.step_time)}</h3>
{_stacked_bar(parts, sum(p[1] for p in parts))}
{_legend([(p[0], p[2]) for p in parts])}
<p id="exposed">Communication {_s(total_comm)} in all
 ({", ".join(f"{_e(a)} {_s(t)}" for a, t in comm.items())}); exposed (not hidden behind compute):
 <b>{_s(exposed)}</b>, hidden {_s(total_comm - exposed)}{" &mdash; none of it overlaps compute" if exposed >= total_comm * 0.999 else ""}.</p>
<h3>Peak memory per device: {_b(m.peak)} of {_b(budget)} budget ({100 * frac:.1f}%)</h3>
{_stacked_bar(mem_parts + [("free", max(budget - m.peak, 0.0), "#e8e8e8")], max(budget, m.peak))}
{_legend([(p[0], p[2]) for p in mem_parts])}
{_offload_html(plan)}
{_pipeline_html(plan)}"""


def _offload_html(plan) -> str:
    from autopar.report import offload_lines

    lines = offload_lines(plan) + [ln for ln in plan.summary().splitlines() if ln.startswith("activations offloaded")]
    if not lines:
        return ""
    return f'<h3 id="offload">Offloaded to host memory</h3><pre>{_e(chr(10).join(lines))}</pre>'


def _pipeline_html(plan) -> str:
    """The stages of a pipeline plan and each rank's busy and idle time over one step."""
    pipe = plan.pipeline
    if not pipe:
        return ""
    rows = "".join(
        f"<tr><td>{st.index}</td><td>{st.pp_rank}</td><td>{len(st.layers)} ({_e(st.layers[0])} &hellip; "
        f"{_e(st.layers[-1])})</td><td>{_s(st.seconds)}</td><td>{_b(st.activations)}</td>"
        f"<td>{st.in_flight:.3g}</td></tr>" for st in pipe.stages)
    return f"""
<h3 id="pipeline">Pipeline: {len(pipe.stages)} stages, schedule {_e(pipe.schedule)}, {pipe.microbatches}
 microbatches, bubble {100 * pipe.bubble_fraction:.1f}% of the ideal time ({_s(pipe.bubble_seconds)})</h3>
<table class="stages"><tr><th>stage</th><th>pp rank</th><th>layers</th><th>seconds / microbatch</th>
<th>activations / microbatch</th><th>in flight</th></tr>{rows}</table>
{_timeline_svg(pipe)}"""


def _timeline_svg(pipe, width=640) -> str:
    """Each rank's busy time (its microbatches) and idle time (the rest of the step), to scale."""
    ranks = pipe.ranks
    busy = [r.seconds_per_microbatch * pipe.microbatches for r in ranks]
    total = max(busy) + pipe.bubble_seconds or 1.0
    bars = []
    for i, (r, b) in enumerate(zip(ranks, busy)):
        y = 4 + 18 * i
        w = width * b / total
        bars.append(f'<text x="0" y="{y + 11}" font-size="10">rank {r.rank}</text>'
                    f'<rect x="50" y="{y}" width="{w:.1f}" height="14" fill="#59a14f"><title>busy {_s(b)}</title></rect>'
                    f'<rect x="{50 + w:.1f}" y="{y}" width="{width - w:.1f}" height="14" fill="#e8e8e8">'
                    f'<title>idle {_s(total - b)}</title></rect>')
    return f'<svg class="timeline" width="{width + 60}" height="{8 + 18 * len(ranks)}">{"".join(bars)}</svg>'


def _graph_data(plan, ix: PlanIndex, color) -> dict:
    """Program-order rows (layer runs collapsed into one expandable row) and resharding edges.
    Each endpoint carries its own row id (when shown) and its collapsed layer row."""
    items, group_of = [], {}
    gi = 0
    i = 0
    nodes = plan.nodes
    while i < len(nodes):
        n = nodes[i]
        if not n.layer:
            items.append({"t": "n", "id": n.name, "op": n.op, "c": color(n)})
            i += 1
            continue
        j = i
        while j < len(nodes) and nodes[j].layer_class == n.layer_class:
            group_of[nodes[j].name] = f"g{gi}"
            j += 1
        run = nodes[i:j]
        insts = list(dict.fromkeys(x.layer for x in run))
        first = ix.first[n.layer_class]
        members = [{"t": "n", "id": x.name, "op": x.op, "c": color(x)} for x in run if x.layer == first]
        items.append({"t": "g", "id": f"g{gi}", "nodes": members,
                      "label": f"{n['layer_class']} \u00d7{len(insts)}, {len(run) // len(insts)} ops each",
                      "tip": f"{insts[0]} \u2026 {insts[-1]}; click to show the nodes of {first}"})
        gi += 1
        i = j
    # The graph's output node is not in plan.nodes, but collectives can feed it (the returned logits).
    items.append({"t": "n", "id": "output", "op": "graph output", "c": "#7f7f7f"})
    edges: dict = {}
    for c in plan.collectives:
        src = c.value
        s = src if src in ix.nodes and _shown(ix, ix.nodes[src].layer) else None
        dst = ix.nodes.get(c.node)
        d = c.node if dst is None or _shown(ix, dst.layer) else None
        key = (s, group_of.get(src), d, group_of.get(c.node), ix.value_name(src) if src not in ix.nodes else None)
        edges.setdefault(key, []).append(c)
    out = []
    for (s, sg, d, dg, stub), cs in edges.items():
        tot = defaultdict(float)
        for c in cs:
            tot[(c.kind, c.axis, c.phase[:3])] += c.bytes
        parts = [f"{k}({a},{ph}) {_b(v)}" for (k, a, ph), v in tot.items()]
        label = ", ".join(parts[:2]) + (f" +{len(parts) - 2} more" if len(parts) > 2 else "")
        src_name = stub or cs[0].value
        out.append({"s": s, "sg": sg, "d": d, "dg": dg, "stub": stub, "l": label,
                    "tip": f"{src_name} \u2192 {cs[0]['node']}" + (f" (and {len(cs)} collectives in all)" if len(cs) > 2 else "")
                           + ": " + "; ".join(parts)})
    return {"items": items, "edges": out}


def _table(tid, head, rows, foot="") -> str:
    ths = "".join(f'<th data-type="{t}">{_e(h)}</th>' for h, t in head)
    return (f'<table id="{tid}" class="sortable clickable"><thead><tr>{ths}</tr></thead>'
            f'<tbody>{"".join(rows)}</tbody><tfoot>{foot}</tfoot></table>')


def _td(text, value=None) -> str:
    return f"<td>{_e(text)}</td>" if value is None else f'<td data-v="{value:.6g}">{_e(text)}</td>'


def _ops_html(plan, ix: PlanIndex) -> str:
    rows, summary = [], defaultdict(lambda: [0, 0.0, 0.0, {}])
    for n in plan.nodes:
        if _shown(ix, n.layer):
            ins = " ".join(layout_text(l) for l in n.inputs)
            outs = " ".join(layout_text(l) for l in n.outputs)
            rows.append(f'<tr data-name="{_e(n.name)}" tabindex="0">{_td(n.name)}{_td(n.op)}'
                        f'{_td(n.layer or "")}{_td(ins)}{_td(outs)}{_td(",".join(n.split_axes))}'
                        f'{_td(_s(n.compute_seconds), n.compute_seconds)}{_td(_s(n.comm_seconds), n.comm_seconds)}'
                        f'{_td(_b(n.activation_bytes), n.activation_bytes)}</tr>')
        else:
            t = summary[n.layer_class]
            t[0] += 1
            t[1] += n.compute_seconds
            t[2] += n.comm_seconds
            t[3][n.layer] = None
    foot = "".join(
        f'<tr class="summary" data-ops="{k}"><td colspan="6">{_e(cls)}: {len(insts)} more instances '
        f'({_e(next(iter(insts)))} \u2026 {_e(list(insts)[-1])}) &mdash; {k} ops with the same '
        f'layouts as {_e(ix.first[cls])}, in total</td><td>{_s(c)}</td><td>{_s(m)}</td><td></td></tr>'
        for cls, (k, c, m, insts) in summary.items())
    head = [("node", "str"), ("op", "str"), ("layer", "str"), ("inputs", "str"), ("outputs", "str"),
            ("split over", "str"), ("compute", "num"), ("communication", "num"), ("saved activations", "num")]
    return _table("op-table", head, rows, foot)


def _params_html(plan, ix: PlanIndex) -> tuple[str, list[str]]:
    rows, names, hidden = [], [], 0
    by_param = plan.memory.by_param
    for fqn, lay in plan.params.items():
        if ix.rep_param(fqn) != fqn:
            hidden += 1
            continue
        names.append(fqn)
        held = by_param.get(fqn, 0.0)
        split = ",".join(a for a, p in zip(plan.axis_names, lay) if p != "R")
        rows.append(f'<tr data-name="{_e(fqn)}" tabindex="0">{_td(fqn)}{_td(layout_text(lay))}{_td(split)}'
                    f'{_td(_b(held), held)}</tr>')
    foot = (f'<tr class="summary" data-params="{hidden}"><td colspan="4">{hidden} more parameters in the other '
            f'instances of repeated layers have the same layouts as their first instance</td></tr>') if hidden else ""
    head = [("parameter", "str"), ("layout", "str"), ("sharded over", "str"),
            ("per device (param, grad, optimizer)", "num")]
    return _table("param-table", head, rows, foot), names


def _memory_svg(plan) -> str:
    tl = plan.memory.timeline
    if not tl:
        return "<p>The plan records no memory timeline.</p>"
    keys = tuple(_MEM_COLORS)
    W, H, L, T, B = 820, 280, 80, 12, 34
    pw, ph = W - L - 12, H - T - B
    totals = [sum(getattr(p, k) for k in keys) for p in tl]
    peak, budget = max(max(totals), plan.memory.peak), plan.memory.memory_budget or 0.0
    # A budget far above the peak would flatten the stack; then the budget is named, not drawn to scale.
    ymax = budget * 1.05 if budget and budget <= 4 * peak else peak * 1.15
    n = len(tl)

    def px(i):
        return L + pw * i / max(n - 1, 1)

    def py(v):
        return T + ph * (1 - v / ymax)

    out, base = [], [0.0] * n
    for k in keys:
        top = [b + getattr(p, k) for b, p in zip(base, tl)]
        pts = " ".join(f"{px(i):.1f},{py(v):.1f}" for i, v in enumerate(top))
        pts += " " + " ".join(f"{px(i):.1f},{py(v):.1f}" for i, v in reversed(list(enumerate(base))))
        out.append(f'<polygon points="{pts}" fill="{_MEM_COLORS[k]}" fill-opacity="0.85"><title>{k}</title></polygon>')
        base = top
    for t in range(5):
        v = ymax * t / 4
        out.append(f'<line x1="{L}" x2="{L + pw}" y1="{py(v):.1f}" y2="{py(v):.1f}" class="grid"/>'
                   f'<text x="{L - 6}" y="{py(v) + 4:.1f}" text-anchor="end">{_b(v)}</text>')
    bwd = next((i for i, p in enumerate(tl) if p.phase == "backward"), n)
    out.append(f'<line x1="{px(bwd):.1f}" x2="{px(bwd):.1f}" y1="{T}" y2="{T + ph}" class="phase"/>'
               f'<text x="{(L + px(bwd)) / 2:.1f}" y="{H - 10}" text-anchor="middle">forward</text>'
               f'<text x="{(px(bwd) + L + pw) / 2:.1f}" y="{H - 10}" text-anchor="middle">backward</text>')
    # The timeline is sampled, so its own top can sit below the plan's peak; the peak is drawn too.
    out.append(f'<line x1="{L}" x2="{L + pw}" y1="{py(peak):.1f}" y2="{py(peak):.1f}" class="peak"/>'
               f'<text x="{L + 4}" y="{py(peak) - 4:.1f}">peak {_b(peak)}</text>')
    if budget and budget <= ymax:
        out.append(f'<line x1="{L}" x2="{L + pw}" y1="{py(budget):.1f}" y2="{py(budget):.1f}" class="budget"/>'
                   f'<text x="{L + pw}" y="{py(budget) - 4:.1f}" text-anchor="end">budget {_b(budget)}</text>')
    elif budget:
        out.append(f'<text x="{L + pw}" y="{T + 12}" text-anchor="end" class="budget-note">budget {_b(budget)} '
                   f'(above this scale: peak is {100 * peak / budget:.1f}% of it)</text>')
    svg = (f'<svg id="memory-chart" width="{W}" height="{H}" viewBox="0 0 {W} {H}" role="img" '
           f'aria-label="memory per device over one step">{"".join(out)}</svg>')
    return svg + _legend([(k, c) for k, c in _MEM_COLORS.items()] + [("peak", "#333"), ("budget", "#d62728")])


def _comm_html(plan) -> str:
    agg = defaultdict(lambda: [0, 0.0, 0.0])
    for c in plan.collectives:
        t = agg[(c.axis, c.kind, c.phase)]
        t[0] += 1
        t[1] += c.bytes
        t[2] += c.seconds
    if not agg:
        return "<p>This plan runs no collectives.</p>"
    per_axis = defaultdict(lambda: defaultdict(float))
    for (axis, kind, _), (_, _, sec) in agg.items():
        per_axis[axis][kind] += sec
    top = max(sum(k.values()) for k in per_axis.values()) or 1.0
    L, W, RH = 60, 560, 30
    out = []
    for r, axis in enumerate(plan.axis_names):
        kinds = per_axis.get(axis, {})
        x, y = float(L), 8 + r * RH
        for kind, sec in sorted(kinds.items()):
            w = W * sec / top
            out.append(f'<rect x="{x:.1f}" y="{y}" width="{w:.1f}" height="{RH - 8}" fill="{_KIND_COLORS[kind]}">'
                       f'<title>{_e(axis)} {kind}: {_s(sec)}</title></rect>')
            x += w
        out.append(f'<text x="{L - 6}" y="{y + 16}" text-anchor="end">{_e(axis)}</text>'
                   f'<text x="{x + 6:.1f}" y="{y + 16}">{_s(sum(kinds.values()))}</text>')
    h = 16 + RH * len(plan.axis_names)
    svg = (f'<svg id="comm-chart" width="{L + W + 110}" height="{h}" viewBox="0 0 {L + W + 110} {h}" role="img" '
           f'aria-label="communication seconds per mesh axis and kind">{"".join(out)}</svg>')
    kinds = sorted({k for _, k, _ in agg})
    rows = "".join(f"<tr>{_td(a)}{_td(k)}{_td(ph)}{_td(n, n)}{_td(_b(b), b)}{_td(_s(s), s)}</tr>"
                   for (a, k, ph), (n, b, s) in sorted(agg.items()))
    head = "".join(f'<th data-type="{t}">{h}</th>' for h, t in (("axis", "str"), ("kind", "str"), ("phase", "str"),
                                                                ("count", "num"), ("bytes", "num"), ("seconds", "num")))
    return (svg + _legend([(k, _KIND_COLORS[k]) for k in kinds])
            + f'<table id="comm-table" class="sortable"><thead><tr>{head}</tr></thead><tbody>{rows}</tbody></table>')


def _layout_colors(plan, ix: PlanIndex):
    def key(n):
        return " ".join(layout_text(l) for l in n.outputs) or "-"

    freq = Counter(key(n) for n in plan.nodes if _shown(ix, n.layer))
    index = {k: i for i, (k, _) in enumerate(freq.most_common(len(_PALETTE)))}

    def color(n):
        i = index.get(key(n))
        return _PALETTE[i] if i is not None else "#bbbbbb"

    legend = [(k, _PALETTE[i]) for k, i in index.items()]
    if len(freq) > len(index):
        legend.append(("other layouts", "#bbbbbb"))
    return color, legend


def render_html(plan) -> str:
    """The report as one HTML string: inline CSS, JS and SVG, nothing fetched."""
    ix = PlanIndex(plan)
    color, legend = _layout_colors(plan, ix)
    params_table, shown_params = _params_html(plan, ix)
    names = [n.name for n in plan.nodes if _shown(ix, n.layer)] + shown_params
    data = {"graph": _graph_data(plan, ix, color), "explain": {k: explain_in(ix, k) for k in names}}
    body = {
        "summary": _summary_html(plan),
        "graph": ('<p class="note">Nodes in program order, coloured by output layout. A repeated layer is one row: '
                  'click it to expand its first instance. Arcs are resharding edges (producer &rarr; consumer), '
                  'labelled with the collectives and bytes; a short dashed arrow comes from a parameter or input. '
                  'Click a node for its explanation.</p>' + _legend(legend)
                  + '<div class="split"><div id="graph-view" class="scroll"></div>'
                    '<aside><pre id="graph-explain" class="explain">Click a node.</pre></aside></div>'),
        "ops": ('<p class="note">One row per node outside repeated layers and per node of the first instance of '
                'each layer class; the other instances have the same layouts and are summarised at the bottom. '
                'Click a column to sort, a row for its explanation.</p><div class="split"><div class="scroll">'
                + _ops_html(plan, ix).replace('class="sortable clickable"', 'class="sortable clickable" data-explain="explain"')
                + '</div><aside><pre id="explain" class="explain">Click a row.</pre></aside></div>'),
        "params": ('<div class="split"><div class="scroll">'
                   + params_table.replace('class="sortable clickable"', 'class="sortable clickable" data-explain="param-explain"')
                   + '</div><aside><pre id="param-explain" class="explain">Click a row.</pre></aside></div>'),
        "memory": _memory_svg(plan),
        "comm": _comm_html(plan),
    }
    sections = "".join(f'<section id="{sid}"><h2>{title}</h2>{body[sid]}</section>' for sid, title in _SECTIONS)
    nav = " ".join(f'<a href="#{sid}">{title}</a>' for sid, title in _SECTIONS)
    title = f"autopar plan: {plan.model.get('class')} on {plan.cluster.get('name') or plan.cluster.get('num_devices')}"
    blob = json.dumps(data, separators=(",", ":")).replace("</", "<\\/")
    return (f'<!DOCTYPE html><html lang="en"><head><meta charset="utf-8"><title>{_e(title)}</title>'
            f'<style>{_CSS}</style></head><body><header><h1>{_e(title)}</h1><nav>{nav}</nav></header>'
            f'<main>{sections}</main><script type="application/json" id="plan-data">{blob}</script>'
            f'<script>{_JS}</script></body></html>')


def to_html(plan, path) -> None:
    """Write the self-contained HTML report of ``plan`` to ``path``."""
    Path(path).write_text(render_html(plan), encoding="utf-8")


_CSS = """
body{font:14px/1.4 system-ui,sans-serif;margin:0;color:#222;background:#fafafa}
header{background:#23395d;color:#fff;padding:10px 20px;position:sticky;top:0;z-index:2}
header h1{font-size:18px;margin:0 0 4px}header a{color:#cde;margin-right:14px}
main{padding:0 20px 40px}section{scroll-margin-top:70px;background:#fff;border:1px solid #ddd;border-radius:6px;margin:16px 0;padding:8px 16px}
h2{font-size:16px;margin:6px 0}h3{font-size:14px;margin:10px 0 4px}
.facts{display:grid;grid-template-columns:max-content 1fr;gap:2px 12px}.facts dt{font-weight:600}.facts dd{margin:0}
.legend{display:flex;flex-wrap:wrap;gap:4px 14px;margin:4px 0 8px;font-size:12px}
.legend i{display:inline-block;width:12px;height:12px;margin-right:4px;vertical-align:-2px;border-radius:2px}
.note{color:#555;font-size:13px}.split{display:grid;grid-template-columns:minmax(0,3fr) minmax(300px,2fr);gap:12px}
.scroll{max-height:560px;overflow:auto;border:1px solid #eee}
.explain{position:sticky;top:0;margin:0;max-height:560px;overflow:auto;background:#f4f6f8;padding:8px;font-size:11.5px;white-space:pre}
table{border-collapse:collapse;font-size:12px;width:100%}th,td{padding:2px 6px;border-bottom:1px solid #eee;text-align:left;white-space:nowrap}
th{position:sticky;top:0;background:#eef1f5;cursor:pointer;user-select:none}th[data-dir=asc]::after{content:" \\25b2"}th[data-dir=desc]::after{content:" \\25bc"}
td[data-v]{text-align:right;font-variant-numeric:tabular-nums}
table.clickable tbody tr{cursor:pointer}tbody tr:hover{background:#f0f5ff}tr.selected{background:#dbe8ff!important}
tfoot td{color:#555;font-style:italic;background:#fbfbfb}
svg text{font-size:11px;fill:#333}.grid{stroke:#e5e5e5}.phase{stroke:#888;stroke-dasharray:4 3}
.peak{stroke:#333;stroke-dasharray:2 2}.budget{stroke:#d62728;stroke-width:2;stroke-dasharray:6 3}.budget-note{fill:#d62728}
#graph-view svg .node{cursor:pointer}#graph-view svg .grp rect{fill:#e9edf3;stroke:#7a8699}
#graph-view .edge{fill:none;stroke:#c0392b;stroke-opacity:.55}#graph-view .stub{stroke-dasharray:3 2}
#graph-view .elabel{fill:#a93226;font-size:10.5px}
"""

_JS = r"""
"use strict";
(function () {
  const D = JSON.parse(document.getElementById("plan-data").textContent);
  function show(name, pre, row) {
    pre.textContent = D.explain[name] || ("No explanation is recorded for " + name + ".");
    pre.dataset.name = name;
    for (const r of document.querySelectorAll("tr.selected")) r.classList.remove("selected");
    if (row) row.classList.add("selected");
  }
  for (const table of document.querySelectorAll("table.clickable")) {
    const pre = document.getElementById(table.dataset.explain);
    const pick = (e) => { const tr = e.target.closest("tr[data-name]"); if (tr) show(tr.dataset.name, pre, tr); };
    table.tBodies[0].addEventListener("click", pick);
    table.tBodies[0].addEventListener("keydown", (e) => { if (e.key === "Enter") pick(e); });
  }
  for (const th of document.querySelectorAll("table.sortable th")) {
    th.addEventListener("click", () => {
      const body = th.closest("table").tBodies[0], i = th.cellIndex, num = th.dataset.type === "num";
      const dir = th.dataset.dir === "asc" ? -1 : 1;
      for (const h of th.parentNode.children) delete h.dataset.dir;
      th.dataset.dir = dir > 0 ? "asc" : "desc";
      const key = (r) => num ? parseFloat(r.cells[i].dataset.v) : r.cells[i].textContent;
      const rows = Array.from(body.rows);
      rows.sort((a, b) => dir * (num ? key(a) - key(b) : key(a).localeCompare(key(b))));
      body.append(...rows);
    });
  }

  const G = D.graph, open = new Set(), RH = 22, X0 = 230, BW = 330;
  const view = document.getElementById("graph-view"), gpre = document.getElementById("graph-explain");
  const cut = (s, n) => s.length > n ? s.slice(0, n - 1) + "\u2026" : s;
  const esc = (s) => String(s).replace(/[&<>"]/g, (c) => ({"&": "&amp;", "<": "&lt;", ">": "&gt;", '"': "&quot;"}[c]));
  function draw() {
    const rows = [];
    for (const it of G.items) {
      rows.push(it);
      if (it.t === "g" && open.has(it.id)) for (const m of it.nodes) rows.push(Object.assign({inner: true}, m));
    }
    const y = new Map(rows.map((r, k) => [r.id, 6 + k * RH]));
    const at = (id, gid) => (id !== null && y.has(id)) ? y.get(id) : (gid !== null ? y.get(gid) : undefined);
    const labels = new Map(), parts = [];
    for (const e of G.edges) {
      const yd = at(e.d, e.dg);
      if (yd === undefined) continue;
      const c = yd + RH / 2 - 2;
      if (e.stub) {
        parts.push(`<path class="edge stub" d="M${X0 - 36},${c} L${X0},${c}" marker-end="url(#arrow)"><title>${esc(e.tip)}</title></path>`);
      } else {
        const ys = at(e.s, e.sg);
        if (ys === undefined || ys === yd) continue;
        const a = ys + RH / 2 - 2, off = Math.min(210, 18 + Math.abs(c - a) / 5);
        parts.push(`<path class="edge" d="M${X0},${a} C${X0 - off},${a} ${X0 - off},${c} ${X0},${c}" marker-end="url(#arrow)"><title>${esc(e.tip)}</title></path>`);
      }
      if (!labels.has(yd)) labels.set(yd, []);
      labels.get(yd).push(e);
    }
    for (const r of rows) {
      const ty = y.get(r.id), x = r.inner ? X0 + 14 : X0, w = r.inner ? BW - 14 : BW;
      if (r.t === "g") {
        parts.push(`<g class="grp node" data-group="${esc(r.id)}"><title>${esc(r.tip)}</title><rect x="${x}" y="${ty}" width="${w}" height="${RH - 4}" rx="4"/>` +
                   `<text x="${x + 6}" y="${ty + 13}">${open.has(r.id) ? "\u25be" : "\u25b8"} ${esc(r.label)}</text></g>`);
      } else {
        parts.push(`<g class="node" data-node="${esc(r.id)}"><title>${esc(r.id + " = " + r.op)}</title>` +
                   `<rect x="${x}" y="${ty}" width="${w}" height="${RH - 4}" rx="3" fill="${r.c}"/>` +
                   `<text x="${x + 6}" y="${ty + 13}" style="fill:#fff">${esc(cut(r.id, 26))}</text>` +
                   `<text x="${x + w - 6}" y="${ty + 13}" text-anchor="end" style="fill:#fff;opacity:.85">${esc(cut(r.op, 22))}</text></g>`);
      }
    }
    for (const [ly, es] of labels) {
      const text = es.slice(0, 2).map((e) => (e.stub ? e.stub + ": " : "") + e.l).join("; ") + (es.length > 2 ? ` (+${es.length - 2} edges)` : "");
      parts.push(`<text class="elabel" x="${X0 + BW + 8}" y="${ly + 13}">${esc(text)}<title>${esc(es.map((e) => e.tip).join("\n"))}</title></text>`);
    }
    const h = 12 + rows.length * RH;
    view.innerHTML = `<svg width="${X0 + BW + 640}" height="${h}" viewBox="0 0 ${X0 + BW + 640} ${h}">` +
      `<defs><marker id="arrow" viewBox="0 0 8 8" refX="8" refY="4" markerWidth="7" markerHeight="7" orient="auto">` +
      `<path d="M0,0 L8,4 L0,8 z" fill="#c0392b"/></marker></defs>${parts.join("")}</svg>`;
  }
  view.addEventListener("click", (e) => {
    const g = e.target.closest("[data-group]"), n = e.target.closest("[data-node]");
    if (g) { const id = g.dataset.group; if (open.has(id)) open.delete(id); else open.add(id); draw(); }
    else if (n) show(n.dataset.node, gpre, null);
  });
  draw();
})();
"""
