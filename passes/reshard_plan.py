"""The resharding plan of a chosen assignment (``plan_reshards``): which steps bring every value to
the layout each consumer reads, deduplicated the way codegen emits them. It plans; codegen lowers.

A value read in the same layout, with the same gradient reductions, by several consumers is
resharded once and shared. Planning reports the collectives from this, and codegen emits exactly
these steps, so ``plan.collectives`` and the generated program agree by construction.
"""
from __future__ import annotations

from dataclasses import dataclass, field

import torch
import torch.fx as fx

from autopar.layout import R
from autopar.plan import PlanCollective
from autopar.passes.exposure import hides_behind_weight_grads
from autopar.passes.meta import is_param, op_name
from autopar.passes.precision import reduce_itemsize
from autopar.passes.resharding import global_transition
from autopar.passes.strategies import Strategy, Value, input_values, requires_grad, value_info


@dataclass(frozen=True)
class ReshardKey:
    value: Value
    dst: tuple
    grad_partial: frozenset


@dataclass
class ReshardPlan:
    strategy: dict                                   # node -> Strategy
    reshards: dict = field(default_factory=dict)     # ReshardKey -> list[Step]
    first_consumer: dict = field(default_factory=dict)  # ReshardKey -> consumer node name
    uses: dict = field(default_factory=dict)         # (consumer node, input position) -> ReshardKey
    output_uses: list = field(default_factory=list)  # per user output: ReshardKey, or None (returned as is)


def gathered_output(node: fx.Node, sharded_outputs: bool) -> bool:
    """Whether a user output is returned whole (replicated). With ``sharded_outputs`` only scalars are:
    a loss costs a few bytes to reduce, while logits stay in the layout they are computed in."""
    return not sharded_outputs or node.meta["val"].dim() == 0


def plan_reshards(gm: fx.GraphModule, strategy: dict, mesh_shape, sharded_outputs: bool = False) -> ReshardPlan:
    mesh_shape = tuple(mesh_shape)
    low = ReshardPlan(strategy)
    for node in gm.graph.nodes:
        if node.op == "call_function":
            s = strategy[node]
            for k, v in enumerate(input_values(node)):
                key = _reshard(low, mesh_shape, v, s.inputs[k], s, node)
                if key is not None:
                    low.uses[(node, k)] = key
        elif node.op == "output":
            leaves = torch.utils._pytree.tree_leaves(node.args)
            for a in leaves:
                if isinstance(a, fx.Node) and isinstance(a.meta.get("val"), torch.Tensor):
                    if not gathered_output(a, sharded_outputs):
                        low.output_uses.append(None)
                        continue
                    rep = tuple(R for _ in mesh_shape)
                    low.output_uses.append(_reshard(low, mesh_shape, Value(a), rep, None, node))
                else:
                    low.output_uses.append(None)
    return low


def _reshard(low: ReshardPlan, mesh_shape, v: Value, dst, s: Strategy | None, consumer: fx.Node):
    producer = low.strategy[v.node]
    src = producer.outputs[v.index]
    partial = producer.read_grad_partial(v, dst, s)
    key = ReshardKey(v, tuple(dst), partial)
    if key not in low.reshards:
        steps = global_transition(tuple(src), tuple(dst), value_info(v).shape, mesh_shape, grad_partial=partial)
        if steps is None:
            raise AssertionError(f"plan reads {v.node.name} as {list(map(str, dst))} but it is produced as "
                                 f"{list(map(str, src))}: no resharding makes a Partial")
        low.reshards[key] = steps
        low.first_consumer[key] = consumer.name
    return key if low.reshards[key] else None


def collectives(low: ReshardPlan, cm, axis_names, sharded_masters=None) -> list[PlanCollective]:
    """The plan's collectives under ``low``, priced by ``cm`` (a passes.costs.CostModel).
    ``sharded_masters``: ZeRO-1/2 parameter -> the copy it is read through where its master is sharded
    (``passes.precision.sharded_master_copy``), whose dtype its post-step all-gather moves."""
    sharded_masters = sharded_masters or {}
    out = []
    for key, steps in low.reshards.items():
        info = value_info(key.value)
        for st, c in cm.priced_steps(steps, info.dtype.itemsize, requires_grad(key.value.node),
                                     reduce_itemsize(key.value.node)):
            out.append(c.record(axis_names, node=low.first_consumer[key], value=key.value.node.name, step=st.op))
    for node, s in low.strategy.items():
        out += [c.record(axis_names, node=node.name, value=node.name, step=op_name(node))
                for c in cm.priced_op_collectives(node, s)]
        if s.zero is not None and is_param(node):     # not a ZeRO-2 weight's copy, which carries its state
            out += [c.record(axis_names, node=node.name, value=node.name, step=f"zero{s.zero.stage}")
                    for c in cm.zero_collectives(node, s.outputs[0], s.zero, _dtype_of(sharded_masters.get(node)))]
    return out


def behind_weight_grads(gm: fx.GraphModule, low: ReshardPlan) -> dict[tuple[str, str], list[str]]:
    """(value, first consumer) -> the consumers, for each resharding that is one ``grad_all_reduce`` whose
    backward runs behind its readers' weight gradients (``passes.exposure.hides_behind_weight_grads``),
    as codegen/overlap.py lowers it: a reader's weight is ready before the first reader if it is
    computed before it and read as it is, or resharded for the first reader itself (codegen emits a
    resharding just before its reader)."""
    position = {n: i for i, n in enumerate(gm.graph.nodes)}
    reads: dict[ReshardKey, list] = {}
    for (consumer, k), key in low.uses.items():
        reads.setdefault(key, []).append((consumer, k))
    resharded_weight = {consumer for (consumer, k) in low.uses if k > 0}
    out = {}
    for key, rs in reads.items():
        if [st.op for st in low.reshards[key]] != ["grad_all_reduce"]:
            continue
        first = min(position[r] for r, _ in rs)

        def ready(r, first=first):
            return (all(position[a] < first for a in r.args[1:] if isinstance(a, fx.Node))
                    and (r not in resharded_weight or position[r] == first))
        if hides_behind_weight_grads(rs, ready):
            out[(key.value.node.name, low.first_consumer[key])] = [r.name for r, _ in rs]
    return out


def _dtype_of(node):
    return None if node is None else node.meta["val"].dtype
