"""Property tests of the sharding rules: for random shapes and meshes, EVERY strategy a rule offers,
run per mesh coordinate by the naive reference executor, reassembles to the unsharded result."""
import operator

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from autopar.layout import S
from autopar.passes.rules import axis_options, context_for
from autopar.passes.strategies import node_strategies
from tests.reference_executor import run_strategy, single_op_node

aten = torch.ops.aten
MESHES = [(2,), (3,), (2, 2), (2, 1, 2), (2, 2, 2, 1)]
dims = st.sampled_from([1, 2, 3, 4, 6, 8])


def rand(*shape, dtype=torch.float64):
    return torch.randn(shape, dtype=dtype)


def _check_all(node, mesh):
    strategies = node_strategies(node, mesh)
    assert strategies, f"{node.target} offered no strategy on mesh {mesh}"
    expected = [o for o in torch.utils._pytree.tree_leaves(node.meta["val"]) if isinstance(o, torch.Tensor)]
    for s in strategies:
        got = run_strategy(node, s, mesh)
        for k, (g, e) in enumerate(zip(got, expected)):
            tol = 1e-9 if e.dtype == torch.float64 else 1e-5      # partial terms round when cast down
            torch.testing.assert_close(g, e.to(torch.float64), rtol=tol, atol=tol,
                                       msg=lambda m: f"{node.target} strategy {s} output {k} on mesh {mesh}: {m}")
    return strategies


def _some_ignored(rows, classes):
    target = torch.randint(0, classes, (rows,))
    target[::3] = -100
    return target


