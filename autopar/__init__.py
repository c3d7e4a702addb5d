"""autopar: an auto-parallelizing graph compiler for PyTorch training.

    pmodel = autopar.compile(model, autopar.ClusterSpec.from_env(), example_inputs=(ids,))
    plan = autopar.plan(model, autopar.ClusterSpec.preset("64xH100"), example_inputs=(ids,))
"""
from autopar.cluster import ClusterSpec, DeviceSpec
from autopar.errors import (AutoparError, AutoparWarning, CaptureError, ClusterMismatchError, InfeasiblePlanError,
                            MeshError, PlanFormatError, ShapeMismatchError, ShardingError)
from autopar.plan import Plan
from autopar import checkpoint

__version__ = "0.1.0"


def plan(model, cluster, example_inputs=(), example_kwargs=None, *, memory_budget=None, **options) -> Plan:
    """Plan ``model`` for ``cluster`` offline; see autopar.planner.plan."""
    from autopar.planner import plan as _plan

    return _plan(model, cluster, example_inputs, example_kwargs, memory_budget=memory_budget, **options)


def compile(model, cluster, example_inputs=(), example_kwargs=None, *, memory_budget=None, plan=None, **options):
    """Plan (or take ``plan``) and return a ParallelModule that trains on torch.distributed.
    ``kernels="auto" | "triton" | "aten"`` picks the kernel backend (docs/kernels.md)."""
    from autopar.compiler import compile as _compile

    return _compile(model, cluster, example_inputs, example_kwargs, memory_budget=memory_budget, plan=plan,
                    **options)


def diff(a: Plan, b: Plan):
    """What differs between two plans: layouts, collectives, step time and memory."""
    from autopar.inspection import diff as _diff

    return _diff(a, b)


__all__ = ["ClusterSpec", "DeviceSpec", "Plan", "plan", "compile", "diff", "checkpoint", "AutoparError",
           "AutoparWarning", "CaptureError", "ClusterMismatchError", "InfeasiblePlanError", "MeshError",
           "PlanFormatError", "ShapeMismatchError", "ShardingError"]
