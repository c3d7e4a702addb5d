"""What each node keeps alive for backward, measured by running the graph on meta tensors under
``saved_tensors_hooks`` and matching every saved tensor to the graph value whose storage it shares.

Saved tensors are attributed at full size; the cost model scales them by each strategy's layout.
Ops whose target-GPU kernel saves something else than the planning machine's kernel (flash attention
keeps a logsumexp, never the s x s scores) declare ``saved_on_gpu`` in their rule, which wins when the
cluster is CUDA (and for attention on CPU too, whose kernel is a flash kernel as well). Under the
Triton backend, the nodes its kernels run keep what those kernels save (``_kernel_records``).
"""
from __future__ import annotations

import dataclasses
import functools
import itertools
import logging
import math
import operator
import weakref

import numpy as np
import torch
import torch.fx as fx
from torch.utils import _pytree as pytree
from torch.utils._python_dispatch import TorchDispatchMode
from dataclasses import dataclass
from typing import Any, Sequence

from autopar.passes.costs import VIEW_OPS
from autopar.passes.fusion import find_regions, library_kernel, tensor_val
from autopar.passes.meta import SavedForBackward, is_param, meta_of, set_meta
from autopar.passes.normalize import folded_matmul
from autopar.passes.precision import gradient_carrier, reduce_itemsize
from autopar.passes.rules import rule_for, tensor_inputs
from autopar.plan import pack_buckets

log = logging.getLogger(__name__)


def _storage_key(t: torch.Tensor):
    return t.untyped_storage()._cdata


def _to_meta(v):
    if isinstance(v, torch.Tensor):
        return torch.empty_strided(v.shape, v.stride(), dtype=v.dtype, device="meta")
    return v


# Ops whose CPU kernel saves what the GPU kernel does rather than what the meta run's reference kernel
# saves: attention runs a flash kernel on CPU too (out and a logsumexp, never the s x s scores).
_FUSED_ON_CPU = {torch.ops.aten.scaled_dot_product_attention.default}


def saved_activations_pass(gm: fx.GraphModule, *, target_device: str = "cuda", fold: bool = True,
                           fused: bool = False) -> fx.GraphModule:
    """Write ``SavedForBackward`` on every call_function node; ``fused`` for the program the Triton backend
    runs (``_kernel_records``).

    With ``fold``, a repeated layer's fourth and later instances are not run: where its second and
    third instances agree at every position (what each node keeps, and whether a view copies), the
    later ones take the third's records, and the values they hand to the ops after them are made from
    their recorded shapes. (The first instance may differ: it reads the embedding, not a layer.)"""
    from autopar.passes.strategies import requires_grad

    owner: dict = {}            # storage -> (node, is_param)
    env: dict = {}
    transients: dict = {}       # _call_key -> _backward_transient
    current = {"node": None, "saved": []}
    template, pairs = _fold_templates(gm) if fold else ({}, {})
    agreed: dict = {}           # layer class -> whether its second and third instances agree

    def value_of(n):
        if n not in env:        # the output of a node not run: a tensor of its recorded shape
            out = pytree.tree_map(_to_meta, n.meta.get("val"))
            for o in pytree.tree_leaves(out):
                if isinstance(o, torch.Tensor):
                    if o.dtype.is_floating_point and requires_grad(n):
                        o.requires_grad_(True)
                    owner.setdefault(_storage_key(o), (n, False))
            env[n] = out
        return env[n]

    def pack(t):
        if current["node"] is not None:
            current["saved"].append(t)
        return t

    grad_mode = torch.is_grad_enabled()
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        for node in gm.graph.nodes:
            if node.op == "placeholder":
                v = _to_meta(node.meta.get("val"))
                role = meta_of(node).role
                if isinstance(v, torch.Tensor) and v.dtype.is_floating_point and role and role.kind == "param":
                    v.requires_grad_(True)
                env[node] = v
                if isinstance(v, torch.Tensor):
                    owner[_storage_key(v)] = (node, role is not None and role.kind == "param")
                continue
            if node.op == "get_attr":
                env[node] = getattr(gm, node.target)
                continue
            if node.op == "output":
                break
            t = template.get(node)
            if t is not None:
                cls = meta_of(node).layer.cls
                if cls not in agreed:
                    agreed[cls] = all(a.target == b.target and meta_of(b).saved is not None
                                      and _view_records(a) == _view_records(b)
                                      for a, b in pairs[cls])
                if agreed[cls]:
                    set_meta(node, saved=meta_of(t).saved, copies=meta_of(t).copies, copies_from=meta_of(t).copies_from)
                    continue
            args, kwargs = fx.node.map_arg((node.args, node.kwargs), value_of)
            if "device" in kwargs:                   # factories: keep everything on meta
                kwargs = {**kwargs, "device": torch.device("meta")}
            current["node"], current["saved"] = node, []
            try:
                with torch.enable_grad():
                    out = node.target(*args, **kwargs)
            except (NotImplementedError, RuntimeError):
                # Ops that insist on real data (a higher-order op whose body moves tensors to a device):
                # take the shapes export recorded; such ops run replicated and save nothing we can see.
                out = pytree.tree_map(_to_meta, node.meta.get("val"))
                current["saved"] = []
            finally:
                # A higher-order op that fails inside its no-grad body leaves grad mode off.
                torch.set_grad_enabled(grad_mode)
            current["node"] = None
            env[node] = out
            outs = [o for o in pytree.tree_leaves(out) if isinstance(o, torch.Tensor)]
            if node.target is not operator.getitem:
                for o in outs:
                    owner.setdefault(_storage_key(o), (node, False))
            if node.target in VIEW_OPS and node.target is not operator.getitem and outs:
                first = next((a for a in pytree.tree_leaves(args) if isinstance(a, torch.Tensor)), None)
                if first is not None and _storage_key(outs[0]) != _storage_key(first):
                    if _reads_narrowed(node):
                        set_meta(node, copies=True)
                    elif target_device == "cpu" or _reads_expanded(first):
                        set_meta(node, copies_from=(tuple(first.shape), tuple(first.stride())))
            reference = _reference_backward(node, target_device)
            saved = _attribute(node, current["saved"], outs, owner, reference is not None)
            if (reference is not None or node.target not in _FUSED_ON_CPU) and node.target is not operator.getitem:
                # Repeated layers run the same ops on the same shapes: one backward per distinct call.
                key = _call_key(node.target, args, kwargs)
                if key is None or key not in transients:
                    t, passed = _backward_transient(node.target, args, kwargs)
                    if key is not None:
                        transients[key] = t, passed
                else:
                    t, passed = transients[key]
                leaves = [a for a in pytree.tree_leaves((args, kwargs)) if isinstance(a, torch.Tensor)]
                passed = tuple(any(p and a is value_of(m) for p, a in zip(passed, leaves)) for m in tensor_inputs(node))
                saved = dataclasses.replace(saved, backward=max(t, int(reference or 0)),
                                            passed=passed if any(passed) else ())
            set_meta(node, saved=saved)
    if fused:
        _kernel_records(gm)
    return gm


def _keeps(saved: SavedForBackward | None) -> bool:
    return saved is not None and bool(saved.outputs or saved.internal or any(saved.inputs))


def _region_backward(region) -> int:
    """Bytes a generated kernel's backward holds beyond the gradients it returns: it writes a gradient of
    every float input (codegen/triton/kernel.py), an input that needs none into a buffer it drops, and
    one that broadcasts (a bias, a norm's weight, a per-row value) at the region's shape in fp32, which
    it then sums to the input's shape."""
    from autopar.passes.strategies import requires_grad

    members = set(region.nodes)
    inputs = dict.fromkeys(a for n in region.nodes for a in n.all_input_nodes if a not in members)
    total = 0
    for a in inputs:
        x = tensor_val(a)
        if x is None or not x.dtype.is_floating_point:
            continue
        per_row = region.row and (x.dim() == 0 or x.shape[-1] == 1) and region.shape[-1] > 1
        full = region.shape[:-1] + (1,) if per_row else region.shape
        exact = tuple(x.shape) == tuple(full)
        if exact and requires_grad(a):
            continue
        total += math.prod(full) * (x.element_size() if exact else 4)
    return total


def _kernel_records(gm: fx.GraphModule) -> None:
    """What the Triton backend's kernels keep for backward, in place of the ATen ops' records, on the
    nodes they run (passes/fusion.py says which; docs/kernels.md). A generated kernel keeps its region's
    inputs and recomputes the rest in its backward kernel, so a value made and read inside the region is
    never kept. The library's norms keep their input, weight and bias and fp32 row statistics (one per
    row for RMS, two for layer norm); its loss keeps the logits, the targets and an fp32 logsumexp per
    row, where ATen's keeps the log-probabilities and its backward makes their gradient beside the
    logits'. The library's kernels hold nothing more in backward than the gradients they return, a generated
    one what ``_region_backward`` counts. A region or kernel through which no gradient flows keeps
    nothing, as its ATen ops do."""
    # A bias add codegen folds into its matmul (passes/normalize.py) is not the kernel's to fuse.
    for region in find_regions(gm.graph, stays=folded_matmul):
        if not any(_keeps(meta_of(n).saved) for n in region.nodes):
            continue
        members = set(region.nodes)
        for n in region.nodes:
            kept = tuple(a not in members for a in tensor_inputs(n))
            set_meta(n, saved=SavedForBackward(0, kept, 0))
        # Its backward runs at the region's last node, where autograd reaches the kernel's call.
        last = region.nodes[-1]
        set_meta(last, saved=dataclasses.replace(meta_of(last).saved, backward=_region_backward(region)))
    for n in gm.graph.nodes:
        kind = library_kernel(n)
        if kind is None or not _keeps(meta_of(n).saved):
            continue
        x = tensor_val(n.args[0])
        rows = x.numel() // x.shape[-1]
        stats = (2 if kind == "layer_norm" else 1) * rows * 4
        set_meta(n, saved=SavedForBackward(0, (True,) * len(tensor_inputs(n)), stats))


def _fold_templates(gm: fx.GraphModule) -> tuple[dict, dict]:
    """For layer classes of 4 or more instances whose instances have the same ops: each node of the
    fourth and later instances -> the node at its position in the third, and per class, the pairs of
    nodes at each position of the second and third instances (which must agree for the fold)."""
    from autopar.passes.layers import layer_instances

    template, pairs = {}, {}
    for cls, insts in layer_instances(gm).items():
        lists = list(insts.values())
        if len(lists) < 4 or any([n.target for n in nodes] != [n.target for n in lists[2]] for nodes in lists[1:]):
            continue
        pairs[cls] = list(zip(lists[1], lists[2]))
        for nodes in lists[3:]:
            template.update(zip(nodes, lists[2]))
    return template, pairs


def _view_records(node: fx.Node) -> tuple:
    """What the meta run records of a node: what it keeps, and whether (and from what) a view copies."""
    m = meta_of(node)
    return m.saved, m.copies, m.copies_from


def _tensor_outputs(gm: fx.GraphModule) -> list:
    """The graph's user outputs that are tensors, as nodes."""
    out = next(n for n in gm.graph.nodes if n.op == "output")
    return [a for a in pytree.tree_leaves(out.args) if isinstance(a, fx.Node) and isinstance(a.meta.get("val"), torch.Tensor)]


def _gathered_outputs(gm: fx.GraphModule, sharded_outputs: bool) -> set:
    """The user outputs returned whole (``passes.reshard_plan.gathered_output``), as values."""
    from autopar.passes.reshard_plan import gathered_output
    from autopar.passes.strategies import Value

    return {Value(a) for a in _tensor_outputs(gm) if gathered_output(a, sharded_outputs)}


def _reads_expanded(x: torch.Tensor) -> bool:
    """Whether a view op's input is broadcast along a dim (stride 0 over more than one element), as
    grouped-query attention's keys and values expanded to every query head are: their reshape copies on
    CUDA as on meta tensors (Qwen2 on an H200 kept both copies per layer: bench/README.md). Other
    reshapes that copy on meta tensors are left to CPU targets: on CUDA the fused attention kernels lay
    their outputs out sequence-major, so the reshape of their transpose views there."""
    return any(st == 0 and size > 1 for size, st in zip(x.shape, x.stride()))


def _reads_narrowed(node: fx.Node) -> bool:
    """Whether a view op reads, through views, a slice that drops part of a dim (the shifted logits
    of a causal LM's loss). Such a reshape copies whatever the shards and kernels. Other reshapes that
    copy on meta tensors may view on a rank (one local head of an expanded key) or on CUDA (the flash
    kernels' outputs are laid out sequence-major): the step memory model finds at each layout whether
    the local input's strides allow a view (``StepMemory._local_copy``), on CUDA only for an expanded
    input (``_reads_expanded``)."""
    n = node.args[0] if node.args and isinstance(node.args[0], fx.Node) else None
    while n is not None and n.op == "call_function" and n.target in VIEW_OPS:
        if n.target is torch.ops.aten.slice.Tensor:
            src, out = n.args[0].meta.get("val"), n.meta.get("val")
            if isinstance(src, torch.Tensor) and isinstance(out, torch.Tensor) and out.numel() < src.numel():
                return True
        n = n.args[0] if n.args and isinstance(n.args[0], fx.Node) else None
    return False


class _NewBytes(TorchDispatchMode):
    """Bytes of the storages that ops allocate while it is active, live and at their peak."""

    def __init__(self):
        super().__init__()
        self.live = self.peak = 0
        self._refs: dict = {}

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in pytree.tree_leaves(out):
            if isinstance(t, torch.Tensor):
                st = t.untyped_storage()
                key = st._cdata
                if key not in self._refs:
                    n = st.nbytes()
                    self.live += n
                    self._refs[key] = weakref.ref(st, functools.partial(self._free, key, n))
        self.peak = max(self.peak, self.live)
        return out

    def _free(self, key, n, _ref):
        self.live -= n
        self._refs.pop(key, None)


