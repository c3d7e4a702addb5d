"""The infeasibility report: when no plan fits the budget, the smallest budget that does and what uses
the most memory there; and the check of offloaded states against the host's memory."""
from __future__ import annotations

import math

from autopar.cluster import ClusterSpec
from autopar.errors import AutoparError, InfeasiblePlanError
from autopar.mesh_search import MeshCandidate
from autopar.passes.costs import INFEASIBLE
from autopar.passes.memory import StepMemory, minimum_budget, solve_under_budget
from autopar.plan import Plan
from autopar.plan_assembly import assemble_plan
from autopar.solver import NODE_LIMIT

def check_host_memory(plan: Plan, cluster: ClusterSpec) -> None:
    """The offloaded states of a node's devices must fit its host memory: a constraint of the ILP
    (``StepMemory.host_constraint``), checked again on the plan."""
    if not plan.offload or cluster.host_is_device:
        return
    need = plan.memory.host * cluster.devices_per_node
    if need > cluster.host_memory:
        raise InfeasiblePlanError(
            f"the plan offloads {len(plan.offload)} parameters' optimizer states, {need / 1e9:.1f} GB per node of "
            f"host memory, more than the node's {cluster.host_memory / 1e9:.1f} GB (host_memory); raise the device "
            f"budget, add devices, or give the host's real memory", memory_budget=plan.memory.memory_budget)


def _smallest_valid_budget(prob, sm: StepMemory, above: float | None = None):
    """(the smallest budget with a valid plan, that plan, a proven lower bound of the budget); None where
    there is none, or none below ``above``.

    The memory-only minimum forbids the reshardings that cannot happen (priced INFEASIBLE); where it
    stops at its node limit with no valid layout, look for the least budget at which the time-aware
    solve finds one.
    """
    found = minimum_budget(prob, sm, above=above)
    if found is None:
        return None
    least_peak, least, lower = found
    if prob.objective(least) < INFEASIBLE:          # the least peak's own layout is a valid plan
        return found
    for factor in (1.0 + 1e-6, 1.01, 1.05, 1.1, 1.25, 1.5, 2.0, 3.0, 5.0, 10.0, 100.0):
        try:
            sol = solve_under_budget(prob, sm, least_peak * factor, time_limit=math.inf, node_limit=NODE_LIMIT)
        except AutoparError:        # no layout found within the node limit at this budget: try a larger one
            continue
        if sol.status != "infeasible" and prob.objective(sol.assignment) < INFEASIBLE:
            return sm.peak(sol.assignment)[1], sol.assignment, lower
    return None


def raise_infeasible(prep, infeasible: list[MeshCandidate], cluster, memory_budget):
    """Raise the InfeasiblePlanError of a search that found no plan within ``memory_budget``: the smallest
    feasible budget over the ``infeasible`` meshes and what uses the most memory in its plan."""
    best = None                 # (the smallest budget, its assignment, its mesh)
    lower = math.inf            # proven: no mesh has a plan below it
    for mesh in infeasible:
        found = _smallest_valid_budget(mesh.prob, mesh.memory, above=None if best is None else best[0])
        if found is None:
            continue
        lower = min(lower, found[2])
        if best is None or found[0] < best[0]:
            best = (found[0], found[1], mesh)
    if best is None:
        raise InfeasiblePlanError(f"no valid plan exists on {cluster.name or cluster.num_devices} devices at any "
                                  f"budget: the pinned layouts cannot be reached; relax the pins",
                                  memory_budget=memory_budget)
    need, assignment, mesh = best
    gap = max(0.0, 1.0 - lower / need) if need > 0 else 0.0
    # A min-max solve stopped at its node limit: the budget found fits, the least one may lie below it.
    proof = (f" The search stopped at its node limit: no plan fits below {lower / 2**30:.3f} GiB ({lower:.0f} "
             f"bytes), so the smallest feasible budget is at most {100 * gap:.1f}% below this one."
             if gap > 1e-6 else "")
    p = assemble_plan(prep, mesh.solved(), assignment, cluster, memory_budget)
    consumers = [(f"param {k} (+grad, optimizer)", v) for k, v in p.memory.by_param.items()]
    consumers += [(f"activations of {n.name}", n.activation_bytes) for n in p.nodes]
    consumers = sorted(consumers, key=lambda x: -x[1])[:5]
    top = ", ".join(f"{name} ({b / 2**20:.1f} MiB)" for name, b in consumers)
    host = ""
    if p.offload and not cluster.host_is_device and p.memory.host * cluster.devices_per_node > cluster.host_memory:
        host = (f" That plan offloads optimizer states, {p.memory.host * cluster.devices_per_node / 1e9:.1f} GB per "
                f"node of host memory, more than the node's {cluster.host_memory / 1e9:.1f} GB (host_memory): the "
                f"smallest budget within the host's memory is higher.")
    raise InfeasiblePlanError(
        f"no plan fits {memory_budget / 2**30:.3f} GiB per device on {cluster.name or cluster.num_devices} "
        f"(meshes tried: {[list(m.shape) for m in infeasible]}). The smallest feasible budget is "
        f"{need / 2**30:.3f} GiB ({need:.0f} bytes), on mesh {list(mesh.shape)}.{proof} Largest consumers there: {top}.{host} "
        f"Raise memory_budget, use more devices, or reduce the batch or sequence length.",
        memory_budget=memory_budget, min_feasible_budget=need, largest_consumers=consumers,
        min_feasible_gap=gap)

