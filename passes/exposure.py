"""Which part of each collective the step's compute hides, as the generated program schedules it.

The plan's collectives are priced one by one (passes/costs.py); this replays one training step on two
streams, compute and communication, the way the generated program runs them:

- **forward** (codegen/overlap.py): a resharding's collective is issued as soon as its input is
  computed and the previous such collective has been waited, and waited just before the first use of
  its result; one is in flight at a time. It hides behind the compute between its issue and its wait.
  One inside a recomputed or offloaded region (a layer, or an attention core) is issued at the earliest
  when the region starts, and one outside after the last region before its reader that has split
  collectives has ended. A recomputed region's run again in backward repeats its forward schedule, so
  each of its collectives is exposed there as much as in forward. Collectives inside sharded ops (the
  vocab-parallel loss, ring attention, priced with their own overlap) wait where they are issued.
- **backward**: a parameter whose every use reduces its gradient over one mesh axis (plain data
  parallelism; codegen/grad_buckets.py), or whose bfloat16 copy's every use does (bf16-mixed), has
  that reduction done once, on its accumulated gradient, in DDP-style buckets of ``bucket_bytes``
  (runtime/grad_buckets.py): a bucket's all-reduce starts when
  its last gradient is accumulated (the backward of the parameter's first reader) and the previous
  bucket has started, and runs on the communication stream while the rest of backward computes.
  A sharded parameter's gradient reduce-scatter (the backward of its split forward all-gather,
  ZeRO-3) is issued at the backward of its reader (waited there in a recomputed or offloaded layer,
  codegen/overlap.py's ``param_gather_start``), a ZeRO-2 one once its gradient is accumulated (the
  backward of its first reader), and so is the all-gather of a replicated parameter's gradient where
  the program reads the parameter in chunks (a feature split over replicated weights); each is waited
  when the next one is issued or when backward ends (runtime/collectives.py, FSDP2's scheme). The
  communication stream runs these and the buckets in issue order. Megatron's "f" before linear layers
  (``hides_behind_weight_grads``) is issued once the input's gradient is summed over its readers and
  waited after their weight gradients (their forward's compute), on the same stream. Every other
  backward collective (an "f" before other readers, sequence parallelism's pairs) waits where it is
  issued: autograd runs the reader of its result next, so there is no compute to hide it behind.
- the optimizer step's collectives (ZeRO-1/2 gathers) wait where they are issued.

``exposure`` returns, per collective, the seconds it runs for (a bucketed reduction: its share of its
bucket's one all-reduce, by bytes) and the seconds of it that no compute hides.
"""
from __future__ import annotations

import bisect
from dataclasses import dataclass, replace

import torch
import torch.fx as fx

from autopar.passes.meta import is_param, meta_of
from autopar.passes.precision import bucketed_value, reduce_dtype_of
from autopar.passes.strategies import requires_grad
from autopar.plan import DDP_BUCKET_MB, PlanCollective, bucket_bytes, pack_buckets

# DDP's bucket size: what a plan without a bucket size of its own prices and runs.
GRAD_BUCKET_BYTES = bucket_bytes(DDP_BUCKET_MB)
# The gradient bucket sizes in MiB the planner prices on the chosen layout (``cheapest_bucket``),
# largest first. The exposed tail after backward is about the last bucket's all-reduce, which
# shrinks with the size, while each bucket more pays one latency (and on CPU, one peer wait), so the
# best size lies below DDP's 25 where the tail dominates (HF GPT-2 on 2 CPU ranks measured a 25-40 ms
# shorter tail at 6 MiB; bench/README.md) and at 25 where latency does: DDP's 25 and its halvings
# down to 1 MiB, the size DDP gives its own first bucket so that the first all-reduce starts early.
# Halving keeps the best of the range within 2x of a candidate, at one replay of backward each.
BUCKET_CANDIDATES_MB = (25, 12, 6, 3, 1)


@dataclass(frozen=True)
class Exposure:
    seconds: list[float]     # per collective: how long it runs (bucketed reductions re-priced per bucket)
    exposed: list[float]     # per collective: the part no compute hides
    buckets: tuple[float, ...] = ()     # the bytes of each gradient bucket, in launch order

    @property
    def hidden(self) -> float:
        # Never negative: with nothing hidden the two sums differ only by rounding.
        return max(0.0, sum(self.seconds) - sum(self.exposed))