def _call_key(target, args, kwargs):
    """What ``_backward_transient`` depends on: the op, its tensors' shapes, strides, dtypes and
    whether they need a gradient, and its other arguments; None when an argument is not plainly
    hashable."""
    def part(a):
        if isinstance(a, torch.Tensor):
            return ("T", tuple(a.shape), a.stride(), a.dtype, a.requires_grad)
        if isinstance(a, (list, tuple)):
            return (type(a).__name__, *(part(x) for x in a))
        if a is None or isinstance(a, (bool, int, float, str, torch.dtype, torch.device, torch.layout,
                                       torch.memory_format)):
            return (type(a).__name__, a)
        raise TypeError

    try:
        return (target, part(list(args)), tuple(sorted((k, part(v)) for k, v in kwargs.items())))
    except TypeError:
        return None


def _backward_transient(target, args, kwargs) -> tuple[int, tuple[bool, ...]]:
    """Bytes an op's backward holds at its peak beyond the gradients it returns (the loss's backward
    keeps a gradient of the log-probabilities while it makes the logits'), on meta tensors at full size,
    and per tensor of ``(args, kwargs)`` (pytree order) whether backward hands it the gradient of the
    op's one output itself, or a view of all of it (an add's inputs of its shape: autograd passes the
    tensor on, no copy; a reshape's). The op runs again on leaf copies of its inputs, so that only its
    own backward runs."""
    def leaf(a):
        return a.detach().requires_grad_(True) if isinstance(a, torch.Tensor) and a.requires_grad else a

    args, kwargs = pytree.tree_map(leaf, (args, kwargs))
    tensors = [a for a in pytree.tree_leaves((args, kwargs)) if isinstance(a, torch.Tensor)]
    ins = [a for a in tensors if a.requires_grad]
    if not ins:
        return 0, ()
    try:
        with torch.enable_grad():
            out = target(*args, **kwargs)
        outs = [o for o in pytree.tree_leaves(out) if isinstance(o, torch.Tensor) and o.grad_fn is not None]
        if not outs:
            return 0, ()
        grads = [torch.empty_like(o) for o in outs]
        with _NewBytes() as mode:
            result = torch.autograd.grad(outs, ins, grads, retain_graph=True, allow_unused=True)
            end = mode.live
    except (NotImplementedError, RuntimeError):
        return 0, ()
    g = grads[0] if len(outs) == 1 else None
    got = {id(a): r for a, r in zip(ins, result)}
    passed = tuple(g is not None and got.get(id(a)) is not None and _storage_key(got[id(a)]) == _storage_key(g)
                   and got[id(a)].numel() == g.numel() and got[id(a)].dtype == g.dtype for a in tensors)
    del result, got
    return max(0, mode.peak - end), passed


def _reference_backward(node, target_device) -> float | None:
    """None where the target device runs the fused kernel the op's rule describes (``saved_on_gpu``), whose
    record then replaces the meta run's; else the target runs the kernel the meta run stands for, and
    this is the least its backward holds there beyond the gradients it returns: the rule's
    ``reference_on_gpu`` where a CUDA target falls back to it, else 0 (the meta run's figure holds)."""
    from autopar.passes.rules import context_for

    rule = rule_for(node)
    if rule.saved_on_gpu is None:
        return 0.0
    if target_device != "cuda":
        return None if node.target in _FUSED_ON_CPU else 0.0
    return rule.reference_on_gpu(context_for(node)) if rule.reference_on_gpu is not None else None


def _attribute(node, saved, outs, owner, reference: bool) -> SavedForBackward:
    rule = rule_for(node)
    ins = tensor_inputs(node)
    if not reference and saved:
        from autopar.passes.rules import context_for

        return rule.saved_on_gpu(context_for(node))
    own_keys = {_storage_key(o) for o in outs}
    saved_keys = set()
    saved_inputs = [False] * len(ins)
    out_bytes, internal, seen = 0, 0, set()
    for t in saved:
        key = _storage_key(t)
        if key in seen:
            continue
        seen.add(key)
        saved_keys.add(key)
        if key in own_keys:
            out_bytes += t.untyped_storage().nbytes()
            continue
        src = owner.get(key)
        if src is None:
            internal += t.untyped_storage().nbytes()
            continue
        producer, _is_param = src
        for k, a in enumerate(ins):
            if a is producer or _views_of(a, producer):
                saved_inputs[k] = True
    held = tuple(_storage_key(o) in saved_keys for o in outs)
    return SavedForBackward(out_bytes, tuple(saved_inputs), internal, held)


def _views_of(node: fx.Node, producer: fx.Node) -> bool:
    """Whether ``node`` reads ``producer``'s storage through a chain of single-input nodes."""
    seen = 0
    while node is not producer and seen < 64:
        ins = node.all_input_nodes
        if len(ins) != 1:
            return False
        node = ins[0]
        seen += 1
    return node is producer


# --- The step's memory: one event list for the plan's timeline and the solver's constraints ---------

CATEGORIES = ("params", "optimizer", "grads", "activations", "transient")
_P, _O, _G, _A, _T = range(5)
# The bucketed gradients' shares ready so far: a running sum of its own, counted as transient only at the
# points where a bucket may copy (``StepMemory._copy_points``).
_S = len(CATEGORIES)


@dataclass(frozen=True)
class Bytes:
    """Bytes that depend on at most two decisions: a constant (``a`` is None), ``table[option of a]``
    (``b`` is None), or ``table[option of a][option of b]``."""

    a: int | None
    b: int | None
    table: Any

    def at(self, assignment) -> float:
        if self.a is None:
            return self.table
        if self.b is None:
            return self.table[assignment[self.a]]
        return self.table[assignment[self.a]][assignment[self.b]]

    def zero(self) -> bool:
        if self.a is None:
            return not self.table
        if self.b is None:
            return not any(self.table)
        return not any(any(r) for r in self.table)

    def map(self, f) -> "Bytes":
        if self.a is None:
            return Bytes(None, None, f(self.table))
        if self.b is None:
            return Bytes(self.a, None, tuple(f(v) for v in self.table))
        return Bytes(self.a, self.b, tuple(tuple(f(v) for v in r) for r in self.table))


def _one(c, table) -> Bytes:
    return Bytes(None, None, float(table[0])) if c is None else Bytes(c, None, tuple(float(v) for v in table))


def _pair(a, b, table) -> Bytes:
    """``table[i][j]`` over the options of ``a`` and ``b``; ``None`` for a decision with one option."""
    if a is None:
        return _one(b, table[0])
    if b is None:
        return _one(a, [row[0] for row in table])
    if a == b:
        return _one(a, [row[i] for i, row in enumerate(table)])
    return Bytes(a, b, tuple(tuple(float(v) for v in row) for row in table))


def _gated(q: Bytes, c: int | None, ind: Sequence[float]) -> Bytes:
    """``q`` where decision ``c`` takes an option whose indicator in ``ind`` is 1: ``q`` may depend on
    ``c`` and at most one other decision."""
    if c is None:
        return q.map(lambda v: v * ind[0])
    if q.a is None:
        return Bytes(c, None, tuple(q.table * f for f in ind))
    if q.a == c and q.b is None:
        return Bytes(c, None, tuple(v * f for v, f in zip(q.table, ind)))
    if q.a == c:
        return Bytes(q.a, q.b, tuple(tuple(v * f for v in row) for row, f in zip(q.table, ind)))
    if q.b == c:
        return Bytes(q.a, q.b, tuple(tuple(v * f for v, f in zip(row, ind)) for row in q.table))
    assert q.b is None, "a gated allocation depends on at most two decisions"
    return Bytes(q.a, c, tuple(tuple(v * f for f in ind) for v in q.table))


def _shared(src: int | None, readers, table):
    """The bytes of one value's copies that ``readers`` (decision, request per option) make at most once
    per request, ``table[request][option of src]``, as the solver's ``SharedBytes``; a decision None has
    one option, and its request is made whatever the others. None where they are no bytes."""
    from autopar.solver import SharedBytes

    always = tuple(sorted({reqs[0] for c, reqs in readers if c is None and reqs[0] >= 0}))
    free = tuple(sorted({(c, reqs) for c, reqs in readers if c is not None and any(r >= 0 for r in reqs)}))
    made = set(always) | {r for _, reqs in free for r in reqs if r >= 0}
    if not any(b for r in made for b in table[r]):
        return None
    return SharedBytes(src, free, tuple(table), always)


def _staging(steps, info, size: float, cpu: bool) -> float:
    """Bytes a resharding's collectives hold while they run beyond its input and its result (``size``
    bytes): each step's own buffers (``Step.staging``), beside the result of the step before it and,
    before the last, its own result where it makes a storage."""
    from math import prod

    def made(st):
        return float(info.dtype.itemsize * prod(st.out_shape)) if st.makes_storage else 0.0

    extra = [(made(steps[i - 1]) if i else 0.0) + st.staging(info.dtype.itemsize, cpu)
             + (made(st) - size if i < len(steps) - 1 else 0.0) for i, st in enumerate(steps)]
    return max([0.0, *extra])


def _copied_after_wait(steps, itemsize: int, cpu: bool) -> bool:
    """Whether a resharding is one split collective (``codegen/overlap.py``) that holds its input itself
    until its wait and makes its result after it, the input dropped at the wait where nothing else
    holds it: an all-gather whose received blocks are copied out contiguous (a dim with larger dims
    before it), or on CPU a reduce-scatter whose blocks go unstacked by an all-to-all and are summed on
    arrival. (An input stacked for sending is let go at the issue; a result received in place is made
    at the issue.)"""
    if len(steps) != 1:
        return False
    (st,) = steps
    if st.op == "all_gather":
        return st.staging(itemsize, cpu) > 0
    return st.op == "reduce_scatter" and cpu and st.staging(itemsize, cpu) == math.prod(st.in_shape) * itemsize


def _if_recomputed(q: Bytes, r: int, ind: Sequence[float]) -> Bytes:
    """``q`` where recompute decision ``r`` takes an option whose indicator in ``ind`` is 1; bytes of two
    layouts whatever it takes (their product with the recompute count would depend on three decisions:
    the safe side)."""
    return q if q.b is not None else _times(q, r, ind)


def _below(q: Bytes) -> Bytes:
    """At most ``q``, as bytes of at most one decision: ``q``, or for two, the least of its rows over
    one of them (the larger on average)."""
    if q.b is None:
        return q
    rows = [min(row) for row in q.table]
    cols = [min(col) for col in zip(*q.table)]
    return _one(q.a, rows) if sum(rows) / len(rows) >= sum(cols) / len(cols) else _one(q.b, cols)


def _always_recomputed(insts, instances) -> str | None:
    """The one of recomputed regions ``insts`` that every option of its decision recomputes (recompute
    pinned on), if any: what it keeps is dropped through forward and made again whatever the layouts."""
    return next((inst for inst in insts if all(instances[inst][1])), None)


def _times(q: Bytes, r: int, ind: Sequence[float]) -> Bytes:
    """``q`` (bytes of at most one decision) times an indicator over the options of decision ``r``."""
    if q.a is None:
        return Bytes(r, None, tuple(q.table * f for f in ind))
    assert q.b is None, "a product with a recompute count takes bytes of one decision"
    return Bytes(q.a, r, tuple(tuple(v * f for f in ind) for v in q.table))


@dataclass(frozen=True)
class _Product(Bytes):
    """The product of ``factors`` (bytes and indicators) where it depends on three decisions: ``at`` (the
    walk, under one assignment) is exact, while ``a``, ``b`` and ``table``, the solver's terms, hold a
    bound of two decisions below it (such a product is only subtracted from what is live, so the solver's
    points stay above the walk's)."""

    factors: tuple = ()

    def at(self, assignment) -> float:
        return math.prod(f.at(assignment) for f in self.factors)


def _broadcast(q: Bytes, ds: list) -> np.ndarray:
    """``q``'s table as an array with one axis per decision of ``ds`` (size 1 where it does not depend on
    it), the least over any decision it depends on outside ``ds``."""
    shape = [1] * len(ds)
    if q.a is None:
        return np.full(shape, q.table, dtype=float)
    table = np.asarray(q.table, dtype=float)
    own = [q.a] if q.b is None else [q.a, q.b]
    for ax in reversed(range(len(own))):
        if own[ax] not in ds:
            table = table.min(axis=ax)
            del own[ax]
    if len(own) == 2 and ds.index(own[0]) > ds.index(own[1]):
        table, own = table.T, own[::-1]
    for d, n in zip(own, table.shape):
        shape[ds.index(d)] = n
    return table.reshape(shape)


@dataclass(frozen=True)
class _MovedGradient:
    """Per option of a parameter, what happens to its gradient once accumulated: an offloaded one is
    copied to host memory at once, and so is a ZeRO-2 one reduce-scattered without overlap: that leaves
    ``offloaded`` on the device and frees ``offloaded_whole``, holding ``output`` (the collective's
    output) meanwhile; with overlap a ZeRO-2 one (``deferred`` 1) is reduce-scattered, and ``in_flight``
    is (its block, the whole gradient the collective holds until its wait, the collective's output
    until then)."""

    offloaded: Bytes
    offloaded_whole: Bytes
    output: Bytes
    in_flight: tuple
    deferred: tuple


