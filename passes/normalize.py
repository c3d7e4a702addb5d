"""Canonicalize the captured graph so that sharding rules see few, simple ops.

- drop metadata asserts and other dead nodes;
- fold no-ops: ``alias``, ``contiguous``, ``to`` without a change, ``dropout`` with p=0;
- split a bias off ``addmm``/``linear``, so that a row-split matmul can end in ``Partial`` and the
  bias be added once after the reduction;
- write a mean cross-entropy as a sum over the tokens divided by the count of counted tokens, so that
  it stays exact when tokens are sharded.
"""
from __future__ import annotations

import torch
import torch.fx as fx

aten = torch.ops.aten

# contiguous only changes strides, and export records it only when the traced tensors need it, so
# a meta model and a real one would otherwise give different graphs (and a plan of one would not
# describe the other). Local programs reshape rather than view, so nothing needs the strides.
_NO_OP_VIEWS = {aten.alias.default, aten.lift_fresh_copy.default, aten.contiguous.default}
_ASSERTS = {aten._assert_tensor_metadata.default, aten._assert_scalar.default}
_CASTS = {aten.to.dtype, aten.to.dtype_layout, aten._to_copy.default, aten.to.device}


def normalize_pass(gm: fx.GraphModule) -> fx.GraphModule:
    g = gm.graph
    for node in list(g.nodes):
        if node.op != "call_function":
            continue
        t = node.target
        if t in _ASSERTS:
            g.erase_node(node)
        elif t in _NO_OP_VIEWS or (t in _CASTS and _same_tensor_type(node)):
            node.replace_all_uses_with(node.args[0])
            g.erase_node(node)
        elif t is aten.dropout.default and float(node.args[1]) == 0.0:
            node.replace_all_uses_with(node.args[0])
            g.erase_node(node)
        elif t is aten.addmm.default and node.args[0].meta["val"].dim() == 1 and _unit_scales(node):
            _split_bias(g, node, aten.mm.default, (node.args[1], node.args[2]), node.args[0])
        elif t is aten.linear.default and len(node.args) > 2 and node.args[2] is not None:
            _split_bias(g, node, aten.linear.default, (node.args[0], node.args[1]), node.args[2])
        elif t is aten.cross_entropy_loss.default:
            _mean_loss_as_sum_over_count(g, node)
    g.eliminate_dead_code()
    gm.recompile()
    return gm


def _same_tensor_type(node):
    src, out = node.args[0].meta.get("val"), node.meta.get("val")
    return (isinstance(src, torch.Tensor) and isinstance(out, torch.Tensor)
            and src.dtype == out.dtype and src.device == out.device and src.layout == out.layout)


def _unit_scales(node):
    return node.kwargs.get("beta", 1) == 1 and node.kwargs.get("alpha", 1) == 1


def _new(g, before, target, args, kwargs=None, like=None):
    with g.inserting_before(before):
        n = g.call_function(target, tuple(args), kwargs or {})
    n.meta.update({k: v for k, v in (like or before).meta.items() if k in ("nn_module_stack", "stack_trace",
                                                                           "source_fn_stack", "seq_nr")})
    n.meta["val"] = target(*[a.meta["val"] if isinstance(a, fx.Node) else a for a in args], **(kwargs or {}))
    return n


def _split_bias(g, node, mm_target, mm_args, bias):
    mm = _new(g, node, mm_target, mm_args)
    add = _new(g, node, aten.add.Tensor, (mm, bias))
    node.replace_all_uses_with(add)
    g.erase_node(node)


def _mean_loss_as_sum_over_count(g, node):
    # cross_entropy_loss(self, target, weight=None, reduction=Mean, ignore_index=-100, label_smoothing=0)
    args = list(node.args) + [None, 1, -100, 0.0][len(node.args) - 2:]
    logits, target, weight, reduction, ignore_index, smoothing = args[:6]
    if reduction != 1 or weight is not None or smoothing:
        return
    total = _new(g, node, aten.cross_entropy_loss.default, (logits, target, None, 2, ignore_index, 0.0))
    counted = _new(g, node, aten.ne.Scalar, (target, ignore_index))
    count = _new(g, node, aten.sum.dim_IntList, (counted, None), {"dtype": logits.meta["val"].dtype})
    loss = _new(g, node, aten.div.Tensor, (total, count))
    node.replace_all_uses_with(loss)
    g.erase_node(node)


# The matmuls normalize_pass split a bias off, and the op that adds the bias back in one kernel.
BIASED_MATMULS = {aten.mm.default: aten.addmm.default, aten.linear.default: aten.linear.default}


def folded_matmul(node: fx.Node) -> fx.Node | None:
    """The matmul whose split-off bias ``node`` adds back, where code generation folds the two into one
    biased matmul as long as no resharding comes between them (codegen/local_program.py); else None."""
    if node.target is not aten.add.Tensor or node.kwargs or not isinstance(node.args[0], fx.Node):
        return None
    mm, bias = node.args
    if mm.target not in BIASED_MATMULS or len(mm.users) != 1 or not isinstance(bias, fx.Node):
        return None
    if mm.target is aten.linear.default and len(mm.args) > 2:
        return None
    out, b = mm.meta.get("val"), bias.meta.get("val")
    if not (isinstance(b, torch.Tensor) and b.dim() == 1 and b.shape[0] == out.shape[-1]
            and b.dtype == out.dtype == node.meta["val"].dtype):
        return None
    return mm