def bucketed_params(gm: fx.GraphModule, colls: list[PlanCollective], strategy: dict,
                    resharded_for: dict[str, set[str]] | None = None) -> dict[str, tuple[str, object]]:
    """Value name -> (mesh axis, dtype), for the values whose gradient the runtime reduces in buckets
    (codegen/grad_buckets.py): a parameter, or its lower-precision copy where that copy is its only
    reader (bf16-mixed's weights, whose reduction then moves the dtype it is summed in), as
    ``passes.precision.bucketed_value`` says, when every use of it reads it through a backward
    all-reduce alone, on one axis. ``resharded_for``: value name -> the consumers that read it through
    a resharding (a resharding several consumers share is listed once in ``colls``, at its first);
    without it, those of ``colls``."""
    by_value: dict[str, list[PlanCollective]] = {}
    for c in colls:
        by_value.setdefault(c.value, []).append(c)
    out = {}
    for n in gm.graph.nodes:
        if n.op != "placeholder" or n not in strategy:
            continue
        v = bucketed_value(n, strategy[n])
        if v is None or v.name not in by_value:
            continue
        own = by_value[v.name]
        axes = {c.axis for c in own}
        readers = resharded_for.get(v.name, set()) if resharded_for is not None else {c.node for c in own}
        if (len(axes) == 1 and all(c.kind == "all_reduce" and c.phase == "backward" and not c.recompute
                                   and c.node != c.value for c in own)
                and readers >= {u.name for u in v.users}):
            out[v.name] = (axes.pop(), reduce_dtype_of(v))
    return out


def hides_behind_weight_grads(reads: list[tuple[fx.Node, int]], weights_ready) -> bool:
    """Whether the backward all-reduce of a value's gradient (Megatron's "f" before column-parallel
    layers) runs while its readers' weight gradients are computed (runtime/collectives.py
    ``column_linears``, placed by codegen/overlap.py): every read is a linear layer's input (its first
    argument), and ``weights_ready(reader)`` says the reader's weight and bias are computed before the
    first reader, where codegen makes one call of them all. ``reads``: (reader, argument position) of
    every read of the value through that all-reduce."""
    return bool(reads) and all(r.op == "call_function" and r.target is torch.ops.aten.linear.default and k == 0
                               and not r.kwargs and weights_ready(r) for r, k in reads)


def exposure(gm: fx.GraphModule, strategy: dict, colls: list[PlanCollective], cm, axis_names, recomputed: set[str],
             bucket_bytes: int = GRAD_BUCKET_BYTES, resharded_for: dict[str, set[str]] | None = None,
             regions: dict[str, str] | None = None,
             behind_weight_grads: dict[tuple[str, str], list[str]] | None = None) -> Exposure:
    """Replay the step on a compute and a communication stream (module docstring), with gradient
    buckets of ``bucket_bytes``. ``strategy``: node -> Strategy; ``colls``: the plan's collective
    entries; ``cm``: the CostModel; ``recomputed``: names of the nodes inside recomputed layers or
    attention cores; ``resharded_for``: as ``bucketed_params``; ``regions``: node name -> the recomputed
    or offloaded region (layer instance or attention core) that codegen makes one call of, for the nodes
    inside one; ``behind_weight_grads``: (value, first consumer) -> its readers, for each backward
    all-reduce that ``hides_behind_weight_grads``."""
    return Replay(gm, strategy, colls, cm, axis_names, recomputed, resharded_for, regions,
                  behind_weight_grads).at(bucket_bytes)