@dataclass
class StepPoint:
    phase: str            # forward, recompute, backward, optimizer
    name: str             # the node, layer instance or parameter at that point
    bytes: dict           # category -> bytes per device

    @property
    def total(self) -> float:
        return sum(self.bytes.values())


class StepMemory:
    """The live bytes of one training step on one device, as events over the plan's decisions.

    The step modelled is any after the first: optimizer states exist from the start, gradients are
    None (``zero_grad(set_to_none=True)``) until backward makes them, and the caller holds the inputs
    and the returned outputs until the step ends. (The first step makes the optimizer states in its
    optimizer step, so its peak is at most a later step's.) Forward runs the graph in order: each op
    allocates its outputs (views allocate nothing) and the resharded copies it reads; a value is freed
    after its last reader unless backward keeps it: a saved input at the layout its reader reads it in,
    a saved output or an op's internal buffer until that op's backward. Backward runs in reverse: each
    op allocates the gradients of its inputs (at the layout read when a resharding's backward then
    converts them; none for an input that autograd hands the output's gradient itself, one tensor the
    inputs that hold it share), then frees its outputs' gradients and what it kept; parameter gradients stay until
    the optimizer step, which adds the optimizer's transient buffers. A recomputed layer instance keeps
    only its inputs through forward and runs its forward again, op by op, when its backward starts.
    ``overlap=False`` follows the program ``compile(overlap=False)`` makes: no gradient buckets, and a
    ZeRO-2 gradient's reduce-scatter waited where it is issued; ``split_collectives=False`` (pipeline
    stages) only its forward collectives waited where they are issued, holding their inputs through
    their copies.

    Every allocation is ``Bytes`` of at most two decisions (two layouts, or a layout and a recompute
    count), so the live bytes at any point are exactly a linear memory constraint with pair terms:
    ``walk`` evaluates every point under one assignment (the plan's timeline and peak) and
    ``constraint`` hands one point to the solver. Both sum the same events; the one kind of event of
    three decisions (``_Product``: the gradient two inputs of an add share, taken off) is exact in the
    walk and a bound below it in the solver's terms, so a constraint is never below the walk.
    """

    def __init__(self, gm, cm, idx, num_options: Sequence[int], *, sharded_outputs: bool = False,
                 overlap: bool = True, sharded_masters: bool = True, split_collectives: bool = True):
        from autopar.passes.layers import attention_cores, layer_instances

        self.cm, self.idx, self.num_options = cm, idx, tuple(num_options)
        self.sharded_outputs, self.overlap = sharded_outputs, overlap
        # Whether the program splits its forward collectives into issue and wait (codegen/overlap.py:
        # with overlap, not in pipeline stages), whose wait drops what the collective holds.
        self.split_collectives = overlap and split_collectives
        # Whether a ZeRO-1/2 weight read through its bfloat16 copy has its float32 master sharded
        # (``passes.precision.sharded_master_copy``; not in a pipeline's stages): the program reads the
        # whole copy, held all step, in place of the cast.
        self.sharded_masters = sharded_masters
        self.events: list[tuple[int, int, Bytes]] = []     # (category, +1 or -1, bytes)
        self.points: list[tuple[int, str, str]] = []       # (number of events before it, phase, name)
        self._copy_points: set[int] = set()                # the points where a gradient bucket may copy
        self._runs: list[range] = []      # the points of a layer's forward, and of a recomputed one's run again
        self._values: dict = {}
        self._reads: dict = {}
        self._steps: dict = {}   # (source layout, read layout, reduced axes, shape, dtype) -> bytes of its steps
        self._copies: dict = {}
        self._released: dict = {}   # fold key of (value, reader, input) -> ``released``
        self._passes: dict = {}    # fold key of (value, reader, input) -> (indicator, its complement) or None
        self._products: dict = {}  # identities of factors -> (the factors, their product)
        self._moved: dict = {}   # an instance whose saved activations go to host -> (decision, indicator)
        self._recomputed: dict = {}   # a region that runs its forward again -> (decision, indicator)
        self._host: dict = {}    # a parameter's decision -> host bytes per option (offloaded optimizer states)
        self._gathered_outputs = _gathered_outputs(gm, sharded_outputs)
        instances = {}        # a recomputed region (a layer instance, or its attention core) -> (decision,
        #                       1 or 0 per option of it: whether the region recomputes, its nodes)
        for cls, insts in layer_instances(gm).items():
            if cls in idx.recompute:
                ri, counts, selective, offloaded = idx.recompute[cls]
                # An instance whose saved activations go to host memory keeps nothing on the device
                # through forward and brings them back as its backward runs: at most what a recomputed
                # one re-materializes when its backward starts. Where host and device are one memory
                # (CPU processes) nothing leaves.
                off = [0 if cm.cluster.host_is_device else f for f in offloaded]
                for j, (inst, nodes) in enumerate(insts.items()):
                    ind = tuple(1.0 if r > j or r + k <= j < r + k + f else 0.0
                                for r, k, f in zip(counts, selective, off))
                    moved = tuple(1.0 if r + k <= j < r + k + f else 0.0 for r, k, f in zip(counts, selective, off))
                    if any(moved):
                        self._moved[inst] = (ri, moved)
                    if any(ind):
                        instances[inst] = (ri, ind, nodes)
                    again = tuple(1.0 if r > j else 0.0 for r in counts)
                    if any(again):
                        self._recomputed[inst] = (ri, again)
                    ind = tuple(1.0 if r <= j < r + k else 0.0 for r, k in zip(counts, selective))
                    if any(ind):
                        for c, core in enumerate(attention_cores(nodes)):
                            instances[core_region(inst, c)] = (ri, ind, core)
                            self._recomputed[core_region(inst, c)] = (ri, ind)
        self._build(gm, instances)

    # --- bytes of values under the decisions -------------------------------------------------------
    def _choice(self, node):
        from autopar.passes.ilp_build import key_of

        if node not in self.idx.strategies:
            return None
        c = self.idx.choice_of_key[key_of(self.idx.strategies.root_of(node))]
        return c if self.num_options[c] > 1 else None

    def _options(self, c):
        return range(1 if c is None else self.num_options[c])

    def _strategy(self, node, o):
        return self.idx.strategies.strategy_of(node, o) if node in self.idx.strategies else None

    def _fold_key(self, v, node=None, k=None):
        """What the bytes of ``v`` (read by ``node`` as input ``k``) depend on: the value itself, or for
        values and readers inside repeated layers their position in the layer, which every instance of
        the layer shares with its decisions and strategies (passes.layers)."""
        from autopar.passes.ilp_build import key_of
        from autopar.passes.strategies import value_info

        ka = key_of(v.node) if v.node in self.idx.strategies else None
        kb = None if node is None else key_of(node)
        if ka is None or ka[0] != "L" or (kb is not None and kb[0] != "L"):
            return (v, node, k)
        info = value_info(v)
        return (ka, v.index, kb, k, info.shape, info.dtype)

    def value(self, v) -> Bytes:
        """Bytes of value ``v`` at the layout its producer makes it in."""
        from autopar.layout import local_fraction
        from autopar.passes.strategies import value_info

        key = self._fold_key(v)
        if key not in self._values:
            nbytes = value_info(v).nbytes
            c = self._choice(v.node)
            table = []
            for o in self._options(c):
                s = self._strategy(v.node, o)
                table.append(nbytes * (1.0 if s is None else local_fraction(s.outputs[v.index], self.cm.mesh_shape)))
            self._values[key] = _one(c, table)
        return self._values[key]

    def _master_copy(self, param, o):
        """The copy ``param`` is read through where its option ``o`` shards its float32 master, else None."""
        from autopar.passes.precision import sharded_master_option

        if not self.sharded_masters or param not in self.idx.strategies:
            return None
        return sharded_master_option(param, o, self.idx.strategies)

    def storage(self, v) -> Bytes:
        """Bytes of the storage value ``v`` makes: its ``value``, but nothing for the copy of a parameter
        whose option shards its master (the copy is the parameter's, held all step)."""
        from autopar.passes.precision import cast_source

        vb = self.value(v)
        src = cast_source(v.node) if v.node.op == "call_function" else None
        if src is None or not is_param(src) or self._choice(src) != self._choice(v.node):
            return vb
        c = self._choice(src)
        held = [self._master_copy(src, o) is v.node for o in self._options(c)]
        if not any(held):
            return vb
        return _one(c, [0.0 if h else vb.at({c: o}) for o, h in zip(self._options(c), held)])

    def reads(self, v, node, k):
        """How ``node`` reads its input ``k``, value ``v``: (the value's decision, the reader's, the request
        each reader option makes (target layout, gradient reduction: one copy per distinct request, as
        codegen reshards), and per request, per option of the value, (bytes of the resharded copy, bytes
        of the gradient at the layout read when a resharding's backward converts it, bytes of the
        gathered blocks beside that gradient's contiguous copy, bytes the resharding's collectives hold
        beyond the value and the copy while they run, 1 where its collective holds the value itself
        until its wait and makes the copy after it (``_copied_after_wait``), else 0))."""
        from math import prod

        from autopar.layout import R, local_fraction
        from autopar.passes.resharding import grad_partial_axes
        from autopar.passes.strategies import requires_grad, value_info

        key = self._fold_key(v, node, k)
        if key not in self._reads:
            info = value_info(v)
            mesh = tuple(self.cm.mesh_shape)
            cpu = self.cm.cluster.device_type != "cuda"
            grad = requires_grad(v.node)
            ca, cb = self._choice(v.node), self._choice(node)
            requests, made = [], {}
            for j in self._options(cb):
                s = self._strategy(node, j)
                dst = tuple(s.inputs[k])
                request = (dst, grad_partial_axes(dst, s.splits_work, grad))
                requests.append(request)
                made.setdefault(request, s)
            # Readers' options ask for few distinct requests and producers make few distinct layouts, and
            # values of one shape and dtype (a layer's every instance) share their steps: each is found once.
            found = self._steps
            # A user output returned whole is gathered once (codegen shares the resharding of one
            # request): a reader that reads it whole, with no gradient to reduce, reads that copy, which
            # ``_output_copy`` counts from the output's node to the step's end.
            returned = (tuple(R for _ in mesh), frozenset()) if v in self._gathered_outputs else None
            per_request = {}
            for (dst, partial), s in made.items():
                size = info.nbytes * local_fraction(dst, mesh)
                rows = []
                for i in self._options(ca):
                    src = self._strategy(v.node, i)
                    pair = (dst, dst, partial) if src is None else (
                        tuple(src.outputs[v.index]), dst, src.readers_grad_partial(partial))
                    fk = (*pair, info.shape, info.dtype)
                    if fk not in found:
                        steps = self.cm.transition(v, *pair) or []
                        # A local chunk's backward all-gathers the gradient; along a dim with larger
                        # dims before it, the gathered blocks stand beside their contiguous copy.
                        gathered = max((info.dtype.itemsize * prod(st.in_shape) for st in steps if st.op == "local_chunk"
                                        and st.dim and prod(st.in_shape[:st.dim]) > 1), default=0.0)
                        found[fk] = (size if any(st.makes_storage for st in steps) else 0.0,
                                     size if steps else 0.0, float(gathered), _staging(steps, info, size, cpu),
                                     1.0 if _copied_after_wait(steps, info.dtype.itemsize, cpu) else 0.0)
                    rows.append((0.0, *found[fk][1:]) if pair[1:3] == returned else found[fk])
                per_request[(dst, partial)] = rows
            self._reads[key] = (ca, cb, tuple(requests), per_request)
        return self._reads[key]

    def copy(self, v, node, k):
        """(bytes of the resharded copy that ``node`` reads input ``k`` through, bytes of that input's
        gradient at the layout read when a resharding's backward converts it, bytes of the gathered blocks
        beside that gradient's contiguous copy, bytes the resharding's collectives hold beyond the value
        and the copy while they run); None where there is none."""
        key = self._fold_key(v, node, k)
        if key not in self._copies:
            ca, cb, requests, per_request = self.reads(v, node, k)
            tables = [[[per_request[r][i][part] for r in requests] for i in self._options(ca)] for part in range(4)]
            self._copies[key] = tuple(None if q.zero() else q for q in (_pair(ca, cb, t) for t in tables))
        return self._copies[key]

    def released(self, v, node, k):
        """Where ``node`` reads input ``k`` (value ``v``) through a resharded copy, the bytes of the input
        that can go before ``node`` runs, of the two decisions: (those its collective's wait drops before
        the copy is made, where its collective holds the input itself until the wait and copies after
        it (``_copied_after_wait``): as many as the copy at most, since the collective's input and its
        received blocks are live together before the wait; the rest, which goes once the copy is made;
        1 where a copy is made), None for what is 0 under every option; None where the read makes no
        copy."""
        key = self._fold_key(v, node, k)
        if key not in self._released:
            cp = self.copy(v, node, k)[0]
            out = None
            if cp is not None:
                ca, cb, requests, per_request = self.reads(v, node, k)
                vb = self.value(v)
                made = cp.map(lambda x: 1.0 if x else 0.0)
                waited, rest = [], []
                for i in self._options(ca):
                    w, r = [], []
                    for j, req in zip(self._options(cb), requests):
                        at, x = {ca: i, cb: j}, vb.at({ca: i})
                        early = min(x, cp.at(at)) * per_request[req][i][4] if self.split_collectives else 0.0
                        w.append(early)
                        r.append(x * made.at(at) - early)
                    waited.append(w)
                    rest.append(r)
                out = tuple(None if q.zero() else q for q in (_pair(ca, cb, waited), _pair(ca, cb, rest))) + (made,)
            self._released[key] = out
        return self._released[key]

    def _local_copy(self, node) -> Bytes | None:
        """Bytes of the copy a view op makes at each of its options where its local input's strides
        allow no view (``copies_from``: a reshape of grouped-query attention's expanded keys, which
        views where a rank holds one key head, or of a transposed attention output), or None."""
        from autopar.layout import local_shape
        from autopar.passes.strategies import Value

        spec = meta_of(node).copies_from
        if spec is None:
            return None
        shape, stride = spec
        out_shape, c, vb = tuple(node.meta["val"].shape), self._choice(node), self.value(Value(node))
        table = []
        for o in self._options(c):
            s = self._strategy(node, o)
            x = torch.empty_strided(shape, stride, device="meta")
            if s is not None:
                for d, size in enumerate(local_shape(shape, s.inputs[0], self.cm.mesh_shape)):
                    x = x.narrow(d, 0, size)
                out_shape = local_shape(tuple(node.meta["val"].shape), s.outputs[0], self.cm.mesh_shape)
            try:
                x.view(out_shape)
                table.append(0.0)
            except RuntimeError:
                table.append(vb.at({c: o}))
        q = _one(c, table)
        return None if q.zero() else q

    def _output_copy(self, node, gathered: bool):
        """(bytes of the replicated copy a gathered user output is returned as, bytes of the contiguous
        copy made of it at the end of forward), or (None, None).

        The collective is issued as soon as the output is computed (codegen/overlap.py) and waited at
        the end of forward, so its result is live from there. An all-gather along a dim with larger
        dims before it receives the blocks stacked on a new leading dim: the result is made
        contiguous in the output's own layout at the wait, a second full copy while the first is
        freed."""
        from math import prod

        from autopar.layout import R
        from autopar.passes.strategies import Value, value_info

        if not gathered:
            return None, None
        v, c = Value(node), self._choice(node)
        rep = tuple(R for _ in self.cm.mesh_shape)
        table, again = [], []
        for o in self._options(c):
            s = self._strategy(node, o)
            steps = self.cm.resharding(v, s, None, 0, dst_layout=rep) if s else []
            nbytes = value_info(v).nbytes if steps else 0.0
            table.append(nbytes)
            again.append(nbytes if any(st.op == "all_gather" and st.dim and prod(st.in_shape[:st.dim]) > 1
                                       for st in steps) else 0.0)
        q, r = _one(c, table), _one(c, again)
        return (None, None) if q.zero() else (q, None if r.zero() else r)

    def _per_work(self, node, nbytes: float) -> Bytes:
        """Bytes private to an op (norm statistics, a log-softmax): they scale with its share of the
        work, not with its output (a loss over sharded tokens has a Partial scalar output)."""
        c = self._choice(node)
        return _one(c, [nbytes / self.cm.work_split(self._strategy(node, o)) for o in self._options(c)])

    def _saved_per_option(self, node, saved) -> list:
        """What ``node`` keeps for backward under each of its options: its sharded form's own where the
        rule gives one (the vocab-parallel loss keeps its logits, not a log-softmax), else ``saved``."""
        from autopar.passes.rules import context_for

        c = self._choice(node)
        rule = rule_for(node)
        if rule.saved_sharded is None:
            return [saved for _ in self._options(c)]
        ctx = context_for(node)
        return [(rule.saved_sharded(ctx, s.inputs, self.cm.mesh_shape) if s is not None else None) or saved
                for s in (self._strategy(node, o) for o in self._options(c))]

    def _converted(self, v, node, k, itemsize) -> Bytes:
        """Bytes of the copy of input ``k`` (value ``v``) in another dtype that ``node`` keeps for
        backward, ``itemsize[option]`` bytes an element, at the layout each option reads it in."""
        from autopar.layout import R
        from autopar.passes.strategies import value_info

        info, c = value_info(v), self._choice(node)
        table = []
        for o in self._options(c):
            s = self._strategy(node, o)
            layout = tuple(R for _ in self.cm.mesh_shape) if s is None else s.inputs[k]
            table.append(self.cm.converted_bytes(info.nbytes, info.dtype.itemsize, itemsize[o], layout))
        return _one(c, table)

    def _backward_work(self, node, saved) -> Bytes:
        """Bytes an op's backward holds beyond the gradients it returns: its sharded form's own figure
        where the rule gives one (the vocab-parallel loss), else the ATen op's measured one."""
        measured = saved.backward if saved is not None else 0
        if rule_for(node).backward_workspace is None:
            return self._per_work(node, measured) if measured else Bytes(None, None, 0.0)
        c = self._choice(node)
        table = []
        for o in self._options(c):
            s = self._strategy(node, o)
            own = self.cm.backward_workspace_bytes(node, s)
            table.append(own if own is not None else measured / self.cm.work_split(s))
        return _one(c, table)

    def _passed(self, v, node, k) -> tuple[Bytes, Bytes] | None:
        """1 where ``node``'s backward hands its input ``k`` (value ``v``) its output's gradient tensor
        itself, or a view of it: the op passes it on (``SavedForBackward.passed``: an add's inputs of its
        shape and dtype, a reshape's input) and, under the two layouts, the input is read in place (no
        resharding whose backward converts the gradient) at the output's layout (a view: of its bytes):
        (that indicator, one less it), or None where it never does."""
        from autopar.passes.strategies import Value

        saved = meta_of(node).saved
        if saved is None or k >= len(saved.passed) or not saved.passed[k] or is_param(v.node):
            return None
        ca, cb = self._choice(v.node), self._choice(node)
        if self._choice(_canonical(v).node) != ca:
            return None
        key = self._fold_key(v, node, k)
        if key in self._passes:
            return self._passes[key]
        gcp, view = self.copy(v, node, k)[1], node.target in VIEW_OPS
        vi, vo = self.value(_canonical(v)), self.value(Value(node))
        table = []
        for i in self._options(ca):
            row = []
            for j in self._options(cb):
                s, at = self._strategy(node, j), {ca: i, cb: j}
                row.append(1.0 if (gcp is None or not gcp.at(at)) and vi.at(at) == vo.at(at)
                           and (view or s is None or tuple(s.inputs[k]) == tuple(s.outputs[0])) else 0.0)
            table.append(row)
        q = _pair(ca, cb, table)
        self._passes[key] = None if q.zero() else (q, q.map(lambda x: 1.0 - x))
        return self._passes[key]

    def _product(self, *factors: Bytes) -> Bytes:
        """The product of ``factors`` (bytes and indicators, never negative): exact where they depend on
        at most two decisions together, else a ``_Product`` whose solver terms are, over the pair of its
        decisions that leaves the most on average, the product of each factor's least over the others."""
        factors = tuple(g for f in factors for g in (f.factors if isinstance(f, _Product) else (f,)))
        key = tuple(map(id, factors))
        if key in self._products:
            return self._products[key][1]
        ds = sorted({d for f in factors for d in (f.a, f.b) if d is not None})
        best = None
        for pair in itertools.combinations(ds, 2) if len(ds) > 2 else (ds,):
            pair = list(pair)
            grid = np.broadcast_to(math.prod(_broadcast(f, pair) for f in factors),
                                   [self.num_options[d] for d in pair])
            if best is None or grid.mean() > best[1].mean():
                best = pair, grid
        pair, grid = best
        a, b = (pair + [None, None])[:2]
        q = _pair(a, b, grid.reshape(len(self._options(a)), len(self._options(b))).tolist())
        # Keyed by the factors' identities, which the entry keeps alive.
        self._products[key] = factors, q if len(ds) <= 2 else _Product(q.a, q.b, q.table, factors)
        return self._products[key][1]

    def _shared_copies(self, calls, pos, input_values, inst_of, frees, copy_views, instances, remat):
        """The copies of values that several ops read through a resharding: one tensor per distinct
        request (codegen reshards once per request and shares the copy), held from the first reader's
        forward until the last reader that keeps it runs its backward. Returns the (reader, input
        position) pairs counted here and the copies made before each position's forward; adds the rest
        to ``frees``.

        In forward, at the i-th reader (in execution order) the value's copies are those of the requests
        the readers from the i-th on make, and those the earlier readers keep for backward (the safe side
        where readers make different requests: a copy is counted from the first reader on). In backward,
        what the readers keep is released a reader at a time, and the gradient at a request's layout is
        accumulated from the first reader whose backward makes it until the last (the resharding's
        backward then converts it), beside each reader's own gradient (counted with its backward). A
        reader inside a recomputed region whose kept copy recompute drops keeps its own copy, and so
        does a copy view (its copy is its output's storage). Readers all inside one instance that every
        option recomputes drop what they keep after the last one's forward; the run again makes it at
        the first one (``remat``), as a kept copy of two layouts is."""
        from autopar.passes.strategies import Value, requires_grad

        readers = {}          # value -> [(reader, input position, its decision, request per option, keeps)]
        tables = {}           # value -> (its decision, request -> per option of it (copy, gradient, blocks))
        for n in calls:
            saved = meta_of(n).saved
            kept = None if saved is None or not requires_grad(n) else \
                [tuple(s.inputs) for s in self._saved_per_option(n, saved)]
            for k, v in enumerate(input_values(n)):
                ca, cb, requests, per_request = self.reads(v, n, k)
                if (ca is not None and ca == cb) or Value(n) in copy_views:
                    continue
                if not any(f or b for rows in per_request.values() for f, b, *_ in rows):
                    continue
                cp = self.copy(v, n, k)[0]
                if n in inst_of and cp is not None and cp.b is None:
                    continue
                keeps = tuple(kept is not None and k < len(ins) and bool(ins[k]) for ins in kept or [()] * len(requests))
                readers.setdefault(v, []).append((n, k, cb, requests, keeps))
                tables.setdefault(v, (ca, {}))[1].update(per_request)
        grouped, before = set(), {}
        for v, members in readers.items():
            if len(members) < 2:
                continue
            members.sort(key=lambda m: (pos[m[0]], m[1]))
            grouped.update((n, k) for n, k, *_ in members)
            ca, per_request = tables[v]
            ids = {r: i for i, r in enumerate(per_request)}
            copy_bytes, grad_bytes = ([tuple(row[part] for row in per_request[r]) for r in ids] for part in (0, 1))
            make = [(cb, tuple(ids[r] for r in requests)) for _, _, cb, requests, _ in members]
            keep = [(cb, tuple(r if kp else -1 for r, kp in zip(reqs, m[4]))) for (cb, reqs), m in zip(make, members)]
            t = [pos[m[0]] for m in members]
            last = len(members) - 1

            def move(key, cat, was, now):
                moves = frees.setdefault(key, [])
                moves += [(cat, -1, was)] if was is not None else []
                moves += [(cat, 1, now)] if now is not None else []

            # Forward: the readers from the i-th on make their copies, the earlier ones keep theirs.
            live = [_shared(ca, keep[:i] + make[i:], copy_bytes) for i in range(last + 2)]
            if live[0] is not None:
                before.setdefault(t[0], []).append(live[0])
            for i in range(last + 1):
                move(("F", t[i]), _T, live[i], None)
                move(("F", t[i]), _A if i == last else _T, None, live[i + 1])
            always = _always_recomputed(set.intersection(*(set(inst_of.get(m[0], ())) for m in members)), instances)
            if always is not None and live[last + 1] is not None:
                move(("F", t[last]), _A, live[last + 1], None)
                remat.setdefault(always, []).append((t[0], live[last + 1]))
            # Backward, in reverse: the i-th reader releases what it keeps, and its gradient joins the
            # accumulated one of its request, which the resharding's backward converts after the first.
            grads = {i for i, (n, *_) in enumerate(members) if requires_grad(n)} if requires_grad(v.node) else set()
            for i in range(last, -1, -1):
                move(("B", t[i]), _A, _shared(ca, keep[:i + 1], copy_bytes), _shared(ca, keep[:i], copy_bytes))
                if i in grads:
                    done = [make[j] for j in range(i + 1, last + 1) if j in grads]
                    move(("B", t[i]), _T, _shared(ca, done, grad_bytes),
                         _shared(ca, [make[i], *done], grad_bytes) if i > min(grads) else None)
        return grouped, before

    # --- the events ---------------------------------------------------------------------------------
    def _build(self, gm, instances):
        from autopar.passes.normalize import folded_matmul
        from autopar.passes.strategies import Value, requires_grad

        calls = [n for n in gm.graph.nodes if n.op == "call_function"]
        pos = {n: t for t, n in enumerate(calls)}
        add = self.events.append
        input_values, output_values = _memoized(_input_values), _memoized(_output_values)

        def is_view(n):
            return n.target in VIEW_OPS and not meta_of(n).copies

        def base(v):
            """The value whose storage ``v`` shares (views and getitems lead back to it)."""
            while v.node.op == "call_function" and is_view(v.node):
                ins = input_values(v.node)
                if not ins:
                    break
                v = ins[0]
            return v

        # A view that reads its input through a resharded copy is a view of that copy: the copy lives as
        # long as the view's readers need it (the logits moved to the vocab-parallel loss's layout, then
        # reshaped for it, which keeps them), a storage of its own whose bytes are the copy's. So is a
        # view that copies at its layout where no collective made its input (``_local_copy``).
        copy_views = {}
        for n in calls:
            if is_view(n) and n.target is not operator.getitem and input_values(n):
                v = input_values(n)[0]
                cp, own = self.copy(v, n, 0)[0], self._local_copy(n)
                if cp is not None and own is not None:      # a collective's output is contiguous: a view
                    ca, cb = self._choice(v.node), self._choice(n)
                    cp = _pair(ca, cb, [[cp.at({ca: i, cb: j}) or own.at({cb: j}) for j in self._options(cb)]
                                        for i in self._options(ca)])
                if cp is not None or own is not None:
                    copy_views[Value(n)] = cp or own

        # A bias add that runs as one biased matmul with its matmul (codegen/local_program.py) where no
        # resharding comes between them: the matmul's output, not live beside the add's there.
        folded = {}
        for n in calls:
            mm = folded_matmul(n)
            if mm is None:
                continue
            ca, cb, requests, per_request = self.reads(Value(mm), n, 0)
            vb = self.value(Value(mm))
            q = _pair(ca, cb, [[0.0 if per_request[r][i][1] else vb.at({ca: i}) for r in requests]
                               for i in self._options(ca)])
            if not q.zero():
                folded[n] = q

        def bases(v):
            """The storages ``v`` shares: the copies of the copy views it is read through, then its base."""
            out = []
            while v.node.op == "call_function" and is_view(v.node):
                if Value(v.node) in copy_views:
                    out.append(Value(v.node))
                ins = input_values(v.node)
                if not ins:
                    break
                v = ins[0]
            return out + [v]

        def stored(s) -> Bytes:
            return copy_views.get(s) or self.storage(s)

        inst_of = {}          # node -> the recomputed regions it is in (a layer and its attention core)
        for inst, (_, _, nodes) in instances.items():
            for n in nodes:
                inst_of.setdefault(n, []).append(inst)

        # Static for the whole step: parameters, optimizer states, inputs, buffers.
        grads_of, step_of, scatter, gathers = {}, {}, {}, {}
        for n in gm.graph.nodes:
            val = n.meta.get("val")
            if n.op != "placeholder" or not isinstance(val, torch.Tensor):
                continue
            if is_param(n):
                c = self._choice(n)
                opts = [self._strategy(n, i) for i in self._options(c)]
                full = [self.cm.param_bytes(n, s.outputs[0]) for s in opts]
                copies = [self._master_copy(n, o) for o in self._options(c)]
                copy_dtype = [None if cp is None else cp.meta["val"].dtype for cp in copies]
                kept = [self.cm.param_bytes(n, s.outputs[0], s.zero, s.offload, w) for s, w in zip(opts, copy_dtype)]
                if c is not None and any(s.offload for s in opts) and not self.cm.cluster.host_is_device:
                    acc = self._host.setdefault(c, [0.0] * len(opts))
                    for i, s in enumerate(opts):
                        acc[i] += self.cm.host_bytes(n, s.outputs[0]) if s.offload else 0.0
                add((_P, 1, _one(c, [k[0] for k in kept])))
                add((_O, 1, _one(c, [k[2] for k in kept])))
                # The gradient backward accumulates (a sharded master's: its block).
                grads_of[n] = _one(c, [k[1] if w else f[1] for f, k, w in zip(full, kept, copy_dtype)])
                shards = [1 if s.zero is None else self.cm.mesh_shape[s.zero.axis] for s in opts]
                # An offloaded parameter's optimizer step runs in host memory: its buffers count on the
                # device only where host and device are one memory.
                on_device = [0.0 if s.offload and not self.cm.cluster.host_is_device else 1.0 for s in opts]
                step_of[n] = _one(c, [f[1] / k * d for f, k, d in zip(full, shards, on_device)])
                if any(s.grad_scatter_axis is not None or s.offload for s in opts):
                    # ZeRO-2: once accumulated, the gradient is reduce-scattered into its shard; offload:
                    # it is copied to host memory (nothing on the device unless host and device are one).
                    # A ZeRO-2 reduce-scatter is waited when the next one is issued or backward ends
                    # (runtime/collectives.py, _DeferredGradients): until then the collective holds the
                    # whole gradient and its output, the whole's size on CPU (gloo's all-to-all), the
                    # block on CUDA. An offloaded gradient's hooks copy it at once, and without overlap
                    # (compile(overlap=False)) a reduce-scatter is waited at once.
                    cpu = self.cm.cluster.device_type != "cuda"
                    scattered = [s.grad_scatter_axis is not None and not s.offload for s in opts]
                    deferred = tuple(1.0 if z and self.overlap else 0.0 for z in scattered)
                    waited = [z and not self.overlap for z in scattered]
                    at_once = [s.offload or w for s, w in zip(opts, waited)]

                    def where(mask, sizes, c=c):
                        return _one(c, [x if m else 0.0 for x, m in zip(sizes, mask)])

                    block, whole = [k[1] for k in kept], [f[1] for f in full]
                    output = [f if cpu else k for f, k in zip(whole, block)]
                    # A sharded master's (ZeRO-2 read through its copy, runtime/zero.py): the copy's
                    # gradient, in its dtype, is what the collective holds, the master's block counted
                    # from the copy's backward on (grads_of); the walk frees the copy's gradient there,
                    # so it is counted again, with the output, until the wait.
                    for i, w in enumerate(copy_dtype):
                        if w is not None:
                            narrow = (reduce_itemsize(gradient_carrier(n)) or w.itemsize) / val.dtype.itemsize
                            output[i] = (whole[i] + (whole[i] if cpu else block[i])) * narrow
                            block[i] = whole[i] = 0.0
                    scatter[n] = _MovedGradient(
                        where(at_once, block), where(at_once, whole),
                        where(waited, output),
                        (where(deferred, block), where(deferred, whole), where(deferred, output)), deferred)
                if any(s.zero is not None for s in opts):
                    # After the step the updated shards of a bucket are copied into one flat buffer and
                    # all-gathered into a new one, then copied into the parameters.
                    # A sharded master's blocks are gathered in its copy's dtype, by a collective of
                    # their own: the bucket's parameters of each dtype, one after the other.
                    dtypes = [val.dtype if w is None else w for w in copy_dtype]
                    gathers[n] = ({d: _one(c, [0.0 if s.zero is None or t != d else
                                               f[0] / val.dtype.itemsize * d.itemsize * (1 + 1 / k)
                                               for s, f, k, t in zip(opts, full, shards, dtypes)])
                                   for d in dict.fromkeys(dtypes)}, max(f[0] for f in full))
            else:
                add((_T, 1, Bytes(None, None, float(val.numel() * val.element_size()))))

        # When each storage is freed: after its last forward reader, or when a backward releases it.
        last_use = {}
        for n in calls:
            if not is_view(n):
                for o in output_values(n):
                    last_use[o] = pos[n]
            elif Value(n) in copy_views:        # one storage, whichever of its outputs is read
                last_use[Value(n)] = pos[n]
            for v in input_values(n):
                for b in bases(v):
                    last_use[b] = pos[n]
        outputs = _tensor_outputs(gm)
        frees = {}            # ("F" forward | "B" backward, position) -> [(category, sign, Bytes)]
        # The caller holds the outputs until the step ends: a gathered output's copy, else the value.
        to_end, output_copies, gather_sources = set(), [], []
        for a in outputs:
            cp, again = self._output_copy(a, Value(a) in self._gathered_outputs)
            if cp is not None:
                frees.setdefault(("F", pos.get(a, 0)), []).append((_T, 1, cp))
            if again is not None:
                output_copies.append(again)
            if cp is None or self._choice(base(Value(a)).node) != self._choice(a):
                to_end.update(bases(Value(a)))
            else:
                # The value is held until the end of forward, where its gather is waited (the
                # collective's Work holds its input until then), and to the step's end where no copy
                # is made.
                c, vb = self._choice(a), self.value(base(Value(a)))
                frees.setdefault(("F", last_use.get(base(Value(a)), pos.get(a, 0))), []).append((_T, 1, vb))
                gather_sources.append(_one(c, [vb.at({c: i}) * (1.0 if cp.at({c: i}) else 0.0)
                                               for i in self._options(c)]))
        remat = {}            # instance -> [(position of the op that makes it, Bytes)] re-materialized
        #                       when its backward starts
        grouped, copies_before = self._shared_copies(calls, pos, input_values, inst_of, frees, copy_views,
                                                     instances, remat)
        @functools.lru_cache(maxsize=None)      # a layer's every instance asks the same of its position
        def kept_unless_copied(ca, cb, vb, keeps, cp):
            """Storage ``vb`` (decision ``ca``) where reader option ``j`` (decision ``cb``) keeps it (``keeps``)
            and reads no copy ``cp`` (None: reads it in place)."""
            return _pair(ca, cb, [[vb.at({ca: i}) * keeps[j] * (0.0 if cp and cp.at({ca: i, cb: j}) else 1.0)
                                   for j in self._options(cb)] for i in self._options(ca)])

        holders = {}          # storage -> [(saving node, None or Bytes kept only where no copy is read)]
        kept = {}             # node -> [Bytes] allocated in its forward, freed after its backward
        held_copy = {}        # (node, input position) whose copy backward keeps -> the part it does not keep
        kept_copies = {}      # node -> the resharded copies among what it keeps (made before it runs)
        for n in calls:
            saved = meta_of(n).saved
            if saved is None or not requires_grad(n):
                continue
            cb = self._choice(n)
            per_option = self._saved_per_option(n, saved)
            ins = input_values(n)
            for k, v in enumerate(ins):
                converted = [s.converted[k] if k < len(s.converted) else 0 for s in per_option]
                if any(converted):
                    kept.setdefault(n, []).append(self._converted(v, n, k, converted))
                keeps = [1.0 if k < len(s.inputs) and s.inputs[k] else 0.0 for s in per_option]
                if not any(keeps):
                    continue
                everywhere = all(keeps)
                cp = self.copy(v, n, k)[0]
                if cp is not None and (n, k) not in grouped:
                    kept.setdefault(n, []).append(cp if everywhere else _gated(cp, cb, keeps))
                    kept_copies.setdefault(n, []).append(kept[n][-1])
                    held_copy[(n, k)] = None if everywhere else _gated(cp, cb, [1.0 - x for x in keeps])
                if v.node.op == "placeholder":
                    continue
                *views, b = bases(v)
                for c in views:         # a copy view's storage, kept where the reader keeps it
                    vc = copy_views[c]
                    holders.setdefault(c, []).append(
                        (n, None if everywhere or cb is None or cb not in (vc.a, vc.b) else _gated(vc, cb, keeps)))
                cond = None
                # Kept only where the reader's option keeps it and no copy is read, unless the reader
                # may be recomputed; where the copy depends on another decision than the storage's
                # (three decisions), it is kept whatever the copy (the safe side). Read through one
                # copy view, it is kept only where that view reads no copy, or, where the reader keeps
                # it under some options only, where the reader keeps it (whatever the copy).
                ca, vb = self._choice(b.node), self.storage(b)
                exact = cp is None or ca == self._choice(v.node)
                if views:
                    vc = copy_views[views[0]]
                    cv = self._choice(views[0].node)
                    if n in inst_of:
                        pass
                    elif not everywhere:
                        cond = _pair(ca, cb, [[vb.at({ca: i}) * keeps[j] for j in self._options(cb)]
                                              for i in self._options(ca)])
                    elif len(views) == 1 and cp is None and {vc.a, vc.b} - {None} <= {ca, cv}:
                        cond = _pair(ca, cv, [[0.0 if vc.at({ca: i, cv: j}) else vb.at({ca: i})
                                               for j in self._options(cv)] for i in self._options(ca)])
                elif (n not in inst_of or _always_recomputed(set(inst_of[n]) & set(inst_of.get(b.node, ())), instances)) \
                        and (not everywhere or (cp is not None and exact)):
                    cond = kept_unless_copied(ca, cb, vb, tuple(keeps), cp if exact else None)
                holders.setdefault(b, []).append((n, cond))
            outs = output_values(n)
            flags = [s.held or _held_by_bytes(s.outputs, outs) for s in per_option]
            for i, o in enumerate(outs):
                keeps = [1.0 if i < len(f) and f[i] else 0.0 for f in flags]
                if any(keeps):
                    b = base(o)
                    cond = None if all(keeps) or self._choice(b.node) != cb else _gated(self.storage(b), cb, keeps)
                    holders.setdefault(b, []).append((n, cond))
            if outs:      # output bytes a rule declares (for a GPU kernel) beyond whole outputs
                vb, extra = self.value(outs[0]), []
                sizes = [value_info_nbytes(x) for x in outs]
                for o, (s, f) in enumerate(zip(per_option, flags)):
                    covered = sum(size for size, kf in zip(sizes, f) if kf)
                    more = 0.0 if s.held or s.outputs <= covered else s.outputs - covered
                    extra.append(vb.at({cb: o}) * more / max(sizes[0], 1))
                if any(extra):
                    kept.setdefault(n, []).append(_one(cb, extra))
            internal = _one(cb, [s.internal / self.cm.work_split(self._strategy(n, o)) if s.internal else 0.0
                                 for o, s in enumerate(per_option)])
            if not internal.zero():
                kept.setdefault(n, []).append(internal)

        held = set()          # storages a backward keeps whatever the layouts
        for s, hs in holders.items():
            if s in to_end or s.node.op != "call_function":     # inputs and buffers live all step
                continue
            h0 = min((h for h, _ in hs), key=pos.__getitem__)
            conds = [c for _, c in hs]
            vb = stored(s)
            t = last_use.get(s, pos.get(s.node, 0))
            if any(c is None for c in conds):
                held.add(s)
                frees.setdefault(("B", pos[h0]), []).append((_A, -1, vb))
                if vb.b is not None:        # a kept copy, of two layouts: it stays (as a kept copy does)
                    continue
                for inst in inst_of.get(s.node, ()):
                    if all(inst in inst_of.get(h, ()) for h, _ in hs):
                        ri, ind, _ = instances[inst]
                        frees.setdefault(("F", t), []).append((_A, -1, _times(vb, ri, ind)))
                        remat.setdefault(inst, []).append((pos[s.node], _times(vb, ri, ind)))
                # A storage made before an instance and saved only inside it: where the instance's saved
                # activations go to host memory, so does it (a recomputed instance keeps it instead).
                for inst, (ri, moved) in self._moved.items():
                    if inst not in inst_of.get(s.node, ()) and all(inst in inst_of.get(h, ()) for h, _ in hs):
                        frees.setdefault(("F", t), []).append((_A, -1, _times(vb, ri, moved)))
                        remat.setdefault(inst, []).append((pos[s.node], _times(vb, ri, moved)))
            else:
                cond = next(c for h, c in hs if h is h0)
                frees.setdefault(("F", t), []).append((_T, -1, vb))
                # Made again after its last reader where every holder's instance always recomputes.
                inst = _always_recomputed(inst_of.get(s.node, ()), instances)
                if inst is not None and all(inst in inst_of.get(h, ()) for h, _ in hs):
                    remat.setdefault(inst, []).append((t + 1, cond))
                else:
                    frees[("F", t)].append((_A, 1, cond))
                frees.setdefault(("B", pos[h0]), []).append((_A, -1, cond))
        for s, t in last_use.items():
            if s not in held and s not in holders and s not in to_end and s.node.op == "call_function":
                frees.setdefault(("F", t), []).append((_T, -1, stored(s)))

        # A recomputed instance keeps the inputs it reads from outside until its backward ends. A storage
        # that several regions of a class read (an attention mask every layer reads) is one tensor:
        # kept while any of them is recomputed, until the backward of the first of them in execution
        # order, the last of theirs (exact when whole layers alone recompute: counts recompute the
        # first instances; with attention cores too, on the safe side).
        external = {}         # (storage, recompute decision) -> (indicator, position of its instance)
        for inst, (ri, ind) in self._recomputed.items():   # an offloaded one keeps no input it does not save
            nodes = instances[inst][2]
            for n in nodes:
                for v in input_values(n):
                    s = base(v)
                    if s.node.op != "call_function" or inst in inst_of.get(s.node, ()) or s in to_end \
                            or s in holders:
                        continue
                    e = external.get((s, ri))
                    external[(s, ri)] = (ind, pos[nodes[0]]) if e is None else \
                        (tuple(max(x, y) for x, y in zip(e[0], ind)), min(e[1], pos[nodes[0]]))
        for (s, ri), (ind, first) in external.items():
            q = _times(self.storage(s), ri, ind)
            frees.setdefault(("F", last_use[s]), []).append((_A, 1, q))
            frees.setdefault(("B", first), []).append((_A, -1, q))

        def workspace(n) -> Bytes:
            if not rule_for(n).workspace:       # most ops hold none: not asked once per option
                return Bytes(None, None, 0.0)
            c = self._choice(n)
            return _one(c, [self.cm.workspace_bytes(n, self._strategy(n, o)) for o in self._options(c)])

        # A value whose last reader reads it through a resharded copy goes before that reader runs,
        # once the copy is made (a split all-gather's wait drops it before its blocks are copied out),
        # unless a backward keeps it, the caller holds it or a recomputed instance keeps it as an input.
        kept_inputs = {s for s, _ in external}

        def let_go(n, again, live):
            """(what goes at the collectives' waits, what goes once the copies are made) of the inputs of
            ``n`` that it is the last to read, each through a copy (``released``); in a run again, of
            those it made, where it recomputes."""
            at_wait, after = [], []
            ins = input_values(n)
            for k, v in enumerate(ins):
                rel = None if (n, k) in grouped else self.released(v, n, k)
                if rel is None:
                    continue
                (s, *more) = bases(v)
                if more or s.node.op != "call_function" or last_use.get(s) != pos[n] or s in holders \
                        or s in to_end or s in kept_inputs or sum(s in bases(u) for u in ins) != 1 \
                        or self.storage(s) is not self.value(s) or (live is not None and s not in live):
                    continue
                if s != v:      # a view of it is resharded: its storage goes once the copy is made
                    parts = [(after, self._product(stored(s), rel[2]))]
                else:
                    parts = [(into, q) for into, q in zip((at_wait, after), rel[:2]) if q is not None]
                for into, q in parts:
                    into.append(q if again is None else self._product(q, Bytes(again[0], None, tuple(again[1]))))
            return at_wait, after

        def run(n, name, again=None, live=None):
            """The events of op ``n``'s forward around its point ``name``: the copies it reads (but shared
            ones), their staging and what it keeps of them, less what ``let_go`` lets go, at a point of
            their own (``name`` (reads)) where any staging or input is let go; then, the staging freed, its
            outputs, what else it keeps and its workspace, less a folded bias add's matmul output. ``again``
            (recompute decision, indicator): the run again of a recomputed instance when its backward
            starts, each term where it recomputes; what the instance keeps comes back apart (``remat``),
            and what it makes and does not keep is recorded in ``live``. A copy sized by two layouts counts
            whether or not it recomputes (``_if_recomputed``)."""
            def gate(q, f=_times):
                return q if again is None else f(q, *again)

            def make(s, q):
                """Storage ``s`` of ``q`` bytes made by ``n``: kept for backward or not."""
                if s not in held:
                    q = gate(q, _if_recomputed if s in copy_views else _times)
                    add((_T, 1, q))
                    if again is not None:
                        live[s] = q
                elif again is None:
                    add((_A, 1, q))

            copies, staged = [], []
            if Value(n) in copy_views:          # the view's own storage from here
                make(Value(n), copy_views[Value(n)])
            for k, v in enumerate(input_values(n)):
                if (n, k) in grouped:
                    continue
                cp, *_, staging = self.copy(v, n, k)
                for into, q in ((copies, None if Value(n) in copy_views else held_copy.get((n, k), cp)),
                                (staged, staging)):
                    if q is not None:
                        into.append(gate(q, _if_recomputed))
            at_wait, after = let_go(n, again, live)
            own = kept_copies.get(n, []) if again is None else []
            fold = None if n not in folded else folded[n] if again is None else _times(_below(folded[n]), *again)
            for q in copies + staged:
                add((_T, 1, q))
            for q in own:
                add((_A, 1, q))
            for q in at_wait:
                add((_T, -1, q))
            if fold is not None:
                add((_T, -1, fold))
            phase = "forward" if again is None else "recompute"
            if staged or at_wait or after:
                self.points.append((len(self.events), phase, f"{name} (reads)"))
            for q in staged + after:
                add((_T, -1, q))
            if not is_view(n):
                for o in output_values(n):
                    make(o, self.storage(o))
            if again is None:
                for q in kept.get(n, ()):
                    if not any(q is c for c in own):
                        add((_A, 1, q))
            work = workspace(n)
            if not work.zero():             # what a sharded op holds while it runs (ring attention's blocks)
                work = gate(work)
                add((_T, 1, work))
            self.points.append((len(self.events), phase, name))
            for q in copies:
                add((_T, -1, q))
            if not work.zero():
                add((_T, -1, work))
            if fold is not None:
                add((_T, 1, fold))
            for q in at_wait + after:       # freed after the op with its last reader's other inputs
                add((_T, 1, q))

        # Forward.
        layer_points = {}     # a layer instance -> the points of its forward
        for t, n in enumerate(calls):
            for q in copies_before.get(t, ()):
                add((_T, 1, q))
            first = len(self.points)
            run(n, n.name)
            if n in inst_of:
                layer_points.setdefault(inst_of[n][0], []).extend(range(first, len(self.points)))
            for cat, sign, q in frees.get(("F", t), ()):
                add((cat, sign, q))
            for inst in inst_of.get(n, ()):
                # A recomputed op drops what it keeps until its instance's backward starts. A kept
                # resharded copy depends on two layouts already: it stays (the safe side), as the
                # product with the recompute count would depend on three decisions, unless every
                # option of the count recomputes the instance (recompute pinned on).
                ri, ind, _ = instances[inst]
                for q in kept.get(n, ()):
                    if q.b is None or all(ind):
                        q = q if q.b is not None else _times(q, ri, ind)
                        add((_A, -1, q))
                        remat.setdefault(inst, []).append((t, q))

        self._runs += [range(ks[0], ks[-1] + 1) for ks in layer_points.values() if ks[-1] - ks[0] + 1 == len(ks)]
        # Split collectives' waits drop the sources before the copies below; a gather that waits where it
        # is issued (compile(overlap=False)) holds its source through its copy.
        sources_held = [] if self.overlap else gather_sources
        for q in gather_sources if self.overlap else ():
            add((_T, -1, q))
        for cp in output_copies:
            add((_T, 1, cp))
        self.points.append((len(self.events), "forward", "outputs"))
        for cp in [*output_copies, *sources_held]:      # the gathered blocks, once made contiguous
            add((_T, -1, cp))

        def replay(inst):
            """Where ``inst`` recomputes, its forward runs again when its backward starts (``run``): what it
            keeps is made op by op, then the outputs it does not keep are dropped after their last reader.
            Where it keeps its saved activations in host memory, they come back at once."""
            nodes = instances[inst][2]
            made = sorted(remat.get(inst, ()), key=lambda e: e[0])[::-1]     # the next one last
            ri, ind = self._recomputed.get(inst, (None, None))

            def make(upto):
                while made and made[-1][0] <= upto:
                    add((_A, 1, made.pop()[1]))

            make(pos[nodes[0]] - 1 if ri is not None else math.inf)
            first = len(self.points)
            self.points.append((len(self.events), "recompute", inst))
            if ri is None:
                return
            live = {}           # storage -> Bytes, made in the run again and not kept
            for m in nodes:
                t = pos[m]
                make(t)
                run(m, f"{inst} {m.name}", (ri, ind), live)
                for s in [s for s in live if last_use.get(s) == t]:
                    add((_T, -1, live.pop(s)))
            self._runs.append(range(first, len(self.points)))
            make(math.inf)
            for q in live.values():
                add((_T, -1, q))

        # Backward, seeded by the gradient of the scalar outputs (the loss).
        # A parameter several ops read through one shared copy: its gradient accumulates at the copy's
        # layout (``_shared_copies``), made its own by the first reader's backward, the last to run.
        # With two readers (a tied embedding and head), exact: (first, later reader), then the bytes the
        # later one's backward makes its own (where it reads in place) and those the first one's makes;
        # with more, from the backward of the last of them (the safe side).
        tied = {}
        for n, k in sorted(grouped, key=lambda m: pos[m[0]]):
            v = input_values(n)[k]
            if is_param(v.node) and v.node not in tied:
                readers = sorted(((m, j) for m in v.node.users if m in pos
                                  for j, u in enumerate(input_values(m)) if u.node is v.node), key=lambda r: pos[r[0]])
                if len(readers) == 2 and all(r in grouped for r in readers):
                    tied[v.node] = readers
        grads = {_canonical(Value(a)): self.value(Value(a)) for a in outputs
                 if requires_grad(a) and a.meta["val"].dim() == 0}
        # A parameter's gradient is complete (and a ZeRO-2 one reduce-scattered) after the backward of
        # its first reader.
        ready = {}
        for p in scatter:
            first = min((m for m in p.users if m in pos), key=pos.__getitem__, default=None)
            if first is not None:
                ready.setdefault(first, []).append(p)
        launched = self._bucketed_gradients(grads_of, pos, input_values) if self.overlap else {}
        # (block, whole, collective output) of the ZeRO-2 reduce-scatter in flight, and those counted
        # until backward's end.
        pending, held_to_end = (Bytes(None, None, 0.0),) * 3, []
        started = set()
        # An add hands its output's gradient tensor to each input of its shape read in place, and a
        # reshape a view of it to its input (autograd makes no copy): one storage, whose bytes the
        # gradient of each input that holds it counts as if its own. Where two hold it (the residual
        # stream and the branch of a residual add), the bytes of one (``_product`` of the output's
        # bytes and both inputs' indicators) are taken off until either gradient is released or
        # accumulated into (an accumulation into a tensor another gradient holds makes a new one); a
        # gradient handed on again passes its share on to its holder.
        sharing = {}          # gradient key -> (bytes taken off, the keys that share them)

        def unshare(key):
            taken = sharing.pop(key, None)
            if taken is not None:
                for other in taken[1]:
                    sharing.pop(other, None)
                add((_T, 1, taken[0]))

        def release(o):
            add((_T, -1, grads.pop(o)))
            unshare(o)

        def hand_on(outs, holders):
            """Release the gradients of ``outs``, which lives on in each of ``holders`` (key, indicator)."""
            if holders:
                (o,) = outs
                vo = grads[o]
                for _, ind in holders:
                    add((_T, 1, self._product(vo, ind)))
                if len(holders) == 2:
                    unshare(o)
                    taken = (self._product(vo, *(ind for _, ind in holders)), [key for key, _ in holders])
                elif o in sharing:
                    before, members = sharing.pop(o)
                    for other in members:
                        sharing.pop(other, None)
                    add((_T, 1, before))
                    taken = (self._product(before, holders[0][1]),
                             [holders[0][0] if key == o else key for key in members])
                else:
                    taken = None
                if taken is not None:
                    add((_T, -1, taken[0]))
                    for key in taken[1]:
                        sharing[key] = taken
            for o in outs:
                if o in grads:
                    release(o)

        for t in range(len(calls) - 1, -1, -1):
            n = calls[t]
            outs = output_values(n)
            # A region's forward runs again when autograd first unpacks what it saved (non-reentrant
            # checkpointing): the backward of its last ops that keep nothing (adds, views, a
            # collective's) runs before, and the gradients they make are live through the run again.
            unpacks = _keeps(meta_of(n).saved) and requires_grad(n) and any(o in grads for o in outs)
            for inst in inst_of.get(n, ()):
                if inst not in started and (unpacks or pos[instances[inst][2][0]] == t):
                    started.add(inst)
                    replay(inst)
            if n.target is not operator.getitem and requires_grad(n) and any(o in grads for o in outs):
                view = n.target in VIEW_OPS
                after, unshared = [], []
                ins = input_values(n)
                keys = [_canonical(v) for v in ins]
                passed = {k: q for k, v in enumerate(ins) if requires_grad(v.node) and v.node not in tied
                          and keys.count(keys[k]) == 1 and (q := self._passed(v, n, k)) is not None}
                holders = []          # (key, indicator) of the inputs that hold the output's gradient
                for k, v in enumerate(ins):
                    if not requires_grad(v.node):
                        continue
                    # The gradient at the layout read (a view's too), converted by the resharding's
                    # backward into the input's.
                    _, gcp, blocks, _ = self.copy(v, n, k)
                    for q in (gcp, blocks):
                        if q is not None:
                            add((_T, 1, q))
                            after.append((_T, q))
                    key = _canonical(v)
                    q, cat = (grads_of[v.node], _G) if is_param(v.node) else (self.value(key), _T)
                    if v.node in tied:
                        # Its gradient is its own from the later reader's backward where that one reads
                        # it in place, else from the first one's (which converts the shared copy's).
                        later = tied[v.node][1] == (n, k)
                        ca, cb = self._choice(v.node), self._choice(n)
                        if later:
                            read = [[bool(gcp is not None and gcp.at({ca: i, cb: j})) for j in self._options(cb)]
                                    for i in self._options(ca)]
                            tied[v.node] += [_pair(ca, cb, [[0.0 if r else q.at({ca: i}) for r in row]
                                                            for i, row in enumerate(read)]),
                                             _pair(ca, cb, [[q.at({ca: i}) if r else 0.0 for r in row]
                                                            for i, row in enumerate(read)])]
                        add((cat, 1, tied[v.node][2 if later else 3]))
                        continue
                    # Made where the output's gradient is not handed on, or is accumulated into a
                    # gradient another holds (which autograd leaves as it is, making their sum).
                    accumulated = key in grads
                    own = k not in passed or (accumulated and key in sharing)
                    made = q if own else self._product(q, passed[k][1])
                    add((cat, 1, made))
                    if accumulated:
                        after.append((cat, made))    # accumulated into the gradient already there
                        unshared.append(key)
                    else:
                        grads[key] = q
                        if k in passed:
                            holders.append((key, passed[k][0]))
                if view:            # a view's gradient becomes its input's
                    hand_on(outs, holders)
                q = self._backward_work(n, meta_of(n).saved)
                if not q.zero():
                    add((_T, 1, q))
                    after.append((_T, q))
                self.points.append((len(self.events), "backward", n.name))
                for cat, q in after:
                    add((cat, -1, q))
                for key in unshared:
                    unshare(key)
                if not view:
                    hand_on(outs, holders)
            for q in kept.get(n, ()):
                add((_A, -1, q))
            for cat, sign, q in frees.get(("B", t), ()):
                add((cat, sign, q))
            for p in ready.get(n, ()):
                moved = scatter[p]
                add((_G, 1, moved.offloaded))
                add((_T, 1, moved.output))
                add((_T, 1, moved.in_flight[2]))
                # The one in flight before is waited here where this one is deferred too (its wait makes
                # its block); where not, it is counted until backward's end: which one is in flight
                # depends on every decision since (the safe side). A bias's or a norm's is counted until
                # backward's end and leaves the one before to the next matrix (the safe side too: the
                # runtime waits it here where this one is reduce-scattered), so that a matrix's bias,
                # ready with it and rarely ZeRO-2, does not hold the matrix's to backward's end.
                c = self._choice(p)
                matrix = p.meta["val"].dim() > 1
                waited = [_gated(q, c, moved.deferred) for q in pending] if matrix else None
                if matrix:
                    add((_G, 1, waited[0]))
                self.points.append((len(self.events), "backward", f"reduce_scatter {meta_of(p).role.target}"))
                add((_G, -1, moved.offloaded_whole))
                add((_T, -1, moved.output))
                if matrix:
                    add((_G, -1, waited[1]))
                    add((_T, -1, waited[2]))
                    held_to_end.append([_gated(q, c, [1.0 - x for x in moved.deferred]) for q in pending])
                    pending = moved.in_flight
                else:
                    held_to_end.append(moved.in_flight)
            # A bucket's buffer and its gradients are both live at its copy, then the gradients are views
            # of it (counted as gradients). A bucket may copy where any of its gradients is ready, holding
            # at most every gradient ready so far twice.
            if n in launched:
                for q in launched[n]:
                    add((_S, 1, q))
                self._copy_points.add(len(self.points))
                self.points.append((len(self.events), "backward", f"gradient buckets after {n.name}"))
        held_to_end = [q for q in [pending, *held_to_end] if not all(x.zero() for x in q)]
        if held_to_end:
            # Backward's end waits for the last reduce-scatter.
            for q in held_to_end:
                add((_G, 1, q[0]))
            self.points.append((len(self.events), "backward", "wait reduce_scatter"))
            for q in held_to_end:
                add((_G, -1, q[1]))
                add((_T, -1, q[2]))

        # The optimizer step and its transient buffers, as torch's Adam makes them by default (states
        # in the parameter's dtype). The foreach path on CUDA makes one buffer as large as all the
        # states (the square roots of the second moments). The per-parameter loop on CPU makes two per parameter (the square root and
        # its quotient, the denominator) and keeps the denominator until the next one replaces it.
        if self.cm.cluster.device_type == "cuda":
            for g in step_of.values():
                add((_T, 1, g))
            self.points.append((len(self.events), "optimizer", "step"))
        else:
            previous = None
            for n, g in step_of.items():
                add((_T, 1, g))
                add((_T, 1, g))
                self.points.append((len(self.events), "optimizer", meta_of(n).role.target))
                add((_T, -1, g))
                if previous is not None:
                    add((_T, -1, previous))
                previous = g
            if previous is not None:
                add((_T, -1, previous))
        buckets = zero_gather_buckets([(n, whole) for n, (_, whole) in gathers.items()])
        self.gather_bucket = {n: b for b, members in enumerate(buckets) for n in members}
        for members in buckets:
            for d in dict.fromkeys(d for n in members for d in gathers[n][0]):
                held = [gathers[n][0][d] for n in members if d in gathers[n][0]]
                for q in held:
                    add((_T, 1, q))
                self.points.append((len(self.events), "optimizer",
                                    f"all_gather {', '.join(meta_of(n).role.target for n in members)} "
                                    f"({str(d).removeprefix('torch.')})"))
                for q in held:
                    add((_T, -1, q))

    def _bucketed_gradients(self, grads_of, pos, input_values) -> dict:
        """Reader node -> [Bytes] of the gradient buckets launched after its backward. With overlap
        (compile's default) a parameter's gradient all-reduce is taken out of the program into DDP's
        buckets where every reader reduces it (codegen/grad_buckets.py): once its gradients are
        accumulated a bucket copies them into one flat buffer, which the gradients then are views of
        (their own storage freed), and all-reduces it in place; backward's end waits for it
        (runtime/grad_buckets.py). Both are live at the copy, the latest of a bucket's launch. A use
        whose reader reduces the gradient counts its share of that buffer at the backward of the
        parameter's first reader and at each copy after it; a bucket launches when its last gradient is
        ready, and a parameter some reader does not reduce is reduced in the program instead (all the
        safe side). A gradient reduced in its bfloat16 copy's dtype has a buffer of that dtype; its
        float32 gradient is let go at the copy and made again from the buffer at backward's end, one
        bucket at a time: counted held throughout (the safe side, by the buffer's bytes, in between),
        and the widening's buffer is within the last copy's count."""
        from autopar.passes.precision import bucketed_value, reduce_dtype_of
        from autopar.passes.strategies import Value, requires_grad

        launched = {}
        reduces = {}      # fold key of (gradient carrier, reader, input) -> per option pair, whether it reduces
        for p, grad in grads_of.items():
            # A weight read only through its bfloat16 copy is bucketed by its copy's readers, in the
            # copy's dtype, where its optimizer state is not sharded (bucketed_value).
            v = gradient_carrier(p)
            narrow = reduce_dtype_of(v).itemsize / p.meta["val"].dtype.itemsize
            uses = [(m, k) for m in v.users if m in pos for k, x in enumerate(input_values(m)) if x.node is v]
            if not uses or not requires_grad(p):
                continue
            ca = self._choice(p)
            first = min((m for m, _ in uses), key=pos.__getitem__)
            for m, k in uses:
                cb = self._choice(m)
                key = self._fold_key(Value(v), m, k)
                if key not in reduces:
                    reduces[key] = [[None not in (own, src, dst) and bucketed_value(p, own) is v and
                                     src.read_grad_partial(Value(v), dst.inputs[k], dst)
                                     for dst in (self._strategy(m, j) for j in self._options(cb))]
                                    for own, src in ((self._strategy(p, i), self._strategy(v, i))
                                                     for i in self._options(ca))]
                q = _pair(ca, cb, [[grad.at({ca: i}) * narrow / len(uses) if r else 0.0 for r in row]
                                   for i, row in enumerate(reduces[key])])
                if not q.zero():
                    launched.setdefault(first, []).append(q)
        return launched

    # --- evaluation ---------------------------------------------------------------------------------
    def walk(self, assignment: Sequence[int], bucket_cap: float | None = None) -> list[StepPoint]:
        """Every point of the step under ``assignment``, with its live bytes per category. A gradient
        bucket's copy holds its gradients and its buffer at once: with ``bucket_cap``, the bytes of the
        largest bucket the runtime packs under ``assignment`` (``passes.exposure.Replay.packing`` at the
        plan's bucket size), a copy point counts at most that much beside the gradients, since one bucket
        copies at a time; without it, every bucketed gradient ready so far (the solver's constraints,
        which hold for any bucket size)."""
        running = [0.0] * (len(CATEGORIES) + 1)
        out, e = [], 0
        for k, (upto, phase, name) in enumerate(self.points):
            while e < upto:
                cat, sign, q = self.events[e]
                running[cat] += sign * q.at(assignment)
                e += 1
            live = dict(zip(CATEGORIES, running))
            if k in self._copy_points:
                live["transient"] += running[_S] if bucket_cap is None else min(running[_S], bucket_cap)
            out.append(StepPoint(phase, name, live))
        return out

    def peak(self, assignment: Sequence[int]) -> tuple[int, float]:
        """(index of the highest point, its bytes) under ``assignment``."""
        totals = [p.total for p in self.walk(assignment)]
        k = max(range(len(totals)), key=totals.__getitem__)
        return k, totals[k]

    @functools.cached_property
    def bound_by(self) -> tuple[int, ...]:
        """Point k -> a point whose live bytes are at least k's under every assignment: k itself, or,
        within a layer's forward or a recomputed layer's run again (a point per op, many of them below
        another), a point that dominates it. One point dominates another where the events between them
        change the live bytes by a sum whose least (largest) value, taking each term's extreme on its
        own, is at least (at most) zero: a sufficient test, so the points kept bound the rest exactly."""
        bound = list(range(len(self.points)))
        for run in self._runs:
            alive = []          # (point, the change in live bytes from it to the current one)
            for j in run:
                if alive:
                    step = _Change(self.events[self.points[j - 1][0]:self.points[j][0]])
                    for _, delta in alive:
                        delta.add(step)
                top = next((k for k, delta in alive if delta.at_most_zero()), None)
                if top is not None:
                    bound[j] = top
                    continue
                for k, delta in alive:
                    if delta.at_least_zero():
                        bound[k] = j
                alive = [(k, delta) for k, delta in alive if bound[k] == k][1 - _DOMINANCE_WINDOW:] + [(j, _Change())]
        for k in range(len(bound)):
            while bound[bound[k]] != bound[k]:
                bound[k] = bound[bound[k]]
        return tuple(bound)

    def bounding_points(self) -> list[int]:
        """The points that bound every point of the step (``bound_by``): as constraints, the same
        feasible assignments as every point."""
        return sorted(set(self.bound_by))

    def constraint(self, k: int):
        """Point ``k`` as a memory constraint of the solver: its live bytes as terms of the decisions."""
        return self.constraints([k])[0]

    def host_constraint(self, memory_budget: float):
        """Offloaded optimizer states within a device's share of its node's host memory, as a memory
        constraint of the solver: its bytes are scaled so that the share meets ``budget``, the limit
        every memory constraint shares. None when nothing can be offloaded."""
        from autopar.solver import MemoryConstraint

        if not self._host:
            return None
        c = self.cm.cluster
        scale = memory_budget / (c.host_memory / c.devices_per_node)
        return MemoryConstraint("host memory of offloaded optimizer states",
                                tuple((ch, tuple(v * scale for v in table)) for ch, table in self._host.items()))

    def constraints(self, ks: Sequence[int]) -> list:
        """``constraint`` of every point in ``ks``, in one pass over the events."""
        from autopar.solver import MemoryConstraint, SharedBytes

        order = sorted(set(ks))
        made, e = {}, 0
        shared = {}
        # [constant, one-decision terms, pair terms] of the live bytes, and of the bucketed shares (_S).
        sums = ([0.0, {}, {}], [0.0, {}, {}])
        arrays: dict[int, np.ndarray] = {}      # id of a Bytes -> its table, (a, b) ordered
        for k in order:
            upto, phase, name = self.points[k]
            while e < upto:
                cat, sign, q = self.events[e]
                e += 1
                if isinstance(q, SharedBytes):
                    key = (q.src, q.readers, q.always)
                    shared[key] = shared.get(key, 0.0) + sign * np.asarray(q.bytes, dtype=float)
                    continue
                into = sums[cat == _S]
                if q.a is None:
                    into[0] += sign * q.table
                    continue
                table = arrays.get(id(q))
                if table is None:
                    table = np.asarray(q.table, dtype=float)
                    arrays[id(q)] = table = table.T if q.b is not None and q.a > q.b else table
                key = q.a if q.b is None else (min(q.a, q.b), max(q.a, q.b))
                acc = into[1] if q.b is None else into[2]
                if key in acc:
                    acc[key] += sign * table
                else:
                    acc[key] = sign * table
            constant, terms, pairs = sums[0]
            if k in self._copy_points:
                constant, terms, pairs = constant + sums[1][0], _added(terms, sums[1][1]), _added(pairs, sums[1][2])
            made[k] = MemoryConstraint(f"{phase} {name} (point {k})",
                                       tuple((c, tuple(v.tolist())) for c, v in terms.items()), constant,
                                       tuple((a, b, tuple(map(tuple, m.tolist()))) for (a, b), m in pairs.items()),
                                       tuple(_live_copies(key, table) for key, table in shared.items()
                                             if np.any(table > 0)))
        return [made[k] for k in ks]


