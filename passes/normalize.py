"""Canonicalize the captured graph so that sharding rules see few, simple ops.

- drop metadata asserts and other dead nodes;
- fold no-ops: ``alias``, ``contiguous``, ``to`` without a change, ``dropout`` with p=0;
- split a bias off ``addmm``/``linear``, so that a row-split matmul can end in ``Partial`` and the
  bias be added once after the reduction;
- write a mean cross-entropy as a sum over the tokens divided by the count of counted tokens, so that
  it stays exact when tokens are sharded;
- fold the tanh approximation of GELU written out in pointwise ops (Hugging Face's ``gelu_new``:
  GPT-2, GPT-J, GPT-Neo) into one ``gelu(approximate="tanh")``: one pass over the activation instead
  of eight forward, one saved tensor instead of four, and ATen's fused backward.
"""
from __future__ import annotations

import math

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
        elif t is aten.mul.Tensor and (x := _tanh_gelu_input(node)) is not None:
            node.replace_all_uses_with(_new(g, node, aten.gelu.default, (x,), {"approximate": "tanh"}))
            g.erase_node(node)
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


def _scalar_op(node, target, value):
    """The tensor operand of ``node`` if it is ``target(tensor, value)`` (either order), read by
    ``node`` alone when it is not the pattern's input; else None."""
    if not isinstance(node, fx.Node) or node.target is not target or node.kwargs or len(node.args) != 2:
        return None
    a, b = node.args
    if isinstance(b, fx.Node):
        a, b = b, a
    if not isinstance(a, fx.Node) or isinstance(b, fx.Node) or abs(float(b) - value) > 1e-6 * abs(value):
        return None
    return a


def _tanh_gelu_input(out):
    """``x`` where ``out`` is ``0.5 * x * (1 + tanh(sqrt(2 / pi) * (x + 0.044715 * x ** 3)))`` as
    exported, every intermediate read by the pattern alone; else None."""
    if out.kwargs or len(out.args) != 2 or not all(isinstance(a, fx.Node) for a in out.args):
        return None
    for half, one_plus in (out.args, out.args[::-1]):
        x = _scalar_op(half, aten.mul.Tensor, 0.5)
        th = _scalar_op(one_plus, aten.add.Tensor, 1.0)
        if x is None or th is None or th.target is not aten.tanh.default:
            continue
        inner = _scalar_op(th.args[0], aten.mul.Tensor, math.sqrt(2 / math.pi))
        if inner is None or inner.target is not aten.add.Tensor or inner.kwargs or x not in inner.args:
            continue
        cubed = _scalar_op(inner.args[1] if inner.args[0] is x else inner.args[0], aten.mul.Tensor, 0.044715)
        if cubed is None or cubed.target is not aten.pow.Tensor_Scalar or cubed.args != (x, 3.0):
            continue
        chain = (half, one_plus, th, th.args[0], inner, inner.args[0] if inner.args[1] is x else inner.args[1],
                 cubed)
        val, out_val = x.meta.get("val"), out.meta.get("val")
        if (all(len(n.users) == 1 for n in chain) and isinstance(val, torch.Tensor)
                and isinstance(out_val, torch.Tensor) and val.dtype == out_val.dtype and val.is_floating_point()):
            return x
    return None


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
