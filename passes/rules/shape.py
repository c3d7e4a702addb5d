"""Views, reshapes and other ops that move dims around without computing.

A shard survives an op when a rank's piece stays one contiguous block; otherwise the dim is not
offered and the solver reshards before the op. Uneven splits are never offered: ``passes.strategies``
drops any strategy whose sharded dims do not divide (documented in docs/sharding.md).
"""
import torch

from autopar.layout import P, S
from autopar.passes.rules import register_rule
from autopar.passes.rules.helpers import dim_map_options, norm_dim, view_mapping, whole_dim_mapping

aten = torch.ops.aten


def _local_size_arg(ctx, args, kwargs, local_ins, local_outs):
    """Views and expands take their output size as args[1]: use the local one."""
    return (args[0], list(local_outs[0])) + tuple(args[2:]), kwargs


@register_rule(aten.view.default, aten.reshape.default, aten._unsafe_view.default,
               local_args=_local_size_arg)
def view_rule(ctx):
    src, dst = ctx.ins[0].shape, ctx.outs[0].shape
    return dim_map_options(ctx, view_mapping(src, dst).get, strided_mapping=whole_dim_mapping(src, dst).get)


# flatten takes dims, not sizes: no rewrite.
register_rule(aten.flatten.using_ints)(view_rule)


def _local_unflatten_sizes(ctx, args, kwargs, local_ins, local_outs):
    """unflatten(x, dim, sizes): the new dims' sizes, taken from the local output."""
    dim = norm_dim(args[1], ctx.ins[0].ndim)
    sizes = list(local_outs[0][dim:dim + len(args[2])])
    return (args[0], args[1], sizes) + tuple(args[3:]), kwargs


register_rule(aten.unflatten.int, local_args=_local_unflatten_sizes)(view_rule)


@register_rule(aten.expand.default, local_args=_local_size_arg)
def expand_rule(ctx):
    src, dst = ctx.ins[0].shape, ctx.outs[0].shape
    off = len(dst) - len(src)
    return dim_map_options(ctx, lambda d: d + off if src[d] == dst[d + off] else None)


@register_rule(aten.transpose.int)
def transpose_rule(ctx):
    nd = ctx.ins[0].ndim
    a, b = norm_dim(ctx.args[1], nd), norm_dim(ctx.args[2], nd)
    return dim_map_options(ctx, lambda d: b if d == a else a if d == b else d)


@register_rule(aten.t.default)
def t_rule(ctx):
    return dim_map_options(ctx, lambda d: ctx.ins[0].ndim - 1 - d)


@register_rule(aten.permute.default)
def permute_rule(ctx):
    nd = ctx.ins[0].ndim
    perm = [norm_dim(d, nd) for d in ctx.args[1]]
    return dim_map_options(ctx, perm.index)


@register_rule(aten.unsqueeze.default)
def unsqueeze_rule(ctx):
    at = norm_dim(ctx.args[1], ctx.outs[0].ndim)
    return dim_map_options(ctx, lambda d: d if d < at else d + 1)


@register_rule(aten.squeeze.dim, aten.squeeze.dims, aten.squeeze.default)
def squeeze_rule(ctx):
    src, nd = ctx.ins[0].shape, ctx.ins[0].ndim
    dims = ctx.args[1] if len(ctx.args) > 1 else [d for d in range(nd) if src[d] == 1]
    dims = {norm_dim(d, nd) for d in ([dims] if isinstance(dims, int) else dims) if src[norm_dim(d, nd)] == 1}
    return dim_map_options(ctx, lambda d: d - sum(1 for x in dims if x < d))


def _other_dims(ctx, dim_index, name, *, drop=False):
    nd = ctx.ins[0].ndim
    dim = norm_dim(ctx.arg(dim_index, name, 0), nd)
    return dim_map_options(ctx, lambda d: None if d == dim else (d - 1 if drop and d > dim else d))


@register_rule(aten.slice.Tensor)
def slice_rule(ctx):
    return _other_dims(ctx, 1, "dim")


@register_rule(aten.select.int)
def select_rule(ctx):
    return _other_dims(ctx, 1, "dim", drop=True)


@register_rule(aten.unbind.int)
def unbind_rule(ctx):
    return _other_dims(ctx, 1, "dim", drop=True)


def _local_split_sizes(ctx, args, kwargs, local_ins, local_outs):
    """split(x, size, dim) and split_with_sizes(x, sizes, dim): the parts' local sizes along the dim
    (a strided input's parts are split along it). chunk takes a count, which stays."""
    if ctx.node.target is aten.chunk.default:
        return args, kwargs
    dim = norm_dim(ctx.arg(2, "dim", 0), ctx.ins[0].ndim)
    sizes = [o[dim] for o in local_outs]
    size = sizes if ctx.node.target is aten.split_with_sizes.default else sizes[0]
    return (args[0], size) + tuple(args[2:]), kwargs


@register_rule(aten.split.Tensor, aten.split_with_sizes.default, aten.chunk.default,
               local_args=_local_split_sizes, reads_strided=True)
def split_rule(ctx):
    """Not along a sharded dim; but a dim cut into equal parts may be strided in as many groups
    (S(dim,parts)), which makes every part a plain shard S(dim): Megatron's fused projections."""
    options = _other_dims(ctx, 2, "dim")
    dim = norm_dim(ctx.arg(2, "dim", 0), ctx.ins[0].ndim)
    parts = len(ctx.outs)
    if parts > 1 and all(o.shape[dim] * parts == ctx.ins[0].shape[dim] for o in ctx.outs):
        options.append(ctx.option([S(dim, parts)], S(dim)))
    return options


@register_rule(aten.cat.default)
def cat_rule(ctx):
    nd = ctx.outs[0].ndim
    dim = norm_dim(ctx.arg(1, "dim", 0), nd)
    if any(i.ndim != nd for i in ctx.ins):        # cat skips legacy empty 1-D tensors; keep it simple
        return []
    opts = [ctx.option([S(d)] * len(ctx.ins), S(d)) for d in range(nd) if d != dim and ctx.outs[0].shape[d] > 1]
    return opts + [ctx.option([P] * len(ctx.ins), P)]


@register_rule(aten.pad.default, aten.constant_pad_nd.default)
def pad_rule(ctx):
    padded = len(ctx.arg(1, "pad")) // 2
    nd = ctx.ins[0].ndim
    return dim_map_options(ctx, lambda d: d if d < nd - padded else None, partial=False)


@register_rule(aten.cumsum.default)
def cumsum_rule(ctx):
    return _other_dims(ctx, 1, "dim")


@register_rule(aten.gather.default)
def gather_rule(ctx):
    nd = ctx.ins[0].ndim
    dim = norm_dim(ctx.args[1], nd)
    x, idx = ctx.ins
    return [ctx.option([S(d), S(d)], S(d)) for d in range(nd)
            if d != dim and x.shape[d] == idx.shape[d] > 1]