class _Change:
    """A sum of events as a constant and terms of the decisions (the bucketed shares ``_S`` left out:
    they count at no point of a layer's forward or run again)."""

    def __init__(self, events=()):
        from autopar.solver import SharedBytes

        self.constant, self.terms, self.shared = 0.0, {}, {}
        for cat, sign, q in events:
            if cat == _S:
                continue
            if isinstance(q, SharedBytes):
                key, table = (q.src, q.readers, q.always), np.asarray(q.bytes, dtype=float)
                self.shared[key] = self.shared.get(key, 0.0) + sign * table
                continue
            if q.a is None:
                self.constant += sign * q.table
                continue
            table = np.asarray(q.table, dtype=float)
            if q.b is not None and q.a > q.b:
                table = table.T
            key = q.a if q.b is None else (min(q.a, q.b), max(q.a, q.b))
            self.terms[key] = self.terms.get(key, 0.0) + sign * table

    def add(self, other: "_Change"):
        self.constant += other.constant
        for mine, theirs in ((self.terms, other.terms), (self.shared, other.shared)):
            for key, table in theirs.items():
                mine[key] = mine[key] + table if key in mine else table

    def at_least_zero(self) -> bool:
        """Whether the sum is at least zero under every assignment (a live copy's bytes grow with its
        table's, so a copy's table must not fall)."""
        return all(np.all(t >= 0) for t in self.shared.values()) and \
            self.constant + sum(np.min(t) for t in self.terms.values()) >= 0

    def at_most_zero(self) -> bool:
        return all(np.all(t <= 0) for t in self.shared.values()) and \
            self.constant + sum(np.max(t) for t in self.terms.values()) <= 0


