"""Pipeline planning: stages, microbatches and the schedule (docs/pipeline.md).

A pipeline plan has a mesh axis named ``pp``. Every layout is replicated along it; each of its ranks
holds some stages of the model instead. The search, per candidate (mesh, microbatch count):

1. capture the model at the microbatch's shapes and solve the layouts on the mesh's other axes (the
   pipeline axis at size 1) with the usual ILP: every instance of a repeated layer shares one solve;
2. price each layer instance (seconds and activation bytes per microbatch, parameter bytes) from that
   solution; the nodes before the first layer (embedding) go to the first stage, those after the last
   (final norm, head, loss) to the last;
3. per schedule: cut the layers into ``pp * v`` contiguous stages by dynamic programming, minimizing the
   slowest rank's time under each rank's memory budget with the schedule's in-flight microbatches;
4. predict the step: ``m * T + bubble * m * T`` plus the slowest rank's gradient sync and optimizer
   step, ``T`` the slowest rank's seconds per microbatch (forward, backward, its collectives and the
   stage-to-stage transfers).

The schedule formulas follow Narayanan et al. 2021 and Korthikanti et al. 2022 (../shared/REFERENCES.md);
zero-bubble schedules follow Qi et al. 2023.
"""
from __future__ import annotations

import copy
import math

import torch
from torch.utils import _pytree as pytree

from autopar.errors import AutoparError, InfeasiblePlanError
from autopar.plan import PIPELINE_SCHEDULES

SCHEDULES = PIPELINE_SCHEDULES
VIRTUAL = {"GPipe": 1, "1F1B": 1, "Interleaved1F1B": 2, "InterleavedZeroBubble": 2, "ZBVZeroBubble": 2}


def bubble_fraction(schedule: str, p: int, m: int, v: int | None = None) -> float:
    """Idle time of the pipeline as a fraction of the ideal (bubble-free) compute time ``m * T``.

    GPipe and 1F1B: ``(p-1)/m``; interleaved with ``v`` chunks per rank: ``(p-1)/(v*m)`` (Narayanan et
    al.). Zero-bubble schedules fill about two thirds of the interleaved bubble with weight-gradient
    passes (ZB-H1 keeps "about a third of its bubble", Qi et al.)."""
    v = VIRTUAL[schedule] if v is None else v
    if schedule in ("GPipe", "1F1B"):
        return (p - 1) / m
    if schedule == "Interleaved1F1B":
        return (p - 1) / (v * m)
    if schedule in ("InterleavedZeroBubble", "ZBVZeroBubble"):
        return (p - 1) / (3 * v * m)
    raise AutoparError(f"unknown pipeline schedule {schedule!r}; choose one of {SCHEDULES}")


def in_flight(schedule: str, p: int, m: int, rank: int = 0) -> float:
    """How many microbatches' activations (of all the layers the rank holds) rank ``rank`` of the
    pipeline axis keeps at its peak, under torch.distributed.pipelining's order of the schedule (checked
    against its runs: tests/test_pipeline_planning.py). GPipe: all ``m``. 1F1B: ``p - rank``.
    Interleaved 1F1B (``v`` stages per rank, ``m`` a multiple of ``p``): its warmup runs ``(v-1)*p +
    2*(p-1-rank)`` stage forwards before the first backward, so ``(v-1)*p + 2*(p-1-rank) + 1`` stages'
    microbatches are in flight, at most ``v*m``; each is a ``v``-th of the rank's layers. On the first
    rank that is Korthikanti et al.'s ``p * (1 + (p-1)/(p*v))``. ZB-H1 (interleaved zero bubble) keeps
    1F1B's first-stage peak, ``p``, on every rank (Qi et al.): a weight-gradient pass it delays holds its
    activations until it runs. ZB-V: ``min(2p, m + 1 + rank)`` stages' microbatches, ``p`` once ``m >= 2p``."""
    v = VIRTUAL.get(schedule)
    if schedule == "GPipe":
        return float(m)
    if schedule == "1F1B":
        return float(min(m, p - rank))
    if schedule == "Interleaved1F1B":
        return min(v * m, (v - 1) * p + 2 * (p - 1 - rank) + 1) / v
    if schedule == "InterleavedZeroBubble":
        return float(min(m, p))
    if schedule == "ZBVZeroBubble":
        return min(2 * p, m + 1 + rank) / 2
    raise AutoparError(f"unknown pipeline schedule {schedule!r}; choose one of {SCHEDULES}")


