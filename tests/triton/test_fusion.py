"""Generated kernels against eager ATen: random pointwise chains and chains ending in a row reduction,
forward and backward, with broadcasting inputs; the bf16 cast path; the kernel cache; backend choice."""
import copy

import pytest
import torch
import torch.fx as fx
from hypothesis import given, settings
from hypothesis import strategies as st
from torch.testing import assert_close

from autopar.codegen.triton import fuse_pass, resolve_kernels
from autopar.codegen.triton.kernel import cache_stats
from autopar.passes.meta import program_meta
from autopar.errors import AutoparError

aten = torch.ops.aten
# fp32: both compute in fp32, in a different order, and relative error grows along chains of powers.
# Absolute error is relative to the tensor's largest entry, as in the parity tests.
FP32 = dict(atol=1e-5, rtol=1e-4)
BF16 = dict(atol=2e-2, rtol=2e-2)


class Program:
    """An fx graph of ATen ops built op by op, with the example tensors for its placeholders."""

    def __init__(self, shape, seed):
        self.graph, self.shape = fx.Graph(), shape
        self.inputs = []
        self.rng = torch.Generator().manual_seed(seed)

    def randn(self, shape, dtype=torch.float32) -> fx.Node:
        return self.input(torch.randn(shape, generator=self.rng).to(dtype))

    def input(self, t: torch.Tensor) -> fx.Node:
        self.inputs.append(t)
        return self.graph.placeholder(f"x{len(self.inputs) - 1}")

    def __call__(self, target, *args, **kwargs) -> fx.Node:
        return self.graph.call_function(target, args, kwargs)

    def module(self, outputs) -> fx.GraphModule:
        self.graph.output(tuple(outputs))
        return fx.GraphModule(torch.nn.Module(), self.graph)


def _positive(p, v):
    return p(aten.add.Tensor, p(aten.abs.default, v), 0.5)


def _moderate(p, v):
    # Saturating functions have gradients like 1 - tanh(x)^2 that cancel to rounding noise for large x,
    # where eager and any other fp32 implementation disagree by far more than their relative accuracy.
    return p(aten.clamp.default, v, -3.0, 3.0)


UNARY = {
    "neg": lambda p, v: p(aten.neg.default, v),
    "exp": lambda p, v: p(aten.exp.default, _moderate(p, v)),
    "tanh": lambda p, v: p(aten.tanh.default, _moderate(p, v)),
    "sigmoid": lambda p, v: p(aten.sigmoid.default, _moderate(p, v)),
    "relu": lambda p, v: p(aten.relu.default, v),
    "silu": lambda p, v: p(aten.silu.default, v),
    "gelu": lambda p, v: p(aten.gelu.default, v),
    "gelu_tanh": lambda p, v: p(aten.gelu.default, v, approximate="tanh"),
    "square": lambda p, v: p(aten.pow.Tensor_Scalar, v, 2),
    "cube": lambda p, v: p(aten.pow.Tensor_Scalar, v, 3.0),
    "pow": lambda p, v: p(aten.pow.Tensor_Scalar, _positive(p, v), 1.7),
    "log": lambda p, v: p(aten.log.default, _positive(p, v)),
    "sqrt": lambda p, v: p(aten.sqrt.default, _positive(p, v)),
    "rsqrt": lambda p, v: p(aten.rsqrt.default, _positive(p, v)),
    "reciprocal": lambda p, v: p(aten.reciprocal.default, _positive(p, v)),
    "clamp": lambda p, v: p(aten.clamp.default, v, -0.5, 0.7),
    "scale": lambda p, v: p(aten.mul.Tensor, v, -1.5),
    "shift": lambda p, v: p(aten.add.Tensor, v, 0.3, alpha=2),
    "rsub": lambda p, v: p(aten.rsub.Scalar, v, 1.0),
}
BINARY = {
    "add": lambda p, a, b: p(aten.add.Tensor, a, b),
    "sub": lambda p, a, b: p(aten.sub.Tensor, a, b, alpha=2),
    "mul": lambda p, a, b: p(aten.mul.Tensor, a, b),
    "div": lambda p, a, b: p(aten.div.Tensor, a, _positive(p, b)),
    "maximum": lambda p, a, b: p(aten.maximum.default, a, b),
    "minimum": lambda p, a, b: p(aten.minimum.default, a, b),
}


