"""Readable text views of a Plan: the per-layer summary table."""
from __future__ import annotations

from collections import OrderedDict


def _b(n: float) -> str:
    for unit, div in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if abs(n) >= div:
            return f"{n / div:.2f} {unit}"
    return f"{n:.0f} B"


def _s(t: float) -> str:
    if t >= 1:
        return f"{t:.3f} s"
    if t >= 1e-3:
        return f"{t * 1e3:.3f} ms"
    return f"{t * 1e6:.1f} us"


def pipeline_summary(plan) -> list[str]:
    pipe = plan.pipeline
    p = plan.mesh["shape"][plan.mesh["axes"].index(pipe.axis)]
    lines = [f"pipeline: {len(pipe.stages)} stages on {p} ranks of axis '{pipe.axis}', schedule "
             f"{pipe.schedule}, {pipe.microbatches} microbatches, bubble {pipe.bubble_fraction:.1%} of "
             f"the ideal time ({_s(pipe.bubble_seconds)})"]
    for st in pipe.stages:
        layers = st.layers
        names = ", ".join(layers[:2]) + (f" ... {layers[-1]}" if len(layers) > 2 else "")
        lines.append(f"  stage {st.index} on pp rank {st.pp_rank}: {len(layers)} layers ({names}), "
                     f"{_s(st.seconds)} per microbatch, {_b(st.activations)} activations per microbatch x "
                     f"{st.in_flight:.3g} in flight")
    return lines


def offload_lines(plan) -> list[str]:
    """What the plan keeps in host memory, and what that frees on each device."""
    off = plan.offload
    if not off:
        return []
    host = sum(v["host_bytes"] for v in off.values())
    freed = sum(v["device_bytes_freed"] for v in off.values())
    same = plan.cluster.get("device_type") == "cpu"
    lines = [f"optimizer states offloaded to host memory (stepped there): {len(off)} of {len(plan.params)} "
             f"parameters, {_b(host)} per device in host memory, {_b(freed)} freed per device"
             + (" (host and device are one memory here: nothing is freed)" if same else "")]
    for k, v in list(off.items())[:8]:
        lines.append(f"  {k:<60} {_b(v['host_bytes'])} on host")
    if len(off) > 8:
        lines.append(f"  ... {len(off) - 8} more")
    return lines


