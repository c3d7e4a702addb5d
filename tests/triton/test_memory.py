"""The memory model under the Triton backend keeps what its kernels save: a generated kernel its region's
inputs, the library's loss the logits and a logsumexp per row; and its predicted peak matches the
measured one on 2 gloo ranks running those kernels within tests/test_memory.py's 10%."""
import pytest
import torch

import autopar
from autopar.passes.meta import meta_of
from autopar.planner import prepare
from tests.distributed_utils import run_distributed

aten = torch.ops.aten


class Head(torch.nn.Module):
    """A SwiGLU-style gate (a pointwise region: silu, mul), a layer norm and a loss over a wide vocabulary."""

    def __init__(self, h=32, vocab=4096):
        super().__init__()
        self.gate, self.up = torch.nn.Linear(h, 4 * h), torch.nn.Linear(h, 4 * h)
        self.norm = torch.nn.LayerNorm(4 * h)
        self.out = torch.nn.Linear(4 * h, vocab)

    def forward(self, x, target):
        y = torch.nn.functional.silu(self.gate(x)) * self.up(x)
        logits = self.out(self.norm(y))
        return torch.nn.functional.cross_entropy(logits, target, reduction="sum")


def _records(fused: bool):
    x, target = torch.randn(64, 32), torch.randint(0, 4096, (64,))
    prep = prepare(Head(), (x, target), None, autopar.ClusterSpec.local_cpu(2), fused=fused)
    return {n.target: (n, meta_of(n).saved) for n in prep.gm.graph.nodes if n.op == "call_function"}


def test_triton_records_keep_what_the_kernels_save():
    aten_records, triton_records = _records(False), _records(True)
    logits_bytes = 64 * 4096 * 4

    ce, plain = aten_records[aten.cross_entropy_loss.default][1], triton_records[aten.cross_entropy_loss.default][1]
    # ATen keeps the log-probabilities and its backward makes their gradient beside the logits'.
    assert ce.internal >= logits_bytes and ce.backward >= logits_bytes, ce
    # The library kernel keeps the logits and the targets, an fp32 logsumexp per row, and makes only the
    # logits' gradient.
    assert plain.inputs == (True, True) and plain.internal == 64 * 4 and plain.backward == 0 and not plain.outputs

    silu, silu_saved = triton_records[aten.silu.default]
    mul, mul_saved = triton_records[aten.mul.Tensor]
    assert mul.args[0] is silu
    # One region (silu, mul): its inputs, the two projections, are kept; silu's output, made and read
    # inside it, is not.
    assert silu_saved.inputs == (True,) and not silu_saved.outputs
    assert mul_saved.inputs == (False, True) and not mul_saved.outputs
    assert aten_records[aten.mul.Tensor][1].inputs == (True, True)     # ATen's mul keeps both operands

    norm = triton_records[aten.layer_norm.default][1]
    assert all(norm.inputs) and norm.internal == 2 * 64 * 4 and norm.backward == 0


@pytest.mark.parametrize("case", [
    # Generated kernels (RMSNorm written out with the residual add, SiLU times the up projection) and the
    # library's loss; the step peaks in backward, in the layers' activations.
    ("llama", "dp", None, {"kernels": "triton", "tokens": (64, 8)}),
    ("gpt2", "dp", None, {"kernels": "triton", "tokens": (64, 8)}),
], ids=["llama", "gpt2"])
def test_triton_predicted_peak_matches_measured_on_two_ranks(case):
    from tests.test_memory import _measure

    run_distributed(_measure, 2, [case], timeout=900)
