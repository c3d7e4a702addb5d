"""The ATen ops that generated kernels implement: how a node reads as a fused op, and its Triton
forward and gradient formulas.

A formula is a template over the op's operands ``{a}``, ``{b}``, ``{c}``, its output ``{y}`` and the
gradient of its output ``{g}``. Every value is fp32 inside a kernel (loads upcast, stores round), so
the formulas are written once for every dtype. A forward is a list of lines whose last one assigns
``{y}``; helper names it defines start with ``{y}_``, and a gradient reads only those that vary along
the row as ``{y}`` does (the kernel gives helpers ``{y}``'s shape class). Inside a row kernel ``mask``
marks the real columns of the row and ``N`` is their count; reductions see only the masked lanes.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.fx as fx

aten = torch.ops.aten

FLOAT_DTYPES = (torch.float32, torch.bfloat16, torch.float16)
TL_DTYPE = {torch.float32: "tl.float32", torch.bfloat16: "tl.bfloat16", torch.float16: "tl.float16"}

_SQRT_2_OVER_PI = math.sqrt(2.0 / math.pi)


@dataclass(frozen=True)
class FusedOp:
    """A node read as a fused op: ``operands`` are fx nodes or Python numbers, in template order."""

    kind: str
    operands: tuple
    params: tuple = ()


def lit(x) -> str:
    """A number as Triton source."""
    x = float(x)
    if math.isinf(x):
        return 'float("inf")' if x > 0 else 'float("-inf")'
    if math.isnan(x):
        return 'float("nan")'
    return repr(x)


_UNARY = {aten.neg.default: "neg", aten.exp.default: "exp", aten.log.default: "log", aten.sqrt.default: "sqrt",
          aten.rsqrt.default: "rsqrt", aten.reciprocal.default: "reciprocal", aten.sigmoid.default: "sigmoid",
          aten.tanh.default: "tanh", aten.relu.default: "relu", aten.silu.default: "silu", aten.abs.default: "abs",
          aten.clone.default: "copy", aten.contiguous.default: "copy"}
_BINARY = {aten.mul.Tensor: "mul", aten.mul.Scalar: "mul", aten.div.Tensor: "div", aten.div.Scalar: "div",
           aten.maximum.default: "maximum", aten.minimum.default: "minimum"}
_ADDITIVE = {aten.add.Tensor: "add", aten.add.Scalar: "add", aten.sub.Tensor: "sub", aten.sub.Scalar: "sub"}
_CASTS = {aten._to_copy.default, aten.to.dtype}
_REDUCTIONS = {aten.sum.dim_IntList: "sum", aten.mean.dim: "mean", aten.amax.default: "amax"}
_SOFTMAX = {aten._softmax.default: "softmax", aten.softmax.int: "softmax",
            aten._log_softmax.default: "log_softmax", aten.log_softmax.int: "log_softmax"}
REDUCTION_KINDS = frozenset(("sum", "mean", "amax"))
ROW_KINDS = REDUCTION_KINDS | {"softmax", "log_softmax"}   # need a whole row in one program


def fused_op(node: fx.Node) -> FusedOp | None:
    """How a generated kernel computes ``node``, or None when it cannot."""
    t, args, kw = node.target, node.args, node.kwargs
    if t in _UNARY:
        return FusedOp(_UNARY[t], (args[0],))
    if t in _BINARY:
        if t is aten.div.Tensor and kw.get("rounding_mode") is not None:
            return None
        return FusedOp(_BINARY[t], (args[0], args[1]))
    if t in _ADDITIVE:
        return FusedOp(_ADDITIVE[t], (args[0], args[1]), (kw.get("alpha", args[2] if len(args) > 2 else 1),))
    if t in (aten.rsub.Scalar, aten.rsub.Tensor):              # other - alpha * self
        return FusedOp("sub", (args[1], args[0]), (kw.get("alpha", args[2] if len(args) > 2 else 1),))
    if t is aten.pow.Tensor_Scalar and isinstance(args[1], (int, float)) and args[1] != 0:
        return FusedOp("pow", (args[0],), (float(args[1]),))
    if t is aten.gelu.default:
        approximate = kw.get("approximate", args[1] if len(args) > 1 else "none")
        return FusedOp("gelu", (args[0],), (approximate,)) if approximate in ("none", "tanh") else None
    if t is aten.clamp.default:
        lo = kw.get("min", args[1] if len(args) > 1 else None)
        hi = kw.get("max", args[2] if len(args) > 2 else None)
        if lo is None and hi is None or any(not isinstance(v, (int, float, type(None))) for v in (lo, hi)):
            return None
        return FusedOp("clamp", (args[0],), (lo, hi))
    if t in (aten.where.self, aten.where.ScalarOther, aten.where.ScalarSelf):
        cond = args[0]
        if not (isinstance(cond, fx.Node) and _val(cond) is not None and _val(cond).dtype == torch.bool):
            return None
        return FusedOp("where", (cond, args[1], args[2]))
    if t in _CASTS:
        if set(kw) - {"dtype", "memory_format", "layout", "device"} or len(args) > (2 if t is aten.to.dtype else 1):
            return None
        return FusedOp("cast", (args[0],), (_val(node).dtype,))
    if t in _REDUCTIONS:
        dims = args[1] if len(args) > 1 else kw.get("dim")
        keepdim = kw.get("keepdim", args[2] if len(args) > 2 else False)
        if kw.get("dtype") is not None or not _last_dim_only(node, dims):
            return None
        return FusedOp(_REDUCTIONS[t], (args[0],), (bool(keepdim),))
    if t in _SOFTMAX:
        dim = args[1]
        extra = args[2] if len(args) > 2 else kw.get("dtype")
        if extra not in (None, False) or not _last_dim_only(node, [dim]):
            return None
        return FusedOp(_SOFTMAX[t], (args[0],))
    return None


def _val(node):
    v = node.meta.get("val")
    return v if isinstance(v, torch.Tensor) else None


def _last_dim_only(node, dims) -> bool:
    x = _val(node.args[0])
    if x is None or x.dim() == 0 or not isinstance(dims, (list, tuple)) or len(dims) != 1:
        return False
    return dims[0] % x.dim() == x.dim() - 1


def _power(x: str, p: float) -> str:
    """x ** p as Triton source: products for small integer powers (exact, and fine for x < 0)."""
    if p == 0:
        return "1.0"
    if p == int(p) and abs(p) <= 4:
        prod = " * ".join([x] * int(abs(p)))
        return prod if p > 0 else f"1.0 / ({prod})"
    if p == 0.5:
        return f"tl.sqrt({x})"
    if p == -0.5:
        return f"tl.rsqrt({x})"
    return f"tl.exp({lit(p)} * tl.log({x}))"


def _tanh(x: str) -> str:
    # Triton has no portable tanh; this form saturates to +-1 without overflow.
    return f"2.0 * tl.sigmoid(2.0 * {x}) - 1.0"


def formulas(kind: str, params: tuple) -> tuple[list[str], tuple]:
    """(forward lines, one gradient expression per operand or None where there is none)."""
    if kind in ("add", "sub"):
        alpha = params[0]
        b = "{b}" if alpha == 1 else f"{lit(alpha)} * {{b}}"
        gb = "{g}" if alpha == 1 else f"{lit(alpha)} * {{g}}"
        sign = "+" if kind == "add" else "-"
        return [f"{{y}} = {{a}} {sign} {b}"], ("{g}", gb if kind == "add" else f"-({gb})")
    simple = {
        "mul": ("{a} * {b}", ("{g} * {b}", "{g} * {a}")),
        "div": ("{a} / {b}", ("{g} / {b}", "-{g} * {y} / {b}")),
        "neg": ("-{a}", ("-{g}",)),
        "copy": ("{a}", ("{g}",)),
        "exp": ("tl.exp({a})", ("{g} * {y}",)),
        "log": ("tl.log({a})", ("{g} / {a}",)),
        "sqrt": ("tl.sqrt({a})", ("{g} * 0.5 / {y}",)),
        "rsqrt": ("tl.rsqrt({a})", ("-0.5 * {g} * {y} * {y} * {y}",)),
        "reciprocal": ("1.0 / {a}", ("-{g} * {y} * {y}",)),
        "sigmoid": ("tl.sigmoid({a})", ("{g} * {y} * (1.0 - {y})",)),
        "tanh": (_tanh("{a}"), ("{g} * (1.0 - {y} * {y})",)),
        "relu": ("tl.where({a} > 0.0, {a}, 0.0)", ("tl.where({a} > 0.0, {g}, 0.0)",)),
        "silu": ("{a} * tl.sigmoid({a})",
                 ("{g} * tl.sigmoid({a}) * (1.0 + {a} * (1.0 - tl.sigmoid({a})))",)),
        "abs": ("tl.abs({a})", ("tl.where({a} > 0.0, {g}, tl.where({a} < 0.0, -{g}, 0.0))",)),
        # Ties share the gradient equally, as in eager.
        "maximum": ("tl.maximum({a}, {b})",
                    ("tl.where({a} > {b}, {g}, tl.where({a} == {b}, 0.5 * {g}, 0.0))",
                     "tl.where({b} > {a}, {g}, tl.where({a} == {b}, 0.5 * {g}, 0.0))")),
        "minimum": ("tl.minimum({a}, {b})",
                    ("tl.where({a} < {b}, {g}, tl.where({a} == {b}, 0.5 * {g}, 0.0))",
                     "tl.where({b} < {a}, {g}, tl.where({a} == {b}, 0.5 * {g}, 0.0))")),
        "where": ("tl.where({a}, {b}, {c})", (None, "tl.where({a}, {g}, 0.0)", "tl.where({a}, 0.0, {g})")),
        # Row reductions (the kernel holds the whole row; masked lanes are left out).
        "sum": ("tl.sum(tl.where(mask, {a}, 0.0), 0)", ("{g}",)),
        "mean": ("tl.sum(tl.where(mask, {a}, 0.0), 0) / N", ("{g} / N",)),
        # Eager amax splits the gradient evenly among tied maxima.
        "amax": ('tl.max(tl.where(mask, {a}, float("-inf")), 0)',
                 ("tl.where({a} == {y}, {g} / tl.sum(tl.where(mask & ({a} == {y}), 1.0, 0.0), 0), 0.0)",)),
    }
    if kind in simple:
        fwd, grads = simple[kind]
        return [f"{{y}} = {fwd}"], grads
    if kind == "pow":
        p = params[0]
        return [f"{{y}} = {_power('{a}', p)}"], (f"{{g}} * {lit(p)} * {_power('{a}', p - 1)}" if p != 1 else "{g}",)
    if kind == "clamp":
        lo, hi = params
        fwd, keep = "{a}", []
        if lo is not None:
            fwd, keep = f"tl.maximum({fwd}, {lit(lo)})", keep + [f"({{a}} >= {lit(lo)})"]
        if hi is not None:
            fwd, keep = f"tl.minimum({fwd}, {lit(hi)})", keep + [f"({{a}} <= {lit(hi)})"]
        return [f"{{y}} = {fwd}"], (f"tl.where({' & '.join(keep)}, {{g}}, 0.0)",)
    if kind == "cast":
        dtype = params[0]
        # Computing stays fp32; a cast to a narrower float rounds the value as eager would.
        fwd = "{a}" if dtype == torch.float32 else f"{{a}}.to({TL_DTYPE[dtype]}).to(tl.float32)"
        return [f"{{y}} = {fwd}"], ("{g}",)
    if kind == "gelu" and params[0] == "none":
        return (["{y} = 0.5 * {a} * (1.0 + tl.erf({a} * 0.7071067811865476))"],
                ("{g} * (0.5 * (1.0 + tl.erf({a} * 0.7071067811865476))"
                 " + {a} * 0.3989422804014327 * tl.exp(-0.5 * {a} * {a}))",))
    if kind == "gelu":
        k = lit(_SQRT_2_OVER_PI)
        return ([f"{{y}}_t = {_tanh(f'{k} * ({{a}} + 0.044715 * {{a}} * {{a}} * {{a}})')}",
                 "{y} = 0.5 * {a} * (1.0 + {y}_t)"],
                (f"{{g}} * (0.5 * (1.0 + {{y}}_t) + 0.5 * {{a}} * (1.0 - {{y}}_t * {{y}}_t) * {k}"
                 " * (1.0 + 0.134145 * {a} * {a}))",))
    if kind == "softmax":
        return (['{y}_max = tl.max(tl.where(mask, {a}, float("-inf")), 0)',
                 "{y}_exp = tl.exp({a} - {y}_max)",
                 "{y} = {y}_exp / tl.sum(tl.where(mask, {y}_exp, 0.0), 0)"],
                ("{y} * ({g} - tl.sum(tl.where(mask, {g} * {y}, 0.0), 0))",))
    if kind == "log_softmax":
        return (['{y}_max = tl.max(tl.where(mask, {a}, float("-inf")), 0)',
                 "{y}_shift = {a} - {y}_max",
                 "{y} = {y}_shift - tl.log(tl.sum(tl.where(mask, tl.exp({y}_shift), 0.0), 0))"],
                ("{g} - tl.exp({y}) * tl.sum(tl.where(mask, {g}, 0.0), 0)",))
    raise KeyError(kind)