def summary(plan) -> str:
    mesh = " x ".join(f"{a}={n}" for a, n in zip(plan.mesh["axes"], plan.mesh["shape"]))
    lines = [f"autopar plan: {plan.model['class']} ({plan.model['num_params']:,} parameters) on "
             f"{plan.cluster.get('name') or plan.cluster['num_devices']} devices, mesh {mesh}, "
             f"precision {plan.precision}"
             + (f", gradients summed in {plan.reduce_dtype}" if plan.reduce_dtype else "")]
    # One block per layer class (shown once, with its instance count) and one for the rest.
    groups: "OrderedDict[str, list]" = OrderedDict()
    for n in plan.nodes:
        groups.setdefault(n.layer_class or "(outside layers)", []).append(n)
    counts = plan.model.get("layers", {})
    first_instance = {}
    for n in plan.nodes:
        if n.layer_class and n.layer_class not in first_instance:
            first_instance[n.layer_class] = n.layer
    colls_by_node: dict = {}
    for c in plan.collectives:
        colls_by_node.setdefault(c.node, []).append(c)
    for group, nodes in groups.items():
        inst = first_instance.get(group)
        if inst is not None:
            nodes = [n for n in nodes if n.layer == inst]
            lines.append(f"\n[{group}] x{counts.get(group, 1)} (showing {inst})")
        else:
            lines.append(f"\n[{group}]")
        lines.append(f"  {'node':<34} {'op':<28} {'output layout':<16} {'compute':>10}  collectives")
        for n in nodes:
            if n.follows and not colls_by_node.get(n.name) and n.compute_seconds == 0:
                continue
            out = ",".join("[" + ",".join(l) + "]" for l in n.outputs)
            cs = ", ".join(f"{c.kind}({c.axis},{c.phase[:3]}) {_b(c.bytes)} {_s(c.seconds)}"
                           for c in colls_by_node.get(n.name, []))
            lines.append(f"  {n.name[:34]:<34} {n.op[:28]:<28} {out[:16]:<16} {_s(n.compute_seconds):>10}  {cs}")
    for w in plan.extra.get("warnings", []):
        lines.append(f"\nwarning: {w}")
    stages = plan.zero_stages()
    sharded = {k: v for k, v in plan.params.items() if any(p != "R" for p in v) or k in stages}
    by_stage = {}
    for stage, _ in stages.values():
        by_stage[stage] = by_stage.get(stage, 0) + 1
    zero = ", ".join(f"ZeRO-{k} {by_stage[k]}" for k in sorted(by_stage))
    lines.append(f"\nparameters: {len(plan.params)}, sharded: {len(sharded)}"
                 + (f"; optimizer states sharded: {zero}, replicated {len(plan.params) - len(stages)}" if zero else ""))
    for k, v in list(sharded.items())[:12]:
        z = f"  ZeRO-{stages[k][0]} along {stages[k][1]}" if k in stages else ""
        lines.append(f"  {k:<60} {v}{z}")
    if len(sharded) > 12:
        lines.append(f"  ... {len(sharded) - 12} more")
    lines += offload_lines(plan)
    m = plan.memory
    lines.append(f"\nmemory per device: peak {_b(m.peak)} of budget {_b(m.memory_budget or 0)} "
                 f"(params {_b(m.params)}, grads {_b(m.grads)}, optimizer {_b(m.optimizer)}, "
                 f"activations {_b(m.activations)})"
                 + ("; nothing offloaded: host and device are one memory on CPU processes"
                    if plan.cluster.get("device_type") == "cpu" and not plan.offload else ""))
    comm = plan.breakdown["communication"]
    recompute = plan.breakdown.get("recompute", 0.0)
    lines.append(f"step time: {_s(plan.step_time)} predicted = compute {_s(plan.breakdown['compute'])} + "
                 + (f"recompute {_s(recompute)} + " if recompute else "")
                 + (f"activation offload {_s(plan.breakdown['offload'])} + " if plan.breakdown.get("offload") else "")
                 + " + ".join(f"comm[{a}] {_s(t)}" for a, t in comm.items())
                 + (f" - comm hidden behind compute {_s(plan.breakdown['hidden'])}" if plan.breakdown.get("hidden")
                    else "")
                 + (f" + its contention with compute {_s(plan.breakdown['contention'])}"
                    if plan.breakdown.get("contention") else "")
                 + f" + optimizer {_s(plan.breakdown['optimizer'])}"
                 + (f" + pipeline bubble {_s(plan.breakdown['bubble'])}" if plan.breakdown.get("bubble") else ""))
    if plan.bucket_mb is not None:
        priced = plan.solver.get("buckets") or {}
        lines.append(f"gradient buckets: {plan.bucket_mb:g} MiB"
                     + (" (step time priced at " + ", ".join(f"{mb} MiB {_s(priced[mb])}"
                                                             for mb in sorted(priced, key=float, reverse=True)) + ")"
                        if len(set(priced.values())) > 1 else ""))
    if plan.pipeline:
        lines += pipeline_summary(plan)
    for cls, r in plan.recompute["classes"].items():
        lines.append(f"recomputed in backward: {r['count']} of {r['of']} {cls} ({', '.join(r['layers'][:4])}"
                     f"{', ...' if r['count'] > 4 else ''})")
    for cls, r in plan.recompute.get("attention", {}).get("classes", {}).items():
        lines.append(f"attention core recomputed in backward (selective): {r['count']} of {r['of']} {cls} "
                     f"({', '.join(r['layers'][:4])}{', ...' if r['count'] > 4 else ''})")
    off = plan.recompute.get("offload")
    for cls, r in (off or {}).get("classes", {}).items():
        lines.append(f"activations offloaded to host memory between forward and backward: {r['count']} of {r['of']} "
                     f"{cls} ({', '.join(r['layers'][:4])}{', ...' if r['count'] > 4 else ''}), "
                     f"{_b(off.get('bytes', 0.0))} per device moved each way"
                     + (" (host and device are one memory here: nothing is freed)"
                        if plan.cluster.get("device_type") == "cpu" else ""))
    sv = plan.solver
    if sv:
        lines.append(f"solver: {sv.get('status')} in {sv.get('seconds', 0):.2f}s ({sv.get('backend')}, "
                     f"{sv.get('variables')} variables, {sv.get('constraints')} constraints); planning took "
                     f"{sv.get('planning_seconds', 0):.2f}s over meshes "
                     f"{[c['mesh'] for c in sv.get('candidates', [])]}")
    return "\n".join(lines)
