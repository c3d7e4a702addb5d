"""The compiler's pipeline, stage by stage. Every pass runs through one ``PassRunner``
(passes/runner.py), which logs, times, lints, skips and checks them; ``PASS_NAMES`` lists them all in
order, which is how ``skip_passes`` and ``insert_passes`` name them.

1. front end, on every rank: ``capture`` (torch.export), ``autocast_pass`` (mixed precision's casts),
   then ``FRONT_END``;
2. analysis, where planning runs: ``analysis_passes``;
3. per candidate mesh: ``mesh_passes``, then costs and the solver (autopar/planner.py);
4. codegen, on every rank, from the Plan: ``codegen_passes``; the result is the runtime's Program.
"""
from __future__ import annotations

from dataclasses import dataclass
from functools import partial

import torch.fx as fx

from autopar.codegen.local_program import example_local_inputs, local_program_pass, retarget_devices_pass
from autopar.codegen.grad_buckets import grad_buckets_pass
from autopar.codegen.overlap import overlap_pass
from autopar.codegen.recompute import recompute_pass
from autopar.codegen.stages import loss_output, split_stages
from autopar.codegen.triton import fuse_pass
from autopar.passes.capture import CapturedProgram, capture, copy_program
from autopar.passes.costs import count_saving_consumers_pass
from autopar.passes.layers import layers_pass
from autopar.passes.memory import saved_activations_pass
from autopar.passes.meta import program_meta
from autopar.passes.normalize import normalize_pass
from autopar.passes.precision import Precision, autocast_pass, resolve_precision
from autopar.passes.runner import PassRunner, pass_name
from autopar.passes.strategies import mark_requires_grad_pass, strategies_pass
from autopar.passes.strided import strided_hints_pass
from autopar.errors import AutoparError
from autopar.plan import Plan, bucket_bytes
from autopar.runtime.program import Program

FRONT_END = (normalize_pass, layers_pass, mark_requires_grad_pass, strided_hints_pass)


def analysis_passes(device_type: str, fused: bool = False) -> tuple:
    """``fused``: for the program the Triton backend runs (passes/memory.py keeps its kernels' records)."""
    return (partial(saved_activations_pass, target_device=device_type, fused=fused), count_saving_consumers_pass)


def mesh_passes(mesh_shape, zero: int = 2, offload: bool = False) -> tuple:
    return (partial(strategies_pass, mesh_shape=tuple(mesh_shape), zero=zero, offload=offload),)


def codegen_passes(plan: Plan, front: "FrontEnd", group_names, device, *, sharded_outputs: bool,
                   kernels: str, overlap: bool = True) -> tuple:
    recompute = plan.recompute["layers"]
    cores = tuple((name, tuple(nodes)) for name, nodes in plan.recompute.get("attention", {}).get("regions", {}).items())
    offloaded = tuple(plan.recompute.get("offload", {}).get("layers", ()))
    # Gradient reductions are bucketed before recompute wraps layers: a parameter read inside a
    # recomputed layer would otherwise keep one all-reduce per use there, each waited in its backward.
    return (partial(local_program_pass, plan=plan, group_names=group_names, sharded_outputs=sharded_outputs),
            *((grad_buckets_pass,) if overlap else ()),
            *((partial(recompute_pass, layers=tuple(recompute), cores=cores, offloaded=offloaded),)
              if recompute or cores or offloaded else ()),
            partial(retarget_devices_pass, device=device),
            partial(fuse_pass, backend=kernels, device=device,
                    example_inputs=example_local_inputs(front.gm, plan) if kernels == "triton" else None),
            *((overlap_pass,) if overlap else ()))


PASS_NAMES = tuple(pass_name(p) for p in (autocast_pass, *FRONT_END, *analysis_passes("cpu"), *mesh_passes(()),
                                           local_program_pass, grad_buckets_pass, recompute_pass,
                                           retarget_devices_pass, fuse_pass, overlap_pass))


@dataclass
class FrontEnd:
    captured: CapturedProgram
    gm: fx.GraphModule            # the captured graph after the front-end passes
    runner: PassRunner
    precision: Precision
    raw: CapturedProgram | None = None   # the capture before the passes, when asked for (``keep_raw``)


