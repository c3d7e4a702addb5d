"""Plan + captured graph -> the per-rank local program (``local_program_pass``).

Every node runs its own ATen op on local shards; view, reshape and expand sizes are rewritten to local
sizes; every resharding the plan implies becomes an explicit call into ``autopar.runtime.collectives``
(the same steps ``passes.reshard_plan`` reports in ``plan.collectives``). The result is an fx.GraphModule
whose ``code`` is readable Python; ``passes.meta.program_meta(gm)`` says how to call it.
"""
from __future__ import annotations

import functools
import importlib
import operator
from dataclasses import replace

import torch
import torch.fx as fx
from torch.utils import _pytree as pytree

from autopar.errors import PlanFormatError, ShardingError
from autopar.layout import format_layout, local_shape, parse_layout
from autopar.passes.normalize import BIASED_MATMULS, folded_matmul
from autopar.passes.reshard_plan import gathered_output, plan_reshards
from autopar.passes.precision import cast_source, gradient_carrier, reads_through_copy
from autopar.passes.meta import is_param, meta_of, op_name, set_meta, set_program_meta
from autopar.passes.rules import context_for, rule_for
from autopar.passes.runner import requires
from autopar.passes.strategies import Strategy, ZeroState, input_values, node_strategies, zero_variants
from autopar.plan import Plan
from autopar.runtime import collectives as C
from autopar.runtime import zero as Z
from autopar.runtime.local_ops import flatten as local_flatten

aten = torch.ops.aten

_STEP_FN = {"all_gather": C.all_gather, "reduce_scatter": C.reduce_scatter, "all_reduce": C.all_reduce,
            "all_to_all": C.all_to_all, "local_chunk": C.local_chunk, "grad_all_reduce": C.grad_all_reduce}


def step_call(st, x, group: str, reduce_dtype: torch.dtype | None = None) -> tuple:
    """(function, args, kwargs) of the runtime call that performs resharding step ``st`` (a
    passes.resharding.Step) on ``x`` over the c10d group ``group``: what the generated program runs
    for it, whose storage ``Step.makes_storage`` describes to the step memory model. ``reduce_dtype``:
    what a sum of the gradient in its backward runs in where not ``x``'s dtype
    (passes.precision.reduce_dtype_of)."""
    fn = _STEP_FN[st.op]
    # A strided shard's groups are passed only where there are some: plain calls read as before.
    strided = {"groups": st.groups} if st.groups > 1 else {}
    reduced = {"reduce_dtype": reduce_dtype} if reduce_dtype is not None else {}
    if st.op == "all_gather":
        return fn, (x, st.dim, group), {"grad": st.grad, **strided,
                                        **(reduced if st.grad == "reduce_scatter" else {})}
    if st.op in ("reduce_scatter", "local_chunk"):
        return fn, (x, st.dim, group), strided
    if st.op == "all_to_all":
        groups = {k: v for k, v in (("src_groups", st.groups), ("dst_groups", st.dst_groups)) if v > 1}
        return fn, (x, st.dim, st.dst_dim, group), groups
    return fn, (x, group), reduced if st.op == "grad_all_reduce" else {}


@functools.lru_cache(maxsize=None)
def resolve_function(path: str):
    """The function a rule's ``local_call`` names by its dotted path, e.g.
    ``autopar.runtime.sharded_ops.vocab_parallel_embedding``."""
    module, _, name = path.rpartition(".")
    try:
        return getattr(importlib.import_module(module), name)
    except (ImportError, AttributeError) as e:
        raise PlanFormatError(f"a sharding rule names the local function {path!r}, which cannot be imported: "
                              f"{e}") from e


