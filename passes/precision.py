"""Training precision, with Lightning's names, and the pass that makes mixed precision explicit.

- ``"32-true"``: parameters, gradients, optimizer states and compute in float32.
- ``"bf16-mixed"``: what ``torch.autocast(device, torch.bfloat16)`` does. Parameters stay float32 (the
  master weights the optimizer updates, with float32 states and float32 gradients); matmul-class ops
  (linear, mm, attention, convolutions) read bfloat16 copies of their inputs, so their outputs, and the
  activations that follow from them, are bfloat16; numerically sensitive ops (losses, and on CUDA norms,
  softmax, exp, log) read float32.
- ``"bf16-true"``: everything in bfloat16, the model's parameters included (the model must be built
  in bfloat16: ``model.to(torch.bfloat16)``); torch's Adam then keeps its states in bfloat16.

``autocast_pass`` writes autocast's casts into the captured graph as ``aten._to_copy`` nodes, following
torch's autocast op lists for the target device (``LOWER``, ``FP32``, ``PROMOTE`` below; the CPU lists
are checked against CPU autocast itself by tests/test_precision.py). One cast per value and dtype is
shared by its readers, as autocast caches the cast of a parameter within a forward. Every later stage
sees plain dtypes: the memory model counts a parameter's float32 master and its bfloat16 copy, and
activations at their dtype; the cost model prices matmuls at bfloat16 FLOP/s and collectives at the
bytes of the dtype they move; the runtime runs the casts on any backend. A parameter's gradient is
reduced where the plan reduces it: the bfloat16 gradient of its copy, or (ZeRO-3) the reduce-scatter of
that gradient, then accumulated into the float32 ``.grad`` by the cast's backward. Those sums run in
float32, the master's dtype, or in bfloat16 where the precision's ``reduce_dtype`` says so
(``reduce_dtype_of``).
"""
from __future__ import annotations

import dataclasses
import operator
from dataclasses import dataclass

import torch
import torch.fx as fx
from torch.utils import _pytree as pytree

aten = torch.ops.aten

from autopar.passes.meta import is_param, meta_of, set_meta
from autopar.plan import PRECISIONS


@dataclass(frozen=True)
class Precision:
    name: str
    param_dtype: torch.dtype          # the parameters the optimizer updates, their gradients and states
    compute_dtype: torch.dtype        # what matmul-class ops compute in
    # Mixed precision: what a parameter's gradient is summed over ranks in where the program reduces it
    # as the gradient of its lower-precision copy: the parameter's dtype (the default, as Megatron-LM's
    # ``accumulate_allreduce_grads_in_fp32``, which it sets for bf16, and torchtitan's
    # ``mixed_precision_reduce``), or the copy's (FSDP2's default). None where not mixed.
    reduce_dtype: torch.dtype | None = None

    @property
    def mixed(self) -> bool:
        return self.param_dtype != self.compute_dtype

    @property
    def grad_reduce_dtype(self) -> torch.dtype:
        """The dtype gradients are summed over ranks in: ``reduce_dtype`` under mixed precision, else
        the parameters' own."""
        return self.reduce_dtype if self.mixed else self.param_dtype

    def to_dict(self) -> dict:
        return {"name": self.name, "param_dtype": dtype_name(self.param_dtype),
                "compute_dtype": dtype_name(self.compute_dtype), "reduce_dtype": dtype_name(self.grad_reduce_dtype)}


def dtype_name(dtype: torch.dtype) -> str:
    """``torch.float32`` -> ``"float32"``: a dtype as plans and messages name it."""
    return str(dtype).removeprefix("torch.")


_BY_NAME = {"32-true": Precision("32-true", torch.float32, torch.float32),
            "bf16-mixed": Precision("bf16-mixed", torch.float32, torch.bfloat16, torch.float32),
            "bf16-true": Precision("bf16-true", torch.bfloat16, torch.bfloat16)}


