"""A model whose layers are a repeated stack is captured from exports of 2 and 3 of its layers
(passes/unroll.py): the program must be the one a whole export gives (nodes, names, arguments,
shapes, metadata, signature) and plan the same; a model whose layers differ is exported whole."""
import logging

import pytest
import torch

import autopar
from autopar.passes import capture as capture_module
from autopar.passes.capture import capture
from autopar.passes.unroll import same_program
from tests.distributed_utils import run_distributed
from tests.test_hf_families import _train_families, build, inputs
from tests.toy_models import Block, Stack

# Tied embeddings and Conv1D (gpt2), GQA and rotary (llama), a fused qkv (phi3), parallel
# attention and MLP (gpt_neox), learned positions (opt), encoder-decoder stacks (bart).
FAMILIES = ["gpt2", "llama", "phi3", "gpt_neox", "opt", "bart"]


@pytest.mark.parametrize("family", FAMILIES)
def test_unrolled_capture_is_the_whole_export(family):
    model = build(family, layers=5, **({"encoder_layers": 2, "decoder_layers": 5} if family == "bart" else {}))
    args, kwargs = inputs(model)
    got = capture(model, args, kwargs)
    assert got.unrolled is not None
    assert same_program(got, capture(model, args, kwargs, unroll=False)) is None


def test_a_model_checked_once_is_unrolled_from_2_layers_at_other_shapes(caplog):
    """A pipeline's microbatch capture (here a batch of 1, which export specializes) reuses the check
    made at the whole batch: one export of 2 layers, still the whole export's program."""
    model = build("llama", layers=4)
    args, kwargs = inputs(model)
    capture(model, args, kwargs)
    one = (args[0][:1],), {"labels": kwargs["labels"][:1]}
    with caplog.at_level(logging.INFO, logger="autopar.capture"):
        got = capture(model, *one)
    assert "unrolled from an export of 2 (checked before)" in caplog.text
    assert same_program(got, capture(model, *one, unroll=False)) is None


@pytest.mark.parametrize("pp", [1, 2], ids=["one stage", "pipeline"])
def test_unrolled_capture_plans_the_same(monkeypatch, pp):
    """A pipeline plan captures every microbatch shape too (by unrolling, or by exporting whole)."""
    with torch.device("meta"):
        model = Stack(256, 4, 1024, 6)
    args = (torch.randn(16, 64, 256, device="meta"),)
    options = dict(mesh_shape=(pp, 8 // pp), axis_names=("pp", "dp")) if pp > 1 else {}
    cluster = autopar.ClusterSpec.preset("8xH100")
    unrolled = autopar.plan(model, cluster, args, progress=False, **options).to_dict()
    monkeypatch.setattr(capture_module, "unrolled_capture", lambda model, export: None)
    whole = autopar.plan(model, cluster, args, progress=False, **options).to_dict()
    assert bool(unrolled["pipeline"]) == (pp > 1)
    assert _untimed(unrolled) == _untimed(whole)


def _untimed(record):
    """A plan's record without how long planning took."""
    if isinstance(record, dict):
        return {k: _untimed(v) for k, v in record.items() if k not in ("seconds", "planning_seconds", "timings")}
    if isinstance(record, list):
        return [_untimed(v) for v in record]
    return record


def test_unrolled_capture_trains_with_parity():
    """Two AdamW steps on 2 gloo ranks, losses equal to eager (tests/test_hf_families.py): every rank
    captures the model from its 2- and 3-layer exports."""
    run_distributed(_train_families, 2, ["gpt2"], 4, timeout=600)


class _IndexedBlock(Block):
    """A block that scales its output by its layer index, as GPT-2 does with
    ``scale_attn_by_inverse_layer_idx``: every layer runs other constants."""

    def __init__(self, index):
        super().__init__(32, 4, 64)
        self.layer_idx = index

    def forward(self, x):
        return super().forward(x) / (self.layer_idx + 1)


def _fallback_reason(model, args, kwargs, caplog):
    with caplog.at_level(logging.INFO, logger="autopar.capture"):
        got = capture(model, args, kwargs)
    assert got.unrolled is None
    assert same_program(got, capture(model, args, kwargs, unroll=False)) is None
    return caplog.text


def test_layers_that_compute_from_their_index_are_exported_whole(caplog):
    model = Stack(32, 4, 64, layers=4)
    model.blocks = torch.nn.ModuleList(_IndexedBlock(i) for i in range(4))
    text = _fallback_reason(model, (torch.randn(2, 8, 32),), {}, caplog)
    assert "not the 2-layer one with one more layer of blocks" in text


def test_layers_with_differing_attributes_are_exported_whole(caplog):
    # Gemma-2 alternates sliding-window and global attention layers (config.layer_types).
    model = build("gemma2", layers=4)
    args, kwargs = inputs(model)
    text = _fallback_reason(model, args, kwargs, caplog)
    assert "exporting every layer of Gemma2ForCausalLM" in text and "differ" in text