def _added(a: dict, b: dict) -> dict:
    """The sum of two dicts of tables."""
    out = dict(a)
    for key, table in b.items():
        out[key] = out[key] + table if key in out else table
    return out


def _live_copies(key, table: np.ndarray):
    """A point's sum of one value's ``SharedBytes`` events: copies made and not yet released. Each one
    released is the one made, so what is left is never negative but for rounding."""
    from autopar.solver import SharedBytes

    assert table.min() >= -1e-6 * max(1.0, np.abs(table).max()), f"copies released more than made: {key}"
    src, readers, always = key
    return SharedBytes(src, readers, tuple(map(tuple, np.maximum(table, 0.0).tolist())), always)


# The post-step all-gathers of ZeRO-1/2 parameters run a bucket at a time (DDP's bucket size).
ZERO_GATHER_BUCKET_BYTES = 25 * 2**20


def zero_gather_buckets(candidates) -> list[list]:
    """Parameters that may be ZeRO-1/2-sharded, as (parameter, its largest local bytes), in order,
    packed into buckets of about ``ZERO_GATHER_BUCKET_BYTES``. The buckets do not depend on which of them
    the plan shards, so the memory each bucket's gather holds is a sum of one term per parameter."""
    return [[n for n, _ in b] for b in pack_buckets(candidates, lambda c: c[1], ZERO_GATHER_BUCKET_BYTES)]


