"""``autopar.compile``: the stages in order, on every rank.

1. capture and the front-end passes (autopar/pass_pipeline.py), once;
2. the plan: made on rank 0 from that front end (autopar/planner.py) and broadcast, or the one given;
3. codegen: this rank's local program with its collectives and kernels (codegen/);
4. the runtime gets the finished Program and the model's weights (runtime/module.py).
"""
from __future__ import annotations

import json
import math
from pathlib import Path

import torch.distributed as dist
from torch import nn

from autopar.cluster import ClusterSpec
from autopar.errors import ClusterMismatchError, PlanFormatError
from autopar.plan import Plan


def compile(model: nn.Module, cluster: ClusterSpec, example_inputs=(), example_kwargs=None, *,
            memory_budget=None, plan: Plan | None = None, check_weights: bool = True,
            sharded_outputs: bool | None = None, kernels: str = "auto", skip_passes=(), insert_passes=(),
            **plan_options):
    """Plan (or take ``plan``) and return this rank's ParallelModule.

    ``sharded_outputs=True`` returns outputs as DTensors and leaves non-scalar ones (logits) in the
    layouts they are computed in, so they are never gathered; the plan is made knowing that. Scalars
    (the loss) are returned whole. The default is the given plan's setting, else False.
    ``kernels`` is "auto" (Triton on CUDA, ATen on CPU), "triton" or "aten" (docs/kernels.md).
    ``skip_passes`` and ``insert_passes`` change the pass pipeline on every rank (docs/extending.md)."""
    from autopar.codegen.triton import resolve_kernels
    from autopar.pass_pipeline import front_end, generate, new_runner
    from autopar.planner import model_fingerprint
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
    front = front_end(model, example_inputs, example_kwargs, runner)
    if plan is None:
        plan = _plan_on_rank0(model, cluster, example_inputs, example_kwargs, memory_budget, front,
                              {**plan_options, "kernels": kernels, "sharded_outputs": bool(sharded_outputs)})
    else:
        if plan.model.get("fingerprint") != model_fingerprint(model):
            raise PlanFormatError(f"this plan was made for another model ({plan.model.get('class')}, fingerprint "
                                  f"{plan.model.get('fingerprint')}) than {type(model).__qualname__} "
                                  f"(fingerprint {model_fingerprint(model)}); plan this model again")
        n = math.prod(plan.mesh_shape)
        if n != world:
            raise ClusterMismatchError(f"the plan's mesh {plan.mesh_shape} has {n} devices but the process "
                                       f"group has {world} ranks")
    if sharded_outputs is None:
        sharded_outputs = plan.sharded_outputs
    if plan.pipeline:
        # A pipeline runs the program of one microbatch: capture again at its shapes.
        from autopar.pipelining import microbatch_inputs

        mb_args, mb_kwargs = microbatch_inputs(example_inputs, example_kwargs, plan.pipeline["microbatches"])
        front = front_end(model, mb_args, mb_kwargs, runner)
    mesh = init_mesh(plan)
    groups = [mesh.get_group(a).group_name for a in plan.axis_names]
    program = generate(front, plan, groups, rank_device(), sharded_outputs=sharded_outputs, kernels=kernels)
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
