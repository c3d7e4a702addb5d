"""The module users hold: local parameter shards, the rank's finished program, and the original
call signature.

``build`` runs on every rank with the Plan and the Program (runtime/program.py) that autopar.compile
made: it checks the weights and cuts this rank's shards out of them. The runtime knows nothing of
capture, planning or code generation.
"""
from __future__ import annotations

import dataclasses
import logging

import torch
import torch.distributed as dist
from torch import nn
from torch.utils import _pytree as pytree

from autopar.errors import AutoparError, ShapeMismatchError
from autopar.layout import block_runs, global_shape, parse_layout
from autopar.plan import Plan
from autopar.runtime.program import Program

log = logging.getLogger("autopar")


def shard_of(full: torch.Tensor, layout, mesh_shape, coords) -> torch.Tensor:
    """This rank's block of ``full`` under ``layout`` (a view, except for a strided shard's blocks of
    its groups, which are copied together)."""
    x = full
    for p, n, c in zip(layout, mesh_shape, coords):
        if p.is_shard:
            runs = [x.narrow(p.dim, start, length) for start, length in block_runs(x.shape[p.dim], p, n, c)]
            x = runs[0] if len(runs) == 1 else torch.cat(runs, p.dim)
    return x


class ParallelModule(nn.Module):
    def __init__(self, program: Program, plan: Plan, mesh, full_params: dict, buffers: dict, *,
                 sharded_outputs: bool = False, aliases: dict | None = None, persistent=None):
        super().__init__()
        self.plan = plan
        self.sharded_outputs = sharded_outputs
        self.mesh = mesh
        self._program = program
        self._coords = tuple(mesh.get_coordinate())
        self._layouts = {fqn: parse_layout(lay) for fqn, lay in plan.params.items()}
        self._fqn_to_key = {fqn: fqn.replace(".", "__") for fqn in plan.params}
        self.shards = nn.ParameterDict()
        # ZeRO-1/2 parameters: the program reads the whole local tensor, the optimizer steps this rank's
        # block of it (runtime/zero.py).
        self._zero_of = {fqn: rest for fqn, *rest in program.sharded_states if fqn in full_params}
        # Offloaded parameters: the program reads a device tensor, the optimizer steps its copy in host
        # memory (runtime/offload.py).
        self._offloaded = set(plan.offload)
        self._whole: dict = {}
        for fqn, full in full_params.items():
            local = shard_of(full, self._layouts[fqn], plan.mesh_shape, self._coords)
            self._set_local(fqn, local, full.requires_grad)
        self._buffers_by_name = buffers
        # The model's state-dict keys beyond the plan's parameters: tied names -> the one they share,
        # and the buffers a state dict holds (torch leaves out non-persistent ones).
        self._aliases = dict(aliases or {})
        self._persistent = [b for b in (buffers if persistent is None else persistent) if b in buffers]
        self._constants = program.constants
        self._materialized = False
        self.local_program = program.gm       # registered as a submodule: its attributes move with .to()
        self._grad_buckets = None
        if program.grad_reductions:
            self._make_grad_buckets()
        self._sharded_states = None
        if self._zero_of:
            self._make_sharded_states()
        self._host_states = None
        if self._offloaded:
            self._make_host_states()

    def _set_local(self, fqn: str, local: torch.Tensor, requires_grad: bool) -> None:
        key = self._fqn_to_key[fqn]
        if fqn in self._zero_of:
            from autopar.runtime.zero import split

            _stage, group, dim, _bucket, copy_dtype, _reduce_dtype = self._zero_of[fqn]
            self._whole[fqn], self.shards[key] = split(local, group, dim, requires_grad, copy_dtype)
        elif fqn in self._offloaded:
            from autopar.runtime.offload import split as to_host

            self._whole[fqn], self.shards[key] = to_host(local, requires_grad)
        else:
            self.shards[key] = nn.Parameter(local.detach().clone(), requires_grad=requires_grad)

    def _make_grad_buckets(self) -> None:
        from autopar.runtime.grad_buckets import GradBuckets

        self._grad_buckets = GradBuckets([(self.local_tensor(t), g, dtype)
                                          for t, g, _, dtype in self._program.grad_reductions],
                                         self._program.bucket_bytes, reduced=self._expose_zero_one_grads)

    def _expose_zero_one_grads(self) -> None:
        if self._sharded_states is not None:
            self._sharded_states.expose_grads()

    def _make_sharded_states(self) -> None:
        from autopar.runtime.zero import ShardedState, ShardedStates

        bucketed = frozenset(t for t, *_ in self._program.grad_reductions)
        self._sharded_states = ShardedStates([ShardedState(fqn, self._whole[fqn], self.local_parameter(fqn), stage,
                                                           group, dim, bucket, reduce_dtype)
                                              for fqn, (stage, group, dim, bucket, _, reduce_dtype)
                                              in self._zero_of.items()],
                                             defer=self._program.overlap, bucketed=bucketed)

    def _make_host_states(self) -> None:
        from autopar.runtime.offload import HostState, HostStates

        self._host_states = HostStates([HostState(fqn, self._whole[fqn], self.local_parameter(fqn))
                                        for fqn in sorted(self._offloaded)])

    # --- the user's view ---------------------------------------------------------------------
    @property
    def code(self) -> str:
        """The generated per-rank program, as Python, followed by the body of each recomputed layer."""
        parts = [self.local_program.code]
        for name, mod in self.local_program.named_children():
            if isinstance(mod, torch.fx.GraphModule):
                how = "its saved activations in host memory" if name.startswith("offload_") else \
                    "activation checkpointing"
                parts.append(f"\n# self.{name}, run under {how}:{mod.code}")
        return "".join(parts)

    @property
    def kernels(self) -> dict:
        """Triton source by kernel name, for every kernel the program calls (empty with ATen kernels)."""
        return dict(self._program.kernels)

    def local_parameter(self, fqn: str) -> nn.Parameter:
        """The parameter the optimizer steps: the local shard under the plan's layout, or under a
        ZeRO-1/2 parameter's state layout (``state_layout``); an offloaded parameter's copy in host
        memory."""
        return self.shards[self._fqn_to_key[fqn]]

    def local_tensor(self, fqn: str) -> torch.Tensor:
        """The local shard under the plan's layout: what the program reads."""
        whole = self._whole.get(fqn)
        return whole if whole is not None else self.local_parameter(fqn)

    def saved_tensor(self, fqn: str) -> tuple[torch.Tensor, tuple]:
        """(the local tensor a state dict holds of parameter ``fqn``, its layout): ``local_tensor``, or the
        float32 master's block where the master is sharded and the whole local tensor is a copy."""
        if self._sharded_master(fqn) is not None:
            return self.local_parameter(fqn), self.state_layout(fqn)
        return self.local_tensor(fqn), self._layouts[fqn]

    def _sharded_master(self, fqn: str):
        """The ZeRO state of ``fqn`` where its float32 master is sharded (runtime/zero.py), else None."""
        states = self._sharded_states.states if self._sharded_states is not None else ()
        return next((st for st in states if st.fqn == fqn and st.sharded_master), None)

    def state_layout(self, fqn: str) -> tuple:
        """The layout of ``local_parameter(fqn)`` and its optimizer state: the plan's layout, with the
        ZeRO axis sharded along the state's dim for a ZeRO-1/2 parameter."""
        from autopar.layout import S

        lay = self._layouts[fqn]
        z = self.plan.zero.get(fqn)
        if z is None:
            return lay
        axis = self.plan.axis_names.index(z["axis"])
        return tuple(S(z["dim"]) if a == axis else p for a, p in enumerate(lay))

    def forward(self, *args, **kwargs):
        flat, spec = pytree.tree_flatten((args, kwargs))
        self._check_inputs(flat, spec)
        self._check_materialized()
        if self._sharded_states is not None:
            self._sharded_states.before_forward()
        if self._host_states is not None:
            self._host_states.sync()
        if self._grad_buckets is not None and torch.is_grad_enabled():
            self._grad_buckets.set_aside()
        outs = pytree.tree_leaves(self.local_program(*self._local_args(flat)))
        if self.sharded_outputs:
            outs = self._as_dtensors(outs)
        return pytree.tree_unflatten(outs, self._program.out_spec)

    def _local_args(self, flat) -> list:
        """This rank's arguments of the local program, from the flattened call arguments."""
        inputs = iter(flat)
        call = []
        for kind, target in self._program.placeholders:
            if kind == "param":
                call.append(self.local_tensor(target))
            elif kind == "buffer":
                call.append(self._buffers_by_name[target])
            elif kind == "constant":
                call.append(self._constants[target])
            else:
                x = next(inputs)
                lay = self.plan.inputs.get(target)
                if lay is not None and isinstance(x, torch.Tensor):
                    x = shard_of(x, parse_layout(lay), self.plan.mesh_shape, self._coords)
                call.append(x)
        return call

    def _as_dtensors(self, outs):
        from torch.distributed.tensor import DTensor

        layouts = iter(self._program.output_layouts)
        wrapped = []
        for x in outs:
            if isinstance(x, torch.Tensor):
                lay = next(layouts)
                shape = global_shape(x.shape, lay, self.plan.mesh_shape)
                x = DTensor.from_local(x, self.mesh, [p.to_dtensor() for p in lay], run_check=False,
                                       shape=torch.Size(shape), stride=_contiguous_stride(shape))
            wrapped.append(x)
        return wrapped

    def _check_inputs(self, flat, spec):
        planned = self._program.input_shapes
        got = tuple(tuple(x.shape) if isinstance(x, torch.Tensor) else None for x in flat)
        if spec != self._program.in_spec or got != tuple(planned):
            raise ShapeMismatchError(
                f"inputs have shapes {list(got)} but the plan was made for {list(planned)} "
                f"(argument structure {'matches' if spec == self._program.in_spec else 'differs'}). "
                f"A plan fixes every shape: call autopar.compile again with example inputs of the new shape, "
                f"or pad batches to the planned shape.")

    def _check_materialized(self):
        if self._materialized:
            return
        on_meta = [f for f in self._layouts if self.local_parameter(f).is_meta]
        on_meta += [b for b, t in self._buffers_by_name.items() if t.is_meta]
        if on_meta:
            raise AutoparError(f"{len(on_meta)} parameters or buffers are still on the meta device (e.g. "
                               f"{on_meta[:3]}); load them with pmodel.load_state_dict(full_state_dict), "
                               f"including non-persistent buffers such as rotary tables")
        self._materialized = True

    def train_step(self, *args, **kwargs):
        """Forward and backward; returns the loss (detached)."""
        out = self(*args, **kwargs)
        loss = _loss_of(out)
        loss.backward()
        return loss.detach()

    # --- state ---------------------------------------------------------------------------------
    def state_dict(self, *args, **kwargs):
        """Parameter FQN -> DTensor with the plan's placements, and each persistent buffer as a
        replicated DTensor: what torch.distributed.checkpoint saves and loads under any plan."""
        from torch.distributed.tensor import DTensor, Replicate

        if self._sharded_states is not None:
            self._sharded_states.sync()
        if self._host_states is not None:
            self._host_states.sync()
        out = {}
        for fqn in self._layouts:
            local, lay = self.saved_tensor(fqn)
            out[fqn] = DTensor.from_local(local.detach(), self.mesh, [p.to_dtensor() for p in lay],
                                          run_check=False, shape=self._full_shape(fqn),
                                          stride=_contiguous_stride(self._full_shape(fqn)))
        for name in self._persistent:
            out[name] = DTensor.from_local(self._buffers_by_name[name].detach(), self.mesh,
                                           [Replicate()] * self.mesh.ndim, run_check=False)
        return out

    def _full_shape(self, fqn):
        return torch.Size(global_shape(self.local_tensor(fqn).shape, self._layouts[fqn], self.plan.mesh_shape))

    @property
    def aliases(self) -> dict:
        """State-dict names of tied parameters -> the planned name whose tensor they share."""
        return dict(self._aliases)

    def full_state_dict(self) -> dict:
        """The original model's state dict as full plain tensors, equal on every rank: every parameter
        under each of its names (tied ones too) and the persistent buffers, so that
        ``model.load_state_dict(pmodel.full_state_dict())`` is strict."""
        full = {fqn: t.full_tensor() for fqn, t in self.state_dict().items()}
        for name, canonical in self._aliases.items():
            full[name] = full[canonical]
        return full

    def load_state_dict(self, state_dict, strict: bool = True, assign: bool = False):
        """Load a full or DTensor state dict of any plan: parameters (under any of their tied names)
        and buffers, non-persistent ones included (a model built on the meta device needs them)."""
        from torch.distributed.tensor import DTensor

        values = {}
        for key, value in state_dict.items():
            fqn = self._aliases.get(key, key)
            if fqn in self._layouts and (fqn not in values or key == fqn):
                values[fqn] = value
        missing = [f for f in self._layouts if f not in values] + \
                  [b for b in self._persistent if b not in state_dict]
        unexpected = [k for k in state_dict if self._aliases.get(k, k) not in self._layouts
                      and k not in self._buffers_by_name]
        if strict and (missing or unexpected):
            raise KeyError(f"load_state_dict: missing {missing[:5]}, unexpected {unexpected[:5]}")
        with torch.no_grad():
            for name, value in state_dict.items():
                if name in self._buffers_by_name:       # buffers run replicated
                    if isinstance(value, DTensor):
                        value = value.full_tensor()
                    old = self._buffers_by_name[name]
                    self._buffers_by_name[name] = value.detach().to(old.device if not old.is_meta
                                                                    else value.device).clone()
            for fqn, value in values.items():
                self._load_local(fqn, value)
        self._after_load()
        return torch.nn.modules.module._IncompatibleKeys(missing, unexpected)

    def _load_local(self, fqn: str, value: torch.Tensor) -> None:
        """Copy this rank's block of ``value`` (a full tensor or a DTensor) into parameter ``fqn``, or
        make the parameter from it where it is still on the meta device."""
        from torch.distributed.tensor import DTensor

        if isinstance(value, DTensor):
            value = value.full_tensor()
        local = shard_of(value, self._layouts[fqn], self.plan.mesh_shape, self._coords)
        param = self.local_parameter(fqn)
        if param.is_meta:
            self._set_local(fqn, local.to(param.dtype), param.requires_grad)
        else:
            self.local_tensor(fqn).detach().copy_(local)
            state = self._sharded_master(fqn)
            if state is not None:
                param.detach().copy_(state.block(local))

    def _after_load(self) -> None:
        """ZeRO-1/2 and offloaded parameters after new weights were copied into the whole local tensors;
        the gradient buckets' hooks on the tensors made on loading a meta model's weights."""
        if self._grad_buckets is not None and any(
                p not in self._grad_buckets.bucket_of for p in (self.local_tensor(t) for t, *_ in
                                                                self._program.grad_reductions) if p.requires_grad):
            self._make_grad_buckets()
        if self._sharded_states is not None:
            if any(self.local_parameter(st.fqn) is not st.shard for st in self._sharded_states.states):
                self._make_sharded_states()        # parameters made on loading a meta model's weights
            self._sharded_states.after_load()
        if self._host_states is not None:
            if any(self.local_parameter(st.fqn) is not st.host for st in self._host_states.states):
                self._make_host_states()           # parameters made on loading a meta model's weights
            self._host_states.download()
        self._materialized = False


