"""Pipeline plans at run time: this rank's stages of the generated program, run by a
``torch.distributed.pipelining`` schedule.

Each stage is a ``StageModule`` around one StageProgram (codegen/stages.py): it holds the shards of the
parameters its program reads (the same Parameter objects as the ParallelModule's, so the user's
optimizer updates them) and cuts this rank's block of each microbatch's inputs. The schedule splits
the global batch into the plan's microbatches along dim 0, sends activations between the ranks of the
pipeline axis and runs backward per microbatch. The loss of a microbatch is divided by the number of
microbatches before its backward, so gradients and the returned loss are those of the whole batch's
mean loss (exact when every microbatch holds as many loss terms, as with equal-length rows).

A parameter read by stages on several ranks (a tied embedding and head) is held by each of them;
their gradients are summed over the pipeline axis after every step, so the copies stay equal.
"""
from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn
from torch.utils import _pytree as pytree

from autopar.errors import AutoparError
from autopar.layout import local_shape, parse_layout
from autopar.plan import PIPELINE_SCHEDULES
from autopar.runtime import collectives as C
from autopar.runtime.module import ParallelModule, ShapeMismatchError, _contiguous_stride, rank_device, shard_of

SCHEDULES = PIPELINE_SCHEDULES
_MULTI = ("Interleaved1F1B", "InterleavedZeroBubble", "ZBVZeroBubble")


class StageModule(nn.Module):
    """One pipeline stage: ``forward(*received, **inputs)`` -> the activations the next stage needs,
    or the microbatch's loss on the last stage."""

    def __init__(self, owner: "PipelineParallelModule", stage):
        super().__init__()
        self.index = stage.index
        self.program = stage.gm
        self._kinds = stage.placeholders
        self._owner = [owner]             # not a submodule: the owner holds this stage
        # What the program reads: a ZeRO-1 parameter's whole local tensor, not the block the optimizer steps.
        self.params = nn.ParameterDict({owner._fqn_to_key[t]: owner.local_tensor(t)
                                        for k, t in stage.placeholders if k == "param"})

    def forward(self, *received, **inputs):
        owner = self._owner[0]
        recv = iter(received)
        call = []
        for kind, target in self._kinds:
            if kind == "recv":
                call.append(next(recv))
            elif kind == "param":
                call.append(self.params[owner._fqn_to_key[target]])
            elif kind == "buffer":
                call.append(owner._buffers_by_name[target])
            elif kind == "constant":
                call.append(owner._constants[target])
            else:
                x = inputs[owner._input_key[target]]
                lay = owner.plan.inputs.get(target)
                if lay is not None and isinstance(x, torch.Tensor):
                    x = shard_of(x, parse_layout(lay), owner.plan.mesh_shape, owner._coords)
                call.append(x)
        return self.program(*call)


