"""Triton source for a fused region: a forward kernel and a backward kernel.

A region is described by a ``RegionSpec``, which is also its cache key: the op sequence with its
constants, the dtypes, and which region dims each input varies along (its broadcasting pattern).
Shapes and strides are kernel arguments, so one kernel serves every region with the same spec.

Two kinds of kernel:

- **pointwise**: one program per block of ``BLOCK`` output elements; the flat index is split into
  one index per region dim, and each input is read through its own strides along the dims it varies
  along (a broadcast dim is simply left out of its address).
- **row**: for regions with a reduction along the last dim. One program per row holds the whole row
  (``BLOCK`` >= the row length); values are either vectors along the row or one scalar per row (a
  reduction's result and what is computed from it).

The backward kernel recomputes the forward from the region's inputs (nothing else is saved) and
runs reverse-mode differentiation over the op list at generation time, so it is one fused kernel
too. An input that broadcasts receives its gradient at the full region shape (or one value per row),
and the launcher sums it down to the input's shape.
"""
from __future__ import annotations

import re
from dataclasses import dataclass, field

import torch

from autopar.codegen.triton.ops import formulas, lit
from autopar.passes.fusion import FLOAT_DTYPES


@dataclass(frozen=True)
class Input:
    dtype: torch.dtype
    dims: tuple          # kernel dims this input varies along; it broadcasts along the others
    row: bool = False    # row kernels: one value per row (it does not vary along the last dim)


@dataclass(frozen=True)
class Op:
    kind: str
    args: tuple          # each ("in", k), ("v", j) or ("c", number)
    params: tuple = ()
    row: bool = False    # row kernels: one value per row
    aten: str = field(default="", compare=False)   # the ATen op it came from, for the comments


@dataclass(frozen=True)
class Output:
    value: int           # index into ops
    dtype: torch.dtype
    keepdim: bool = True  # a per-row output keeps its reduced dim (size 1)


@dataclass(frozen=True)
class RegionSpec:
    row_mode: bool
    rank: int            # rank of the region shape
    dims: tuple          # the region dims the kernel iterates over: those of size > 1 (and the last, in row mode)
    inputs: tuple
    ops: tuple
    outputs: tuple

    @property
    def kinds(self) -> list[str]:
        return [op.kind for op in self.ops]


@dataclass(frozen=True)
class KernelSource:
    text: str
    fwd_params: tuple     # argument names, in order
    bwd_params: tuple
    grad_inputs: tuple    # the inputs the backward kernel writes a gradient for


_NAME = re.compile(r"\b[A-Za-z_]\w*")


class _Body:
    """Straight-line kernel code: named values (each a vector along the block or one scalar per
    program) and stores. Only the lines that a store needs are printed."""

    def __init__(self):
        self.lines: list[tuple[str, str]] = []
        self.stores: list[str] = []
        self.row: dict[str, bool] = {}

    def let(self, name: str, expr: str, row: bool = False):
        self.lines.append((name, expr))
        self.row[name] = row
        return name

    def is_row(self, expr: str) -> bool:
        """Whether ``expr`` is one value per row: true unless it reads a vector."""
        return all(self.row.get(t, True) for t in _NAME.findall(expr))

    def code(self, indent="    ") -> str:
        needed = {t for s in self.stores for t in _NAME.findall(s)}
        kept = []
        for name, expr in reversed(self.lines):
            if name in needed:
                kept.append(f"{name} = {expr}")
                needed.update(_NAME.findall(expr))
        return "\n".join(indent + s for s in list(reversed(kept)) + self.stores)