def _memoized(f):
    cache = {}

    def get(n):
        r = cache.get(n)
        if r is None:
            r = cache[n] = f(n)
        return r

    return get


def _input_values(n) -> list:
    from autopar.passes.strategies import input_values

    return input_values(n)


def _output_values(n) -> list:
    return output_values(n)


def core_region(inst: str, k: int) -> str:
    """The name of layer instance ``inst``'s ``k``-th attention core as a recomputed region."""
    return f"{inst}:attention" + (str(k) if k else "")


def output_values(n) -> list:
    from autopar.passes.rules import output_infos
    from autopar.passes.strategies import Value

    return [Value(n, i) for i in range(len(output_infos(n)))]


def value_info_nbytes(v) -> int:
    from autopar.passes.strategies import value_info

    return value_info(v).nbytes


def _canonical(v):
    """A getitem's value is its producer's output."""
    from autopar.passes.strategies import Value

    while v.node.op == "call_function" and v.node.target is operator.getitem:
        v = Value(v.node.args[0], v.node.args[1])
    return v


def _held_by_bytes(nbytes: int, outs) -> tuple[bool, ...]:
    """Which outputs ``nbytes`` of saved outputs stand for, when a rule gives only the byte count."""
    flags, total = [], 0
    for o in outs:
        total += value_info_nbytes(o)
        flags.append(total <= nbytes)
    return tuple(flags)