def rank_of_stage(schedule: str, stage: int, p: int) -> int:
    """Which rank of the pipeline axis runs ``stage``: round robin (looped), or V-shaped for ZB-V
    (stages ``i`` and ``2p-1-i`` on rank ``i``)."""
    if schedule == "ZBVZeroBubble":
        return stage if stage < p else 2 * p - 1 - stage
    return stage % p


def microbatch_inputs(example_inputs, example_kwargs, m: int):
    """The first of ``m`` equal microbatches of the example inputs (every tensor split along dim 0)."""
    args, kwargs = tuple(example_inputs) if isinstance(example_inputs, (tuple, list)) else (example_inputs,), \
        dict(example_kwargs or {})

    def first(x):
        if x.dim() == 0 or x.shape[0] % m:
            raise AutoparError(f"an input of shape {tuple(x.shape)} cannot be split into {m} microbatches along "
                               f"dim 0: pick a microbatch count that divides the batch "
                               f"({x.shape[0] if x.dim() else 'a scalar'}), or pass microbatches=...")
        return x[: x.shape[0] // m]

    return pytree.tree_map_only(torch.Tensor, first, (args, kwargs))


def batch_size(example_inputs, example_kwargs) -> int:
    leaves = [x for x in pytree.tree_leaves((example_inputs, example_kwargs)) if isinstance(x, torch.Tensor)]
    if not leaves or leaves[0].dim() == 0:
        raise AutoparError("a pipeline plan splits the batch into microbatches along dim 0 of the inputs, but "
                           "the example inputs have no batch dimension")
    return int(leaves[0].shape[0])


def balance(costs: list[float], pre: float, post: float, n: int) -> list[int]:
    """Cut ``len(costs)`` layers into ``n`` contiguous, non-empty stages minimizing the largest stage
    cost (``pre`` is added to the first stage, ``post`` to the last); returns the first layer of each
    stage. Infinite costs mark cuts that do not fit."""
    L = len(costs)
    prefix = [0.0]
    for c in costs:
        prefix.append(prefix[-1] + c)
    INF = math.inf
    # best[k][j]: the smallest max cost of the first j layers in k stages; cut[k][j]: where stage k starts.
    best = [[INF] * (L + 1) for _ in range(n + 1)]
    cut = [[0] * (L + 1) for _ in range(n + 1)]
    best[0][0] = 0.0
    for k in range(1, n + 1):
        for j in range(k, L - (n - k) + 1):
            for i in range(k - 1, j):
                c = prefix[j] - prefix[i] + (pre if k == 1 else 0.0) + (post if k == n else 0.0)
                v = max(best[k - 1][i], c)
                if v < best[k][j]:
                    best[k][j], cut[k][j] = v, i
    starts, j = [], L
    for k in range(n, 0, -1):
        starts.append(cut[k][j])
        j = cut[k][j]
    return starts[::-1]


class LayerCosts:
    """Per-microbatch figures of the solved microbatch program, per layer instance and for the nodes
    before (``pre``) and after (``post``) the layers."""

    def __init__(self, gm, sub_plan, optimizer_seconds: dict, boundary_bytes: dict,
                 recompute_seconds: dict | None = None, forced: frozenset = frozenset(), recompute: bool = False):
        """``optimizer_seconds``: per parameter FQN, its optimizer step (of its ZeRO-1 shard where the
        plan shards its state); ``recompute_seconds``: per layer instance, its forward again (compute
        and the collectives it reads through), what recomputing it costs in backward; ``forced``:
        instances that recompute in every plan; ``recompute``: whether the others may recompute where
        memory is short."""
        from autopar.passes.meta import meta_of

        self.layers: list[str] = []
        self.compute, self.comm, self.sync, self.activations = {}, {}, {}, {}
        params = {n.name for n in gm.graph.nodes if n.op == "placeholder" and meta_of(n).role.kind == "param"}
        comm_of_node: dict = {}
        sync_of_node: dict = {}
        for c in sub_plan.collectives:
            # A parameter's gradient all-reduce runs once per step, after the last microbatch
            # (codegen/stages.py); every other collective runs in every microbatch.
            once = c.step == "grad_all_reduce" and c.value in params
            per = (sync_of_node if once else comm_of_node).setdefault(c.node, {})
            per[c.axis] = per.get(c.axis, 0.0) + c.seconds
        first_layer_seen = False
        region_of_node = {}
        for entry in sub_plan.nodes:
            inst = entry.layer
            if inst is not None:
                if inst not in self.compute:
                    self.layers.append(inst)
                first_layer_seen = True
                key = inst
            else:
                key = "post" if first_layer_seen else "pre"
            region_of_node[entry.name] = key
            self.compute[key] = self.compute.get(key, 0.0) + entry.compute_seconds
            for table, of_node in ((self.comm, comm_of_node), (self.sync, sync_of_node)):
                comm = table.setdefault(key, {})
                for a, t in of_node.get(entry.name, {}).items():
                    comm[a] = comm.get(a, 0.0) + t
            self.activations[key] = self.activations.get(key, 0.0) + entry.activation_bytes
        self.boundary = boundary_bytes
        # Parameter bytes (weights, gradients, optimizer states) per region; a parameter read in several
        # regions (tied embeddings) is held by each.
        by_param = sub_plan.memory.by_param
        # A ZeRO-1 parameter's all-gather of the updated shards runs once per step, after the optimizer.
        gathers: dict = {}
        for c in sub_plan.collectives:
            if c.step.startswith("zero"):
                gathers.setdefault(c.value, {})[c.axis] = gathers.get(c.value, {}).get(c.axis, 0.0) + c.seconds
        self.param_bytes: dict = {}
        self.param_regions: dict = {}
        self.optimizer: dict = {}
        for n in gm.graph.nodes:
            role = meta_of(n).role if n.op == "placeholder" else None
            if role is None or role.kind != "param":
                continue
            regions = {region_of_node[u.name] for u in n.users if u.name in region_of_node}
            self.param_regions[role.target] = regions
            for r in regions:
                self.param_bytes[r] = self.param_bytes.get(r, 0.0) + by_param.get(role.target, 0.0)
                self.optimizer[r] = self.optimizer.get(r, 0.0) + optimizer_seconds.get(role.target, 0.0)
                sync = self.sync.setdefault(r, {})
                for a, t in gathers.get(n.name, {}).items():
                    sync[a] = sync.get(a, 0.0) + t
        self.recompute_seconds = dict(recompute_seconds or {})
        self.forced = frozenset(forced)
        self.may_recompute = bool(recompute)

    def seconds(self, key: str) -> float:
        return self.compute.get(key, 0.0) + sum(self.comm.get(key, {}).values())

    def stage(self, layers: list[str], first: bool, last: bool) -> dict:
        keys = list(layers) + (["pre"] if first else []) + (["post"] if last else [])
        params = sum(self.param_bytes.get(k, 0.0) for k in keys)
        comm: dict = {}
        sync: dict = {}
        for k in keys:
            for table, out in ((self.comm, comm), (self.sync, sync)):
                for a, t in table.get(k, {}).items():
                    out[a] = out.get(a, 0.0) + t
        return {"seconds": sum(self.seconds(k) for k in keys),
                "compute_seconds": sum(self.compute.get(k, 0.0) for k in keys),
                "comm_seconds": comm, "grad_sync_seconds": sync,
                "activations": sum(self.activations.get(k, 0.0) for k in keys),
                "param_bytes": params, "optimizer_seconds": sum(self.optimizer.get(k, 0.0) for k in keys),
                "send_bytes": 0.0 if last else self.boundary.get(layers[-1], 0.0) if layers else 0.0}


def schedule_plan(costs: LayerCosts, schedule: str, p: int, m: int, memory_budget: float, link: tuple[float, float]):
    """Stages, predicted step and memory of one schedule, or None when no cut fits the budget."""
    v = VIRTUAL[schedule]
    n = p * v
    L = len(costs.layers)
    if n > L:
        return None
    bw, lat = link
    # Stage-to-stage transfers: an activation forward and its gradient backward, per microbatch.
    p2p = {inst: 2 * (lat + costs.boundary.get(inst, 0.0) / bw) for inst in costs.layers}
    per_layer = [costs.seconds(i) + p2p[i] for i in costs.layers]
    starts = balance(per_layer, costs.seconds("pre"), costs.seconds("post"), n)
    bounds = list(zip(starts, starts[1:] + [L]))
    stages = []
    for s, (a, b) in enumerate(bounds):
        layers = costs.layers[a:b]
        st = costs.stage(layers, s == 0, s == n - 1)
        st["p2p_seconds"] = 0.0 if s == n - 1 else p2p[layers[-1]]
        st["seconds"] += st["p2p_seconds"]
        stages.append({"index": s, "pp_rank": rank_of_stage(schedule, s, p), "layers": layers, **st})
    ranks = []
    for r in range(p):
        mine = [st for st in stages if st["pp_rank"] == r]
        k = in_flight(schedule, p, m, r)
        static = sum(st["param_bytes"] for st in mine)
        act = _recompute_to_fit(costs, mine, static, k, memory_budget)
        if act is None:
            return None
        per_mb = sum(st["seconds"] for st in mine)
        comm: dict = {}
        sync: dict = {}
        for st in mine:
            for key, out in (("comm_seconds", comm), ("grad_sync_seconds", sync)):
                for a, t in st[key].items():
                    out[a] = out.get(a, 0.0) + t
        ranks.append({"rank": r, "seconds_per_microbatch": per_mb, "in_flight": k,
                      "compute_seconds": sum(st["compute_seconds"] for st in mine), "comm_seconds": comm,
                      "grad_sync_seconds": sync,
                      "p2p_seconds": sum(st["p2p_seconds"] for st in mine),
                      "recompute_seconds": sum(st["recompute_seconds"] for st in mine),
                      "activation_bytes": act, "static_bytes": static, "peak": static + act,
                      "optimizer_seconds": sum(st["optimizer_seconds"] for st in mine)})
    slowest_rank = max(ranks, key=lambda r: r["seconds_per_microbatch"])
    slowest = slowest_rank["seconds_per_microbatch"]
    ideal = m * slowest
    bubble = bubble_fraction(schedule, p, m, v) * ideal
    # After the last microbatch: each rank's gradient sync and optimizer step; the slowest counts.
    tail_rank = max(ranks, key=lambda r: r["optimizer_seconds"] + sum(r["grad_sync_seconds"].values()))
    optim = tail_rank["optimizer_seconds"]
    sync = sum(tail_rank["grad_sync_seconds"].values())
    peak = max(r["peak"] for r in ranks)
    if peak > memory_budget:
        return None
    for st in stages:
        st["in_flight"] = ranks[st["pp_rank"]]["in_flight"]
    return {"schedule": schedule, "virtual_stages": v, "slowest_rank": slowest_rank["rank"],
            "tail_rank": tail_rank["rank"], "grad_sync_seconds": sync, "microbatches": m, "stages": stages, "ranks": ranks,
            "step_time": ideal + bubble + optim + sync, "ideal_seconds": ideal, "bubble_seconds": bubble,
            "bubble_fraction": bubble_fraction(schedule, p, m, v), "optimizer_seconds": optim, "peak": peak}


def excess_bytes(costs: LayerCosts, schedule: str, p: int, m: int, memory_budget: float,
                 link: tuple[float, float]) -> float:
    """How many bytes the fullest rank is over ``memory_budget`` under ``schedule`` with as much recompute
    as the plan allows: what the layouts must save for it to fit (inf where no cut exists)."""
    least = copy.copy(costs)
    if costs.may_recompute:
        least.forced = frozenset(costs.layers)
    found = schedule_plan(least, schedule, p, m, math.inf, link)
    return math.inf if found is None else found["peak"] - memory_budget


def _recompute_to_fit(costs: LayerCosts, mine: list[dict], static: float, k: float,
                      memory_budget: float) -> float | None:
    """Choose which layers of one rank's stages recompute, and return the rank's activation bytes at its
    peak (None when recomputing every layer it may still leaves it over ``budget``).

    A recomputed layer keeps only what it reads from outside (its boundary bytes) for each of the ``k``
    microbatches in flight, and holds its whole activations again for one microbatch while its backward
    runs. Layers beyond the forced ones recompute in order of bytes freed per second of recompute, until
    the rank fits: with the stages fixed, that is the least recompute time that fits (the layers of one
    class cost and free the same)."""
    chosen = {inst for st in mine for inst in st["layers"] if inst in costs.forced}

    def activation_bytes():
        kept = transient = 0.0
        for st in mine:
            kept += st["activations"]
            for inst in st["layers"]:
                if inst in chosen:
                    full = costs.activations.get(inst, 0.0)
                    kept -= full - min(costs.boundary.get(inst, 0.0), full)
                    transient = max(transient, full)
        return kept * k + transient

    if costs.may_recompute:
        saving = {inst: costs.activations.get(inst, 0.0) - costs.boundary.get(inst, 0.0)
                  for st in mine for inst in st["layers"] if inst not in chosen}
        order = sorted((i for i in saving if saving[i] > 0),
                       key=lambda i: -saving[i] / max(costs.recompute_seconds.get(i, 0.0), 1e-12))
        for inst in order:
            if static + activation_bytes() <= memory_budget:
                break
            chosen.add(inst)
    for st in mine:
        st["recompute"] = [inst for inst in st["layers"] if inst in chosen]
        st["recompute_seconds"] = sum(costs.recompute_seconds.get(inst, 0.0) for inst in st["recompute"])
        st["seconds"] += st["recompute_seconds"]
    act = activation_bytes()
    return act if static + act <= memory_budget else None


def check_layers(gm, p: int, schedule: str | None = None) -> None:
    """A pipeline of ``p`` ranks (``schedule``'s virtual stages on each, when it is fixed) needs a layer
    per stage."""
    from autopar.passes.layers import layer_counts

    counts = layer_counts(gm)
    n = sum(counts.values())
    if n == 0:
        raise AutoparError("a pipeline plan cuts the model between repeated layers (modules in an indexed "
                           "list such as model.layers.0), and this model has none; plan it without a 'pp' "
                           "axis")
    if n < p:
        raise AutoparError(f"the pipeline axis 'pp' has {p} ranks but the model has only {n} layers to cut "
                           f"between; use a pipeline axis of at most {n}")
    v = VIRTUAL[schedule] if schedule else 1
    if n < p * v:
        raise AutoparError(f"schedule {schedule} puts {v} stages on each of the {p} pipeline ranks, {p * v} in all, "
                           f"but the model has only {n} layers to cut between; use a schedule of one stage per "
                           f"rank (GPipe, 1F1B) or a pipeline axis of at most {n // v}")


def no_fit(p, m, memory_budget):
    return InfeasiblePlanError(f"no cut of the model into {p} pipeline stages with {m} microbatches fits "
                               f"{memory_budget / 2**30:.3f} GiB per device under any schedule; use more stages or "
                               f"microbatches, or raise memory_budget", memory_budget=memory_budget)