def new_runner(skip_passes=(), insert_passes=(), debug_dir=None) -> PassRunner:
    kwargs = {} if debug_dir is None else {"debug_dir": debug_dir}
    runner = PassRunner(frozenset(skip_passes), tuple(insert_passes), **kwargs)
    runner.check_names(PASS_NAMES)
    return runner


def front_end(model, example_inputs, example_kwargs, runner: PassRunner, *, precision: str | Precision | None = None,
              device_type: str = "cpu", captured: CapturedProgram | None = None, keep_raw: bool = False) -> FrontEnd:
    """Capture ``model`` (or take ``captured``, a capture of it at these inputs) and run the passes that
    depend only on the model and the training precision (passes/precision.py: ``precision`` is a
    Lightning name, None for the model's own dtype, or a resolved Precision, with autocast's op lists of
    ``device_type``).
    ``keep_raw`` keeps a copy of the capture as it was before the passes (``FrontEnd.raw``), from which
    the planner derives pipelines' microbatch programs (passes/capture.py ``rebatch``), unless the
    capture was unrolled from a few layers (passes/unroll.py): capturing again costs less then."""
    prec = resolve_precision(precision, model)
    if captured is None:
        captured = capture(model, example_inputs, example_kwargs)
    # An unrolled capture costs less than a derivation, which propagates shapes through every layer.
    raw = copy_program(captured) if keep_raw and captured.unrolled is None else None
    runner.dump(captured.gm, "capture")
    gm = runner.run((partial(autocast_pass, precision=prec, device_type=device_type), *FRONT_END), captured.gm,
                    "front end")
    return FrontEnd(captured, gm, runner, prec, raw)


def generate(front: FrontEnd, plan: Plan, group_names, device, *, sharded_outputs: bool,
             kernels: str, overlap: bool = True) -> Program:
    """Run codegen on the front end's graph: the finished program of this rank. With ``overlap``,
    forward collectives are issued early and waited at the first use of their result
    (codegen/overlap.py), and data-parallel gradients are all-reduced during backward in buckets of
    the plan's size (``plan.bucket_mb``, which the plan was priced at; codegen/grad_buckets.py);
    pipeline stages keep both as they were."""
    stages = ()
    if plan.pipeline:
        if kernels == "triton":
            raise AutoparError("pipeline plans run ATen kernels for now; compile with kernels='aten'")
        if plan.recompute.get("attention") or plan.recompute.get("offload"):
            raise AutoparError("pipeline plans recompute whole layers, and this plan recomputes attention cores "
                               "alone or offloads activations; plan it again")
        passes = (partial(local_program_pass, plan=plan, group_names=group_names, sharded_outputs=sharded_outputs),
                  partial(retarget_devices_pass, device=device))
        gm = front.runner.run(passes, front.gm, "codegen")
        stage_of_layer = {inst: st.index for st in plan.pipeline.stages for inst in st.layers}
        stages = split_stages(gm, stage_of_layer, len(plan.pipeline.stages), loss_output(front.gm),
                              dict(zip(group_names, plan.axis_names)))
        recomputed = set(plan.recompute["layers"])
        for st in stages:
            mine = tuple(inst for inst in plan.pipeline.stages[st.index].layers if inst in recomputed)
            if mine:
                front.runner.run((partial(recompute_pass, layers=mine),), st.gm, f"codegen, stage {st.index}")
    else:
        gm = front.runner.run(codegen_passes(plan, front, group_names, device, sharded_outputs=sharded_outputs,
                                             kernels=kernels, overlap=overlap), front.gm, "codegen")
    info = program_meta(gm)
    cap = front.captured
    return Program(gm, info.placeholders, info.output_layouts, cap.in_spec, cap.out_spec, cap.input_shapes,
                   dict(cap.constant_values), dict(info.kernels), grad_reductions=info.grad_reductions,
                   bucket_bytes=bucket_bytes(plan.bucket_mb), overlap=overlap and not plan.pipeline, stages=stages,
                   sharded_states=info.sharded_states)
