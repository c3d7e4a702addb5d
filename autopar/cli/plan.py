"""``python -m autopar plan``: plan a zoo model (or ``package.module:function``) for a cluster offline.

The model is built on the meta device and planned under a fake process group, so this needs no GPU,
no weights and no memory for the model.
"""
from __future__ import annotations

import argparse
import sys

_DTYPES = ("float32", "bfloat16", "float16")
_PRECISIONS = ("32-true", "bf16-mixed", "bf16-true")
_REDUCE_DTYPES = ("float32", "bfloat16")


def add_arguments(p: argparse.ArgumentParser) -> None:
    from autopar.zoo import NAMES

    p.add_argument("--model", required=True, metavar="NAME_OR_MODULE:FUNCTION",
                   help=f"one of {', '.join(NAMES)}, or package.module:function returning a model "
                        f"or (model, args, kwargs)")
    p.add_argument("--cluster", required=True, metavar="PRESET",
                   help="NxDEVICE (e.g. 8xH100, 64xH100, 8xA100), or cpu:N for N local gloo processes")
    p.add_argument("--batch", type=int, default=8, help="global batch size (default 8)")
    p.add_argument("--seq", type=int, default=None, help="sequence length (default: the model's zoo default)")
    p.add_argument("--dtype", choices=_DTYPES, default=None,
                   help="the model's parameter dtype (default: float32, bfloat16 under --precision bf16-true)")
    p.add_argument("--precision", choices=_PRECISIONS, default=None,
                   help="training precision, Lightning's names (default: bf16-mixed for the zoo's large models "
                        "gpt2-xl, llama3-8b, llama2-70b, gqa-7b-128k, else the model's own dtype)")
    p.add_argument("--reduce-dtype", choices=_REDUCE_DTYPES, default=None,
                   help="what bf16-mixed sums gradients over ranks in (default: float32, as Megatron-LM and "
                        "torchtitan do; bfloat16 moves half the bytes)")
    p.add_argument("--memory-budget", type=float, default=None, metavar="GB",
                   help="bytes per device, in GB (1e9 bytes); default: the device's capacity less its reserve")
    p.add_argument("--mesh", default=None, metavar="A,B,...", help="fix the mesh shape, e.g. 8,8")
    p.add_argument("--axes", default=None, metavar="A,B,...",
                   help="name the --mesh axes, e.g. pp,dp,tp (an axis named pp makes a pipeline plan)")
    p.add_argument("--microbatches", type=int, default=None, metavar="M",
                   help="pipeline plans: microbatches per step (default: chosen by predicted step time)")
    p.add_argument("--schedule", default=None, choices=("GPipe", "1F1B", "Interleaved1F1B",
                                                         "InterleavedZeroBubble", "ZBVZeroBubble"),
                   help="pipeline plans: the schedule (default: chosen by predicted step time)")
    p.add_argument("--bucket-mb", type=float, default=None, metavar="MIB",
                   help="fix the gradient bucket size in MiB (default: chosen by the replay of the plan)")
    p.add_argument("--no-pipeline", action="store_true",
                   help="do not try pipeline meshes (tried by default on clusters of several nodes)")
    p.add_argument("--time-limit", type=float, default=None, metavar="S",
                   help="ILP time limit per solve (s); by default each solve stops at a node limit, so the plan "
                        "does not depend on the machine's load")
    p.add_argument("--sharded-outputs", action="store_true",
                   help="plan for compile(..., sharded_outputs=True): logits stay sharded, only the loss is "
                        "gathered (what a training loop needs)")
    p.add_argument("--out", default=None, metavar="PLAN.json", help="save the plan as JSON")
    p.add_argument("--html", default=None, metavar="REPORT.html", help="write an HTML report of the plan")


def _cluster(name: str):
    from autopar import ClusterSpec

    if name.lower().startswith("cpu:"):
        try:
            n = int(name[4:])
        except ValueError:
            raise ValueError(f"cluster {name!r}: write cpu:N with N an integer, e.g. cpu:2") from None
        return ClusterSpec.local_cpu(n)
    return ClusterSpec.preset(name)


def _mesh(text: str | None):
    if text is None:
        return None
    try:
        return tuple(int(x) for x in text.split(","))
    except ValueError:
        raise ValueError(f"--mesh {text!r}: write comma-separated integers, e.g. 8,8") from None


def _fail(e: Exception) -> int:
    print(f"autopar plan: error: {e}".replace("\n", " "), file=sys.stderr)
    return 1


def run(args: argparse.Namespace) -> int:
    import torch

    import autopar
    from autopar import zoo
    from autopar.passes.precision import resolve_precision

    try:
        cluster = _cluster(args.cluster)
        mesh = _mesh(args.mesh)
        precision = args.precision
        if precision is None and args.dtype is None:
            precision = zoo.DEFAULT_PRECISION.get(args.model)
        dtype = args.dtype or ("bfloat16" if precision == "bf16-true" else "float32")
        model, ex_args, ex_kwargs = zoo.build(args.model, batch=args.batch, seq=args.seq, device="meta",
                                              dtype=getattr(torch, dtype))
        resolve_precision(precision, model, args.reduce_dtype)
    except (ValueError, ImportError) as e:    # bad names, presets, meshes; transformers missing
        return _fail(e)
    budget = args.memory_budget * 1e9 if args.memory_budget is not None else None
    try:
        axes = tuple(args.axes.split(",")) if args.axes else None
        plan = autopar.plan(model, cluster, ex_args, ex_kwargs, memory_budget=budget, mesh_shape=mesh,
                            axis_names=axes, time_limit=args.time_limit, sharded_outputs=args.sharded_outputs,
                            microbatches=args.microbatches, schedule=args.schedule,
                            pipeline=False if args.no_pipeline else None, precision=precision,
                            bucket_mb=args.bucket_mb, reduce_dtype=args.reduce_dtype)
    except autopar.AutoparError as e:         # raised on purpose, with what to change; a bug keeps its traceback
        return _fail(e)
    print(plan.summary())
    if args.out:
        plan.save(args.out)
        print(f"plan saved to {args.out}")
    if args.html:
        plan.to_html(args.html)
        print(f"HTML report written to {args.html}")
    return 0
