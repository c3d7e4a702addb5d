"""Where a strided shard can pay (``strided_hints_pass``): the fused projections that are split or
chunked into equal parts right after (GPT-2's ``c_attn``, a fused gate-up).

A plain ``S(d)`` of such a projection's output puts whole parts on some ranks, so splitting it by
heads or columns needs an all-to-all. ``S(d,k)`` (autopar.layout) keeps every part split evenly,
and the split turns it into a plain ``S(d)`` of each part. The pass walks the graph backwards: a rule
that reads strided inputs by itself (``reads_strided``: split, chunk) seeds a hint on its input, and
every rule asked for a strided output by a hint (``ctx.strided``) passes hints on to the inputs its
strided option reads strided (a bias add, a view, the matmul and its weight). The hints are mesh
independent; ``passes.strategies`` offers the strided options where the sizes divide.
"""
from __future__ import annotations

import torch.fx as fx

from autopar.passes.meta import set_meta
from autopar.passes.rules import context_for, rule_for


def strided_hints_pass(gm: fx.GraphModule) -> fx.GraphModule:
    """Write ``meta.strided`` ((output dim, groups) pairs) on every node whose output a consumer
    can read as a strided shard."""
    hints: dict[fx.Node, set] = {}
    for node in reversed(gm.graph.nodes):
        wanted = hints.get(node)
        if wanted:
            set_meta(node, strided=tuple(sorted(wanted)))
        if node.op != "call_function":
            continue
        rule = rule_for(node)
        if not wanted and not rule.reads_strided:
            continue
        ctx = context_for(node)
        for option in rule.options(ctx):
            for placement, producer in zip(option.inputs, ctx.input_nodes):
                if placement.is_strided:
                    hints.setdefault(producer, set()).add((placement.dim, placement.groups))
    return gm
