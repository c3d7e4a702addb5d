"""The Triton forward and gradient formulas of the ops generated kernels implement (which ATen node
reads as which op is passes/fusion.py's ``fused_op``).

A formula is a template over the op's operands ``{a}``, ``{b}``, ``{c}``, its output ``{y}`` and the
gradient of its output ``{g}``. Every value is fp32 inside a kernel (loads upcast, stores round), so
the formulas are written once for every dtype. A forward is a list of lines whose last one assigns
``{y}``; helper names it defines start with ``{y}_``, and a gradient reads only those that vary along
the row as ``{y}`` does (the kernel gives helpers ``{y}``'s shape class). Inside a row kernel ``mask``
marks the real columns of the row and ``N`` is their count; reductions see only the masked lanes.
"""
from __future__ import annotations

import math

import torch

TL_DTYPE = {torch.float32: "tl.float32", torch.bfloat16: "tl.bfloat16", torch.float16: "tl.float16"}

_SQRT_2_OVER_PI = math.sqrt(2.0 / math.pi)


def lit(x) -> str:
    """A number as Triton source."""
    x = float(x)
    if math.isinf(x):
        return 'float("inf")' if x > 0 else 'float("-inf")'
    if math.isnan(x):
        return 'float("nan")'
    return repr(x)


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