def resolve_precision(name: str | Precision | None, model: torch.nn.Module, reduce_dtype=None) -> Precision:
    """The precision ``name`` for ``model``; ``None`` is the model's own: "bf16-true" for a bfloat16
    model, else "32-true". A name the model's parameters contradict is refused. ``reduce_dtype``
    ("float32", "bfloat16", a torch dtype or None) is what gradients are summed over ranks in; only
    mixed precision has a choice: its parameters' dtype (the default) or its compute dtype."""
    if isinstance(name, Precision):
        resolve_precision(name.name, model)
        return with_reduce_dtype(name, reduce_dtype)
    dtypes = {p.dtype for p in model.parameters() if p.is_floating_point()}
    if name is None:
        return with_reduce_dtype(_BY_NAME["bf16-true" if dtypes == {torch.bfloat16} else "32-true"], reduce_dtype)
    if name not in _BY_NAME:
        raise ValueError(f"precision={name!r} is not one of {', '.join(repr(p) for p in PRECISIONS)} "
                         f"(Lightning's names)")
    p = _BY_NAME[name]
    wrong = sorted(dtype_name(d) for d in dtypes - {p.param_dtype})
    if wrong:
        how = ("build the model in float32 (its parameters are the float32 master weights; autopar makes "
               "the bfloat16 copies)" if p.mixed else f"convert it first: model.to({p.param_dtype})")
        raise ValueError(f"precision={name!r} trains {dtype_name(p.param_dtype)} parameters, "
                         f"but the model has {', '.join(wrong)} parameters: {how}, or leave precision unset "
                         f"to train in the model's own dtype")
    return with_reduce_dtype(p, reduce_dtype)


def with_reduce_dtype(p: Precision, reduce_dtype) -> Precision:
    """``p`` reducing gradients in ``reduce_dtype`` (see ``resolve_precision``); a ValueError names the
    dtypes ``p`` offers."""
    if reduce_dtype is None:
        return p
    dtype = getattr(torch, reduce_dtype, None) if isinstance(reduce_dtype, str) else reduce_dtype
    offered = (p.param_dtype, p.compute_dtype) if p.mixed else (p.param_dtype,)
    if not isinstance(dtype, torch.dtype) or dtype not in offered:
        raise ValueError(f"reduce_dtype={reduce_dtype!r}: under precision {p.name!r} gradients are summed over ranks "
                         f"in {' or '.join(repr(dtype_name(d)) for d in offered)}"
                         + ("" if p.mixed else " (only mixed precision has a choice)"))
    return dataclasses.replace(p, reduce_dtype=dtype if p.mixed else None)


# torch's autocast op lists (aten/src/ATen/autocast_mode.cpp), for the ops of training IR graphs.
# LOWER: floating inputs cast to the low-precision dtype; FP32: low-precision inputs cast to float32;
# PROMOTE: inputs cast to the widest floating dtype among them. On CUDA the ops autocast runs in
# float32 "unless a dtype is given" (softmax, log_softmax, sum, cumsum, prod) are in FP32 when the
# graph gives none. cross_entropy_loss is not on CUDA's list, but it decomposes into log_softmax and
# nll_loss under autocast, which amounts to a float32 cast of the logits.
_MATMULS = {aten.linear.default, aten.mm.default, aten.bmm.default, aten.matmul.default, aten.addmm.default,
            aten.baddbmm.default, aten.addbmm.default, aten.conv1d.default, aten.conv2d.default,
            aten.conv3d.default, aten.convolution.default, aten._convolution.default,
            aten.conv_transpose1d.default, aten.conv_transpose2d.input, aten.conv_transpose3d.input,
            aten.scaled_dot_product_attention.default, aten.prelu.default}
_LOSSES = {aten.cross_entropy_loss.default, aten.nll_loss.default, aten.nll_loss2d.default, aten.mse_loss.default,
           aten.l1_loss.default, aten.smooth_l1_loss.default, aten.huber_loss.default, aten.kl_div.default,
           aten.binary_cross_entropy.default, aten.binary_cross_entropy_with_logits.default,
           aten.poisson_nll_loss.default, aten.margin_ranking_loss.default, aten.soft_margin_loss.default,
           aten.cosine_embedding_loss.default, aten.hinge_embedding_loss.default}
LOWER = {"cpu": _MATMULS,
         "cuda": _MATMULS | {aten.addmv.default, aten.addr.default, aten.mv.default, aten.einsum.default,
                             aten.chain_matmul.default, aten.linalg_vecdot.default}}
