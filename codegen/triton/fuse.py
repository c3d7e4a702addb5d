"""The fusion pass on a rank's local program.

1. Norms, the loss and ring attention become calls into the kernel library (``autopar.codegen.kernels``).
2. Pointwise ops are grouped into regions, walking the graph in order and joining each op to the
   regions of its producers when the result is still one kernel:
   - a pointwise region: every op has the same shape (inputs may broadcast to it);
   - a row region: a reduction along the last dim (sum, mean, amax, softmax, log_softmax) with the
     pointwise ops before it (at the full shape) and after it (at the full shape or one per row);
   - the region stays convex: no path leaves it and comes back, so one call can replace it. Calls
     into ``runtime.collectives`` are never fused, so no region spans a collective.
3. Each region of two ops or more becomes one call of a generated kernel (codegen.triton.kernel).

Which nodes steps 1 and 2 take is passes/fusion.py's (``library_kernel``, ``find_regions``): the memory
model reads the same answer to count what the kernels save.
"""
from __future__ import annotations

import collections
import importlib
import inspect
import logging
import operator

import torch
import torch.fx as fx

from autopar.codegen.graph_order import stable_toposort
from autopar.codegen.triton.kernel import kernel_for
from autopar.codegen.triton.source import Input, Op, Output, RegionSpec
from autopar.passes.fusion import Region, find_regions, fused_op, library_kernel, node_arg, tensor_val
from autopar.passes.meta import program_meta, set_meta, set_program_meta

log = logging.getLogger("autopar")


def fuse_pass(gm: fx.GraphModule, *, backend: str = "triton", example_inputs=None, device=None) -> fx.GraphModule:
    """Replace fusible regions of ``gm`` by Triton kernels (``backend="triton"``; ``"aten"`` leaves
    ``gm`` as it is). Nodes need ``meta["val"]``; give ``example_inputs`` (one per placeholder, real,
    fake or meta; meta ones stand for tensors on ``device``) to have it recorded first. The generated
    sources are in ``passes.meta.program_meta(gm).kernels``."""
    if backend == "aten":
        return gm
    if backend != "triton":
        raise ValueError(f"fuse_pass: backend must be 'triton' or 'aten', got {backend!r}")
    if example_inputs is not None:
        record_meta(gm, example_inputs, device=device)
    graph = gm.graph
    sources = dict(program_meta(gm).kernels)
    for node in list(graph.nodes):
        call = _library_call(node)
        if call is not None:
            fn, args, module = call
            sources[fn.__name__] = inspect.getsource(importlib.import_module(f"autopar.codegen.kernels.{module}"))
            _replace(graph, [node], [node], fn, args)
    fused = 0
    for region in find_regions(graph):
        spec, inputs, outputs = region_spec(region)
        if not outputs:          # dead code: nothing reads it
            continue
        kernel = kernel_for(spec)
        sources[kernel.name] = kernel.source.text
        _replace(graph, region.nodes, outputs, kernel.fn, inputs)
        fused += 1
    set_program_meta(gm, kernels=tuple(sources.items()))
    stable_toposort(graph)
    graph.lint()
    gm.recompile()
    if log.isEnabledFor(logging.DEBUG):
        left = collections.Counter(str(n.target) for n in graph.nodes
                                   if n.op == "call_function" and isinstance(n.target, torch._ops.OpOverload))
        log.debug("fuse_pass: %d generated regions; left as ATen: %s", fused, dict(left))
    return gm