def _broadcast_shapes(shape):
    """Shapes that broadcast to ``shape``: itself, its last dim, one per row, size-1 leading dims, a scalar."""
    out = {shape, shape[-1:], shape[:-1] + (1,), (1,) * (len(shape) - 1) + shape[-1:], ()}
    return sorted(out)


@st.composite
def pointwise_programs(draw, *, min_last=1, bf16_input=False):
    """A random chain of pointwise ops over a full-shape input, whose second operands are earlier
    values or broadcasting inputs; returns the Program and the values, all of the full shape.
    ``bf16_input``: the input is bf16, cast to fp32 first (mixed precision)."""
    shape = tuple(draw(st.lists(st.integers(1, 4), min_size=0, max_size=2))) + (draw(st.integers(min_last, 9)),)
    p = Program(shape, draw(st.integers(0, 2**16)))
    if bf16_input:
        values = [p(aten._to_copy.default, p.randn(shape, torch.bfloat16), dtype=torch.float32)]
    else:
        values = [p.randn(shape)]
    for _ in range(draw(st.integers(2, 6))):
        kind = draw(st.sampled_from(["unary", "binary", "where"]))
        v = values[-1]                  # a chain; the second operand may be any earlier value
        if kind == "unary":
            values.append(UNARY[draw(st.sampled_from(sorted(UNARY)))](p, v))
            continue
        if draw(st.booleans()):
            w = draw(st.sampled_from(values))
        else:
            w = p.randn(draw(st.sampled_from(_broadcast_shapes(shape))))
        if kind == "binary":
            values.append(BINARY[draw(st.sampled_from(sorted(BINARY)))](p, v, w))
        else:
            mask = p.input(torch.rand(draw(st.sampled_from(_broadcast_shapes(shape))), generator=p.rng) > 0.5)
            values.append(p(aten.where.self, mask, v, w))
    return p, values


def _outputs(draw, values):
    """The last value, and sometimes an earlier one too (a region with two outputs)."""
    extra = draw(st.sampled_from(values[1:-1])) if len(values) > 2 and draw(st.booleans()) else None
    return [values[-1]] + ([extra] if extra is not None else [])


REDUCTIONS = ["sum", "sum_nokeep", "mean", "amax", "softmax", "log_softmax", "rms_norm", "layer_norm"]


def _reduce(p, kind, v, shape):
    """A reduction over the last dim, or a norm written out in pointwise ops and means. The norms'
    eps is large: a constant row (a broadcast input can make one) has zero variance, and rsqrt(eps)
    would magnify the rounding noise in which any two implementations differ."""
    if kind == "sum":
        return p(aten.sum.dim_IntList, v, [-1], True)
    if kind == "sum_nokeep":
        return p(aten.sum.dim_IntList, v, [len(shape) - 1])
    if kind == "mean":
        return p(aten.mean.dim, v, [-1], True)
    if kind == "amax":
        return p(aten.amax.default, v, [-1], True)
    if kind == "softmax":
        return p(aten._softmax.default, v, -1, False)
    if kind == "log_softmax":
        return p(aten._log_softmax.default, v, -1, False)
    if kind == "rms_norm":
        var = p(aten.mean.dim, p(aten.pow.Tensor_Scalar, v, 2), [-1], True)
        weight = p.randn(shape[-1:])
        return p(aten.mul.Tensor, weight, p(aten.mul.Tensor, v, p(aten.rsqrt.default, p(aten.add.Tensor, var, 0.1))))
    centered = p(aten.sub.Tensor, v, p(aten.mean.dim, v, [-1], True))
    var = p(aten.mean.dim, p(aten.mul.Tensor, centered, centered), [-1], True)
    y = p(aten.mul.Tensor, centered, p(aten.rsqrt.default, p(aten.add.Tensor, var, 0.1)))
    return p(aten.add.Tensor, p(aten.mul.Tensor, y, p.randn(shape[-1:])), p.randn(shape[-1:]))


@st.composite
def row_programs(draw):
    p, values = draw(pointwise_programs(min_last=2))
    kind = draw(st.sampled_from(REDUCTIONS))
    out = _reduce(p, kind, values[-1], p.shape)
    if kind in ("sum", "mean", "amax") and draw(st.booleans()):
        # an epilogue at the full shape that reads the per-row value, like x - max
        out = p(aten.sub.Tensor, values[-1], out)
    outputs = [out] + ([values[-1]] if draw(st.booleans()) else [])
    return p, outputs


