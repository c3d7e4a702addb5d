"""Elementwise ops with broadcasting, and factories."""
import torch

from autopar.passes.rules import register_replicated, register_rule
from autopar.passes.rules.helpers import broadcast_options

aten = torch.ops.aten


def _elementwise_flops(ctx):
    return float(ctx.outs[0].numel)


# Unary ops that are linear in their input: a Partial passes through.
@register_rule(aten.neg.default, aten.clone.default, aten.contiguous.default, aten.to.dtype,
               aten.to.device, aten.to.dtype_layout, aten._to_copy.default, aten.type_as.default,
               flops=_elementwise_flops)
def linear_unary_rule(ctx):
    return broadcast_options(ctx, linear=[0] if len(ctx.ins) == 1 else [])


@register_rule(aten.silu.default, aten.gelu.default, aten.relu.default, aten.tanh.default,
               aten.sigmoid.default, aten.exp.default, aten.log.default, aten.rsqrt.default,
               aten.sqrt.default, aten.pow.Tensor_Scalar, aten.abs.default, aten.sin.default,
               aten.cos.default, aten.reciprocal.default, aten.where.ScalarOther, aten.where.ScalarSelf,
               aten.eq.Scalar, aten.ne.Scalar, aten.ge.Scalar, aten.gt.Scalar, aten.le.Scalar,
               aten.lt.Scalar, aten.logical_not.default, aten.bitwise_not.default,
               aten.masked_fill.Scalar, aten.where.self, aten.eq.Tensor, aten.ne.Tensor, aten.ge.Tensor,
               aten.gt.Tensor, aten.le.Tensor, aten.lt.Tensor, aten.__and__.Tensor, aten.__or__.Tensor,
               aten.bitwise_and.Tensor, aten.bitwise_or.Tensor, aten.logical_and.default,
               aten.logical_or.default, aten.maximum.default, aten.minimum.default,
               aten.pow.Tensor_Tensor, aten.clamp.default, aten.tril.default, aten.triu.default,
               flops=_elementwise_flops)
def pointwise_rule(ctx):
    return broadcast_options(ctx)


def _dropout_saved_on_gpu(ctx):
    """The CUDA kernel keeps a one-byte mask; CPU kernels keep it in the activation dtype."""
    from autopar.passes.meta import SavedForBackward

    return SavedForBackward(0, (False,), ctx.outs[0].numel)


@register_rule(aten.dropout.default, aten.native_dropout.default, flops=_elementwise_flops,
               saved_on_gpu=_dropout_saved_on_gpu)
def dropout_rule(ctx):
    return broadcast_options(ctx)


@register_rule(aten.add.Tensor, aten.sub.Tensor, flops=_elementwise_flops)
def additive_rule(ctx):
    # x + y with both Partial sums to a Partial; with one tensor input (x + 1.0) a Partial would add
    # the scalar once per rank, so it must stay replicated.
    return broadcast_options(ctx, all_partial=len(ctx.ins) == 2)


@register_rule(aten.mul.Tensor, flops=_elementwise_flops)
def mul_rule(ctx):
    return broadcast_options(ctx, linear=range(len(ctx.ins)))


@register_rule(aten.div.Tensor, flops=_elementwise_flops)
def div_rule(ctx):
    return broadcast_options(ctx, linear=[0])


register_replicated(
    aten.arange.default, aten.arange.start, aten.arange.start_step, aten.zeros.default, aten.ones.default,
    aten.full.default, aten.empty.memory_format, aten.new_ones.default, aten.new_zeros.default,
    aten.new_full.default, aten.new_empty.default, aten.scalar_tensor.default, aten.zeros_like.default,
    aten.ones_like.default, aten.full_like.default, aten.empty_like.default, aten.rand.default,
    aten.randn.default, aten.index.Tensor, aten.diff.default, aten.lift_fresh_copy.default,
)

# getitem only picks one output of a multi-output node; passes.strategies gives it its producer's
# layout, so the rule is never consulted for strategies. Registering it keeps it out of the warnings.
register_replicated(__import__("operator").getitem)

# Hugging Face computes rotary tables under no_grad inside this higher-order op: whole tensors, tiny.
register_replicated(__import__("torch._higher_order_ops.wrap", fromlist=["wrap_with_set_grad_enabled"])
                    .wrap_with_set_grad_enabled)
