"""``autopar.compile``: the stages in order, on every rank.

1. capture and the front-end passes (autopar/pass_pipeline.py), once (a pipeline plan's at the shapes of
   one microbatch);
2. the plan: made on rank 0 from that front end (autopar/planner.py) and broadcast, or the one given;
3. codegen: this rank's local program with its collectives and kernels (codegen/);
4. the runtime gets the finished Program and the model's weights (runtime/module.py).
"""
from __future__ import annotations

import json
import math
from pathlib import Path

import torch
import torch.distributed as dist
from torch import nn
from torch.utils import _pytree as pytree

from autopar.cluster import ClusterSpec
from autopar.errors import ClusterMismatchError, PlanFormatError
from autopar.plan import Plan


def compile(model: nn.Module, cluster: ClusterSpec, example_inputs=(), example_kwargs=None, *,
            memory_budget=None, plan: Plan | None = None, check_weights: bool = True,
            sharded_outputs: bool | None = None, kernels: str = "auto", skip_passes=(), insert_passes=(),
            overlap: bool = True, bucket_mb: float | None = None, **plan_options):
    """Plan (or take ``plan``) and return this rank's ParallelModule.

    ``sharded_outputs=True`` returns outputs as DTensors and leaves non-scalar ones (logits) in the
    layouts they are computed in, so they are never gathered; the plan is made knowing that. Scalars
    (the loss) are returned whole. The default is the given plan's setting, else False.
    ``kernels`` is "auto" (Triton on CUDA, ATen on CPU), "triton" or "aten" (docs/kernels.md).
    ``skip_passes`` and ``insert_passes`` change the pass pipeline on every rank (docs/extending.md).
    ``overlap=False`` makes every collective wait where it is issued, for debugging (codegen/overlap.py),
    and is planned for (``plan``'s ``overlap``); a given plan made with overlap over-predicts its memory.
    ``bucket_mb`` is the size in MiB of the buckets data-parallel gradients are all-reduced in during
    backward (DDP's ``bucket_cap_mb``; codegen/grad_buckets.py): a plan decision (``plan.bucket_mb``,
    chosen by the planner's replay unless given, which fixes it); beside a given plan it must be the
    plan's own, since the plan's step time and memory were priced at it.
    ``precision`` (a planning option) is Lightning's name of the training precision: "32-true",
    "bf16-mixed" or "bf16-true"; a given plan's own is used, and a different one is refused. So is
    ``reduce_dtype``, what "bf16-mixed" sums gradients over ranks in ("float32" or "bfloat16": ``plan``)."""
    from autopar.codegen.triton import resolve_kernels
    from autopar.pass_pipeline import front_end, generate, new_runner
    from autopar.passes.precision import dtype_name, resolve_precision
    from autopar.runtime.module import build, device_type, init_mesh, rank_device

    if not dist.is_available() or not dist.is_initialized():
        raise ClusterMismatchError("autopar.compile runs inside an initialized process group: start the "
                                   "program with torchrun (ClusterSpec.from_env() initializes it) or call "
                                   "torch.distributed.init_process_group first")
    world = dist.get_world_size()
    if world != cluster.num_devices:
        raise ClusterMismatchError(f"the process group has {world} ranks but the ClusterSpec describes "
                                   f"{cluster.num_devices} devices; use ClusterSpec.from_env() or a spec of "
                                   f"{world} devices")
    kernels = resolve_kernels(kernels, device_type())
    runner = new_runner(skip_passes, insert_passes)
    if runner.debug_dir is not None and world > 1:
        runner.debug_dir = Path(runner.debug_dir) / f"rank{dist.get_rank()}"
        runner.debug_dir.mkdir(parents=True, exist_ok=True)
    precision, reduce_dtype = plan_options.get("precision"), plan_options.get("reduce_dtype")
    if plan is not None:
        if precision is not None and precision != plan.precision:
            raise PlanFormatError(f"precision={precision!r} but the plan was made for {plan.precision!r}; plan "
                                  f"again with it")
        # A bf16-mixed plan made before the field summed its gradients in bfloat16.
        planned = resolve_precision(plan.precision, model,
                                    plan.reduce_dtype or ("bfloat16" if plan.precision == "bf16-mixed" else None))
        if reduce_dtype is not None and \
                resolve_precision(plan.precision, model, reduce_dtype).grad_reduce_dtype != planned.grad_reduce_dtype:
            raise PlanFormatError(f"reduce_dtype={reduce_dtype!r} but the plan sums gradients in "
                                  f"{dtype_name(planned.grad_reduce_dtype)}; plan again with it")
        plan_options.pop("precision", None)
        plan_options.pop("reduce_dtype", None)
        precision = planned
    else:
        precision = resolve_precision(precision, model, reduce_dtype)
    # A pipeline runs the program of one microbatch, and is planned from captures at microbatch shapes:
    # where one is known to come (a given pipeline plan, a 'pp' axis asked for), the whole batch is not
    # captured. Otherwise every rank captures it while rank 0 plans from its own.
    pipelined = bool(plan.pipeline) if plan is not None else "pp" in (plan_options.get("axis_names") or ())
    front = None
    if not pipelined:
        front = front_end(model, example_inputs, example_kwargs, runner, precision=precision,
                          device_type=cluster.device_type, keep_raw=plan is None)
    if plan is None:
        plan = _plan_on_rank0(model, cluster, example_inputs, example_kwargs, memory_budget, front,
                              {**plan_options, "kernels": kernels, "sharded_outputs": bool(sharded_outputs),
                               "overlap": overlap, "bucket_mb": bucket_mb})
    else:
        check_plan(plan, model, example_inputs, example_kwargs, world, memory_budget=memory_budget,
                   bucket_mb=bucket_mb, **plan_options)
    if sharded_outputs is None:
        sharded_outputs = plan.sharded_outputs
    if plan.pipeline:
        from autopar.pipelining import microbatch_inputs

        mb_args, mb_kwargs = microbatch_inputs(example_inputs, example_kwargs, plan.pipeline["microbatches"])
        front = front_end(model, mb_args, mb_kwargs, runner, precision=precision, device_type=cluster.device_type)
    mesh = init_mesh(plan)
    groups = [mesh.get_group(a).group_name for a in plan.axis_names]
    program = generate(front, plan, groups, rank_device(), sharded_outputs=sharded_outputs, kernels=kernels,
                       overlap=overlap)
    return build(model, program, plan, mesh, check_weights=check_weights, sharded_outputs=sharded_outputs)