# Each case: a function from drawn sizes to (op, args, kwargs). Sizes are drawn independently.
CASES = {
    "mm": lambda m, k, n, b: (aten.mm.default, (rand(m, k), rand(k, n)), {}),
    "bmm": lambda m, k, n, b: (aten.bmm.default, (rand(b, m, k), rand(b, k, n)), {}),
    "linear": lambda m, k, n, b: (aten.linear.default, (rand(b, m, k), rand(n, k)), {}),
    "linear_bias": lambda m, k, n, b: (aten.linear.default, (rand(b, m, k), rand(n, k), rand(n)), {}),
    "matmul_broadcast": lambda m, k, n, b: (aten.matmul.default, (rand(b, 1, m, k), rand(2, k, n)), {}),
    "add_broadcast": lambda m, k, n, b: (aten.add.Tensor, (rand(b, m, k), rand(m, k)), {}),
    "add_scalar": lambda m, k, n, b: (aten.add.Tensor, (rand(b, m), 1.5), {}),
    "sub": lambda m, k, n, b: (aten.sub.Tensor, (rand(b, 1, k), rand(m, 1)), {}),
    "mul": lambda m, k, n, b: (aten.mul.Tensor, (rand(b, m, k), rand(k)), {}),
    "div": lambda m, k, n, b: (aten.div.Tensor, (rand(b, m), rand(m).abs() + 1), {}),
    "neg": lambda m, k, n, b: (aten.neg.default, (rand(b, m),), {}),
    "silu": lambda m, k, n, b: (aten.silu.default, (rand(b, m),), {}),
    "gelu": lambda m, k, n, b: (aten.gelu.default, (rand(b, m, k),), {}),
    "tanh": lambda m, k, n, b: (aten.tanh.default, (rand(m, k),), {}),
    "rsqrt": lambda m, k, n, b: (aten.rsqrt.default, (rand(m, k).abs() + 1,), {}),
    "pow": lambda m, k, n, b: (aten.pow.Tensor_Scalar, (rand(b, m), 3.0), {}),
    "where": lambda m, k, n, b: (aten.where.self, (rand(b, m) > 0, rand(b, m), rand(m)), {}),
    "eq": lambda m, k, n, b: (aten.eq.Tensor, (torch.randint(0, 2, (b, m)), torch.randint(0, 2, (m,))), {}),
    "to_dtype": lambda m, k, n, b: (aten.to.dtype, (rand(b, m), torch.float32), {}),
    "view_merge": lambda m, k, n, b: (aten.view.default, (rand(b, m, k), [b * m, k]), {}),
    "view_split": lambda m, k, n, b: (aten.view.default, (rand(b * m, k), [b, m, k]), {}),
    "reshape_regroup": lambda m, k, n, b: (aten.reshape.default, (rand(b, m * k), [b * m, k]), {}),
    "flatten": lambda m, k, n, b: (aten.flatten.using_ints, (rand(b, m, k), 1, 2), {}),
    "unflatten": lambda m, k, n, b: (aten.unflatten.int, (rand(b, m * k), 1, [m, -1]), {}),
    "expand": lambda m, k, n, b: (aten.expand.default, (rand(1, m, 1), [b, m, k]), {}),
    "transpose": lambda m, k, n, b: (aten.transpose.int, (rand(b, m, k), 0, 2), {}),
    "permute": lambda m, k, n, b: (aten.permute.default, (rand(b, m, k), [2, 0, 1]), {}),
    "t": lambda m, k, n, b: (aten.t.default, (rand(m, k),), {}),
    "unsqueeze": lambda m, k, n, b: (aten.unsqueeze.default, (rand(b, m), 1), {}),
    "squeeze": lambda m, k, n, b: (aten.squeeze.dim, (rand(b, 1, m), 1), {}),
    "slice": lambda m, k, n, b: (aten.slice.Tensor, (rand(b, m, k + 1), 2, 1, k + 1), {}),
    "select": lambda m, k, n, b: (aten.select.int, (rand(b, m, k), 1, 0), {}),
    "split": lambda m, k, n, b: (aten.split.Tensor, (rand(b, 2 * m, k), m, 1), {}),
    "split_with_sizes": lambda m, k, n, b: (aten.split_with_sizes.default, (rand(3 * m, k), [m, m, m]), {}),
    "chunk": lambda m, k, n, b: (aten.chunk.default, (rand(b, k, 3 * m), 3, -1), {}),
    "cat": lambda m, k, n, b: (aten.cat.default, ([rand(b, m), rand(b, k)], 1), {}),
    "pad": lambda m, k, n, b: (aten.pad.default, (rand(b, m, k), [0, 1]), {}),
    "cumsum": lambda m, k, n, b: (aten.cumsum.default, (rand(b, m), 1), {}),
    "gather": lambda m, k, n, b: (aten.gather.default, (rand(b, m), 1, torch.randint(0, m, (b, 2))), {}),
    "sum_dims": lambda m, k, n, b: (aten.sum.dim_IntList, (rand(b, m, k), [1]), {}),
    "sum_all": lambda m, k, n, b: (aten.sum.default, (rand(b, m),), {}),
    "mean_keepdim": lambda m, k, n, b: (aten.mean.dim, (rand(b, m, k), [-1], True), {}),
    "amax": lambda m, k, n, b: (aten.amax.default, (rand(b, m), [0]), {}),
    "softmax": lambda m, k, n, b: (aten._softmax.default, (rand(b, m, k), -1, False), {}),
    "log_softmax": lambda m, k, n, b: (aten._log_softmax.default, (rand(b, m, k), 1, False), {}),
    "layer_norm": lambda m, k, n, b: (aten.layer_norm.default, (rand(b, m, k), [k], rand(k), rand(k), 1e-5), {}),
    "rms_norm": lambda m, k, n, b: (aten.rms_norm.default, (rand(b, m, k), [k], rand(k), 1e-6), {}),
    "embedding": lambda m, k, n, b: (aten.embedding.default, (rand(n + 1, k), torch.randint(0, n + 1, (b, m))), {}),
    "sdpa": lambda m, k, n, b: (aten.scaled_dot_product_attention.default,
                                (rand(b, 2, m, k), rand(b, 2, n, k), rand(b, 2, n, k), rand(m, n) > -0.5), {}),
    "sdpa_causal": lambda m, k, n, b: (aten.scaled_dot_product_attention.default,
                                       (rand(b, 2, m, k), rand(b, 2, m, k), rand(b, 2, m, k)), {"is_causal": True}),
    # Self-attention, where ring attention (keys split too) is offered: a mask, and GQA with causal.
    "sdpa_self_masked": lambda m, k, n, b: (aten.scaled_dot_product_attention.default,
                                            (rand(b, 2, m, k), rand(b, 2, m, k), rand(b, 2, m, k),
                                             (rand(b, 1, m, m) > -0.5) | torch.eye(m, dtype=torch.bool)), {}),
    "sdpa_gqa_causal": lambda m, k, n, b: (aten.scaled_dot_product_attention.default,
                                           (rand(b, 4, 2 * m, k), rand(b, 2, 2 * m, k), rand(b, 2, 2 * m, k)),
                                           {"is_causal": True, "enable_gqa": True}),
    "cross_entropy_sum": lambda m, k, n, b: (aten.cross_entropy_loss.default,
                                             (rand(b * m, k + 1), torch.randint(0, k + 1, (b * m,)), None, 2), {}),
    "embedding_padding": lambda m, k, n, b: (aten.embedding.default,
                                             (rand(n + 1, k), torch.randint(0, n + 1, (b, m)), n), {}),
    "cross_entropy_ignored": lambda m, k, n, b: (aten.cross_entropy_loss.default,
                                                 (rand(b * m, 2 * k), _some_ignored(b * m, 2 * k), None, 2), {}),
    "cross_entropy_mean": lambda m, k, n, b: (aten.cross_entropy_loss.default,
                                              (rand(b * m, 2 * k), torch.randint(0, 2 * k, (b * m,)), None, 1), {}),
    "cross_entropy_none": lambda m, k, n, b: (aten.cross_entropy_loss.default,
                                              (rand(b, k + 1), torch.randint(0, k + 1, (b,)), None, 0), {}),
}