def record_meta(gm: fx.GraphModule, example_inputs, *, device=None) -> None:
    """Run ``gm`` on fake copies of ``example_inputs`` and keep every node's value in ``meta["val"]``.
    Meta tensors become fake tensors on ``device`` (default: the device of the other inputs)."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    mode = FakeTensorMode(allow_non_fake_inputs=True)
    tensors = [x for x in example_inputs if isinstance(x, torch.Tensor)]
    if device is None:
        device = next((x.device for x in tensors if not x.is_meta), torch.device("cpu"))

    def fake(x):
        if not isinstance(x, torch.Tensor):
            return x
        if x.is_meta:
            with mode:
                return torch.empty_strided(x.shape, x.stride(), dtype=x.dtype, device=device)
        return mode.from_tensor(x)

    class Recorder(fx.Interpreter):
        def run_node(self, n):
            out = super().run_node(n)
            n.meta["val"] = out
            return out

    args = [fake(x) for x in example_inputs]
    with mode, torch.no_grad():
        Recorder(gm).run(*args)


# --- library kernels -----------------------------------------------------------------------------
def _library_call(node):
    """(kernel function, its arguments, library module) for a norm, a loss or ring attention the
    library covers."""
    from autopar.codegen import kernels
    from autopar.runtime.context_parallel import ring_attention
    from autopar.runtime.sharded_ops import vocab_parallel_cross_entropy

    if node.op != "call_function":
        return None
    kind = library_kernel(node)
    if kind == "layer_norm":
        args = (node.args[0], node_arg(node, 2, "weight", None), node_arg(node, 3, "bias", None),
                node_arg(node, 4, "eps", 1e-5))
        return kernels.layer_norm, args, "_norms"
    if kind == "rms_norm":
        eps = node_arg(node, 3, "eps", None)
        args = (node.args[0], node_arg(node, 2, "weight", None),
                torch.finfo(tensor_val(node.args[0]).dtype).eps if eps is None else eps)
        return kernels.rms_norm, args, "_norms"
    if kind == "cross_entropy":
        reduction = node_arg(node, 3, "reduction", 1)
        args = (node.args[0], node.args[1], node_arg(node, 4, "ignore_index", -100),
                "none" if reduction == 0 else "sum")
        return kernels.cross_entropy, args, "_cross_entropy"
    if node.target is ring_attention:
        return kernels.ring_attention, tuple(node.args), "_attention"
    if node.target is vocab_parallel_cross_entropy:
        logits, target, ignore_index, reduction, group = node.args
        args = (logits, target, group, ignore_index, ("none", "mean", "sum")[reduction])
        return kernels.vocab_parallel_cross_entropy, args, "_cross_entropy"
    return None


def region_spec(region: Region):
    """(the RegionSpec, the input nodes, the output nodes) of a region."""
    full, rank = region.shape, len(region.shape)
    if region.row:
        dims = tuple(d for d in range(rank - 1) if full[d] > 1) + (rank - 1,)
    else:
        dims = tuple(d for d in range(rank) if full[d] > 1)
    index = {n: j for j, n in enumerate(region.nodes)}
    inputs: dict = {}
    specs, ops = [], []
    for n in region.nodes:
        low = fused_op(n)           # read afresh: an earlier region's call may now feed this one
        args = []
        for a in low.operands:
            if not isinstance(a, fx.Node):
                args.append(("c", a))
            elif a in index:
                args.append(("v", index[a]))
            else:
                if a not in inputs:
                    inputs[a] = len(inputs)
                    specs.append(_input_spec(tensor_val(a), full, dims, region.row))
                args.append(("in", inputs[a]))
        row = region.row and tuple(tensor_val(n).shape) != full
        ops.append(Op(low.kind, tuple(args), low.params, row, aten=str(n.target)))
    outputs = [n for n in region.nodes if any(u not in index for u in n.users)]
    outs = tuple(Output(index[n], tensor_val(n).dtype, tensor_val(n).dim() == rank) for n in outputs)
    spec = RegionSpec(region.row, rank, dims, tuple(specs), tuple(ops), outs)
    return spec, list(inputs), outputs


def _input_spec(x: torch.Tensor, full: tuple, dims: tuple, row_mode: bool) -> Input:
    offset = len(full) - x.dim()
    varies = tuple(k for k, d in enumerate(dims) if d >= offset and x.shape[d - offset] == full[d])
    return Input(x.dtype, varies, row_mode and len(dims) - 1 not in varies)


# --- rewriting -----------------------------------------------------------------------------------
def _replace(graph: fx.Graph, nodes: list, outputs: list, fn, args) -> None:
    """One call of ``fn`` in place of ``nodes``; ``outputs`` are the nodes read outside them."""
    members = set(nodes)
    with graph.inserting_after(nodes[-1]):
        call = graph.call_function(fn, tuple(args))
    set_meta(call, fused=tuple(n.name for n in nodes))
    if len(outputs) == 1:
        call.meta["val"] = outputs[0].meta.get("val")
        outputs[0].replace_all_uses_with(call, delete_user_cb=lambda u: u not in members)
    else:
        call.meta["val"] = tuple(o.meta.get("val") for o in outputs)
        for m, o in reversed(list(enumerate(outputs))):
            with graph.inserting_after(call):
                item = graph.call_function(operator.getitem, (call, m))
            item.meta["val"] = o.meta.get("val")
            o.replace_all_uses_with(item, delete_user_cb=lambda u: u not in members)
    for n in reversed(nodes):
        graph.erase_node(n)
