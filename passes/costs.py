"""Seconds and bytes for every strategy and every resharding, from the ClusterSpec.

- Compute: a roofline, max(FLOPs / peak, bytes / memory bandwidth), on the local shapes, and the
  device's per-op overhead (``DeviceSpec.op_overhead``: dispatch, autograd and launch) for every op that
  launches a kernel: added to the roofline on CPU, its floor on GPUs (the host launches ahead); backward costs twice the forward (two matmuls per forward matmul; memory-bound ops
  read and write about twice; about two kernels per op). A recomputed op pays its forward, overhead
  included, again.
- Communication: alpha-beta per mesh axis (``passes.resharding.collective_seconds``), with the axis's
  link from ``ClusterSpec.axis_link`` (intra-node or inter-node), plus the device's peer wait per
  collective (``DeviceSpec.peer_wait``: the ranks' skew, which each collective synchronizes).
- Memory per device: parameters, gradients and optimizer states under each parameter's layout, and the
  activations each node keeps for backward under its layouts.
- Communication overlaps compute where the generated program schedules it so (passes/exposure.py); an
  op that overlaps its own transfers with its own compute (ring attention) costs per step
  max(compute, transfer) (``op_collective_seconds``). Hidden communication still costs the device's
  contention share of it (``overlap_saving``).
"""
from __future__ import annotations

import functools
import math
import operator
from dataclasses import dataclass

import torch
import torch.fx as fx

from autopar.cluster import ClusterSpec
from autopar.layout import local_fraction, local_shape
from autopar.plan import DDP_BUCKET_MB, AlternativeCollective, PlanCollective, bucket_bytes
from autopar.passes.meta import is_param, meta_of, set_meta
from autopar.passes.precision import gradient_carrier, reads_through_copy, reduce_itemsize, reduced_in_buckets
from autopar.passes.resharding import Step, collective_seconds, transition
from autopar.passes.rules import context_for, rule_for, tensor_inputs
from autopar.passes.runner import requires
from autopar.passes.strategies import Strategy, Value, requires_grad, signature, value_info

aten = torch.ops.aten

# Ops that only relabel memory: no kernel runs.
VIEW_OPS = {aten.view.default, aten._unsafe_view.default, aten.transpose.int, aten.t.default,
            aten.permute.default, aten.unsqueeze.default, aten.squeeze.dim, aten.squeeze.dims,
            aten.squeeze.default, aten.expand.default, aten.slice.Tensor, aten.select.int,
            aten.split.Tensor, aten.split_with_sizes.default, aten.chunk.default, aten.unbind.int,
            aten.reshape.default, operator.getitem, aten.alias.default}


@dataclass(frozen=True)
class Collective:
    """One collective a step runs on one mesh axis, with its price: what ``plan.collectives`` (``record``)
    and the alternatives of ``explain`` (``alternative_entry``) list and what the ILP's edge and op costs
    sum."""

    kind: str          # all_reduce, all_gather, reduce_scatter or all_to_all
    axis: int
    phase: str         # forward or backward
    nbytes: float      # per device (passes.resharding.Step.collectives)
    seconds: float

    def record(self, axis_names, node: str, value: str, step: str) -> PlanCollective:
        """The plan's entry: ``node`` (its first consumer) runs ``step`` on ``value``."""
        return PlanCollective(self.kind, axis_names[self.axis], self.phase, int(self.nbytes), self.seconds, node,
                              value, step)

    def alternative_entry(self, axis_names, neighbor: str, value: str) -> AlternativeCollective:
        """An alternative's entry in ``plan.alternatives``: what it would run with ``neighbor``."""
        return AlternativeCollective(self.kind, neighbor, value, axis_names[self.axis], self.phase, int(self.nbytes),
                                     self.seconds)


@dataclass(frozen=True)
class OptimizerSpec:
    """Optimizer state bytes per parameter element (Adam: two states)."""

    bytes_per_param: float = 8.0
    name: str = "adam"