class Replay:
    """``exposure``'s replay, made once for a plan and run at any gradient bucket size (``at``): all
    but the packing of the buckets and backward's streams is the same at every size."""

    def __init__(self, gm: fx.GraphModule, strategy: dict, colls: list[PlanCollective], cm, axis_names,
                 recomputed: set[str], resharded_for: dict[str, set[str]] | None = None,
                 regions: dict[str, str] | None = None,
                 behind_weight_grads: dict[tuple[str, str], list[str]] | None = None):
        order = [n for n in gm.graph.nodes if n.op in ("placeholder", "call_function", "output")]
        position = {n.name: i for i, n in enumerate(order)}
        ops = [n for n in order if n.op == "call_function" and n in strategy]
        forward = dict.fromkeys(position, 0.0) | {n.name: cm.forward_compute_seconds(n, strategy[n]) for n in ops}
        backward = dict.fromkeys(position, 0.0) | {n.name: cm.compute_seconds(n, strategy[n]) - forward[n.name]
                                                   for n in ops}
        for name in recomputed:          # the forward again, at the layer's backward
            backward[name] += forward[name]
        seconds = [c.seconds for c in colls]
        exposed = list(seconds)
        buckets = bucketed_params(gm, colls, strategy, resharded_for)

        regions = regions or {}
        # Forward: the split collectives, in program order (their first consumer's, then their steps').
        split = sorted((i for i, c in enumerate(colls)
                        if c.phase == "forward" and c.node != c.value and c.node in position and c.value in position),
                       key=lambda i: (position[colls[i].node], i))
        at_consumer: dict[str, list[int]] = {}
        for i in split:
            at_consumer.setdefault(colls[i].node, []).append(i)
        blocking: dict[str, list[int]] = {}
        for i, c in enumerate(colls):
            if c.phase == "forward" and i not in set(split):
                blocking.setdefault(c.node, []).append(i)
        communicating = {regions[colls[i].node] for i in split if colls[i].node in regions}
        region_end = {regions[n.name]: n.name for n in order if n.name in regions}      # its last node
        clock, last_wait, done = 0.0, 0.0, {}
        region_start: dict[str, float] = {}
        barrier = 0.0            # when the last region with split collectives ended
        for n in order:
            region = regions.get(n.name)
            if region is not None:
                region_start.setdefault(region, clock)
            for i in at_consumer.get(n.name, ()):
                issue = max(done[colls[i].value], last_wait, barrier if region is None else region_start[region])
                before = clock
                clock = max(clock, issue + seconds[i])
                exposed[i] = clock - before
                last_wait = clock
            clock += sum(seconds[i] for i in blocking.get(n.name, ())) + forward[n.name]
            done[n.name] = clock
            if region in communicating and region_end[region] == n.name:
                barrier = clock
        # A recomputed region's run again: each collective as exposed as its forward twin.
        twins: dict[PlanCollective, list[int]] = {}
        for i, c in enumerate(colls):
            if c.phase == "forward":
                twins.setdefault(c, []).append(i)
        for i, c in enumerate(colls):
            if c.recompute and (twin := twins.get(replace(c, phase="forward", recompute=False))):
                exposed[i] = exposed[twin.pop(0)]

        # Backward, in reverse: blocking collectives at their node; a sharded parameter's gradient
        # reduce-scatter issued at its node and waited at the next one's issue or at the end; bucketed
        # gradients launched when their bucket is ready. One communication stream runs them in issue order.
        nodes = {n.name: n for n in order}
        split_reads = {(colls[i].value, colls[i].node) for i in split}

        def first_reader_of(node):
            return min(node.users, key=lambda u: position.get(u.name, len(order))).name

        deferred: dict[int, str] = {}         # collective -> the node whose backward issues it
        waits_in_flight: set[str] = set()     # nodes whose backward waits the deferred one in flight
        for i, c in enumerate(colls):
            if (c.phase != "backward" or c.recompute or c.kind not in ("reduce_scatter", "all_gather")
                    or c.value not in nodes):
                continue
            st = strategy.get(nodes[c.value])
            if st is None or not is_param(nodes[c.value]) or st.offload:
                continue
            if c.kind == "all_gather":
                # A replicated parameter read in chunks (runtime/collectives.py: param_chunk), at its reader's
                # backward, recomputed or not.
                if st.zero is None:
                    deferred[i] = c.node
                continue
            if (c.value, c.node) in split_reads and st.zero is None:
                if c.node in regions:       # ZeRO-3 in a region: waited at once, after the one in flight
                    waits_in_flight.add(c.node)
                else:
                    deferred[i] = c.node                               # ZeRO-3, at its reader's backward
            elif c.node == c.value and st.grad_scatter_axis is not None and nodes[c.value].users:
                deferred[i] = first_reader_of(nodes[c.value])          # ZeRO-2, once accumulated
        first_reader = {p: first_reader_of(n) for n in order if (p := n.name) in buckets}
        members: dict[str, list[int]] = {}
        for i, c in enumerate(colls):
            if c.value in buckets:
                members.setdefault(c.value, []).append(i)
        at_node: dict[str, list[int]] = {}
        deferred_at: dict[str, list[int]] = {}
        # The weight gradients' compute an input gradient's all-reduce runs behind, at its first reader,
        # whose backward autograd runs last of its readers'.
        behind = {i: sum(forward[r] for r in readers) for i, c in enumerate(colls)
                  if c.phase == "backward" and not c.recompute and c.node not in regions
                  and (readers := (behind_weight_grads or {}).get((c.value, c.node)))}
        for i, c in enumerate(colls):
            if i in deferred:
                deferred_at.setdefault(deferred[i], []).append(i)
            elif c.phase == "backward" and c.value not in buckets and i not in behind:
                at_node.setdefault(c.node, []).append(i)
        behind_at: dict[str, list[int]] = {}
        for i in behind:
            behind_at.setdefault(colls[i].node, []).append(i)
        ready_at: dict[str, list[str]] = {}
        for p, reader in first_reader.items():
            ready_at.setdefault(reader, []).append(p)
        self.grad_bytes = {p: float(max(colls[i].bytes for i in members[p])) for p in buckets}
        # The order gradients become ready in, which the runtime packs them in.
        self.ready_order = [p for n in reversed(order) for p in ready_at.get(n.name, ())]
        self.cm, self.axis_names, self.order, self.seconds, self.exposed = cm, axis_names, order, seconds, exposed
        self.buckets, self.members, self.backward, self.at_node = buckets, members, backward, at_node
        self.behind, self.behind_at, self.deferred_at, self.ready_at = behind, behind_at, deferred_at, ready_at
        self.waits_in_flight = waits_in_flight
        self.forward_end = clock

    def packing(self, bucket_bytes: int) -> list[list[str]]:
        """The buckets of ``bucket_bytes`` the runtime packs the bucketed gradients in, in launch order."""
        return pack_buckets(self.ready_order, self.grad_bytes.__getitem__, bucket_bytes,
                            key=self.buckets.__getitem__)

    def at(self, bucket_bytes: int) -> Exposure:
        """The replay with gradient buckets of ``bucket_bytes``."""
        return self.packed(self.packing(bucket_bytes))

    def packed(self, packed: list[list[str]]) -> Exposure:
        """The replay with the gradients in the buckets ``packed`` (``packing``'s)."""
        cm, axis_names, buckets, members, grad_bytes = self.cm, self.axis_names, self.buckets, self.members, \
            self.grad_bytes
        backward, at_node, behind, behind_at = self.backward, self.at_node, self.behind, self.behind_at
        deferred_at, ready_at = self.deferred_at, self.ready_at
        seconds, exposed = list(self.seconds), list(self.exposed)
        clock = self.forward_end
        last_of = {b[-1]: b for b in packed}
        stream_free = 0.0
        runs: list[tuple[list[str], float, float]] = []     # (parameters, start, finish) per bucket
        in_flight = None                                    # (collective, finish) of the deferred one

        def wait_in_flight():
            nonlocal clock, in_flight
            if in_flight is not None:
                i, finish = in_flight
                exposed[i] = min(seconds[i], max(0.0, finish - clock))     # its own part of the wait
                clock = max(clock, finish)
                in_flight = None

        for n in reversed(self.order):
            clock += backward[n.name]
            if n.name in self.waits_in_flight:
                wait_in_flight()
            clock += sum(exposed[i] for i in at_node.get(n.name, ()))
            for i in behind_at.get(n.name, ()):
                stream_free = max(clock - behind[i], stream_free) + seconds[i]
                exposed[i] = max(0.0, stream_free - clock)
                clock += exposed[i]
            for i in deferred_at.get(n.name, ()):
                wait_in_flight()
                stream_free = max(clock, stream_free) + seconds[i]
                in_flight = i, stream_free
            for p in ready_at.get(n.name, ()):
                if p in last_of:
                    bucket = last_of[p]
                    start = max(clock, stream_free)
                    stream_free = start + cm.collective_seconds("all_reduce", sum(grad_bytes[q] for q in bucket),
                                                                axis_names.index(buckets[bucket[0]][0]))
                    runs.append((bucket, start, stream_free))
        wait_in_flight()
        for params, start, finish in runs:
            total = sum(grad_bytes[p] for p in params)
            hidden = max(0.0, min(finish, clock) - start)
            for p in params:
                share = grad_bytes[p] / total / len(members[p])
                for i in members[p]:
                    seconds[i] = share * (finish - start)
                    exposed[i] = share * (finish - start - hidden)
        return Exposure(seconds, exposed, tuple(sum(grad_bytes[p] for p in b) for b in packed))


