"""Pipeline plans train like single-device eager training, on real gloo ranks.

Every rank runs its stages of the generated program under a torch.distributed.pipelining schedule.
Tolerances are those of tests/test_parity.py (fp32): losses to relative 1e-5 at every step, first-step
gradients to 1e-5 of the largest gradient entry, parameters after 3 AdamW steps to 1e-4 absolute.
"""
import contextlib
import copy

import pytest
import torch

from tests.distributed_utils import run_distributed
from tests.eager_parity import train_and_compare
from tests.hf_models import MEGATRON, batch, build


def _stages(mesh, schedule):
    return mesh[0] * (2 if "Interleaved" in schedule or "ZBV" in schedule else 1)


def _held_gradient(pm, fqn):
    """A parameter's whole gradient over its stage's ranks; None where this rank's stages do not hold it."""
    from torch.distributed.tensor import DTensor

    if fqn not in pm._held:
        return None
    grad = pm.local_parameter(fqn).grad      # a ZeRO-1 parameter's: its block of the state layout
    sub = pm._stage_mesh()
    if sub is not None:
        lay = [p.to_dtensor() for i, p in enumerate(pm.state_layout(fqn)) if i != pm.pp_axis]
        grad = DTensor.from_local(grad, sub, lay, run_check=False).full_tensor()
    return grad