FP32 = {"cpu": _LOSSES,
        "cuda": _LOSSES | {aten.layer_norm.default, aten.native_layer_norm.default, aten.group_norm.default,
                           aten.acos.default, aten.asin.default, aten.cosh.default, aten.erfinv.default,
                           aten.exp.default, aten.expm1.default, aten.log.default, aten.log10.default,
                           aten.log2.default, aten.log1p.default, aten.reciprocal.default, aten.rsqrt.default,
                           aten.sinh.default, aten.tan.default, aten.pow.Tensor_Scalar, aten.pow.Tensor_Tensor,
                           aten.softplus.default, aten.logsumexp.default, aten.cdist.default,
                           aten.softmax.int, aten.log_softmax.int, aten.sum.default, aten.sum.dim_IntList,
                           aten.cumsum.default, aten.cumprod.default, aten.prod.default, aten.prod.dim_int}}
PROMOTE = {"cpu": {aten.cat.default, aten.stack.default, aten.index_copy.default},
           "cuda": {aten.cat.default, aten.stack.default, aten.index_put.default, aten.addcdiv.default,
                    aten.addcmul.default, aten.atan2.default, aten.dot.default, aten.scatter_add.default}}


def autocast_dtypes(target, dtypes: list, device_type: str, low: torch.dtype) -> list:
    """The dtype autocast gives each tensor input of an op (``dtypes``: theirs, None for non-floating
    ones; float64 is never cast), on ``device_type``, with ``low`` the low-precision dtype."""
    eligible = [d is not None and d != torch.float64 for d in dtypes]
    if target in LOWER[device_type]:
        return [low if e else d for d, e in zip(dtypes, eligible)]
    if target in FP32[device_type]:
        return [torch.float32 if e else d for d, e in zip(dtypes, eligible)]
    if target in PROMOTE[device_type]:
        floats = [d for d, e in zip(dtypes, eligible) if e]
        if floats:
            wide = max(floats, key=lambda d: (torch.finfo(d).bits, d == torch.float32))
            return [wide if e else d for d, e in zip(dtypes, eligible)]
    return list(dtypes)


def autocast_pass(gm: fx.GraphModule, *, precision: Precision, device_type: str) -> fx.GraphModule:
    """Insert autocast's casts (``precision.mixed`` only) and update every value's fake tensor."""
    if not precision.mixed:
        return gm
    device_type = "cuda" if device_type == "cuda" else "cpu"
    fake_mode = torch._guards.detect_fake_mode([n.meta.get("val") for n in gm.graph.nodes])
    casts: dict = {}              # (value, dtype) -> its cast
    changed: set = set()          # nodes whose value's dtype the casts changed
    no_ops = {n for n in gm.graph.nodes if n.op == "call_function" and n.target in _CASTS
              and _dtypes(n.meta.get("val")) == _dtypes(n.args[0].meta.get("val"))}
    for node in list(gm.graph.nodes):
        if node.op != "call_function":
            continue
        if node.target is not operator.getitem and _explicit_dtype(node) is None:
            _cast_inputs(gm, node, precision.compute_dtype, device_type, casts, changed, precision.reduce_dtype)
        if any(a in changed or a in casts.values() for a in node.all_input_nodes):
            if node.target is aten._assert_tensor_metadata.default:     # export's check of the old dtype
                gm.graph.erase_node(node)
                continue
            old = node.meta.get("val")
            node.meta["val"] = _rerun(gm, node, fake_mode)
            if _dtypes(old) != _dtypes(node.meta["val"]):
                changed.add(node)
    # A cast to the dtype a tensor already has returns the tensor itself, so where export names such a
    # cast as an output (a model returns its logits and upcasts them for the loss: ``logits.float()``),
    # the output is the tensor: under autocast it keeps its own dtype, as the eager model returns it.
    out = next(n for n in gm.graph.nodes if n.op == "output")
    for n in no_ops:
        if _dtypes(n.meta["val"]) != _dtypes(n.args[0].meta["val"]):
            out.replace_input_with(n, n.args[0])
    gm.graph.lint()
    gm.recompile()
    return gm