class CostModel:
    """Costs under one mesh shape.

    ``fused=True`` prices the program the Triton backend runs (docs/kernels.md): a pointwise value
    whose only reader is also pointwise stays in registers inside one fused kernel, so neither the
    producer's write nor the reader's load of it touches memory; both still pay their FLOPs. Every
    other op (matmuls, reductions, attention) and every other edge costs the same as without fusion.
    """

    def __init__(self, cluster: ClusterSpec, mesh_shape, optimizer: OptimizerSpec = OptimizerSpec(),
                 fused: bool = False):
        self.cluster = cluster
        self.mesh_shape = tuple(mesh_shape)
        self.optimizer = optimizer
        self.fused = fused
        self.links = [cluster.axis_link(self.mesh_shape, a) for a in range(len(self.mesh_shape))]
        self._compute_cache: dict = {}
        self._node_compute_cache: dict = {}   # (node, strategy) -> compute_seconds
        self._activation_cache: dict = {}
        self._transition_cache: dict = {}     # a value's (layouts, shape, dtype, grad) -> (forward, backward) seconds
        self._param_counts: dict = {}         # graph -> its parameters (a bucket's latency and wait shared)

    # --- compute -------------------------------------------------------------------------------
    def compute_seconds(self, node: fx.Node, s: Strategy) -> float:
        """Forward plus backward seconds of ``node`` under ``s``."""
        seconds = self._node_compute_cache.get((node, s))
        if seconds is None:
            if node.op != "call_function" or node.target in VIEW_OPS:
                seconds = 0.0
            else:
                # Copies of a layer share their signature, and so their figures.
                in_registers = _in_registers(node) if self.fused else None
                key = (signature(node), s, requires_grad(node), in_registers)
                if key not in self._compute_cache:
                    self._compute_cache[key] = self._compute_seconds(node, s, in_registers)
                seconds = self._compute_cache[key]
            self._node_compute_cache[(node, s)] = seconds
        return seconds

    def forward_compute_seconds(self, node: fx.Node, s: Strategy) -> float:
        """The forward part of ``compute_seconds``."""
        return self.compute_seconds(node, s) / (3.0 if requires_grad(node) else 1.0)

    def forward_seconds(self, node: fx.Node, s: Strategy) -> float:
        """The forward part of ``node``'s compute and own collectives: what recomputing it costs."""
        return self.forward_compute_seconds(node, s) + sum(
            self.op_collective_seconds(oc) for oc in self.op_collectives(node, s) if oc.phase == "forward")

    def work_split(self, s: Strategy) -> int:
        """Into how many pieces the op's work is divided: the product of the axes it splits along."""
        return math.prod(n for n, split in zip(self.mesh_shape, s.splits_work) if split)

    def _compute_seconds(self, node: fx.Node, s: Strategy, in_registers=None) -> float:
        ctx = context_for(node)
        rule = rule_for(node)
        flops = (rule.flops(ctx) if rule.flops else 0.0) / self.work_split(s)
        inputs_kept, output_kept = in_registers or ((False,) * len(ctx.ins), False)
        nbytes = sum(i.nbytes * local_fraction(lay, self.mesh_shape)
                     for i, lay, kept in zip(ctx.ins, s.inputs, inputs_kept) if not kept)
        if not output_kept:
            nbytes += sum(o.nbytes * local_fraction(lay, self.mesh_shape) for o, lay in zip(ctx.outs, s.outputs))
        dtype = ctx.outs[0].dtype if ctx.outs else torch.float32
        dev = self.cluster.device
        # A pointwise op whose output stays in registers runs inside its reader's fused kernel.
        overhead = 0.0 if output_kept else dev.op_overhead
        roofline = max(flops / dev.peak_flops(dtype), nbytes / dev.memory_bandwidth)
        # A CPU process dispatches an op and then runs it; a GPU's host launches ahead of the kernels
        # queued before, so there the overhead only shows where the kernel is shorter than it.
        fwd = roofline + overhead if self.cluster.device_type == "cpu" else max(roofline, overhead)
        return fwd * (3.0 if requires_grad(node) else 1.0)

    # --- communication -------------------------------------------------------------------------
    def op_collectives(self, node: fx.Node, s: Strategy) -> list:
        """The collectives ``node``'s own sharded computation runs under ``s`` (OpCollective), beyond
        any resharding of its inputs: e.g. the reductions of a vocab-parallel loss."""
        if node.op != "call_function":
            return []
        rule = rule_for(node)
        if rule.collectives is None:
            return []
        return rule.collectives(context_for(node), s.inputs, self.mesh_shape)

    def collective_seconds(self, kind: str, nbytes: float, axis: int) -> float:
        """The one price of a collective: alpha-beta on the link of mesh axis ``axis``, and the wait for
        the peers to reach it (``DeviceSpec.peer_wait``)."""
        bw, lat = self.links[axis]
        seconds = collective_seconds(kind, nbytes, self.mesh_shape[axis], bw, lat)
        return seconds + self.cluster.device.peer_wait if seconds else 0.0

    def overlap_saving(self, hidden: float) -> float:
        """The step time that ``hidden`` seconds of communication overlapped with compute save: all of
        them but the device's contention share (``DeviceSpec.comm_contention``), which the compute
        still pays. Every hiding the model credits (the replay, the solver's credits, an op's own
        overlap) goes through here."""
        return hidden * (1.0 - self.cluster.device.comm_contention)

    def op_collective_seconds(self, oc) -> float:
        """Seconds of an op's own collective that its compute does not save: a transfer of ``steps``
        steps, each overlapped with ``overlap_flops`` of compute, costs per step max(0, transfer -
        compute) beyond the compute already counted (ring attention's max(compute, transfer)), plus the
        contention share of the part the compute hides."""
        step = self.collective_seconds(oc.kind, oc.nbytes / oc.steps, oc.axis)
        compute = oc.overlap_flops / self.cluster.device.peak_flops(oc.dtype)
        return oc.steps * (step - self.overlap_saving(min(step, compute)))

    def workspace_bytes(self, node: fx.Node, s: Strategy) -> float:
        """Bytes ``node``'s own sharded computation holds while it runs, beyond its inputs and output
        (the rule's ``workspace``): part of the transient at that point of the step."""
        if node.op != "call_function":
            return 0.0
        rule = rule_for(node)
        return rule.workspace(context_for(node), s.inputs, self.mesh_shape) if rule.workspace else 0.0

    def backward_workspace_bytes(self, node: fx.Node, s: Strategy) -> float | None:
        """Bytes ``node``'s own sharded backward holds beyond the gradients it returns (the rule's
        ``backward_workspace``), or None where the ATen op's measured figure holds."""
        if node.op != "call_function":
            return None
        rule = rule_for(node)
        return rule.backward_workspace(context_for(node), s.inputs, self.mesh_shape) if rule.backward_workspace else None

    def op_comm_seconds(self, node: fx.Node, s: Strategy) -> float:
        return sum(self.op_collective_seconds(oc) for oc in self.op_collectives(node, s))

    def priced_op_collectives(self, node: fx.Node, s: Strategy) -> list[Collective]:
        return [Collective(oc.kind, oc.axis, oc.phase, oc.nbytes, self.op_collective_seconds(oc))
                for oc in self.op_collectives(node, s)]

    def priced_steps(self, steps: list[Step], itemsize: int, needs_grad: bool,
                     reduce_itemsize: int | None = None) -> list[tuple[Step, Collective]]:
        """Every collective of ``steps``, in order, with the step that runs it (``reduce_itemsize``: as
        ``Step.collectives``)."""
        return [(st, Collective(kind, st.axis, phase, nbytes, self.collective_seconds(kind, nbytes, st.axis)))
                for st in steps for kind, phase, nbytes in st.collectives(itemsize, needs_grad, reduce_itemsize)]

    def resharding(self, value: Value, src: Strategy, dst_strategy: Strategy | None, position: int, dst_layout=None):
        """Steps to bring ``value`` from its layout under its producer's strategy ``src`` to what the
        consumer's strategy reads."""
        dst = dst_layout if dst_layout is not None else dst_strategy.inputs[position]
        return self.transition(value, src.outputs[value.index], dst, src.read_grad_partial(value, dst, dst_strategy))

    def transition(self, value: Value, src_layout, dst_layout, partial_axes: frozenset):
        """Steps to bring ``value`` from ``src_layout`` to ``dst_layout``, reducing its gradient over
        ``partial_axes`` on the way back; None when no resharding can."""
        return _transition_cached(tuple(src_layout), tuple(dst_layout), value_info(value).shape, self.mesh_shape,
                                  partial_axes)

    def transition_seconds(self, value: Value, src_layout, dst_layout, partial_axes: frozenset) -> float:
        """Seconds to bring ``value`` from ``src_layout`` to ``dst_layout``, reducing its gradient over
        ``partial_axes`` on the way back; INFEASIBLE when no resharding can."""
        phases = self.transition_phase_seconds(value, src_layout, dst_layout, partial_axes)
        return INFEASIBLE if phases is None else phases[0] + phases[1]

    def transition_phase_seconds(self, value: Value, src_layout, dst_layout,
                                 partial_axes: frozenset) -> tuple[float, float] | None:
        """``transition_seconds`` as (forward, backward) seconds; None when no resharding can."""
        info = value_info(value)
        key = (tuple(src_layout), tuple(dst_layout), info.shape, info.dtype, requires_grad(value.node), partial_axes,
               reduce_itemsize(value.node))
        if key not in self._transition_cache:
            steps = _transition_cached(*key[:3], self.mesh_shape, partial_axes)
            self._transition_cache[key] = None if steps is None else self.steps_phase_seconds(
                steps, info.dtype.itemsize, key[4], reduce_itemsize=key[6])
        return self._transition_cache[key]

    def steps_phase_seconds(self, steps: list[Step], itemsize: int, needs_grad: bool,
                            share=lambda step: 1.0, reduce_itemsize: int | None = None) -> tuple[float, float]:
        """(forward, backward) seconds of a resharding's steps, each step's collectives times ``share(step)``
        (``reduce_itemsize``: as ``Step.collectives``)."""
        phases = [0.0, 0.0]
        for st in steps:
            for kind, phase, nbytes in st.collectives(itemsize, needs_grad, reduce_itemsize):
                phases[phase == "backward"] += self.collective_seconds(kind, nbytes, st.axis) * share(st)
        return phases[0], phases[1]

    # --- parameters and memory -----------------------------------------------------------------
    def param_bytes(self, node: fx.Node, layout, zero=None, offload: bool = False,
                    whole_dtype: torch.dtype | None = None) -> tuple[float, float, float]:
        """(parameter, gradient, optimizer state) bytes per device that a parameter under ``layout``
        keeps through the step. ``zero`` (a ZeroState) shards the optimizer state along its axis
        (ZeRO-1), and the gradient kept for the optimizer too (ZeRO-2); ZeRO's formulas
        (REFERENCES.md) follow: ``p + g + o/N`` and ``p + (g + o)/N``. ``whole_dtype``: a ZeRO-1
        parameter whose float32 master is sharded too (``passes.precision.sharded_master_copy``) keeps
        whole only its copy in that dtype, and its master and gradient at the state's block:
        ``w + p/N``, ``g/N`` (bf16-mixed Adam: 2 + 4/N + 8/N bytes, ZeRO's 2 + 12/N with the master
        among the states, and a float32 gradient of 4/N). ``offload`` keeps the
        optimizer state, the gradient the optimizer reads and the copy of the parameter it steps in
        host memory (``host_bytes``): on a GPU only the parameter the program reads stays, ``p``; where
        host and device are one memory (CPU processes) the host copies count too, ``2p + g + o``."""
        val = node.meta["val"]
        numel = val.numel() * local_fraction(layout, self.mesh_shape)
        p = numel * val.dtype.itemsize
        g, o = p, numel * self.optimizer.bytes_per_param
        if offload:
            return (2 * p, g, o) if self.cluster.host_is_device else (p, 0.0, 0.0)
        if zero is not None:
            n = self.mesh_shape[zero.axis]
            o /= n
            if whole_dtype is not None:
                return numel * whole_dtype.itemsize + p / n, g / n, o
            if zero.scatters_grad:
                g /= n
        return p, g, o

    def host_bytes(self, node: fx.Node, layout) -> float:
        """Host memory an offloaded parameter takes per device: the copy the optimizer steps (the fp32
        master under bf16-mixed), its gradient and its optimizer state."""
        p, g, o = self.param_bytes(node, layout)
        return p + g + o

    def optimizer_seconds(self, node: fx.Node, layout, zero=None, offload: bool = False) -> float:
        """Seconds of the optimizer step on what this device steps (its shard under ZeRO-1/2). An
        offloaded parameter's step runs on the host: its gradient goes down and the updated parameter
        comes back over the host link, and the host's Adam, bound by the host's memory bandwidth (a
        node's devices share it), reads and writes what the device's would."""
        p, g, o = self.param_bytes(node, layout, zero)
        if zero is not None:
            p, g = p / self.mesh_shape[zero.axis], g if zero.scatters_grad else g / self.mesh_shape[zero.axis]
        # Adam reads the parameter, gradient and states and writes the parameter and states.
        touched = 2 * p + g + 2 * o
        if offload:
            c = self.cluster
            c.require_host_figures("offloading optimizer states")
            return (g + p) / c.host_link_bandwidth + touched / (c.host_memory_bandwidth / c.devices_per_node)
        return touched / self.cluster.device.memory_bandwidth

    def zero_collectives(self, node: fx.Node, layout, zero, whole_dtype: torch.dtype | None = None) -> list[Collective]:
        """What a ZeRO-1/2 parameter's state costs in communication beyond plain data parallelism's:
        ZeRO-2 reduce-scatters the gradient (in place of the all-reduce along its axis, which its
        readers then leave out) and both all-gather the updated shards after the optimizer step, in
        ``whole_dtype`` where a sharded float32 master updates a whole copy in it (``param_bytes``),
        whose gradient, the copy's, ZeRO-2 reduce-scatters in that dtype too."""
        if zero is None:
            return []
        p = self.param_bytes(node, layout)[0]
        gathered = p if whole_dtype is None else p / node.meta["val"].dtype.itemsize * whole_dtype.itemsize
        out = []
        if zero.scatters_grad:       # a sharded master's: its copy's gradient, in the dtype it is summed in
            wide = reduce_itemsize(gradient_carrier(node)) if whole_dtype is not None else None
            scattered = gathered if wide is None else p / node.meta["val"].dtype.itemsize * wide
            out.append(Collective("reduce_scatter", zero.axis, "backward", scattered,
                                  self.collective_seconds("reduce_scatter", scattered, zero.axis)))
        out.append(Collective("all_gather", zero.axis, "optimizer", gathered,
                              self.collective_seconds("all_gather", gathered, zero.axis)))
        return out

    def zero_seconds(self, node: fx.Node, layout, zero, whole_dtype: torch.dtype | None = None) -> float:
        return sum(c.seconds for c in self.zero_collectives(node, layout, zero, whole_dtype))

    def param_transition_seconds(self, value: Value, src: Strategy, dst_layout, partial_axes: frozenset) -> float:
        """``transition_seconds`` from a parameter's strategy: a ZeRO-2 parameter's gradient is reduced
        along its axis by its own reduce-scatter, so a reader must leave it partial there (a reader
        that does not split its work along that axis cannot read it)."""
        phases = self.param_transition_phase_seconds(value, src, dst_layout, partial_axes)
        return INFEASIBLE if phases is None else phases[0] + phases[1]

    def param_transition_phase_seconds(self, value: Value, src: Strategy, dst_layout,
                                       partial_axes: frozenset) -> tuple[float, float] | None:
        """``param_transition_seconds`` as (forward, backward) seconds; None where it is INFEASIBLE. A
        gradient reduction the runtime runs in a bucket (``bucketed_gradient``) pays the link's latency
        and the peer wait once per bucket, not once per parameter (the replay prices the bucket): a
        parameter is charged its share of them, its bytes' share of a DDP-sized bucket, but at least
        one over the graph's parameters, so that the buckets of a model smaller than one bucket still
        pay them once in all. Charged whole to every parameter, they made a data-parallel layout look
        dearer than one of fewer, larger collectives."""
        axis = src.grad_scatter_axis
        # A weight read through its bfloat16 copy leaves the reduce-scatter to the copy's readers'
        # gradient (the copy's strategy carries the ZeroState: passes.strategies._try_follow).
        if axis is not None and not (dst_layout[axis].is_replicate and axis in partial_axes) \
                and not (is_param(value.node) and reads_through_copy(value.node)):
            return None
        src_layout, partial = src.outputs[value.index], src.readers_grad_partial(partial_axes)
        phases = self.transition_phase_seconds(value, src_layout, dst_layout, partial)
        if phases is None or not self.bucketed_gradient(src, phases[0]):
            return phases
        itemsize = value_info(value).dtype.itemsize
        runs = [(st.axis, kind, phase, nbytes) for st in self.transition(value, src_layout, dst_layout, partial)
                for kind, phase, nbytes in st.collectives(itemsize, True, reduce_itemsize(value.node))
                if nbytes > 0 and self.mesh_shape[st.axis] > 1]
        # Only a read whose gradient is all-reduced and nothing else joins a bucket
        # (passes.exposure.bucketed_params): a weight read in chunks all-gathers its gradient alone.
        if not runs or any(kind != "all_reduce" or phase != "backward" for _, kind, phase, _ in runs):
            return phases
        reduced = value_info(value).nbytes / itemsize * (reduce_itemsize(value.node) or itemsize)
        share = max(reduced / bucket_bytes(DDP_BUCKET_MB), 1.0 / self._param_count(value.node.graph))
        fixed = sum(self.cluster.device.peer_wait + self.links[axis][1] for axis, _, _, _ in runs)
        return phases[0], max(0.0, phases[1] - fixed * (1.0 - min(share, 1.0)))

    def _param_count(self, graph: fx.Graph) -> int:
        count = self._param_counts.get(graph)
        if count is None:
            count = self._param_counts[graph] = max(1, sum(is_param(n) for n in graph.nodes))
        return count

    @staticmethod
    def bucketed_gradient(src: Strategy, forward_seconds: float) -> bool:
        """Whether a parameter read under ``src`` through a resharding of ``forward_seconds`` has its
        gradient reduced in the runtime's buckets (passes.exposure.bucketed_params): read as it is, its
        gradient all-reduced alone, where ``passes.precision.reduced_in_buckets`` says so."""
        stage = None if src.zero is None else src.zero.stage
        return forward_seconds == 0.0 and reduced_in_buckets(stage, src.offload, through_copy=False)

    def activation_bytes(self, node: fx.Node, s: Strategy) -> float:
        """Bytes ``node`` keeps for backward under ``s``, per device.

        A saved input is counted at the layout the node reads it in (a resharded copy is what backward
        keeps), split evenly among the consumers that save the same value, which then share it.
        """
        saved = meta_of(node).saved
        if saved is None or node.op != "call_function" or not requires_grad(node):
            return 0.0
        sharers = tuple(meta_of(a).saved_by for a in node.all_input_nodes)
        key = (signature(node), s, saved, sharers)
        if key not in self._activation_cache:
            self._activation_cache[key] = self._activation_bytes(node, s, saved)
        return self._activation_cache[key]

    def _activation_bytes(self, node: fx.Node, s: Strategy, saved) -> float:
        ctx = context_for(node)
        rule = rule_for(node)
        if rule.saved_sharded is not None:
            # The op's own sharded form (ring attention) keeps what it keeps on every device.
            saved = rule.saved_sharded(ctx, s.inputs, self.mesh_shape) or saved
        total = 0.0
        if ctx.outs:
            total += saved.outputs * local_fraction(s.outputs[0], self.mesh_shape)
        # Buffers private to the op (norm statistics, a log-softmax, masks) scale with its share of the
        # work, not with its output: a loss summed over sharded tokens has a Partial scalar output.
        total += saved.internal / self.work_split(s)
        for k, keep in enumerate(saved.inputs):
            if keep and k < len(ctx.ins) and not is_param(ctx.input_nodes[k]):
                sharers = meta_of(ctx.input_nodes[k]).saved_by
                total += ctx.ins[k].nbytes * local_fraction(s.inputs[k], self.mesh_shape) / sharers
        # A copy of an input in another dtype (an additive mask) is the op's own, shared with no one.
        for k, itemsize in enumerate(saved.converted):
            if itemsize and k < len(ctx.ins):
                total += self.converted_bytes(ctx.ins[k].nbytes, ctx.ins[k].dtype.itemsize, itemsize, s.inputs[k])
        return total

    def converted_bytes(self, nbytes: float, from_itemsize: int, itemsize: int, layout) -> float:
        """Bytes per device of a copy, ``itemsize`` bytes an element, of a tensor of ``nbytes`` whole
        bytes in elements of ``from_itemsize``, at ``layout``: what an op keeps of an input it converts
        (ATen's additive copy of a boolean mask), in the ILP's activation bytes and the step memory model."""
        return nbytes / from_itemsize * itemsize * local_fraction(layout, self.mesh_shape)


