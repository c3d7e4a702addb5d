"""The local program's flatten: a storage no larger than its output, whatever layout its input has."""
import torch

from autopar.runtime.local_ops import flatten


def _shares(a, b):
    return a.untyped_storage().data_ptr() == b.untyped_storage().data_ptr()


def test_a_flatten_of_a_rank_s_rows_of_a_sequence_major_attention_output_is_copied():
    # CPU's flash attention lays its output out like a projection's query: [B, H, S, D] over a
    # [B, S, H, D] storage. A rank's rows of it, transposed back, flatten to a view of the whole.
    whole = torch.randn(1, 64, 4, 8).transpose(1, 2)
    rows = whole.transpose(1, 2).narrow(1, 32, 32)
    assert _shares(torch.ops.aten.flatten.using_ints(rows, 2, -1), whole)
    out = flatten(rows, 2)
    assert not _shares(out, whole)
    assert out.untyped_storage().nbytes() == out.numel() * out.element_size()
    assert torch.equal(out, rows.reshape(1, 32, 32))


def test_a_flatten_of_a_whole_storage_stays_a_view():
    x = torch.randn(2, 16, 4, 8)
    out = flatten(x, 2)
    assert _shares(out, x) and out.shape == (2, 16, 32)


def test_a_flatten_that_copies_is_not_copied_again_and_gradients_flow():
    head_major = torch.randn(1, 4, 64, 8, requires_grad=True)
    rows = head_major.transpose(1, 2).narrow(1, 0, 32)
    out = flatten(rows, 2)
    assert not _shares(out, head_major)
    out.sum().backward()
    assert torch.equal(head_major.grad, torch.ones(1, 4, 64, 8).index_fill(2, torch.arange(32, 64), 0))