def _contiguous_stride(shape):
    stride, acc = [], 1
    for s in reversed(shape):
        stride.append(acc)
        acc *= s
    return tuple(reversed(stride))


def _loss_of(out):
    if isinstance(out, torch.Tensor):
        return out
    loss = getattr(out, "loss", None)
    if loss is None and isinstance(out, (tuple, list)) and out:
        loss = out[0]
    if loss is None and isinstance(out, dict):
        loss = out.get("loss")
    if not isinstance(loss, torch.Tensor) or loss.numel() != 1:
        raise AutoparError("train_step needs the model to return a scalar loss (a tensor, a ModelOutput with "
                           ".loss, or a tuple whose first item is the loss); pass labels, or call the "
                           "module and backward yourself")
    if hasattr(loss, "to_local"):          # a DTensor under sharded_outputs: scalars come back replicated
        loss = loss.to_local()
    return loss


def device_type() -> str:
    """The device kind of the initialized process group: cuda under NCCL, else cpu."""
    return "cuda" if dist.get_backend() == "nccl" else "cpu"


def build(model, program: Program, plan: Plan, mesh, *, check_weights=True,
          sharded_outputs=False) -> ParallelModule:
    """This rank's ParallelModule: ``program`` on this rank's shards of ``model``'s weights."""
    from autopar.runtime.collectives import same_on_all_ranks

    device = rank_device()
    params = dict(model.named_parameters())
    on_meta = any(p.is_meta for p in params.values())
    if check_weights and not on_meta:
        world = dist.group.WORLD.group_name
        if not same_on_all_ranks([p.detach() for p in params.values()], world, device):
            raise AutoparError("the model's weights differ between ranks; seed every rank the same "
                               "(torch.manual_seed) before building the model, or load one checkpoint on all")
    full = {fqn: (p if p.is_meta else p.to(device)) for fqn, p in params.items() if fqn in plan.params}
    # Buffers (rotary frequencies, position ids) and lifted constants run on the program's device too.
    buffers = {name: (b if b.is_meta else b.to(device)) for name, b in model.named_buffers()}
    constants = {k: (v.to(device) if isinstance(v, torch.Tensor) and not v.is_meta else v)
                 for k, v in program.constants.items()}
    program = dataclasses.replace(program, constants=constants)
    aliases, persistent = state_dict_names(model, plan.params, buffers)
    if plan.pipeline:
        from autopar.runtime.pipeline import PipelineParallelModule

        return PipelineParallelModule(program, plan, mesh, full, buffers, sharded_outputs=sharded_outputs,
                                      aliases=aliases, persistent=persistent)
    return ParallelModule(program, plan, mesh, full, buffers, sharded_outputs=sharded_outputs, aliases=aliases,
                          persistent=persistent)


def state_dict_names(model, planned: dict, buffers: dict):
    """The model's state-dict keys that are not planned parameters: tied names -> the planned name they
    share a tensor with, and the persistent buffers."""
    canonical = {}
    for fqn, p in model.named_parameters(remove_duplicate=False):
        if fqn in planned:
            canonical[id(p)] = fqn
    aliases = {fqn: canonical[id(p)] for fqn, p in model.named_parameters(remove_duplicate=False)
               if fqn not in planned and id(p) in canonical}
    keys = model.state_dict(keep_vars=True).keys()
    return aliases, [k for k in keys if k in buffers]


def init_mesh(plan: Plan):
    """The DeviceMesh of ``plan`` on the initialized process group."""
    from torch.distributed.device_mesh import init_device_mesh

    return init_device_mesh(device_type(), plan.mesh_shape, mesh_dim_names=plan.axis_names)


def rank_device() -> torch.device:
    kind = device_type()
    return torch.device(kind, torch.cuda.current_device()) if kind == "cuda" else torch.device("cpu")