def _check(p: Program, outputs, tol, fused_calls=1):
    gm = p.module(outputs)
    ref = copy.deepcopy(gm)
    fuse_pass(gm, backend="triton", example_inputs=p.inputs)
    calls = [n for n in gm.graph.nodes if n.op == "call_function" and n.target.__name__.startswith("fused_")]
    assert len(calls) >= fused_calls, gm.code
    got, want = _forward_backward(gm, p.inputs), _forward_backward(ref, p.inputs)
    for a, b in zip(got, want, strict=True):
        assert (a is None) == (b is None)
        if a is not None:
            scale = max(1.0, b.float().abs().nan_to_num(0.0, 0.0, 0.0).max().item()) if b.numel() else 1.0
            assert_close(a.float(), b.float(), atol=tol["atol"] * scale, rtol=tol["rtol"], equal_nan=True,
                         msg=lambda m: f"{m}\n{gm.code}")


def _forward_backward(gm, inputs):
    torch.manual_seed(1)
    leaves = [x.detach().clone().requires_grad_(x.is_floating_point()) for x in inputs]
    outs = gm(*leaves)
    grads = [torch.randn_like(o) for o in outs]
    torch.autograd.backward(outs, grads)
    return [o.detach() for o in outs] + [x.grad for x in leaves if x.is_floating_point()]


@settings(max_examples=25, deadline=None)
@given(st.data())
def test_pointwise_chains_match_eager(data):
    p, values = data.draw(pointwise_programs())
    _check(p, _outputs(data.draw, values), FP32)


@settings(max_examples=25, deadline=None)
@given(row_programs())
def test_chains_ending_in_a_row_reduction_match_eager(program):
    p, outputs = program
    _check(p, outputs, FP32)


@settings(max_examples=10, deadline=None)
@given(st.data())
def test_bf16_cast_path_matches_eager(data):
    """bf16 in, fp32 inside, bf16 out: the casts fuse with the chain and round as eager does."""
    p, values = data.draw(pointwise_programs(bf16_input=True))
    outputs = [p(aten._to_copy.default, v, dtype=torch.bfloat16) for v in _outputs(data.draw, values)]
    _check(p, outputs, BF16)


def _gelu_twice():
    p = Program((4, 24), seed=0)
    outs = []
    for _ in range(2):
        x = p.randn((4, 24))
        outs.append(p(aten.mul.Tensor, x, p(aten.sigmoid.default, p(aten.mul.Tensor, x, 1.702))))
    return p, p.module(outs)


def test_kernel_cache_hits_on_a_repeated_region():
    p, gm = _gelu_twice()
    misses = cache_stats["misses"]
    fuse_pass(gm, backend="triton", example_inputs=p.inputs)
    targets = {n.target for n in gm.graph.nodes if n.op == "call_function"}
    assert len(targets) == 1 and len(program_meta(gm).kernels) == 1, gm.code
    assert cache_stats["misses"] - misses <= 1

    hits, misses = cache_stats["hits"], cache_stats["misses"]
    p, again = _gelu_twice()
    fuse_pass(again, backend="triton", example_inputs=p.inputs)
    assert cache_stats["misses"] == misses and cache_stats["hits"] == hits + 2
    assert {n.target for n in again.graph.nodes if n.op == "call_function"} == targets


def test_generated_source_is_readable():
    p, gm = _gelu_twice()
    fuse_pass(gm, backend="triton", example_inputs=p.inputs)
    (name, src), = program_meta(gm).kernels
    assert f"def {name}_fwd(" in src and f"def {name}_bwd(" in src and "@triton.jit" in src
    assert "<- aten.sigmoid.default" in src and "<- aten.mul.Tensor" in src     # the header lists the ATen ops


def test_backend_choice(monkeypatch):
    assert resolve_kernels("auto", "cpu") == "aten"
    assert resolve_kernels("aten", "cuda") == "aten"
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    assert resolve_kernels("triton", "cpu") == "triton"
    with pytest.raises(AutoparError, match="kernels must be one of"):
        resolve_kernels("inductor", "cpu")


def test_triton_on_cpu_without_the_interpreter_is_a_clear_error(monkeypatch):
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    with pytest.raises(AutoparError, match=r"TRITON_INTERPRET=1.*kernels='aten'"):
        resolve_kernels("triton", "cpu")