_CASTS = {aten._to_copy.default, aten.to.dtype, aten.to.dtype_layout, aten.type_as.default}


def cast_source(node: fx.Node) -> fx.Node | None:
    """The value ``node`` is a dtype cast of (``aten._to_copy`` with a dtype only, as ``autocast_pass``
    writes it for a float32 master weight's bfloat16 copy), else None. The gradient of the copy flows
    into its source's, so a reduction of it can be a reduction of the source's gradient."""
    if node.op == "call_function" and node.target is aten._to_copy.default and set(node.kwargs) == {"dtype"} \
            and isinstance(node.args[0], fx.Node):
        return node.args[0]
    return None


def reduce_dtype_of(node: fx.Node) -> torch.dtype | None:
    """The dtype the sums over ranks of ``node``'s gradient run in: its own, or for a parameter's
    lower-precision copy under a precision that reduces in the parameter's dtype, that dtype
    (``autocast_pass`` marks those copies). Code generation casts the gradient to it around each such
    collective, the cost model prices the collective's bytes in it, and the runtime's buckets hold it
    in it (codegen/grad_buckets.py). None for a node without a value (a hand-built graph's)."""
    return meta_of(node).reduce_dtype or getattr(node.meta.get("val"), "dtype", None)


def reduce_itemsize(node: fx.Node) -> int | None:
    """``reduce_dtype_of(node)``'s bytes an element where it is not the value's own dtype, else None."""
    dtype = meta_of(node).reduce_dtype
    return None if dtype is None else dtype.itemsize


def gradient_carrier(param: fx.Node) -> fx.Node:
    """The value whose gradient is a parameter's whole gradient: its one dtype copy where that copy is
    its only use (bf16-mixed's bfloat16 weight), else the parameter itself. A data-parallel reduction of
    that value's gradient is a reduction of the parameter's, which a pipeline runs once per step
    (codegen/stages.py) and prices so (autopar/pipeline_search.py)."""
    users = list(param.users)
    return users[0] if len(users) == 1 and cast_source(users[0]) is param else param


def reduced_in_buckets(zero_stage: int | None, offloaded: bool, through_copy: bool) -> bool:
    """Whether the runtime's buckets take over the reductions of a parameter's gradient (where every
    reader of its ``gradient_carrier`` all-reduces it over one group): the one predicate of code
    generation (codegen/grad_buckets.py) and of the models that price and count it (``bucketed_value``,
    ``CostModel.bucketed_gradient``). Not where the gradient is reduce-scattered (ZeRO-2: ``zero_stage``
    2) or copied to the host (``offloaded``), nor where a ZeRO-1 parameter is read through a copy
    (``through_copy``: its float32 master sharded, the copy no leaf whose accumulated gradient a bucket
    could take; its reductions stay in the program). A ZeRO-1 parameter read as it is is bucketed as a
    replicated one: the gradient of its read (runtime/zero.py ``whole_of``), summed over the read's
    uses, is the whole tensor's."""
    return not offloaded and (zero_stage is None or (zero_stage < 2 and not through_copy))


def bucketed_value(param: fx.Node, s) -> fx.Node | None:
    """The value whose readers' gradient all-reduces the runtime's buckets take over for a parameter
    under its Strategy ``s`` (codegen/grad_buckets.py), or None where ``reduced_in_buckets`` says not:
    its ``gradient_carrier``."""
    carrier = gradient_carrier(param)
    stage = None if s.zero is None else s.zero.stage
    return carrier if reduced_in_buckets(stage, s.offload, carrier is not param) else None


def reads_through_copy(param: fx.Node) -> bool:
    """Whether a parameter's only reader is its cast to a narrower dtype (bf16-mixed's bfloat16 weight).
    That cast follows the parameter's layout (passes/strategies.py): the copy is made where the weight
    lives, and resharded as the copy, the fewer bytes."""
    carrier = gradient_carrier(param)
    return carrier is not param and carrier.meta["val"].dtype.itemsize < param.meta["val"].dtype.itemsize