def _plan_on_rank0(model, cluster, example_inputs, example_kwargs, memory_budget, front, options):
    from autopar.planner import plan as make_plan

    payload = [None]
    if dist.get_rank() == 0:
        try:
            p = make_plan(model, cluster, example_inputs, example_kwargs, memory_budget=memory_budget, front=front,
                          **options)
            payload = [p.to_json()]
        except Exception as e:     # every rank must learn of the failure, not hang in the broadcast
            payload = [e]
    dist.broadcast_object_list(payload, src=0)
    if isinstance(payload[0], Exception):
        raise payload[0]
    return Plan.from_dict(json.loads(payload[0]))


def check_plan(plan: Plan, model: nn.Module, example_inputs=(), example_kwargs=None, world: int | None = None, *,
               memory_budget=None, pins=None, mesh_shape=None, axis_names=None, progress=None, bucket_mb=None,
               **options) -> None:
    """Check a given plan against the model, the example inputs and the options beside it.

    A plan fixes every shape, so inputs of other shapes are refused (plan again for them). Planning
    options cannot change a finished plan: ``memory_budget``, ``pins``, ``mesh_shape`` and
    ``axis_names`` are checked against it, ``bucket_mb`` must be the plan's (its time and memory are
    priced at it), and any other planning option is refused rather than ignored."""
    from autopar.errors import InfeasiblePlanError, ShapeMismatchError
    from autopar.planner import model_fingerprint

    if plan.model.get("fingerprint") != model_fingerprint(model):
        raise PlanFormatError(f"this plan was made for another model ({plan.model.get('class')}, fingerprint "
                              f"{plan.model.get('fingerprint')}) than {type(model).__qualname__} "
                              f"(fingerprint {model_fingerprint(model)}); plan this model again")
    n = math.prod(plan.mesh_shape)
    if world is not None and n != world:
        raise ClusterMismatchError(f"the plan's mesh {plan.mesh_shape} has {n} devices but the process "
                                   f"group has {world} ranks")
    if options:
        raise PlanFormatError(f"options {sorted(options)} only apply when planning, and plan= gives a finished "
                              f"plan; drop them, or plan again with them (autopar.plan(..., "
                              f"{', '.join(f'{k}=...' for k in sorted(options))}))")
    flat = pytree.tree_leaves((tuple(example_inputs), dict(example_kwargs or {})))
    got = [list(x.shape) if isinstance(x, torch.Tensor) else None for x in flat]
    planned = plan.model.get("input_shapes")
    if planned is not None and got != planned:
        raise ShapeMismatchError(f"this plan was made for inputs of shapes {planned} but the example inputs have "
                                 f"shapes {got}. Layouts, memory and time are planned for one shape: plan again "
                                 f"for these inputs (autopar.compile without plan=), or call with the planned shapes")
    if mesh_shape is not None and tuple(mesh_shape) != plan.mesh_shape:
        raise PlanFormatError(f"mesh_shape={tuple(mesh_shape)} but the plan's mesh is {plan.mesh_shape}")
    if axis_names is not None and tuple(axis_names) != plan.axis_names:
        raise PlanFormatError(f"axis_names={tuple(axis_names)} but the plan's mesh axes are {plan.axis_names}")
    if memory_budget is not None and plan.memory.peak > float(memory_budget):
        raise InfeasiblePlanError(f"the plan's predicted peak, {plan.memory.peak:.0f} bytes per device, exceeds "
                                  f"memory_budget={float(memory_budget):.0f}; plan again with this budget",
                                  memory_budget=float(memory_budget))
    if bucket_mb is not None and bucket_mb != plan.bucket_mb:
        raise PlanFormatError(
            f"bucket_mb={bucket_mb} but the plan "
            + ("makes no gradient bucket of a size of its own (a pipeline plan, a plan made with overlap=False, or "
               "one saved before plans recorded it)" if plan.bucket_mb is None else
               f"was priced with gradient buckets of {plan.bucket_mb:g} MiB (plan.bucket_mb)")
            + "; drop bucket_mb to run the plan's, or plan again with it (autopar.plan(..., bucket_mb=...))")
    for pattern, pin in (pins or {}).items():
        _check_pin(plan, pattern, pin)