def strategies_from_plan(gm: fx.GraphModule, plan: Plan) -> dict:
    """Rebuild each node's Strategy from the plan, checking that the plan describes this graph."""
    axes = plan.axis_names
    nax = len(axes)
    by_name = {n.name: n for n in plan.nodes}
    rep = tuple(parse_layout(["R"] * nax))
    out, legal = {}, {}
    for node in gm.graph.nodes:
        if node.op == "placeholder":
            role = meta_of(node).role
            lay = rep
            if role.kind == "param":
                if role.target not in plan.params:
                    raise PlanFormatError(f"the plan has no layout for parameter {role.target!r}: it was made for "
                                          f"another model ({plan.model.get('class')}); plan this model again")
                lay = parse_layout(plan.params[role.target])
            elif role.kind == "input" and role.target in plan.inputs:
                lay = parse_layout(plan.inputs[role.target])
            val = node.meta.get("val")
            if isinstance(val, torch.Tensor):
                field = f"params[{role.target!r}]" if role.kind == "param" else f"inputs[{role.target!r}]"
                try:
                    local_shape(tuple(val.shape), lay, plan.mesh_shape, what=f"plan {field} {format_layout(lay)}")
                except ShardingError as e:
                    raise PlanFormatError(str(e)) from e
            outs = (lay,) if isinstance(val, torch.Tensor) else ()
            zero = None
            if role.kind == "param" and role.target in plan.zero:
                z = plan.zero[role.target]
                zero = ZeroState(z.stage, axes.index(z.axis), z.dim)
                if zero not in zero_variants(tuple(val.shape), lay, plan.mesh_shape):
                    raise PlanFormatError(f"plan zero[{role.target!r}] = {dict(z)}: the parameter {format_layout(lay)} "
                                          f"of shape {list(val.shape)} cannot shard its state that way on mesh "
                                          f"{list(plan.mesh_shape)}; plan this model again")
            out[node] = Strategy((), outs, (False,) * nax, zero, role.kind == "param" and role.target in plan.offload)
        elif node.op == "call_function":
            entry = by_name.get(node.name)
            val = node.meta.get("val")
            shape = tuple(val.shape) if isinstance(val, torch.Tensor) else None
            if entry is None or entry.op != op_name(node) or entry.shape != shape:
                raise PlanFormatError(f"the plan does not match this model at node {node.name!r} "
                                      f"({op_name(node)}): it was made for another model or another "
                                      f"version of it ({plan.model.get('class')}); plan this model again")
            s = Strategy(tuple(parse_layout(l) for l in entry.inputs), tuple(parse_layout(l) for l in entry.outputs),
                         tuple(a in entry.split_axes for a in axes))
            if node.target is not operator.getitem and s not in node_strategies(node, plan.mesh_shape, legal):
                raise PlanFormatError(f"plan node {node.name!r} ({op_name(node)}): inputs "
                                      f"{[list(l) for l in entry.inputs]} -> outputs {[list(l) for l in entry.outputs]} "
                                      f"splitting work on {list(entry.split_axes)} is not a strategy of its op for "
                                      f"shape {None if shape is None else list(shape)} on mesh {list(plan.mesh_shape)}; "
                                      f"the plan was edited or made by another version: plan this model again")
            out[node] = s
    # A ZeRO-2 weight read through its copy: the copy carries the weight's state, so that its readers
    # leave its gradient to the reduce-scatter (passes.strategies._try_follow).
    for node, s in list(out.items()):
        if node.op == "placeholder" and s.grad_scatter_axis is not None and reads_through_copy(node):
            copy = gradient_carrier(node)
            out[copy] = replace(out[copy], zero=s.zero)
    return out