def sharded_master_copy(param: fx.Node, strategy: dict) -> fx.Node | None:
    """The lower-precision copy a ZeRO-1/2 parameter is read through where its float32 master is
    sharded too (Megatron-LM's distributed optimizer), else None: under ``strategy`` (node -> Strategy)
    the parameter's optimizer state is ZeRO-1/2 sharded, its only reader is its cast (bf16-mixed's
    bfloat16 weight), and the cast reads it at its own layout. Each rank then keeps that copy whole,
    which the program reads in place of the cast, and the master at the state's block; the copy's
    gradient, summed over its readers, is all-reduced in the program (ZeRO-1) or reduce-scattered into
    the block (ZeRO-2), in the copy's dtype, and the updated blocks are all-gathered in it
    (runtime/zero.py). Pipeline plans read their ZeRO-1 parameters directly (codegen/stages.py) and
    keep the master whole; they offer no ZeRO-2."""
    s = strategy.get(param)
    if s is None or s.zero is None or not reads_through_copy(param):
        return None
    carrier = gradient_carrier(param)
    return carrier if tuple(strategy[carrier].inputs[0]) == tuple(s.outputs[0]) else None


def sharded_master_option(param: fx.Node, option: int, strategies) -> fx.Node | None:
    """``sharded_master_copy`` under option ``option`` of the parameter's decision in ``strategies``
    (passes.strategies.MeshStrategies), where its copy follows that decision."""
    if not reads_through_copy(param) or strategies.root_of(gradient_carrier(param)) is not param:
        return None
    carrier = gradient_carrier(param)
    return sharded_master_copy(param, {param: strategies.strategy_of(param, option),
                                       carrier: strategies.strategy_of(carrier, option)})


def _explicit_dtype(node):
    return node.kwargs.get("dtype")


def _tensor_inputs(node) -> list[tuple[tuple, fx.Node]]:
    """(where in args, the node) for every tensor input, lists of tensors (cat's) included."""
    out = []
    for i, a in enumerate(node.args):
        if isinstance(a, fx.Node) and isinstance(a.meta.get("val"), torch.Tensor):
            out.append(((i,), a))
        elif isinstance(a, (list, tuple)):
            out += [((i, j), b) for j, b in enumerate(a)
                    if isinstance(b, fx.Node) and isinstance(b.meta.get("val"), torch.Tensor)]
    return out


def _cast_inputs(gm, node, low, device_type, casts, changed, reduce_dtype):
    inputs = _tensor_inputs(node)
    if not inputs:
        return
    dtypes = [a.meta["val"].dtype if a.meta["val"].is_floating_point() else None for _, a in inputs]
    want = autocast_dtypes(node.target, dtypes, device_type, low)
    args = [list(a) if isinstance(a, (list, tuple)) else a for a in node.args]
    for ((i, *j), a), have, dtype in zip(inputs, dtypes, want):
        if have is None or dtype == have:
            continue
        if (a, dtype) not in casts:
            with gm.graph.inserting_before(node):        # its first reader: the graph is in order
                c = gm.graph.call_function(aten._to_copy.default, (a,), {"dtype": dtype})
            c.meta.update({k: v for k, v in node.meta.items() if k in ("nn_module_stack", "stack_trace")})
            c.meta["val"] = a.meta["val"].to(dtype)
            if reduce_dtype is not None and is_param(a) and dtype.itemsize < reduce_dtype.itemsize:
                set_meta(c, reduce_dtype=reduce_dtype)
            casts[(a, dtype)] = c
        if j:
            args[i][j[0]] = casts[(a, dtype)]
        else:
            args[i] = casts[(a, dtype)]
    node.args = tuple(type(node.args[k])(v) if isinstance(node.args[k], (list, tuple)) else v
                      for k, v in enumerate(args))


def _rerun(gm, node, fake_mode):
    def val(a):
        if isinstance(a, fx.Node):
            return getattr(gm, a.target) if a.op == "get_attr" else a.meta["val"]
        return a

    args, kwargs = fx.node.map_aggregate((node.args, node.kwargs), val)
    with fake_mode:
        return node.target(*args, **kwargs)


def _dtypes(v):
    return tuple(t.dtype for t in pytree.tree_leaves(v) if isinstance(t, torch.Tensor))