def _pointwise(node: fx.Node) -> bool:
    return node.op == "call_function" and (node.target is aten._to_copy.default
                                           or torch.Tag.pointwise in getattr(node.target, "tags", ()))


def _in_registers(node: fx.Node):
    """For a pointwise node under fused kernels: (per tensor input, whether it comes from a pointwise
    producer read only here; whether the output goes only to one pointwise reader). None otherwise."""
    if not _pointwise(node):
        return None
    inputs = tuple(_pointwise(a) and len(a.users) == 1 for a in tensor_inputs(node))
    return inputs, len(node.users) == 1 and _pointwise(next(iter(node.users)))


# A resharding that cannot happen (a Partial made from a non-Partial), or a pinned-out option: the
# solver turns infinite costs into constraints.
INFEASIBLE = math.inf


@functools.lru_cache(maxsize=200_000)
def _transition_cached(src, dst, shape, mesh_shape, partial_axes):
    try:
        local = local_shape(shape, src, mesh_shape)
    except Exception:
        return None
    return transition(src, dst, local, mesh_shape, grad_partial=partial_axes)


@requires("saved_activations_pass")
def count_saving_consumers_pass(gm: fx.GraphModule) -> fx.GraphModule:
    """How many nodes save each value for backward (``saved_by``)."""
    from collections import Counter

    counts = Counter()
    for node in gm.graph.nodes:
        saved = meta_of(node).saved
        if node.op != "call_function" or saved is None:
            continue
        ins = context_for(node).input_nodes
        for k, keep in enumerate(saved.inputs):
            if keep and k < len(ins) and not is_param(ins[k]):
                counts[ins[k]] += 1
    for n, c in counts.items():
        set_meta(n, saved_by=c)
    return gm