# --- Solving under the step's true peak ----------------------------------------------------------

_MAX_ROUNDS = 50
# The points a point of a layer's forward or run again is compared with (``StepMemory.bound_by``): the
# latest undominated ones, where a dominating point usually is.
_DOMINANCE_WINDOW = 8


def _initial_points(sm: StepMemory, problem) -> list[int]:
    """Where the peak usually is: the end of forward, the first backward op, the largest optimizer
    point, and the peak of the greedy layout that ignores memory."""
    from autopar.solver.greedy import greedy
    import dataclasses

    phases = [p[1] for p in sm.points]
    picks = set()
    fwd = [k for k, ph in enumerate(phases) if ph == "forward"]
    bwd = [k for k, ph in enumerate(phases) if ph == "backward"]
    if fwd:
        picks.add(fwd[-1])
    if bwd:
        picks.add(bwd[0])
    free = dataclasses.replace(problem, memory=[], memory_budget=None)
    walk = sm.walk(greedy(free))
    picks.add(max(range(len(walk)), key=lambda k: walk[k].total))
    opt = [k for k, ph in enumerate(phases) if ph == "optimizer"]
    if opt:
        picks.add(max(opt, key=lambda k: walk[k].total))
    return sorted({sm.bound_by[k] for k in picks})


def _over_budget(sm: StepMemory, walk, memory_budget: float, have: set) -> list[int]:
    """The points to add to the solver's constraints after a solve whose step goes over ``budget``:
    the highest point of each stretch of consecutive points over it (one solve then learns every
    stretch at once; the rest of a stretch usually falls with its highest point), or the point that
    bounds it (``StepMemory.bound_by``), skipping those held."""
    cap = memory_budget * (1 + 1e-9)
    out, run = [], None
    for k, p in enumerate(walk):
        t = p.total
        if t > cap:
            if run is None or t > walk[run].total:
                run = k
        elif run is not None:
            out.append(run)
            run = None
    if run is not None:
        out.append(run)
    return sorted({sm.bound_by[k] for k in out} - have)