def generate(spec: RegionSpec, name: str) -> KernelSource:
    """The kernels ``{name}_fwd`` and (when an input gets a gradient) ``{name}_bwd`` of a region."""
    k = len(spec.dims)
    sizes = [f"size{d}" for d in range(k - 1 if spec.row_mode else k)]
    extent = ["N"] if spec.row_mode else ["numel"]
    ins = [p for j, x in enumerate(spec.inputs) for p in [f"in{j}"] + [f"in{j}_s{d}" for d in x.dims]]
    outs = [f"out{m}" for m in range(len(spec.outputs))]
    gouts = [p for m in range(len(spec.outputs)) for p in [f"gout{m}"] + [f"gout{m}_s{d}" for d in _out_dims(spec, m)]]

    fwd = _Body()
    _forward(fwd, spec)
    for m, out in enumerate(spec.outputs):
        fwd.stores.append(_store(spec, f"out{m}", f"v{out.value}", spec.ops[out.value].row, fwd))

    bwd = _Body()
    _forward(bwd, spec)
    grad_inputs = _backward(bwd, spec)
    dins = [f"din{j}" for j in grad_inputs]
    fwd_params = tuple(ins + outs + sizes + extent)
    bwd_params = tuple(ins + gouts + dins + sizes + extent)

    header = _header(spec, name)
    text = (f"{header}\nimport triton\nimport triton.language as tl\n\n\n"
            f"@triton.jit\ndef {name}_fwd({', '.join(fwd_params)}, BLOCK: tl.constexpr):\n{fwd.code()}\n")
    if grad_inputs:
        text += (f"\n\n@triton.jit\ndef {name}_bwd({', '.join(bwd_params)}, BLOCK: tl.constexpr):\n"
                 f"{bwd.code()}\n")
    return KernelSource(text, fwd_params, bwd_params, grad_inputs)


def _header(spec: RegionSpec, name: str) -> str:
    kind = "row kernel (reduces the last dim)" if spec.row_mode else "pointwise kernel"
    lines = [f"# {name}: a generated {kind} for a region of {len(spec.ops)} ATen ops.", "#"]
    for j, x in enumerate(spec.inputs):
        along = ", ".join(map(str, x.dims)) or "none (a scalar)"
        lines.append(f"#   x{j}: {str(x.dtype).replace('torch.', '')}, varies along kernel dims {along}")
    for j, op in enumerate(spec.ops):
        args = ", ".join(_ref(a) for a in op.args)
        params = "; " + ", ".join(map(str, op.params)) if op.params else ""
        lines.append(f"#   v{j} = {op.kind}({args}{params})" + (f"  <- {op.aten}" if op.aten else ""))
    lines.append("#   outputs: " + ", ".join(f"v{o.value} ({str(o.dtype).replace('torch.', '')})"
                                               for o in spec.outputs))
    return "\n".join(lines)


def _out_dims(spec: RegionSpec, m: int) -> range:
    """The kernel dims an output varies along: all of them, or all but the row for a per-row one."""
    k = len(spec.dims)
    return range(k - 1) if spec.row_mode and spec.ops[spec.outputs[m].value].row else range(k)


def _index(spec: RegionSpec, d: int) -> str:
    return "cols" if spec.row_mode and d == len(spec.dims) - 1 else f"i{d}"


def _forward(body: _Body, spec: RegionSpec) -> None:
    """Index arithmetic, the loads of the inputs and every op, in order (unused lines are dropped)."""
    k = len(spec.dims)
    if spec.row_mode:
        body.let("row", "tl.program_id(0).to(tl.int64)", row=True)
        body.let("cols", "tl.arange(0, BLOCK)")
        body.let("mask", "cols < N")
        flat, lead = "row", k - 1
    else:
        body.let("offs", "tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)")
        body.let("mask", "offs < numel")
        flat, lead = "offs", k
    for d in range(lead):
        inner = " * ".join(f"size{e}" for e in range(d + 1, lead))
        expr = f"{flat} // ({inner})" if " " in inner else f"{flat} // {inner}" if inner else flat
        body.let(f"i{d}", expr if d == 0 else f"{expr} % size{d}", row=spec.row_mode)
    for j, x in enumerate(spec.inputs):
        terms = [f"{_index(spec, d)} * in{j}_s{d}" for d in x.dims]
        ptr = " + ".join([f"in{j}"] + terms)
        vector = bool(terms) and not x.row
        load = f"tl.load({ptr}, mask=mask{', other=0.0' if x.dtype != torch.bool else ''})" if vector \
            else f"tl.load({ptr})"
        body.let(f"x{j}", load if x.dtype == torch.bool else f"{load}.to(tl.float32)", row=not vector)
    for j, op in enumerate(spec.ops):
        lines, _ = formulas(op.kind, op.params)
        names = _names(op, f"v{j}")
        for line in lines:
            target, expr = line.format(**names).split(" = ", 1)
            body.let(target, expr, row=op.row)