def _check(rank, world, cases):
    import autopar

    ids, labels = batch()
    cluster = autopar.ClusterSpec.local_cpu(world)
    for name, mesh, axes, schedule, microbatches, pins, *options in cases:
        options = options[0] if options else {}
        torch.manual_seed(0)
        model = build(name, layers=max(2, _stages(mesh, schedule)))   # one layer per stage
        ref = copy.deepcopy(model)
        with _front_end_batches() as captured:
            pm = autopar.compile(model, cluster, (ids,), {"labels": labels}, mesh_shape=mesh, axis_names=axes,
                                 schedule=schedule, microbatches=microbatches, pins=pins, **options)
        where = f"{name} / {schedule} x {microbatches} microbatches on mesh {dict(zip(axes, mesh))} {options}"
        # A pipeline runs one microbatch's program: compile (and rank 0's planning) capture the model at
        # its shapes only, never the whole batch.
        assert set(captured) == {len(ids) // microbatches}, f"{where}: captured batches {captured}"
        if "recompute" in options:
            _check_recompute(pm, where)
        pipe = pm.plan.pipeline
        assert pipe["schedule"] == schedule and pipe["microbatches"] == microbatches, where
        assert len(pipe["stages"]) == _stages(mesh, schedule), where
        held = [lay for lay in pm.plan.params.values()]
        assert all(lay[0] == "R" for lay in held), f"{where}: a layout shards along the pipeline axis"
        if "dp" in axes:
            # Data parallelism's gradient sync runs once per step, not in every microbatch's backward.
            assert any(s.grad_sums for s in pm._stage_programs), where
            assert pipe["grad_sync_seconds"] > 0, f"{where}: the plan does not price the gradient sync"
            for st in pm._stage_programs:
                assert not _params_reduced_in_backward(st), f"{where}: stage {st.index}"
        if any(isinstance(pin, dict) and pin.get("zero") for pin in (pins or {}).values()):
            # Adam's states sharded over the stage's data-parallel ranks: the optimizer steps half of each.
            assert pm.plan.zero and {z["stage"] for z in pm.plan.zero.values()} == {1}, where
            for fqn in set(pm.plan.zero) & set(pm._held):
                assert 2 * pm.local_parameter(fqn).numel() == pm.local_tensor(fqn).numel(), f"{where}: {fqn}"
        with pytest.raises(autopar.AutoparError, match="train_step"):
            pm(ids, labels=labels)
        # A batch of another size does not split into the plan's microbatches: refused before any collective.
        with pytest.raises(autopar.ShapeMismatchError, match=f"{microbatches} microbatches of"):
            pm.train_step(ids[:-1], labels=labels[:-1])
        train_and_compare(pm, ref, ids, labels, where, gradient=_held_gradient)


@contextlib.contextmanager
def _front_end_batches():
    """The batch sizes the model is captured at (its front ends), while inside."""
    from autopar import pass_pipeline

    real, batches = pass_pipeline.front_end, []

    def counted(model, args, kwargs, *rest, **options):
        batches.append(len(args[0]))
        return real(model, args, kwargs, *rest, **options)

    pass_pipeline.front_end = counted
    try:
        yield batches
    finally:
        pass_pipeline.front_end = real


def _params_reduced_in_backward(stage):
    """Parameters whose gradient a stage program still all-reduces in each microbatch's backward. (An
    activation's may be: a position embedding's output, replicated, added to the batch-split tokens.)"""
    params = {n for n, (kind, _) in zip(stage.gm.graph.find_nodes(op="placeholder"), stage.placeholders)
              if kind == "param"}
    return [n.args[0].name for n in stage.gm.graph.nodes
            if n.op == "call_function" and getattr(n.target, "__name__", "") == "grad_all_reduce"
            and n.args[0] in params]


def _check_recompute(pm, where):
    """Every layer the plan recomputes is one checkpointed call in its stage's program, and no other."""
    from autopar.runtime.recompute import checkpointed

    recomputed = set(pm.plan.recompute["layers"])
    assert recomputed, f"{where}: the plan recomputes nothing"
    for st in pm._stage_programs:
        mine = {inst for inst in pm.plan.pipeline["stages"][st.index]["layers"] if inst in recomputed}
        calls = [n for n in st.gm.graph.nodes if n.op == "call_function" and n.target is checkpointed]
        assert len(calls) == len(mine), f"{where}: stage {st.index} checkpoints {len(calls)} regions for {mine}"
    assert pm.plan.breakdown["recompute"] > 0, f"{where}: the plan does not price the recompute"


def _tp_pins(name):
    return {k: ["R", v] for k, v in MEGATRON[name].items()}


def _dp_pins(name, zero=0):
    # Weights replicated (their Adam states sharded over dp under ZeRO-1) and the batch split; the token
    # embedding (the first; positions have no batch dim) and the linear ops pinned too, or the solver may
    # prefer to gather the tiny batch and compute replicated (a valid plan, but no data parallelism to
    # test). LLaMA has no biases.
    pins = {"input_ids": ["R", "S(0)"], "labels": ["R", "S(0)"], "*.weight": {"output": ["R", "R"], "zero": zero},
            "embedding": ["R", "S(0)"], "linear*": ["R", "S(0)"]}
    if name != "llama":
        pins["*.bias"] = ["R", "R"]
    return pins


def test_pipeline_parity_two_ranks():
    """pp=2 alone: the built-in GPT under interleaved 1F1B and the zero-bubble V schedule, and activation
    recompute inside stages: GPT-2's first layer only (one stage checkpoints, the other does not), every
    layer under the zero-bubble V schedule's split backward. (Every family under GPipe and 1F1B on a
    pipeline axis alone: pp=4 below.)"""
    cases = [("gpt", (2,), ("pp",), "Interleaved1F1B", 4, None),
             ("gpt", (2,), ("pp",), "ZBVZeroBubble", 2, None),
             ("gpt2", (2,), ("pp",), "1F1B", 2, None, {"recompute": {"*": 1}}),
             ("gpt", (2,), ("pp",), "ZBVZeroBubble", 2, None, {"recompute": {"*": "all"}})]
    run_distributed(_check, 2, cases, timeout=500)


def test_pipeline_parity_four_ranks():
    """Every architecture family under each 4-rank mesh, the five schedules spread over them: pp=4 (one
    layer per stage), pp=2 x dp=2 (the batch split inside each stage, its gradient summed once per
    step), pp=2 x tp=2 (Megatron layers inside each stage). One launch: starting 4 ranks costs more
    than a case. ZeRO-1 inside the stages: GPT-2 (its tied embedding on both ranks) under the
    interleaved zero-bubble schedule, which assigns weight gradients rather than accumulating them, and
    LLaMA under 1F1B."""
    cases = [("gpt", (4,), ("pp",), "1F1B", 4, None),
             ("gpt2", (4,), ("pp",), "GPipe", 4, None),
             ("llama", (4,), ("pp",), "1F1B", 8, None),
             ("bert", (4,), ("pp",), "GPipe", 4, None),
             ("gpt", (2, 2), ("pp", "dp"), "GPipe", 2, _dp_pins("gpt")),
             ("gpt2", (2, 2), ("pp", "dp"), "Interleaved1F1B", 4, _dp_pins("gpt2")),
             ("llama", (2, 2), ("pp", "dp"), "1F1B", 2, _dp_pins("llama")),
             ("bert", (2, 2), ("pp", "dp"), "ZBVZeroBubble", 2, _dp_pins("bert")),
             ("gpt2", (2, 2), ("pp", "dp"), "InterleavedZeroBubble", 4, _dp_pins("gpt2", zero=1)),
             ("llama", (2, 2), ("pp", "dp"), "1F1B", 2, _dp_pins("llama", zero=1)),
             ("gpt", (2, 2), ("pp", "tp"), "1F1B", 4, _tp_pins("gpt")),
             ("gpt2", (2, 2), ("pp", "tp"), "GPipe", 2, _tp_pins("gpt2")),
             ("llama", (2, 2), ("pp", "tp"), "InterleavedZeroBubble", 4, _tp_pins("llama")),
             ("bert", (2, 2), ("pp", "tp"), "Interleaved1F1B", 4, _tp_pins("bert"))]
    run_distributed(_check, 4, cases, timeout=900)