def _walk_over(sm: StepMemory, assignment, cap: float, have: set) -> tuple[int, float, list[int]]:
    """(the highest point of the step under ``assignment``, its bytes, the points to add to the solver's
    constraints where the step goes over ``cap``: ``_over_budget``, empty where it fits)."""
    walk = sm.walk(assignment)
    k = max(range(len(walk)), key=lambda i: walk[i].total)
    return k, walk[k].total, _over_budget(sm, walk, cap, have)


def solve_under_budget(problem, sm: StepMemory, memory_budget: float, *, time_limit: float | None = None, bound=None,
                       node_limit: int | None = None):
    """The fastest assignment whose step peak (``sm.peak``) fits ``budget``: solve with the memory
    constraints of a few candidate points, walk the step, add the points over the budget (the highest
    of each stretch), solve again. Every returned feasible solution's walked peak is within the budget.
    ``bound`` is the solver's: stop ("bounded") once no assignment can beat that many seconds;
    ``node_limit`` too (a cut-off that does not depend on the machine's load). ``time_limit`` None: each
    solve stops at ``solver.NODE_LIMIT`` nodes (or ``node_limit``), the wall clock a guard only, so the
    answer does not depend on the machine's load."""
    from autopar.errors import AutoparError
    from autopar.solver import GUARD_SECONDS, NODE_LIMIT, solve

    if time_limit is None:
        time_limit, node_limit = GUARD_SECONDS, node_limit or NODE_LIMIT

    problem.memory_budget = memory_budget
    host = sm.host_constraint(memory_budget)
    # The fastest assignment ignoring device memory is the answer whenever its walked peak fits, and
    # without memory rows HiGHS solves it at its first relaxation: most plans stop here.
    problem.memory = [host] if host is not None else []
    sol = solve(problem, time_limit=time_limit, bound=bound, node_limit=node_limit)
    if sol.status in ("infeasible", "bounded") or sm.peak(sol.assignment)[1] <= memory_budget * (1 + 1e-9):
        return sol
    have = set(_initial_points(sm, problem))
    problem.memory.extend(sm.constraints(sorted(have)))
    for _ in range(_MAX_ROUNDS):
        sol = solve(problem, time_limit=time_limit, bound=bound, node_limit=node_limit)
        if sol.status in ("infeasible", "bounded"):
            return sol
        k, peak, add = _walk_over(sm, sol.assignment, memory_budget, have)
        if peak <= memory_budget * (1 + 1e-9):
            return sol
        if sm.bound_by[k] in have or not add:
            raise AutoparError(f"memory point {sm.points[k][1]} {sm.points[k][2]!r} is over the budget although "
                               f"the solver was held to it ({peak:.0f} > {memory_budget:.0f} bytes); please "
                               f"report this")
        log.debug("step peak %.0f over the budget %.0f: memory points %s join", peak, memory_budget, add)
        have.update(add)
        problem.memory.extend(sm.constraints(add))
    raise AutoparError(f"no layout within {memory_budget:.0f} bytes was proven after {_MAX_ROUNDS} rounds of memory "
                       f"points; raise the budget")


def minimum_budget(problem, sm: StepMemory, *, time_limit: float = math.inf,
                   above: float | None = None) -> tuple[float, tuple[int, ...], float] | None:
    """(the least step peak any assignment reaches, that assignment, a proven lower bound of it), by
    the same rounds as ``solve_under_budget``: minimize the largest point held so far, walk, add the
    highest point of each stretch over that minimum, and start the next round from the best
    assignment walked. Each round's proven minimum (its ``lower``) bounds the answer from below, as its
    points are some of the step's: with ``above``, None as soon as one proves that no assignment peaks
    below it. Where the rounds leave more than ``solver.memory_bound.PROOF_GAP`` between the two (and
    at most its ``PROOF_REACH``), ``_narrow`` closes it to that."""
    from autopar.solver import memory_bound, minimum_feasible_budget

    have = set(_initial_points(sm, problem))
    problem.memory = sm.constraints(sorted(have))
    best, lower = None, 0.0
    for _ in range(_MAX_ROUNDS):
        bound, a, proved = minimum_feasible_budget(problem, time_limit=time_limit, start=best and best[1],
                                                   cutoff=above)
        lower = max(lower, proved)
        if above is not None and lower >= above:
            return None
        _, peak, add = _walk_over(sm, a, bound, have)
        if best is None or peak < best[0]:
            best = (peak, a)
        if not add:
            break
        have.update(add)
        problem.memory.extend(sm.constraints(add))
    ceiling = best[0] if above is None else min(best[0], above)
    if lower >= ceiling * (1 - memory_bound.PROOF_REACH):
        best, lower = _narrow(problem, sm, have, best, lower, ceiling, time_limit)
    return best[0], best[1], min(lower, best[0])


def _narrow(problem, sm: StepMemory, have: set, best: tuple, lower: float, ceiling: float, time_limit: float):
    """(best, lower) with lower within ``solver.memory_bound.PROOF_GAP`` of the least of ``best``'s peak
    and ``ceiling``, or as close as ``fits_within``'s limits allow: ask whether any assignment fits that
    much below it. None fits over the points held, so none over all of them: that budget is proven.
    One that fits is walked: under the budget it is the new best, and the question is asked again below
    its peak; over it, the points it breaks join (as in ``solve_under_budget``) and the question is
    asked again."""
    from autopar.solver import fits_within, memory_bound

    for _ in range(_MAX_ROUNDS):
        target = min(best[0], ceiling) * (1 - memory_bound.PROOF_GAP)
        if lower >= target:
            break
        status, a = fits_within(problem, target, time_limit=time_limit)
        if status == "none":
            lower = target
        if status != "fits":
            break
        _, peak, add = _walk_over(sm, a, target, have)
        if peak < best[0]:
            best = (peak, a)
        if peak > target * (1 + 1e-9):
            if not add:
                break
            have.update(add)
            problem.memory.extend(sm.constraints(add))
    return best, lower