def _names(op: Op, y: str, g: str | None = None) -> dict:
    names = {"y": y, "g": g}
    names.update(zip("abc", (_ref(a) for a in op.args)))
    return names


def _ref(arg) -> str:
    kind, v = arg
    return f"x{v}" if kind == "in" else f"v{v}" if kind == "v" else lit(v)


def _store(spec: RegionSpec, ptr: str, value: str, row: bool, body: _Body) -> str:
    if spec.row_mode and row:
        return f"tl.store({ptr} + row, {value}.to({ptr}.dtype.element_ty))"
    if spec.row_mode and body.is_row(value):       # a vector output that got one value per row
        value = f"tl.broadcast_to({value}, [BLOCK])"
    where = f"{ptr} + row * N + cols" if spec.row_mode else f"{ptr} + offs"
    return f"tl.store({where}, {value}.to({ptr}.dtype.element_ty), mask=mask)"


def _backward(body: _Body, spec: RegionSpec) -> tuple:
    """Reverse-mode over the ops; returns the inputs that get a gradient."""
    terms: dict[str, list[str]] = {}
    for m, out in enumerate(spec.outputs):
        index = [f"{_index(spec, d)} * gout{m}_s{d}" for d in _out_dims(spec, m)]
        ptr = " + ".join([f"gout{m}"] + index)
        row = spec.row_mode and spec.ops[out.value].row or not index
        load = f"tl.load({ptr})" if row else f"tl.load({ptr}, mask=mask, other=0.0)"
        terms.setdefault(f"v{out.value}", []).append(body.let(f"g{m}", f"{load}.to(tl.float32)", row=row))
    for j in reversed(range(len(spec.ops))):
        op = spec.ops[j]
        if f"v{j}" not in terms:
            continue
        grad = _sum(body, f"dv{j}", terms[f"v{j}"])
        _, grads = formulas(op.kind, op.params)
        names = _names(op, f"v{j}", grad)
        for arg, template in zip(op.args, grads):
            if template is None or arg[0] == "c":
                continue
            if arg[0] == "in" and spec.inputs[arg[1]].dtype not in FLOAT_DTYPES:
                continue
            expr = template.format(**names)
            target_row = spec.inputs[arg[1]].row if arg[0] == "in" else spec.ops[arg[1]].row
            if target_row and not op.row:
                # The operand was broadcast along the row: its gradient sums over the row.
                if body.is_row(expr):
                    expr = f"({expr}) * N"
                else:
                    expr = body.let(f"d{_ref(arg)}_{j}", f"tl.sum(tl.where(mask, {expr}, 0.0), 0)", row=True)
            terms.setdefault(_ref(arg), []).append(expr)
    grad_inputs = []
    for j, x in enumerate(spec.inputs):
        if f"x{j}" in terms:
            grad = _sum(body, f"dx{j}", terms[f"x{j}"])
            body.stores.append(_store(spec, f"din{j}", grad, x.row, body))
            grad_inputs.append(j)
    return tuple(grad_inputs)


def _sum(body: _Body, name: str, parts: list[str]) -> str:
    expr = " + ".join(f"({p})" if len(parts) > 1 and " " in p else p for p in parts)
    return body.let(name, expr, row=body.is_row(expr))