def _check_pin(plan: Plan, pattern: str, pin) -> None:
    """A pin beside plan=: the plan must already give what the pin asks for."""
    import fnmatch

    from autopar.passes.ilp_build import unmatched_pin_error

    want = pin if isinstance(pin, dict) else {"output": pin}
    layouts = {**{k: {"output": v} for k, v in plan.params.items()},
               **{k: {"output": v} for k, v in plan.inputs.items()},
               **{n.name: {"output": list(n.outputs[0]) if n.outputs else None,
                           "inputs": [list(lay) for lay in n.inputs]} for n in plan.nodes}}
    matched = [name for name in layouts if fnmatch.fnmatchcase(name, pattern)]
    if not matched:
        raise unmatched_pin_error(pattern, list(layouts))
    for name in matched:
        asked = {}
        if "output" in want:
            asked["output"] = [str(p) for p in want["output"]]
        if "inputs" in want:
            asked["inputs"] = [[str(p) for p in lay] for lay in want["inputs"]]
        if "zero" in want and name in plan.params:
            asked["zero"] = want["zero"]
            layouts[name]["zero"] = plan.zero[name].stage if name in plan.zero else 0
        for key, lay in asked.items():
            if lay != layouts[name].get(key):
                raise PlanFormatError(f"pin {pattern!r} asks {name} for {key} {lay}, but the plan gives it "
                                      f"{layouts[name].get(key)}; plan again with the pin "
                                      f"(autopar.plan(..., pins=...))")