@requires("mark_requires_grad_pass")
def local_program_pass(gm: fx.GraphModule, *, plan: Plan, group_names: list[str],
                       sharded_outputs: bool = False) -> fx.GraphModule:
    """The local program of one rank. ``group_names[a]`` is the c10d group of mesh axis ``a``.
    With ``sharded_outputs=True`` non-scalar outputs are returned in the layout they are computed in
    (passes.reshard_plan.gathered_output), whatever the plan was priced for."""
    mesh_shape = plan.mesh_shape
    strategy = strategies_from_plan(gm, plan)
    low = plan_reshards(gm, strategy, mesh_shape, sharded_outputs)

    g = fx.Graph()
    env: dict = {}
    resharded: dict = {}
    placeholders, output_layouts = [], []
    current = {"layer": None, "node": None}          # the layer tag and name of the node being emitted

    def reshard(key):
        if key in resharded:
            return resharded[key]
        x = env[key.value.node]
        if isinstance(x, tuple):             # a multi-output node: read one output
            x = x[key.value.index]
        for st in low.reshards[key]:
            x = g.call_function(*step_call(st, x, group_names[st.axis], meta_of(key.value.node).reduce_dtype))
            set_meta(x, step=st, layer=current["layer"], reader=current["node"])
        resharded[key] = x
        return x

    for node in gm.graph.nodes:
        if node.op == "placeholder":
            env[node] = g.placeholder(node.name)
            role = meta_of(node).role
            placeholders.append((role.kind, role.target))
        elif node.op == "get_attr":
            env[node] = g.get_attr(node.target)
        elif node.op == "call_function":
            current["layer"], current["node"] = meta_of(node).layer, node.name
            env[node] = _emit(g, node, strategy[node], low, env, reshard, mesh_shape, group_names)
            set_meta(env[node], source=node.name, layer=current["layer"])
            current["layer"] = current["node"] = None
        elif node.op == "output":
            leaves, spec = pytree.tree_flatten(node.args[0])
            outs, k = [], 0
            for a in leaves:
                if isinstance(a, fx.Node) and isinstance(a.meta.get("val"), torch.Tensor):
                    key = low.output_uses[k]
                    outs.append(reshard(key) if key is not None else env[a])
                    gathered = gathered_output(a, sharded_outputs)
                    output_layouts.append(tuple(parse_layout(["R"] * len(mesh_shape))) if gathered
                                          else strategy[a].outputs[0])
                    k += 1
                else:
                    outs.append(env[a] if isinstance(a, fx.Node) else a)
            g.output(pytree.tree_unflatten(outs, spec))
    _fold_biases(gm, env)
    copies = _read_zero_before_use(g, placeholders, plan)
    local = fx.GraphModule(gm, g, class_name="LocalProgram")
    # A plan without gather buckets (written before they existed) gathers each parameter alone.
    # A sharded master's gradient is its copy's, summed in the dtype the copy is marked with.
    summed_in = {meta_of(n).role.target: meta_of(gradient_carrier(n)).reduce_dtype
                 for n in gm.graph.nodes if is_param(n)}
    zero = tuple((fqn, z.stage, group_names[plan.axis_names.index(z.axis)], z.dim,
                  f"own {fqn}" if z.bucket is None else z.bucket, copies.get(fqn),
                  summed_in.get(fqn) if fqn in copies else None)
                 for fqn, z in plan.zero.items())
    set_program_meta(local, placeholders=tuple(placeholders), output_layouts=tuple(output_layouts),
                     sharded_states=zero, offloaded=tuple(sorted(plan.offload)))
    return local


def _read_zero_before_use(g: fx.Graph, roles: list, plan: Plan) -> dict:
    """Read each ZeRO-1/2 parameter through ``runtime.zero.whole_of`` right before its first use: for
    ZeRO-2 the read is where backward reduce-scatters the parameter's summed gradient, and autograd runs
    it as soon as its gradient is complete only if it was made after everything that ran before its use
    (it runs the ready node made last first). The read belongs to its first user's layer, so that a
    recomputed layer's region holds it: outside, it would be made before the whole region and run after
    the region's whole backward. A pipeline plan's ZeRO-1 parameters are read directly: its
    stages find a parameter's per-microbatch all-reduce at its placeholder (codegen/stages.py), and it
    runs through ``train_step`` only, never under the user's ``torch.autograd.grad``.
    A parameter whose float32 master the plan shards (``PlanZero.sharded_master``) is held whole as its
    lower-precision copy: the read is that copy, in place of the cast. Returns those parameters' copy
    dtypes."""
    sharded_states = {fqn for fqn, z in plan.zero.items() if z.stage == 2 or not plan.pipeline}
    order = {n: i for i, n in enumerate(g.nodes)}
    copies = {}
    for ph, (kind, target) in zip([n for n in g.nodes if n.op == "placeholder"], roles):
        if kind != "param" or target not in sharded_states or not ph.users:
            continue
        first = min(ph.users, key=order.__getitem__)
        with g.inserting_before(first):
            whole = g.call_function(Z.whole_of, (ph,))
        set_meta(whole, layer=meta_of(first).layer)
        ph.replace_all_uses_with(whole, delete_user_cb=lambda u: u is not whole)
        if plan.zero[target].sharded_master:
            cast = next(iter(whole.users)) if len(whole.users) == 1 else None
            if cast is None or cast_source(cast) is not whole:
                raise PlanFormatError(f"plan zero[{target!r}] shards its float32 master, but the program reads "
                                      f"{target!r} other than through one dtype cast; plan this model again")
            copies[target] = cast.kwargs["dtype"]
            cast.replace_all_uses_with(whole)
            g.erase_node(cast)
    return copies


