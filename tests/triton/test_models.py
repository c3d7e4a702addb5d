"""GPT-2 compiled with kernels="triton": its local program calls the library's norms and loss (the
vocab-parallel loss where the plan splits the vocabulary) and ATen's one-op tanh GELU, and it
trains with the tolerances of tests/test_parity.py on 1 and 2 gloo ranks (the interpreter runs every
kernel, forward and backward)."""
import collections
import copy

import torch

from tests.distributed_utils import run_distributed
from autopar.runtime.sharded_ops import vocab_parallel_cross_entropy
from tests.hf_models import MEGATRON, VOCAB_PARALLEL, VOCAB_PARALLEL_NODES, batch, build
from tests.eager_parity import train_and_compare

aten = torch.ops.aten


def _check_program(pm, where, vocab_parallel):
    left = collections.Counter(n.target for n in pm.local_program.graph.nodes if n.op == "call_function")
    for op in (aten.layer_norm.default, aten.cross_entropy_loss.default, aten.tanh.default, aten.pow.Tensor_Scalar,
               vocab_parallel_cross_entropy):
        assert not left[op], f"{where}: {op} is still called as ATen:\n{pm.code}"
    names = {getattr(t, "__name__", "") for t in left}
    loss = "vocab_parallel_cross_entropy" if vocab_parallel else "cross_entropy"
    kernels = pm.kernels
    assert {"layer_norm", loss} <= set(kernels) and {"layer_norm", loss} <= names, (names, where)
    # The tanh GELU is one ATen op (normalize_pass folds GPT-2's written-out one) and runs as ATen's
    # fused kernel: one op alone gains nothing from a generated one (codegen/triton/fuse.py).
    assert not [k for k in kernels if k.startswith("fused_") and "tanh" in k], list(kernels)
    assert left[aten.gelu.default] == 2     # one call per layer


def _train_with_triton(rank, world, plans):
    import autopar

    torch.manual_seed(0)
    model = build("gpt2")
    ref = copy.deepcopy(model)
    ids, labels = batch()
    if world == 1:
        aten_pm = autopar.compile(model, autopar.ClusterSpec.local_cpu(1), (ids,), {"labels": labels},
                                  progress=False)        # kernels="auto" is ATen on CPU
        assert aten_pm.kernels == {} and "aten.layer_norm" in aten_pm.code
    for label, options in plans:
        pm = autopar.compile(model, autopar.ClusterSpec.local_cpu(world), (ids,), {"labels": labels},
                             mesh_shape=(world,), kernels="triton", progress=False, **options)
        where = f"gpt2 / {label} / kernels='triton' on {world} ranks"
        _check_program(pm, where, "vocab" in label)
        train_and_compare(pm, copy.deepcopy(ref), ids, labels, where)


def test_gpt2_trains_with_triton_kernels_on_one_rank():
    run_distributed(_train_with_triton, 1, [("one device", {})], timeout=300)


def test_gpt2_trains_with_triton_kernels_on_two_ranks():
    # Megatron's layers with the vocabulary-parallel loss: every kernel runs on a shard, and the loss is
    # the library's vocab-parallel one. The unsplit kernels (and the gathered-logits loss) are the
    # one-rank case's; data parallelism adds no kernel of its own.
    megatron = {k: [v] for k, v in MEGATRON["gpt2"].items()}
    vocab = {**megatron, **{k: [v] for k, v in VOCAB_PARALLEL["gpt2"].items()}, **VOCAB_PARALLEL_NODES}
    run_distributed(_train_with_triton, 2, [("megatron + vocab parallel", {"pins": vocab})], timeout=600)
