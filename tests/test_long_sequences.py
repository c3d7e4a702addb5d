"""Long sequences: ring attention (context parallel), Ulysses and their combination with tensor
parallel, compiled and trained on real gloo ranks against single-device eager (test_parity's
tolerances); the bad sizes; and the solver's choice of a sequence split where memory demands it."""
import copy

import pytest
import torch

from tests.distributed_utils import run_distributed
from tests.hf_models import batch, build
from tests.test_parity import _train_and_compare

# Every activation split along the sequence: the inputs by tokens, weights whole.
SEQUENCE = {"input_ids": ["S(1)"], "labels": ["S(1)"], "*.weight": ["R"], "*.bias": ["R"]}


def _sdpa_pin(model_name, layout, mask=None):
    """Pin every attention call to read q, k, v in ``layout`` (and the mask, which HF LLaMA passes
    explicitly, [B, 1, S, S], in ``mask``); a pin on one layer's copy holds for every copy."""
    return {"scaled_dot_product_attention*": {"inputs": [layout] * 3 + ([mask or layout] if model_name == "llama" else [])}}


def _plans(model_name, mesh):
    if len(mesh) == 1:
        ring = {**SEQUENCE, **_sdpa_pin(model_name, ["S(2)"])}
        yield "ring attention", ring, "ring_attention"
        if model_name == "llama":
            # Ulysses: attention split by heads while its neighbors stay split by the sequence; the
            # resharding between them is the all-to-all.
            # q, k, v and o projections stay sequence-split (LLaMA's first layer: linear .. linear_3).
            projections = {"linear": ["S(1)"], "linear_1": ["S(1)"], "linear_2": ["S(1)"],
                           "linear_3": {"inputs": [["S(1)"], ["R"]]}}
            yield "ulysses", {**SEQUENCE, **projections,
                              "scaled_dot_product_attention*": {"inputs": [["S(1)"]] * 3 + [["R"]]}}, "all_to_all"
    else:
        # Heads on axis 0 (Megatron's attention split), ring on axis 1.
        tp = {"input_ids": ["R", "S(1)"], "labels": ["R", "S(1)"], "*.weight": ["R", "R"], "*.bias": ["R", "R"],
              "*.q_proj.weight": ["S(0)", "R"], "*.k_proj.weight": ["S(0)", "R"], "*.v_proj.weight": ["S(0)", "R"],
              "*.o_proj.weight": ["S(1)", "R"]}
        yield "heads x ring", {**tp, **_sdpa_pin(model_name, ["S(1)", "S(2)"], ["R", "S(2)"])}, "ring_attention"


def _check(rank, world, model_name, mesh):
    import autopar

    torch.manual_seed(0)
    model = build(model_name)
    ref = copy.deepcopy(model)
    ids, labels = batch()
    cluster = autopar.ClusterSpec.local_cpu(world)
    for label, pins, marker in _plans(model_name, mesh):
        pm = autopar.compile(model, cluster, (ids,), {"labels": labels}, mesh_shape=mesh, pins=pins)
        where = f"{model_name} / {label} on mesh {mesh}"
        assert marker in pm.code, f"{where}: the program does not call {marker}"
        _train_and_compare(pm, copy.deepcopy(ref), ids, labels, where)


@pytest.mark.parametrize("model_name, world, mesh", [
    ("llama", 2, (2,)),         # explicit causal mask, GQA (4 heads, 2 KV heads); and Ulysses
    ("gpt", 4, (4,)),           # is_causal=True: load-balanced half-chunks
    ("llama", 4, (2, 2)),       # tensor parallel heads x ring
])
def test_sequence_split_attention_trains_like_eager(model_name, world, mesh):
    run_distributed(_check, world, model_name, mesh, timeout=600)