def retarget_devices_pass(gm: fx.GraphModule, *, device) -> fx.GraphModule:
    """Point factory ops (``arange(..., device=...)``) at this rank's device, in submodules too: they
    were captured with the model's device (meta, for a meta model)."""
    device = torch.device(device)
    for mod in gm.modules():
        if not isinstance(mod, fx.GraphModule):
            continue
        for n in mod.graph.nodes:
            if n.op == "call_function":
                n.args, n.kwargs = pytree.tree_map_only(torch.device, lambda _: device, (n.args, dict(n.kwargs)))
        mod.recompile()
    return gm


def example_local_inputs(gm: fx.GraphModule, plan: Plan) -> list:
    """One meta tensor of this rank's local shape per placeholder of the captured ``gm``: what the
    local program is called with, for passes that record shapes (codegen.triton.record_meta)."""
    out = []
    for node, lay in strategies_from_plan(gm, plan).items():
        if node.op != "placeholder":
            continue
        val = node.meta.get("val")
        if isinstance(val, torch.Tensor):
            shape = local_shape(tuple(val.shape), lay.outputs[0], plan.mesh_shape, what=node.name)
            val = torch.empty(shape, dtype=val.dtype, device="meta")
        out.append(val)
    return out


def _fold_biases(gm: fx.GraphModule, env: dict) -> None:
    """Where a split-off bias is added to its matmul's local result with nothing between them (no
    resharding, no other reader), emit the biased matmul again (``addmm``, ``linear`` with a bias):
    one op less and no extra pass over the output, forward and backward. Any layout qualifies, as
    both forms compute the same local sum; the plan's graph keeps the split."""
    for node in gm.graph.nodes:
        mm = folded_matmul(node)
        if mm is None:
            continue
        add, local_mm = env[node], env[mm]
        if add.args[0] is not local_mm or len(local_mm.users) != 1 or local_mm.target is not mm.target:
            continue
        local_bias = add.args[1]
        add.target = BIASED_MATMULS[mm.target]
        add.args = ((local_bias, *local_mm.args) if mm.target is aten.mm.default
                    else (*local_mm.args, local_bias))
        local_mm.graph.erase_node(local_mm)


def _emit(g, node, s: Strategy, low, env, reshard, mesh_shape, group_names):
    if node.target is operator.getitem:
        return g.call_function(operator.getitem, (env[node.args[0]], node.args[1]))
    values = input_values(node)
    position = iter(range(len(values)))

    def local_arg(a):
        if isinstance(a, fx.Node):
            if not isinstance(a.meta.get("val"), torch.Tensor):
                return env[a]
            k = next(position)
            key = low.uses.get((node, k))
            return reshard(key) if key is not None else env[a]
        return a

    args = pytree.tree_map_only(fx.Node, local_arg, node.args)
    kwargs = pytree.tree_map_only(fx.Node, local_arg, dict(node.kwargs))
    rule = rule_for(node)
    if rule.local_args is not None:
        ctx = context_for(node)
        lin = [local_shape(i.shape, l, mesh_shape, what=node.name) for i, l in zip(ctx.ins, s.inputs)]
        lout = [local_shape(o.shape, l, mesh_shape, what=node.name) for o, l in zip(ctx.outs, s.outputs)]
        args, kwargs = rule.local_args(ctx, args, kwargs, lin, lout)
    target = node.target
    call = rule.local_call(context_for(node), s.inputs, args, kwargs, group_names) if rule.local_call else None
    if call is not None:
        # The op's sharded form communicates by itself (runtime.sharded_ops).
        path, args, kwargs = call
        target = resolve_function(path)
    if target is aten.view.default:
        # A resharded input may not be contiguous in the way the view needs; reshape copies only then.
        target = aten.reshape.default
    elif target is aten.flatten.using_ints:
        # A storage of its own, as the memory model counts it, never a view of a larger one.
        target = local_flatten
    return g.call_function(target, args, kwargs)
