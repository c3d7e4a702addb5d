"""``autopar.compile``: plan on rank 0 (or take a Plan), check it against the model and the process
group, then build every rank's ParallelModule (runtime/module.py)."""
from __future__ import annotations

import json
import math

import torch.distributed as dist
from torch import nn

from autopar.cluster import ClusterSpec
from autopar.errors import ClusterMismatchError, PlanFormatError
from autopar.plan import Plan
from autopar.runtime.module import build, device_type


def compile(model: nn.Module, cluster: ClusterSpec, example_inputs=(), example_kwargs=None, *,
            memory_budget=None, plan: Plan | None = None, check_weights: bool = True,
            sharded_outputs: bool | None = None, kernels: str = "auto", **plan_options):
    """Plan (or take ``plan``) and return this rank's ParallelModule.

    ``sharded_outputs=True`` returns outputs as DTensors and leaves non-scalar ones (logits) in the
    layouts they are computed in, so they are never gathered; the plan is made knowing that. Scalars
    (the loss) are returned whole. The default is the given plan's setting, else False.
    ``kernels`` is "auto" (Triton on CUDA, ATen on CPU), "triton" or "aten" (docs/kernels.md)."""
    if not dist.is_available() or not dist.is_initialized():
        raise ClusterMismatchError("autopar.compile runs inside an initialized process group: start the "
                                   "program with torchrun (ClusterSpec.from_env() initializes it) or call "
                                   "torch.distributed.init_process_group first")
    world = dist.get_world_size()
    if world != cluster.num_devices:
        raise ClusterMismatchError(f"the process group has {world} ranks but the ClusterSpec describes "
                                   f"{cluster.num_devices} devices; use ClusterSpec.from_env() or a spec of "
                                   f"{world} devices")
    from autopar.codegen.triton import resolve_backend
    from autopar.planner import model_fingerprint

    kernels = resolve_backend(kernels, device_type())
    if plan is None:
        plan = _plan_on_rank0(model, cluster, example_inputs, example_kwargs, memory_budget,
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
    return build(model, plan, example_inputs, example_kwargs, check_weights=check_weights,
                 sharded_outputs=sharded_outputs, kernels=kernels)


def _plan_on_rank0(model, cluster, example_inputs, example_kwargs, memory_budget, options):
    from autopar.planner import plan as make_plan

    payload = [None]
    if dist.get_rank() == 0:
        try:
            p = make_plan(model, cluster, example_inputs, example_kwargs, memory_budget=memory_budget, **options)
            payload = [p.to_json()]
        except Exception as e:     # every rank must learn of the failure, not hang in the broadcast
            payload = [e]
    dist.broadcast_object_list(payload, src=0)
    if isinstance(payload[0], Exception):
        raise payload[0]
    return Plan.from_dict(json.loads(payload[0]))