class PipelineParallelModule(ParallelModule):
    """The ParallelModule of a pipeline plan: holds this rank's stages; ``train_step`` runs a step."""

    def __init__(self, program, plan, mesh, full_params: dict, buffers: dict, *, sharded_outputs=False,
                 **state_names):
        pipe = plan.pipeline
        self.pp_axis = plan.axis_names.index(pipe["axis"])
        coords = tuple(mesh.get_coordinate())
        pp_rank = coords[self.pp_axis]
        rank_of_stage = {s["index"]: s["pp_rank"] for s in pipe["stages"]}
        mine = [s for s in program.stages if rank_of_stage[s.index] == pp_rank]
        held = {t for s in mine for k, t in s.placeholders if k == "param"}
        self_full = {f: (tuple(p.shape), p.dtype) for f, p in full_params.items()}
        super().__init__(program, plan, mesh, {f: p for f, p in full_params.items() if f in held}, buffers,
                         sharded_outputs=sharded_outputs, **state_names)
        self._held = [f for f in self._layouts if f in held]
        self._full_meta = self_full           # FQN -> (global shape, dtype), for every parameter
        self._stage_programs = mine
        self._num_stages = len(program.stages)
        self._microbatches = int(pipe["microbatches"])
        self._schedule_name = pipe["schedule"]
        if self._schedule_name not in SCHEDULES:
            raise AutoparError(f"the plan's pipeline schedule {self._schedule_name!r} is not one of {SCHEDULES}")
        self._pp_group = mesh.get_group(pipe["axis"])
        self._pp_rank = pp_rank
        self._last_rank = rank_of_stage[self._num_stages - 1]
        # Parameters read on more than one rank of the pipeline axis: their gradients are summed there.
        ranks_of: dict = {}
        for s in program.stages:
            for k, t in s.placeholders:
                if k == "param":
                    ranks_of.setdefault(t, set()).add(rank_of_stage[s.index])
        self._tied = sorted(f for f, r in ranks_of.items() if len(r) > 1)
        self._grad_sums = sorted({x for s in mine for x in s.grad_sums})
        inputs = [t for k, t in program.placeholders if k == "input"]
        self._input_key = {t: f"input_{i}" for i, t in enumerate(inputs)}
        self._input_order = inputs
        self._rest_axes = [a for i, a in enumerate(plan.axis_names) if i != self.pp_axis]
        self._schedule = None

    # --- running ---------------------------------------------------------------------------------
    def forward(self, *args, **kwargs):
        raise AutoparError(f"this plan is a pipeline ({self._num_stages} stages over mesh axis "
                           f"{self.plan.pipeline['axis']!r}, {self._microbatches} microbatches, schedule "
                           f"{self._schedule_name}): no rank holds the whole model, so it cannot be called "
                           f"like the model. Run a training step with pmodel.train_step(*inputs, **kwargs), "
                           f"which returns the loss, then step your optimizer")

    def train_step(self, *args, **kwargs):
        """One pipelined forward and backward over the whole batch; returns the mean loss (detached),
        the same on every rank. Gradients are left in ``.grad`` for the optimizer."""
        flat, spec = pytree.tree_flatten((args, kwargs))
        self._check_batch(flat, spec)
        self._check_materialized()
        if self._schedule is None:
            self._schedule = self._make_schedule()
        if self._sharded_states is not None:
            self._sharded_states.before_forward()
        named = {}
        leaves = iter(flat)
        for kind, target in self._program.placeholders:
            if kind == "input":
                named[self._input_key[target]] = next(leaves)
        m = self._microbatches
        losses: list = []
        target = torch.zeros(m, device=rank_device())
        self._schedule.step(**named, target=target, losses=losses, return_outputs=False)
        self._sum_grads()
        if self._sharded_states is not None:
            self._sharded_states.expose_grads()
        if self._pp_rank == self._last_rank:
            loss = torch.stack([x.detach().reshape(()).float() for x in losses]).sum()
        else:
            loss = torch.zeros((), device=rank_device())
        dist.broadcast(loss, group=self._pp_group, group_src=self._last_rank)
        return loss

    def _make_schedule(self):
        from torch.distributed import pipelining as P

        m = self._microbatches
        device = rank_device()
        self._stage_modules = nn.ModuleList([StageModule(self, s) for s in self._stage_programs])
        stages = [P.PipelineStage(mod, s.index, self._num_stages, device, group=self._pp_group)
                  for mod, s in zip(self._stage_modules, self._stage_programs)]

        def loss_fn(output, _target):
            return output / m

        name = self._schedule_name
        cls = {"GPipe": P.ScheduleGPipe, "1F1B": P.Schedule1F1B, "Interleaved1F1B": P.ScheduleInterleaved1F1B,
               "InterleavedZeroBubble": P.ScheduleInterleavedZeroBubble,
               "ZBVZeroBubble": P.ScheduleZBVZeroBubble}[name]
        if name in _MULTI:
            return cls(stages, n_microbatches=m, loss_fn=loss_fn, scale_grads=False)
        if len(stages) != 1:
            raise AutoparError(f"schedule {name} runs one stage per rank, but this rank holds {len(stages)}")
        return cls(stages[0], n_microbatches=m, loss_fn=loss_fn, scale_grads=False)

    def _sum_grads(self):
        # A tied parameter's gradients over the pipeline axis first: its data-parallel sync below then
        # reduces their sum.
        for fqn in self._tied:
            if fqn in self._fqn_to_key and self._fqn_to_key[fqn] in self.shards:
                p = self.local_tensor(fqn)
                g = p.grad if p.grad is not None else torch.zeros_like(p)
            else:
                shape, dtype = self._full_meta[fqn]
                g = torch.zeros(local_shape(shape, self._layouts[fqn], self.plan.mesh_shape), dtype=dtype,
                                device=rank_device())
            dist.all_reduce(g, group=self._pp_group)
            if fqn in self._held:
                self.local_tensor(fqn).grad = g
        # Data parallelism's gradient sync, once per step (codegen/stages.py took it out of backward). A
        # ZeRO-1 parameter's gradient is reduce-scattered along its state's axis into the block its
        # optimizer steps (Megatron-LM's distributed optimizer), after its all-reduces along any other
        # axis; the whole local gradient stays for the next step's accumulation until the optimizer's
        # gradient is set to None. A gradient summed in a narrower dtype (bf16-mixed's ``reduce_dtype``
        # "bfloat16") is narrowed for the collective and widened back.
        scatters = []
        for fqn, axis, dtype in self._grad_sums:
            p = self.local_tensor(fqn)
            if p.grad is None:
                p.grad = torch.zeros_like(p)
            group = self.mesh.get_group(axis)
            zero = self._zero_of.get(fqn)
            if zero is not None and zero[1] == group.group_name:
                scatters.append((fqn, p.grad, dtype, zero, dist.get_world_size(group)))
            elif dtype is None:
                dist.all_reduce(p.grad, group=group)
            else:
                narrow = p.grad.to(dtype)
                dist.all_reduce(narrow, group=group)
                p.grad.copy_(narrow)
        for fqn, grad, dtype, (_stage, name, dim, *_), size in scatters:
            self.local_parameter(fqn).grad = C._summed_in(dtype, lambda t: C._reduce_scatter(t, dim, size, name), grad)

    def _check_batch(self, flat, spec):
        m = self._microbatches
        planned = [None if s is None else (s[0] * m, *s[1:]) if len(s) else tuple(s)
                   for s in self._program.input_shapes]
        got = [tuple(x.shape) if isinstance(x, torch.Tensor) else None for x in flat]
        if spec != self._program.in_spec or got != [None if s is None else tuple(s) for s in planned]:
            raise ShapeMismatchError(
                f"inputs have shapes {got} but the pipeline plan was made for {planned} ({m} microbatches of "
                f"{[None if s is None else tuple(s) for s in self._program.input_shapes]}); call "
                f"autopar.compile again with example inputs of the new shape")

    # --- state -----------------------------------------------------------------------------------
    def parameters(self, recurse: bool = True):
        seen = set()
        for p in self.shards.values():
            if id(p) not in seen:
                seen.add(id(p))
                yield p

    def local_parameter(self, fqn: str) -> nn.Parameter:
        key = self._fqn_to_key[fqn]
        if key not in self.shards:
            raise KeyError(f"parameter {fqn} lives on another pipeline stage than this rank's "
                           f"(pipeline rank {self._pp_rank})")
        return self.shards[key]

    def _check_materialized(self):
        if self._materialized:
            return
        on_meta = [f for f in self._held if self.local_parameter(f).is_meta]
        on_meta += [b for b, t in self._buffers_by_name.items() if t.is_meta]
        if on_meta:
            raise AutoparError(f"{len(on_meta)} parameters or buffers are still on the meta device (e.g. "
                               f"{on_meta[:3]}); load them with pmodel.load_state_dict(full_state_dict)")
        self._materialized = True

    def _stage_mesh(self):
        return self.mesh[tuple(self._rest_axes)] if self._rest_axes else None

    def state_dict(self, *args, **kwargs):
        """The parameters this rank's stages hold: FQN -> DTensor on the mesh's other axes (a plain
        tensor when the pipeline axis is the only one)."""
        from torch.distributed.tensor import DTensor

        if self._sharded_states is not None:
            self._sharded_states.sync()
        sub = self._stage_mesh()
        out = {}
        for fqn in self._held:
            local = self.local_tensor(fqn).detach()
            if sub is None:
                out[fqn] = local
                continue
            lay = [p for i, p in enumerate(self._layouts[fqn]) if i != self.pp_axis]
            shape = self._full_meta[fqn][0]
            out[fqn] = DTensor.from_local(local, sub, [p.to_dtensor() for p in lay], run_check=False,
                                          shape=torch.Size(shape), stride=_contiguous_stride(shape))
        return out

    def full_state_dict(self) -> dict:
        """Every parameter as a full plain tensor, equal on every rank (gathered over the pipeline)."""
        mine = {f: (t.full_tensor() if hasattr(t, "full_tensor") else t).cpu() for f, t in self.state_dict().items()}
        gathered = [None] * dist.get_world_size(self._pp_group)
        dist.all_gather_object(gathered, mine, group=self._pp_group)
        out = {}
        for part in gathered:
            out.update(part)
        device = rank_device()
        full = {f: out[f].to(device) for f in self._layouts}
        full.update({name: full[canonical] for name, canonical in self._aliases.items()})
        full.update({name: self._buffers_by_name[name].detach().clone() for name in self._persistent})
        return full

    def load_state_dict(self, state_dict, strict: bool = True, assign: bool = False):
        # a tied parameter's other names (full_state_dict gives them) stand for the planned one
        state_dict = {self._aliases.get(k, k): v for k, v in state_dict.items()
                      if k not in self._aliases or self._aliases[k] not in state_dict}
        missing = [f for f in self._layouts if f not in state_dict]
        unexpected = [k for k in state_dict if k not in self._layouts and k not in self._buffers_by_name]
        if strict and (missing or unexpected):
            raise KeyError(f"load_state_dict: missing {missing[:5]}, unexpected {unexpected[:5]}")
        with torch.no_grad():
            for fqn, value in state_dict.items():
                if fqn in self._buffers_by_name:
                    self._buffers_by_name[fqn] = value.detach().clone()
                if fqn in self._held:
                    self._load_local(fqn, value)
        self._after_load()
        self._schedule = None          # stages hold the parameter objects: rebuild them
        return torch.nn.modules.module._IncompatibleKeys(missing, unexpected)
