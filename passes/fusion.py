"""Which ops the Triton backend runs in generated or library kernels (docs/kernels.md), as knowledge the
planner shares with codegen: the memory model keeps what those kernels save for backward, which is not
what the ATen ops they replace save (passes/memory.py), and codegen/triton/fuse.py makes the kernels.

- ``fused_op``: how a node reads as an op of a generated kernel, or None;
- ``find_regions``: the regions of a graph that become one generated kernel each;
- ``library_kernel``: the kernel library's (autopar.codegen.kernels) norm or loss that runs an ATen node.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.fx as fx

aten = torch.ops.aten

FLOAT_DTYPES = (torch.float32, torch.bfloat16, torch.float16)
MAX_ROW = 65536     # a row kernel holds one row in registers; longer rows stay ATen


@dataclass(frozen=True)
class FusedOp:
    """A node read as a fused op: ``operands`` are fx nodes or Python numbers, in template order."""

    kind: str
    operands: tuple
    params: tuple = ()


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
        if not (isinstance(cond, fx.Node) and tensor_val(cond) is not None and tensor_val(cond).dtype == torch.bool):
            return None
        return FusedOp("where", (cond, args[1], args[2]))
    if t in _CASTS:
        if set(kw) - {"dtype", "memory_format", "layout", "device"} or len(args) > (2 if t is aten.to.dtype else 1):
            return None
        return FusedOp("cast", (args[0],), (tensor_val(node).dtype,))
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


def tensor_val(node) -> torch.Tensor | None:
    """The tensor a node computes (``meta["val"]``), or None for a non-node or a non-tensor."""
    v = node.meta.get("val") if isinstance(node, fx.Node) else None
    return v if isinstance(v, torch.Tensor) else None


def _last_dim_only(node, dims) -> bool:
    x = tensor_val(node.args[0])
    if x is None or x.dim() == 0 or not isinstance(dims, (list, tuple)) or len(dims) != 1:
        return False
    return dims[0] % x.dim() == x.dim() - 1


def node_arg(node: fx.Node, i: int, name: str, default):
    """The node's argument at position ``i``, or keyword ``name``, or ``default``."""
    return node.args[i] if len(node.args) > i else node.kwargs.get(name, default)


def library_kernel(node: fx.Node) -> str | None:
    """The kernel library's function that runs ``node`` under the Triton backend ("layer_norm",
    "rms_norm" or "cross_entropy"), or None where the node stays as it is."""
    if node.op != "call_function":
        return None
    t = node.target
    x = tensor_val(node.args[0]) if node.args else None
    if x is None or x.dtype not in FLOAT_DTYPES or x.dim() == 0:
        return None
    if t in (aten.layer_norm.default, aten.rms_norm.default):
        if list(node.args[1]) != [x.shape[-1]] or x.shape[-1] > MAX_ROW:
            return None
        return "layer_norm" if t is aten.layer_norm.default else "rms_norm"
    if t is aten.cross_entropy_loss.default:
        target = tensor_val(node.args[1])
        if (x.dim() != 2 or target is None or target.dim() != 1 or node_arg(node, 2, "weight", None) is not None
                or node_arg(node, 3, "reduction", 1) not in (0, 2)
                or node_arg(node, 5, "label_smoothing", 0.0) != 0.0):
            return None
        return "cross_entropy"
    return None


# --- regions -------------------------------------------------------------------------------------
@dataclass(eq=False)
class Region:
    nodes: list          # in graph order
    shape: tuple         # the iteration shape: every op's shape (pointwise), or the reduced input's (row)
    row: bool            # holds a reduction along the last dim


def _fusible(node: fx.Node) -> FusedOp | None:
    if node.op != "call_function":
        return None
    out = tensor_val(node)
    if out is None or out.dtype not in FLOAT_DTYPES:
        return None
    low = fused_op(node)
    if low is None:
        return None
    for i, a in enumerate(low.operands):
        if isinstance(a, fx.Node):
            v = tensor_val(a)
            if v is None or v.device != out.device or v.dtype.is_complex or v.dtype == torch.float64:
                return None
            if v.dtype == torch.bool and not (low.kind == "where" and i == 0):   # masks select, never add
                return None
        elif not isinstance(a, (int, float, bool)):
            return None
    if low.kind in ROW_KINDS and not 1 < tensor_val(low.operands[0]).shape[-1] <= MAX_ROW:
        return None
    return low


def _shape_of(node, low: FusedOp) -> tuple[tuple, bool]:
    """The (iteration shape, row) of a region holding only ``node``."""
    if low.kind in ROW_KINDS:
        return tuple(tensor_val(low.operands[0]).shape), True
    return tuple(tensor_val(node).shape), False


def _combine(a, b):
    """The (shape, row) of two regions joined, or None when one kernel cannot hold both."""
    if a[1] == b[1]:
        return a if a[0] == b[0] else None
    (full, _), (other, _) = (a, b) if a[1] else (b, a)
    return (full, True) if other in (full, full[:-1] + (1,)) else None


def find_regions(graph: fx.Graph, stays=None) -> list[Region]:
    """The regions of two or more fusible nodes, in graph order; ``stays(node)`` marks nodes left out
    (code generation folds them into other ops before the fusion pass sees its graph)."""
    pos = {n: i for i, n in enumerate(graph.nodes)}
    region_of: dict = {}
    for node in graph.nodes:
        low = None if stays is not None and stays(node) else _fusible(node)
        if low is None:
            continue
        candidates = list(dict.fromkeys(region_of[a] for a in low.operands if isinstance(a, fx.Node)
                                        and a in region_of))
        choices = ([candidates] if len(candidates) > 1 else []) + [[c] for c in candidates]
        region = next((r for r in (_join(c, node, low, pos) for c in choices) if r is not None), None)
        if region is None:
            shape, row = _shape_of(node, low)
            region = Region([node], shape, row)
        for n in region.nodes:
            region_of[n] = region
    kept = [r for r in dict.fromkeys(region_of.values()) if len(r.nodes) > 1]   # one op alone gains nothing
    return sorted(kept, key=lambda r: pos[r.nodes[0]])


def _join(regions, node, low, pos) -> Region | None:
    shape = _shape_of(node, low)
    for r in regions:
        shape = shape and _combine(shape, (r.shape, r.row))
    if shape is None:
        return None
    members = {n for r in regions for n in r.nodes} | {node}
    full, row = shape
    # A reduction without keepdim has lost the row's axis: it may leave the region, not feed it.
    if row and any(a in members and tensor_val(a).dim() != len(full) for n in members for a in n.all_input_nodes):
        return None
    if not _convex(members, pos):
        return None
    return Region(sorted(members, key=pos.__getitem__), full, row)


def _convex(members: set, pos: dict) -> bool:
    """No path leaves ``members`` and comes back (the region could not run as one call)."""
    last = max(pos[n] for n in members)
    stack = [u for n in members for u in n.users if u not in members]
    seen = set()
    while stack:
        u = stack.pop()
        if u in seen or pos[u] > last:
            continue
        seen.add(u)
        for w in u.users:
            if w in members:
                return False
            stack.append(w)
    return True


