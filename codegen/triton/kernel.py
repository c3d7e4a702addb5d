"""Compiled fused kernels: the cache by region signature, the launcher and the autograd.Function.

Generated source is written to a file before it is imported, because ``triton.jit`` reads a
kernel's source through ``inspect``; the files stay in a per-process temporary folder for reading.
"""
from __future__ import annotations

import collections
import hashlib
import importlib.util
import math
import os
import sys
import tempfile

import torch

from autopar.codegen.triton.source import KernelSource, RegionSpec, generate

_CACHE: dict[RegionSpec, "FusedKernel"] = {}
cache_stats = collections.Counter()     # "hits" and "misses" of kernel_for
_folder: str | None = None


def kernel_for(spec: RegionSpec) -> "FusedKernel":
    """The compiled kernel of a region signature, generated on the first request."""
    kernel = _CACHE.get(spec)
    if kernel is None:
        cache_stats["misses"] += 1
        kernel = _CACHE[spec] = FusedKernel(spec)
    else:
        cache_stats["hits"] += 1
    return kernel


def kernel_name(spec: RegionSpec) -> str:
    kinds = list(dict.fromkeys(spec.kinds))[:4]
    digest = hashlib.sha1(repr(spec).encode()).hexdigest()[:8]
    return f"fused_{'_'.join(kinds)}_{digest}"


def _import(name: str, text: str):
    global _folder
    if _folder is None:
        _folder = tempfile.mkdtemp(prefix="autopar-kernels-")
    path = os.path.join(_folder, f"{name}.py")
    with open(path, "w") as f:
        f.write(text)
    spec = importlib.util.spec_from_file_location(f"autopar_kernels_{name}", path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    return module


class FusedKernel:
    """One generated region kernel. ``fn`` is what the local program calls: it takes the region's
    inputs and returns its output (a tuple when there are several)."""

    def __init__(self, spec: RegionSpec):
        from autopar.codegen.kernels._util import patch_interpreter

        patch_interpreter()
        self.spec = spec
        self.name = kernel_name(spec)
        self.source: KernelSource = generate(spec, self.name)
        module = _import(self.name, self.source.text)
        self._fwd = getattr(module, f"{self.name}_fwd")
        self._bwd = getattr(module, f"{self.name}_bwd", None)
        self.fn = self._entry_point()

    def _entry_point(self):
        kernel = self

        def fused_region(*inputs):
            outs = _FusedRegion.apply(kernel, *inputs)
            return outs[0] if len(outs) == 1 else outs

        # Generated programs print the call by name; registering it on the package keeps that name
        # importable (and the GraphModule picklable).
        import autopar.codegen.triton as package

        fused_region.__name__ = fused_region.__qualname__ = self.name
        fused_region.__module__ = package.__name__
        setattr(package, self.name, fused_region)
        return fused_region

    # --- launching -----------------------------------------------------------------------------
    def _common(self, inputs):
        """Kernel arguments shared by forward and backward: inputs, strides and sizes."""
        spec = self.spec
        shape = tuple(torch.broadcast_shapes(*(x.shape for x in inputs)))
        if len(shape) != spec.rank or any(shape[d] != 1 for d in range(spec.rank) if d not in spec.dims):
            raise ValueError(f"{self.name} was generated for regions of rank {spec.rank} iterating over dims "
                             f"{spec.dims}; got inputs broadcasting to {shape}")
        args = {}
        for j, (x, inp) in enumerate(zip(inputs, spec.inputs)):
            strides = x.expand(shape).stride()        # 0 along broadcast dims
            args[f"in{j}"] = x
            args.update({f"in{j}_s{d}": strides[spec.dims[d]] for d in inp.dims})
        sizes = [shape[d] for d in spec.dims]
        numel = math.prod(shape)
        if spec.row_mode:
            args.update({f"size{d}": s for d, s in enumerate(sizes[:-1])}, N=shape[-1])
            block = max(16, 1 << (shape[-1] - 1).bit_length())
            launch = dict(grid=(numel // shape[-1],), BLOCK=block, num_warps=min(max(block // 256, 1), 8))
        else:
            args.update({f"size{d}": s for d, s in enumerate(sizes)}, numel=numel)
            block = min(1024, max(16, 1 << (numel - 1).bit_length()))
            launch = dict(grid=(-(-numel // block),), BLOCK=block, num_warps=4)
        return shape, args, launch

    def _output_shape(self, shape, m):
        out = self.spec.outputs[m]
        if self.spec.row_mode and self.spec.ops[out.value].row:
            return shape[:-1] + ((1,) if out.keepdim else ())
        return shape

    @staticmethod
    def _run(jit_fn, params, args, launch):
        launch = dict(launch)
        jit_fn[launch.pop("grid")](*(args[p] for p in params), **launch)

    def forward(self, inputs) -> tuple:
        shape, args, launch = self._common(inputs)
        device = inputs[0].device
        outs = tuple(torch.empty(self._output_shape(shape, m), dtype=o.dtype, device=device)
                     for m, o in enumerate(self.spec.outputs))
        if math.prod(shape):
            args.update({f"out{m}": t for m, t in enumerate(outs)})
            self._run(self._fwd, self.source.fwd_params, args, launch)
        return outs

    def backward(self, inputs, grads, needs) -> list:
        result = [None] * len(inputs)
        wanted = [j for j in self.source.grad_inputs if needs[j]]
        if not wanted:
            return result
        shape, args, launch = self._common(inputs)
        spec = self.spec
        for m, g in enumerate(grads):
            args[f"gout{m}"] = g
            dims = range(len(spec.dims) - 1) if spec.row_mode and spec.ops[spec.outputs[m].value].row \
                else range(len(spec.dims))
            args.update({f"gout{m}_s{d}": g.stride(spec.dims[d]) for d in dims})
        exact = {}
        for j in self.source.grad_inputs:
            x = inputs[j]
            full = shape[:-1] + (1,) if spec.row_mode and spec.inputs[j].row else shape
            exact[j] = tuple(x.shape) == full
            # A broadcast input's gradient is summed below; keep the full-size terms in fp32.
            args[f"din{j}"] = torch.empty(full, dtype=x.dtype if exact[j] else torch.float32, device=x.device)
        if math.prod(shape):
            self._run(self._bwd, self.source.bwd_params, args, launch)
        else:
            for j in exact:
                args[f"din{j}"].zero_()
        for j in wanted:
            d = args[f"din{j}"]
            result[j] = d if exact[j] else d.sum_to_size(inputs[j].shape).to(inputs[j].dtype)
        return result


class _FusedRegion(torch.autograd.Function):
    """Forward and backward are both generated kernels; backward recomputes from the saved inputs."""

    @staticmethod
    def forward(ctx, kernel: FusedKernel, *inputs):
        ctx.kernel = kernel
        ctx.save_for_backward(*inputs)
        return kernel.forward(inputs)

    @staticmethod
    def backward(ctx, *grads):
        return None, *ctx.kernel.backward(ctx.saved_tensors, grads, ctx.needs_input_grad[1:])