@pytest.mark.parametrize("case", sorted(CASES))
@settings(max_examples=6, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(m=dims, k=dims, n=dims, b=dims, mesh=st.sampled_from(MESHES))
def test_every_strategy_reassembles(case, m, k, n, b, mesh):
    op, args, kwargs = CASES[case](m, k, n, b)
    node = single_op_node(op, args, kwargs)
    _check_all(node, mesh)


# Ops that produce a fused projection's output, asked for a strided output dim (output dim, groups)
# by a split after them (passes/strided.py): each case is (op, args, kwargs, hint).
STRIDED_CASES = {
    "mm": lambda m, k, n, b: (aten.mm.default, (rand(m, k), rand(k, 3 * n)), {}, (1, 3)),
    "linear": lambda m, k, n, b: (aten.linear.default, (rand(b, m, k), rand(2 * n, k)), {}, (2, 2)),
    "linear_bias": lambda m, k, n, b: (aten.linear.default, (rand(m, k), rand(2 * n, k), rand(2 * n)), {}, (1, 2)),
    "bias_add": lambda m, k, n, b: (aten.add.Tensor, (rand(m, 3 * n), rand(3 * n)), {}, (1, 3)),
    "gelu": lambda m, k, n, b: (aten.gelu.default, (rand(b, 2 * n),), {}, (1, 2)),
    "view_split": lambda m, k, n, b: (aten.view.default, (rand(b * m, 3 * n), [b, m, 3 * n]), {}, (2, 3)),
    "view_merge": lambda m, k, n, b: (aten.view.default, (rand(b, m, 3 * n), [b * m, 3 * n]), {}, (1, 3)),
    "transpose": lambda m, k, n, b: (aten.transpose.int, (rand(b, 2 * n, m), 1, 2), {}, (2, 2)),
}


@pytest.mark.parametrize("case", sorted(STRIDED_CASES))
@settings(max_examples=6, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(m=dims, k=dims, n=dims, b=dims, mesh=st.sampled_from(MESHES))
def test_strided_strategies_reassemble(case, m, k, n, b, mesh):
    """Asked for a strided output, the rule offers it (where the groups divide by an axis), and every
    strategy, strided ones included, reassembles to the unsharded result."""
    from autopar.passes.meta import set_meta

    op, args, kwargs, (dim, groups) = STRIDED_CASES[case](m, k, n, b)
    node = single_op_node(op, args, kwargs)
    set_meta(node, strided=((dim, groups),))
    strategies = _check_all(node, mesh)
    wanted = S(dim, groups)
    if any(a > 1 and n_ % a == 0 for a in mesh for n_ in [node.meta["val"].shape[dim] // groups]):
        assert any(wanted in s.outputs[0] for s in strategies), f"{case}: no {wanted} output on mesh {mesh}"


def test_split_into_equal_parts_reads_a_strided_input():
    """A strided shard of the split dim is a plain shard of each part; unequal parts take none."""
    node = single_op_node(aten.split.Tensor, (rand(4, 12), 4, 1))
    opts = {(str(o.inputs[0]), tuple(map(str, o.outputs))) for o in axis_options(context_for(node))}
    assert ("S(1,3)", ("S(1)",) * 3) in opts
    uneven = single_op_node(aten.split.Tensor, (rand(4, 10), 4, 1))
    assert not any(o.inputs[0].is_strided for o in axis_options(context_for(uneven)))


def test_contracted_dim_gives_partial():
    node = single_op_node(aten.mm.default, (rand(4, 6), rand(6, 8)))
    opts = {(tuple(map(str, o.inputs)), str(o.outputs[0])) for o in axis_options(context_for(node))}
    assert opts == {(("R", "R"), "R"), (("S(0)", "R"), "S(0)"), (("R", "S(1)"), "S(1)"), (("S(1)", "S(0)"), "P")}


def test_dims_that_do_not_divide_are_refused():
    node = single_op_node(aten.mm.default, (rand(3, 6), rand(6, 5)))
    strategies = node_strategies(node, (2,))
    outputs = {str(s.outputs[0][0]) for s in strategies}
    assert outputs == {"R", "P"}          # m=3 and n=5 do not divide by 2; k=6 does


def test_same_dim_is_never_sharded_by_two_axes():
    node = single_op_node(aten.add.Tensor, (rand(8, 8), rand(8, 8)))
    for s in node_strategies(node, (2, 2)):
        dims_used = [p.dim for p in s.outputs[0] if p.is_shard]
        assert len(dims_used) == len(set(dims_used))


def test_unknown_op_is_replicated_with_one_warning(caplog):
    import logging

    from autopar.passes import rules

    op = aten.logaddexp.default
    rules._warned.discard("logaddexp.default")
    with caplog.at_level(logging.WARNING, logger="autopar.rules"):
        node = single_op_node(op, (rand(4, 4), rand(4, 4)))
        first = node_strategies(node, (2,))
        node_strategies(single_op_node(op, (rand(4, 4), rand(4, 4))), (2,))
    assert [str(s.outputs[0][0]) for s in first] == ["R"]
    warnings = [r for r in caplog.records if "logaddexp" in r.getMessage()]
    assert len(warnings) == 1 and "no sharding rule" in warnings[0].getMessage()
    _check_all(node, (2,))


def test_getitem_is_not_a_known_gap():
    from autopar.passes.rules import get_rule

    assert get_rule(operator.getitem) is not None