def cheapest_bucket(replay: Replay, cm, sizes=BUCKET_CANDIDATES_MB) -> tuple[float, Exposure, dict[str, float]]:
    """(the bucket size in MiB among ``sizes`` whose replay costs the step least, that replay, the
    seconds each size costs the step in communication less what hiding saves). A tie keeps the
    earlier (larger) size, and sizes that pack the gradients alike are replayed once."""
    priced: dict[str, float] = {}
    best = None
    by_packing: dict = {}
    for mb in sizes:
        packed = replay.packing(bucket_bytes(mb))
        packing = tuple(map(tuple, packed))
        if packing not in by_packing:
            ex = replay.packed(packed)
            by_packing[packing] = sum(ex.seconds) - cm.overlap_saving(ex.hidden), ex
        cost, ex = by_packing[packing]
        priced[f"{mb:g}"] = cost
        if best is None or cost < best[0]:
            best = cost, mb, ex
    return best[1], best[2], priced


class HidingWindows:
    """The compute the generated program can hide a resharding behind, as constants the solver's
    objective can carry (passes/ilp_build.py's hiding credits; docs/cost-model.md, "What the solver
    minimizes"). Each window is what the runtime's schedule guarantees whatever the other decisions,
    so a credit never counts hiding that some layout would not get; an op's compute is the least over
    its strategies.

    - ``forward(value, first_reader)``: a forward collective is issued once its input is computed and
      the previous split collective has been waited, and is waited at its first reader. The previous
      one may be waited at any op that reads a value from another decision (``boundaries``: such
      readers, each with the first of its input positions that does), so the window is the forward
      compute from the later of the value's producer and the last such op before the reader, up to the
      reader. A reader's collectives are issued in input order, each after the wait of the one before,
      just before the reader: only its first input that may be resharded has a window.
    - ``backward(param, nbytes)``: a bucketed gradient all-reduce starts when the last gradient of its
      bucket is accumulated (at the backward of that parameter's first reader; buckets packed as the
      runtime packs them, in the order gradients become ready, every parameter at its whole size), and
      after the buckets before it, on one stream. It hides behind the backward compute of the ops before
      that reader, less the all-reduces of the earlier buckets (at their whole size, on the slowest
      axis); the bucket's members share that window by bytes.
    - ``behind_weight_grads(value, reads)``: Megatron's "f" before column-parallel linears
      (``hides_behind_weight_grads``: every read a linear layer's input, its weight and bias computed
      before the first reader) is issued at the first reader's backward and waited after the readers'
      weight gradients, whose compute is their forward's: the window is the least forward compute of
      one reader (whichever of them read through the all-reduce, one does), less the all-reduces of the
      buckets launched before the readers' backward (and during it, on a mesh of several axes, where
      the readers' weights may be bucketed along another axis), which may hold the stream.

    The replay (``exposure``) prices the plan the solver picks exactly; what the windows leave out
    makes a credit smaller than the replay's hiding, never larger, but where recompute or offload
    splits the program into regions (the ILP decides those with the layouts, so the windows cannot
    know them): a window that reaches back past the start of its reader's region, or across a region
    with collectives of its own, or an "f" whose readers are in one, counts compute the runtime does not
    hide behind; and an "f" whose reader other than the first reads its weight through a resharding,
    which codegen then emits after the first reader, waits where it is issued. A recomputed region's
    run again hides its collectives as its forward does, which no credit counts.
    """

    def __init__(self, gm: fx.GraphModule, strategies, cm, boundaries, bucket_bytes: int = GRAD_BUCKET_BYTES):
        order = list(gm.graph.nodes)
        self.position = {n: i for i, n in enumerate(order)}
        self._forward_before, self._backward_before = [0.0], [0.0]     # compute of the ops before position i
        # Per node, or per position in a repeated layer: its copies share strategies and costs (unless
        # fused kernels are priced, whose figures depend on the neighbours, which differ at the stack's ends).
        least = {}
        self._least_forward: dict = {}
        for n in order:
            fwd = bwd = 0.0
            if n.op == "call_function" and n in strategies:
                tag = meta_of(n).layer
                key = n if tag is None or cm.fused else (tag.cls, tag.index)
                if key not in least:
                    sset = strategies[n]
                    least[key] = (min(cm.forward_compute_seconds(n, s) for s in sset),
                                  min(cm.compute_seconds(n, s) - cm.forward_compute_seconds(n, s) for s in sset))
                fwd, bwd = least[key]
                self._least_forward[n] = fwd
            self._forward_before.append(self._forward_before[-1] + fwd)
            self._backward_before.append(self._backward_before[-1] + bwd)
        self._mesh_shape = tuple(cm.mesh_shape)
        self._boundaries = sorted(self.position[n] for n in boundaries)
        self._first_input = boundaries     # reader -> its first input position that may be resharded
        params = [n for n in order if is_param(n) and n.users and requires_grad(n)]
        first_reader = {p: min(self.position[u] for u in p.users) for p in params}
        # In the order gradients become ready; one stream for every axis (no layout is assumed).
        buckets = pack_buckets(sorted(params, key=lambda p: -first_reader[p]), _nbytes, bucket_bytes)
        self._bucket_window: dict = {}        # parameter -> (its bucket's window, the bucket's bytes)
        earlier = 0.0                         # the all-reduces of the buckets launched before
        self._launches: list[tuple[int, float]] = []    # (position whose backward launches it, all-reduces so far)
        for b in buckets:
            total = sum(_nbytes(p) for p in b)
            window = max(0.0, self._backward_before[first_reader[b[-1]]] - earlier)   # ready when its latest is
            self._bucket_window.update({p: (window, total) for p in b})
            earlier += max((cm.collective_seconds("all_reduce", total, axis) for axis in range(len(cm.mesh_shape))),
                           default=0.0)
            self._launches.append((first_reader[b[-1]], earlier))

    def forward(self, value: fx.Node, first_reader: fx.Node, index: int) -> float:
        """The window of ``value`` read by ``first_reader`` as its input ``index``."""
        if index != self._first_input[first_reader]:
            return 0.0
        end = self.position[first_reader]
        k = bisect.bisect_left(self._boundaries, end)
        start = max(self.position[value] + 1, self._boundaries[k - 1] if k else 0)
        return max(0.0, self._forward_before[end] - self._forward_before[start])

    def behind_weight_grads(self, value: fx.Node, reads: list[tuple[fx.Node, int]]) -> float:
        """The window of the all-reduce of ``value``'s gradient where ``reads`` ((reader, input index),
        every read of it from another decision) are all column-parallel linears' (0 otherwise)."""
        if is_param(value) or not reads:
            return 0.0
        first = min(self.position[r] for r, _ in reads)
        if not hides_behind_weight_grads(reads, lambda r: all(self.position[a] < first for a in r.args[1:]
                                                               if isinstance(a, fx.Node))):
            return 0.0
        # Buckets are launched in backward order, the later positions first: those launched before the
        # readers' backward may still run when it issues the all-reduce, and so may the readers' own
        # weights' on a mesh of several axes. On one axis a reader that leaves its input's gradient
        # partial splits its weight along it, whose gradient is then not all-reduced.
        since = max(self.position[r] for r, _ in reads) if len(self._mesh_shape) == 1 else first
        busy = max((done for at, done in self._launches if at > since), default=0.0)
        return max(0.0, min(self._least_forward.get(r, 0.0) for r, _ in reads) - busy)

    def backward(self, param: fx.Node) -> float:
        """The part of its bucket's window that ``param``'s gradient reduction may hide behind."""
        window, total = self._bucket_window.get(param, (0.0, 1.0))
        return window * _nbytes(param) / total if total else 0.0


def _nbytes(node: fx.Node) -> int:
    val = node.meta["val"]
    return val.numel() * val.element_size()
