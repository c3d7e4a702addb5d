"""ClusterSpec: the devices and links a plan is made for.

Every cost in autopar is seconds or bytes, and every figure behind those costs comes from here:
peak FLOP/s per dtype, memory bandwidth and capacity per device, and an alpha-beta link (bandwidth,
latency) inside a node and across nodes. A spec comes from a preset (``ClusterSpec.preset("64xH100")``,
for planning offline), from the running job (``ClusterSpec.from_env()``), or from this machine's gloo
processes (``ClusterSpec.local_cpu(n)``); ``spec.profile()`` replaces the figures with measured ones.

Conventions:

- Bandwidths are bytes/s per device, one direction. Latencies are seconds.
- Devices are numbered node-major (ranks ``0..devices_per_node-1`` are node 0) and meshes are
  row-major over the ranks, as ``init_device_mesh`` lays them out, so the innermost mesh axes are the
  ones that stay inside a node.
- Preset figures are public datasheet numbers (dense, no sparsity). Memory is the datasheet's decimal
  gigabytes (80 GB -> 80e9 bytes): the driver reports a little more (an H100 80GB shows ~85.5e9 bytes),
  so planning with the datasheet figure errs on the safe side. Latencies are rough small-message NCCL
  figures. ``profile()`` measures all of these on a live process group.
- ``memory_reserve`` is what the planner must leave free per device, for what live tensors do not
  show: the CUDA context and cuBLAS workspaces (about 0.5-1 GB), NCCL buffers (about 0.5-1 GB on 8
  GPUs) and the caching allocator's fragmentation (it typically reserves 5-10% more than the peak of
  live tensors) on GPUs, or the interpreter and the OS on CPU. It defaults to 10% of capacity for
  CUDA (8 GB of an 80 GB H100) and 20% for CPU; ``usable_memory`` is what remains, and the budget
  the planner solves for when none is given (docs/cost-model.md, "Allocator headroom").
- Host memory, for offload: ``host_memory`` is the host RAM of one node (bytes), ``host_link_bandwidth``
  the device<->host link per device and direction (B/s), ``host_memory_bandwidth`` the host's memory
  bandwidth per node (B/s), which the optimizer steps of the node's devices share. None (a spec built
  by hand without them) means offload cannot be planned. The presets take them from the DGX
  datasheets: DGX H100/H200 2 TB of DDR5 per node on two Xeon 8480C (2 x 8 channels of DDR5-4800,
  614 GB/s), each GPU on PCIe Gen5 x16 (64 GB/s per direction nominal, about 55 GB/s measured by
  host<->device copies of pinned memory); DGX A100 2 TB on two EPYC 7742 (2 x 8 channels of DDR4-3200,
  410 GB/s), PCIe Gen4 x16 (32 GB/s nominal, about 25 GB/s measured). There is no GH200 preset (its
  NVLink-C2C would give about 450 GB/s per direction). On a CPU cluster host and device are the same
  memory (``host_is_device``): offload moves nothing off the device there, so planning never offers
  it; a pin can still force it, to test the runtime.

torch is imported only inside the functions that need it, so importing this module is cheap.
"""
from __future__ import annotations

import dataclasses
import math
import os
import re
import time
from dataclasses import dataclass
from typing import Any, Mapping

from autopar.errors import ClusterMismatchError, MeshError, PlanFormatError

_DTYPE_ALIASES = {
    "bf16": "bfloat16",
    "fp16": "float16",
    "half": "float16",
    "fp32": "float32",
    "float": "float32",
}
_RESERVE_FRACTION = {"cuda": 0.10, "cpu": 0.20}
_DEFAULT_AXIS_NAMES = {
    1: ("dp",),
    2: ("dp", "tp"),
    3: ("dp", "cp", "tp"),
    4: ("pp", "dp", "cp", "tp"),
}


def _positive(what: str, value: Any, *, allow_zero: bool = False) -> float:
    """``value`` as a float, or ValueError: a finite number > 0 (>= 0 with ``allow_zero``)."""
    ok = isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)
    if not ok or value < 0 or (value == 0 and not allow_zero):
        bound = ">= 0" if allow_zero else "> 0"
        raise ValueError(f"{what} must be a finite number {bound}, got {value!r}")
    return float(value)


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


@dataclass(frozen=True)
class DeviceSpec:
    """One accelerator (or one CPU process): peak compute, memory bandwidth and capacity.

    ``flops`` maps dtype names (``"float32"``, ``"bfloat16"``, ``"float16"``) to dense peak FLOP/s,
    with tensor cores where they apply; for GPUs ``"float32"`` is plain FP32 (TF32 off). It must
    have a ``"float32"`` entry, the fallback for any dtype it does not list. The dict is copied on
    construction; treat it as read-only (the spec is hashed by its contents).

    ``op_overhead`` is the time an op costs beyond its FLOPs and bytes, in seconds per op launched: the
    framework's dispatch, autograd's bookkeeping and the kernel launch, which a step of many small ops
    pays once per op in forward and about twice per op in backward (on GPUs only where the kernel is
    shorter: the host launches ahead). It is 0, none priced, until ``ClusterSpec.profile()`` measures it:
    one eager ATen op with autograd on one CPU thread costs 2-4 us forward and 4-7 us backward (a 2-core
    AMD EPYC virtual machine, torch 2.13); no default per device kind yet.

    ``comm_contention`` is what a collective in flight costs the compute it overlaps: of each second of
    a collective that compute hides, the fraction the step still pays, because the collective takes
    the compute's resources (0: hiding is free; 1: nothing is gained by overlapping). On CPU, gloo
    copies and sums with the same cores the compute uses; ``ClusterSpec.profile()`` measures it (a
    matmul chain alone, an all-reduce alone, and both at once). The default, 0, is the GPU's: NCCL runs
    its transfers and reductions on a few SMs of its own (one per channel, up to 32 of an H100's 132)
    and moves data over NVLink and the NIC, so a collective hides nearly whole behind matmuls on the
    other SMs; what it does take is left to the profile. A CPU spec not profiled keeps 0 as well
    (``local_cpu``'s figures are all guesses until ``profile()``), as does a spec saved before the term.

    ``peer_wait`` is what each collective costs beyond its link's alpha-beta time, in seconds: the wait
    for the last rank to reach it after the compute before it (the ranks' skew) and for the
    collective's threads to be scheduled. Ranks that share cores with each other and with other
    processes (gloo processes on one machine) drift apart between two collectives by milliseconds,
    and every collective that synchronizes them pays it; the link latency, measured by back-to-back
    collectives of ranks already in step, does not show it. ``ClusterSpec.profile()`` measures it (a
    small all-reduce issued after a few milliseconds of matmuls, the median of interleaved rounds, less
    the latency). The default, 0, is the GPU's: a rank's host queues identical kernels ahead of the
    device, so the ranks reach a collective within microseconds of each other, within NCCL's latency
    already priced. A CPU spec not profiled and a spec saved before the term price none.
    """

    name: str
    flops: Mapping[str, float]
    memory_bandwidth: float
    memory: float
    op_overhead: float = 0.0
    comm_contention: float = 0.0
    peer_wait: float = 0.0

    def __post_init__(self):
        if not isinstance(self.name, str) or not self.name:
            raise ValueError(f"device name must be a non-empty string, got {self.name!r}")
        if not isinstance(self.flops, Mapping) or "float32" not in self.flops:
            raise ValueError(f"device {self.name}: flops must be a mapping with a 'float32' entry, "
                             f"got {self.flops!r}")
        flops = {}
        for dtype, value in self.flops.items():
            if not isinstance(dtype, str):
                raise ValueError(f"device {self.name}: flops keys are dtype names, got {dtype!r}")
            flops[dtype] = _positive(f"device {self.name}: flops[{dtype!r}]", value)
        object.__setattr__(self, "flops", flops)
        object.__setattr__(self, "memory_bandwidth",
                           _positive(f"device {self.name}: memory_bandwidth", self.memory_bandwidth))
        object.__setattr__(self, "memory", _positive(f"device {self.name}: memory", self.memory))
        object.__setattr__(self, "op_overhead",
                           _positive(f"device {self.name}: op_overhead", self.op_overhead, allow_zero=True))
        contention = _positive(f"device {self.name}: comm_contention", self.comm_contention, allow_zero=True)
        if contention > 1:
            raise ValueError(f"device {self.name}: comm_contention is a fraction of the hidden time, "
                             f"at most 1, got {contention!r}")
        object.__setattr__(self, "comm_contention", contention)
        object.__setattr__(self, "peer_wait",
                           _positive(f"device {self.name}: peer_wait", self.peer_wait, allow_zero=True))

    def __hash__(self):
        return hash((self.name, tuple(sorted(self.flops.items())), self.memory_bandwidth, self.memory,
                     self.op_overhead, self.comm_contention, self.peer_wait))

    def peak_flops(self, dtype) -> float:
        """Peak FLOP/s for a torch dtype or a name (``"bf16"``, ``"torch.bfloat16"``); unknown
        dtypes get the float32 figure."""
        name = str(dtype).removeprefix("torch.")
        return self.flops.get(_DTYPE_ALIASES.get(name, name), self.flops["float32"])

    def to_dict(self) -> dict:
        return {"name": self.name, "flops": dict(self.flops),
                "memory_bandwidth": self.memory_bandwidth, "memory": self.memory, "op_overhead": self.op_overhead,
                "comm_contention": self.comm_contention, "peer_wait": self.peer_wait}


# Datasheet figures, SXM parts. NVLink: H100/H200 900 GB/s and A100 600 GB/s bidirectional, i.e.
# 450e9 and 300e9 per direction. Network: one NDR 400 Gb/s (H100/H200) or HDR 200 Gb/s (A100)
# InfiniBand port per GPU, the usual DGX/HGX build.
_H100_FLOPS = {"float32": 67e12, "bfloat16": 989e12, "float16": 989e12}
_A100_FLOPS = {"float32": 19.5e12, "bfloat16": 312e12, "float16": 312e12}
_PRESETS: dict[str, tuple[DeviceSpec, float, float]] = {  # device, NVLink B/s, network B/s
    "H100": (DeviceSpec("H100", _H100_FLOPS, 3.35e12, 80e9), 450e9, 50e9),
    "H200": (DeviceSpec("H200", _H100_FLOPS, 4.8e12, 141e9), 450e9, 50e9),
    "A100": (DeviceSpec("A100", _A100_FLOPS, 2.039e12, 80e9), 300e9, 25e9),
    "A100-40GB": (DeviceSpec("A100-40GB", _A100_FLOPS, 1.555e12, 40e9), 300e9, 25e9),
}
_PRESET_ALIASES = {"A100-80GB": "A100"}
# Per preset: host memory per node (B), host link per device and direction (B/s), host memory
# bandwidth per node (B/s); the module docstring gives the sources.
_HOST = {"H100": (2e12, 55e9, 614e9), "H200": (2e12, 55e9, 614e9),
         "A100": (2e12, 25e9, 410e9), "A100-40GB": (1e12, 25e9, 410e9)}
_HOST_FIELDS = ("host_memory", "host_link_bandwidth", "host_memory_bandwidth")
_GPU_INTRA_LATENCY, _GPU_INTER_LATENCY = 5e-6, 1e-5
_PRESET_RE = re.compile(r"^\s*(\d+)\s*x\s*([A-Za-z0-9-]+)\s*$", re.IGNORECASE)
_GPUS_PER_NODE = 8

# Rough figures for a GPU we have no preset for (PCIe 4.0 x16 inside a node, 100 Gb/s between
# nodes) and for CPU processes; profile() replaces them with measured ones.
_GENERIC_GPU = dict(flops={"float32": 20e12, "bfloat16": 100e12, "float16": 100e12},
                    memory_bandwidth=1e12, intra=(25e9, 1e-5), inter=(12.5e9, 2e-5))
_CPU_FLOPS, _CPU_MEMORY_BANDWIDTH = 5e10, 1e10
# profile()'s peer wait: the compute before each all-reduce (seconds), about what a step of a small model
# runs between two collectives, and the rounds it takes the median of.
_PEER_WAIT_SEGMENT, _PEER_WAIT_ROUNDS = 5e-3, 24
_OVERHEAD_CHAIN = 200  # ops in profile()'s chain: enough that the chain's own start and end vanish
_CPU_INTRA, _CPU_INTER = (2e9, 5e-5), (1.25e9, 1e-4)  # shared memory / loopback; 10 GbE


def default_axis_names(shape) -> tuple[str, ...]:
    """Conventional axis names for a mesh of 1 to 4 axes, outermost first."""
    try:
        return _DEFAULT_AXIS_NAMES[len(shape)]
    except KeyError:
        raise MeshError(f"no default axis names for a {len(shape)}-axis mesh {tuple(shape)}; "
                        f"pass axis_names explicitly") from None


@dataclass(frozen=True)
class ClusterSpec:
    """A homogeneous cluster: ``num_devices`` devices, ``devices_per_node`` to a node.

    ``mesh_shape``/``axis_names`` pin the device mesh; left as None, the planner chooses among
    ``mesh_candidates()``. Construct through ``preset``, ``from_env`` or ``local_cpu`` unless you
    have your own figures. Invalid sizes raise MeshError; invalid figures raise ValueError.
    """

    num_devices: int
    devices_per_node: int
    device: DeviceSpec
    intra_node_bandwidth: float
    intra_node_latency: float
    inter_node_bandwidth: float
    inter_node_latency: float
    mesh_shape: tuple[int, ...] | None = None
    axis_names: tuple[str, ...] | None = None
    device_type: str = "cuda"
    name: str = ""
    # None means the per-device-type default fraction of device.memory (see the module docstring).
    memory_reserve: float | None = None
    host_memory: float | None = None            # host RAM per node, bytes
    host_link_bandwidth: float | None = None    # device <-> host, per device and direction, B/s
    host_memory_bandwidth: float | None = None  # host RAM bandwidth per node, B/s

    def __post_init__(self):
        set_ = lambda k, v: object.__setattr__(self, k, v)  # noqa: E731 - frozen dataclass
        for what in ("num_devices", "devices_per_node"):
            value = getattr(self, what)
            if not _is_int(value) or value < 1:
                raise MeshError(f"{what} must be an integer >= 1, got {value!r}")
        if not isinstance(self.device, DeviceSpec):
            raise ValueError(f"device must be a DeviceSpec, got {type(self.device).__name__}")
        for what in ("intra_node_bandwidth", "inter_node_bandwidth"):
            set_(what, _positive(what, getattr(self, what)))
        for what in ("intra_node_latency", "inter_node_latency"):
            set_(what, _positive(what, getattr(self, what), allow_zero=True))
        if not isinstance(self.device_type, str) or self.device_type not in _RESERVE_FRACTION:
            raise ValueError(f"device_type must be 'cuda' or 'cpu', got {self.device_type!r}")
        if not isinstance(self.name, str):
            raise ValueError(f"name must be a string, got {self.name!r}")
        reserve = self.memory_reserve
        if reserve is None:
            reserve = _RESERVE_FRACTION[self.device_type] * self.device.memory
        reserve = _positive("memory_reserve", reserve, allow_zero=True)
        if reserve >= self.device.memory:
            raise ValueError(f"memory_reserve {reserve:.3g} B leaves nothing of the device's "
                             f"{self.device.memory:.3g} B; lower it")
        set_("memory_reserve", reserve)
        for what in _HOST_FIELDS:
            if getattr(self, what) is not None:
                set_(what, _positive(what, getattr(self, what)))
        self._validate_mesh()

    def _validate_mesh(self):
        shape, names = self.mesh_shape, self.axis_names
        if shape is None:
            if names is not None:
                raise MeshError(f"axis_names {names!r} given without a mesh_shape; pass "
                                f"mesh_shape too, or drop axis_names")
            return
        if not isinstance(shape, (tuple, list)):
            raise MeshError(f"mesh_shape must be a tuple of integers, got {shape!r}")
        shape = tuple(shape)
        if not shape or any(not _is_int(s) or s < 1 for s in shape):
            raise MeshError(f"mesh shape {shape} must be a non-empty tuple of integers >= 1")
        if math.prod(shape) != self.num_devices:
            raise MeshError(f"mesh shape {shape} multiplies to {math.prod(shape)} but the cluster has "
                            f"{self.num_devices} devices; pick sizes whose product is "
                            f"{self.num_devices}, e.g. "
                            f"{' or '.join(map(str, _node_aligned_shapes(self.num_devices, self.devices_per_node, 2)[-2:]))}")
        object.__setattr__(self, "mesh_shape", shape)
        if names is None:
            return
        if not isinstance(names, (tuple, list)):
            raise MeshError(f"axis_names must be a tuple of strings, got {names!r}")
        names = tuple(names)
        if len(names) != len(shape):
            raise MeshError(f"{len(names)} axis names {names} for the {len(shape)}-axis mesh "
                            f"{shape}; give one name per axis")
        if any(not isinstance(n, str) or not n for n in names) or len(set(names)) != len(names):
            raise MeshError(f"axis names {names} must be unique non-empty strings")
        object.__setattr__(self, "axis_names", names)

    # ---- derived figures -------------------------------------------------------------------------

    @property
    def num_nodes(self) -> int:
        return -(-self.num_devices // self.devices_per_node)

    @property
    def usable_memory(self) -> float:
        """Bytes per device the planner may fill: capacity minus ``memory_reserve``."""
        return self.device.memory - self.memory_reserve

    default_axis_names = staticmethod(default_axis_names)

    @property
    def host_is_device(self) -> bool:
        """Host and device are the same memory (CPU processes): offload frees nothing."""
        return self.device_type == "cpu"

    @property
    def has_host_figures(self) -> bool:
        return all(getattr(self, f) is not None for f in _HOST_FIELDS)

    def require_host_figures(self, why: str) -> None:
        """Raise ClusterMismatchError naming the host figures ``why`` needs and this spec lacks."""
        missing = [f for f in _HOST_FIELDS if getattr(self, f) is None]
        if missing:
            raise ClusterMismatchError(
                f"{why} needs the host's figures, and cluster {self.name or self.device.name!r} has no "
                f"{', '.join(missing)}; give them to ClusterSpec (bytes per node, B/s per device and "
                f"direction, B/s per node), e.g. dataclasses.replace(spec, host_memory=2e12, "
                f"host_link_bandwidth=55e9, host_memory_bandwidth=614e9) for a DGX H100 node")

    def axis_link(self, mesh_shape, axis: int) -> tuple[float, float]:
        """(bandwidth B/s, latency s) of the links a collective over mesh axis ``axis`` uses.

        With node-major ranks and a row-major mesh, the devices of one group along ``axis`` span
        ``prod(mesh_shape[axis:])`` consecutive ranks; the group stays inside a node iff that span
        fits in a node and tiles it. Otherwise the group crosses the network, its slowest link.
        """
        shape = tuple(mesh_shape)
        if math.prod(shape) != self.num_devices:
            raise MeshError(f"mesh shape {shape} multiplies to {math.prod(shape)} but the cluster has "
                            f"{self.num_devices} devices")
        if not -len(shape) <= axis < len(shape):
            raise MeshError(f"axis {axis} out of range for the {len(shape)}-axis mesh {shape}")
        span = math.prod(shape[axis:])
        if span <= self.devices_per_node and self.devices_per_node % span == 0:
            return self.intra_node_bandwidth, self.intra_node_latency
        return self.inter_node_bandwidth, self.inter_node_latency

    def mesh_candidates(self, max_axes: int = 2) -> list[tuple[int, ...]]:
        """Mesh shapes for the planner to try, outermost axis first.

        ``[mesh_shape]`` when it is pinned. Otherwise ``(N,)`` and every shape ``(N // p, *inner)``
        with up to ``max_axes - 1`` inner axes of size > 1 whose product ``p`` divides both the node
        size and N (and is < N): inner axes (tensor, context parallel) stay inside a node, the
        outermost axis takes the rest. For ``max_axes=2`` that is ``(N // k, k)``, k ascending.
        """
        if self.mesh_shape is not None:
            return [self.mesh_shape]
        if not _is_int(max_axes) or max_axes < 1:
            raise ValueError(f"max_axes must be an integer >= 1, got {max_axes!r}")
        return _node_aligned_shapes(self.num_devices, self.devices_per_node, max_axes)

    # ---- constructors ----------------------------------------------------------------------------

    @classmethod
    def preset(cls, name: str, *, mesh_shape=None, axis_names=None) -> "ClusterSpec":
        """A cluster of ``"NxDEVICE"`` (case-insensitive), DEVICE one of H100, H200, A100
        (= A100-80GB) or A100-40GB, in nodes of 8 (or N when N < 8)."""
        valid = ", ".join(f"'Nx{d}'" for d in [*_PRESETS, *_PRESET_ALIASES])
        m = _PRESET_RE.match(name) if isinstance(name, str) else None
        key = m and m.group(2).upper()
        key = _PRESET_ALIASES.get(key, key)
        if not m or key not in _PRESETS or int(m.group(1)) < 1:
            raise ValueError(f"unknown cluster preset {name!r}; use {valid} with N >= 1, "
                             f"e.g. '8xH100' or '64xA100'")
        n = int(m.group(1))
        device, nvlink, network = _PRESETS[key]
        return cls(n, min(_GPUS_PER_NODE, n), device, nvlink, _GPU_INTRA_LATENCY, network,
                   _GPU_INTER_LATENCY, mesh_shape=mesh_shape, axis_names=axis_names,
                   device_type="cuda", name=f"{n}x{key}", **dict(zip(_HOST_FIELDS, _HOST[key])))

    @classmethod
    def local_cpu(cls, world_size: int) -> "ClusterSpec":
        """``world_size`` gloo processes on this machine, one node. The compute and link figures are
        rough guesses for one process; call ``profile()`` under the process group to measure them."""
        if not _is_int(world_size) or world_size < 1:
            raise MeshError(f"world_size must be an integer >= 1, got {world_size!r}")
        return cls._cpu(world_size, world_size)

    @classmethod
    def _cpu(cls, world_size: int, local_world_size: int) -> "ClusterSpec":
        device = DeviceSpec("cpu", {"float32": _CPU_FLOPS}, _CPU_MEMORY_BANDWIDTH,
                            _total_ram() / local_world_size)
        # Host and device are one memory: a forced offload is a copy at memory bandwidth.
        return cls(world_size, local_world_size, device, *_CPU_INTRA, *_CPU_INTER,
                   device_type="cpu", name=f"{world_size}xcpu", host_memory=_total_ram(),
                   host_link_bandwidth=_CPU_MEMORY_BANDWIDTH, host_memory_bandwidth=_CPU_MEMORY_BANDWIDTH)

    @classmethod
    def from_env(cls) -> "ClusterSpec":
        """The cluster this process runs in, under torchrun or an initialized process group.

        Initializes the default group from torchrun's environment variables when needed (nccl when
        CUDA is available, else gloo); under ``torchrun --max-restarts`` each restart's group keys are
        its own, so a restarted rank never reads a dead rank's address. Known GPUs (H100, H200, A100 in the device name) get their
        preset figures, other GPUs rough generic ones; the memory is the device's real capacity.
        ``devices_per_node`` is ``LOCAL_WORLD_SIZE``.
        """
        import torch
        import torch.distributed as dist

        if not dist.is_initialized():
            if "WORLD_SIZE" not in os.environ:
                raise ClusterMismatchError(
                    "no process group and no torchrun environment (WORLD_SIZE unset); launch with "
                    "torchrun, initialize torch.distributed first, or use ClusterSpec.preset/local_cpu")
            if torch.cuda.is_available():
                torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", 0)))
            _init_default_group("nccl" if torch.cuda.is_available() else "gloo")
        world = dist.get_world_size()
        cuda = torch.cuda.is_available() and dist.get_backend() != "gloo"
        default_local = min(world, torch.cuda.device_count()) if cuda else world
        local = int(os.environ.get("LOCAL_WORLD_SIZE", default_local))
        if not cuda:
            return cls._cpu(world, local)
        gpu = torch.cuda.get_device_name()
        memory = float(torch.cuda.get_device_properties(torch.cuda.current_device()).total_memory)
        key = next((k for k in ("H200", "H100", "A100") if k in gpu.upper()), None)
        if key == "A100" and "40GB" in gpu.upper():
            key = "A100-40GB"
        host = {}
        if key is not None:
            device, nvlink, network = _PRESETS[key]
            intra, inter = (nvlink, _GPU_INTRA_LATENCY), (network, _GPU_INTER_LATENCY)
            host = dict(zip(_HOST_FIELDS, _HOST[key]), host_memory=_total_ram())
        else:
            g = _GENERIC_GPU
            device = DeviceSpec(gpu, g["flops"], g["memory_bandwidth"], memory)
            intra, inter = g["intra"], g["inter"]
        return cls(world, local, dataclasses.replace(device, memory=memory), *intra, *inter,
                   device_type="cuda", name=f"{world}x{key or gpu}", **host)

    # ---- measurement -----------------------------------------------------------------------------

    def profile(self, group=None, *, sizes: tuple[int, int] | None = None) -> "ClusterSpec":
        """This spec with figures measured on the live process group ``group`` (default: world).

        Measures matmul FLOP/s (fp32, plus bf16 on CUDA, whose figure float16 shares), memory
        bandwidth (a large copy), the per-op overhead (a chain of multiplies of a 16-element tensor
        under autograd, forward and backward, over three op shares each: one forward, two backward, as
        the cost model prices it) and all-reduce time at two message sizes ``sizes`` (bytes; default
        4 KiB and 16 MiB on CPU, 256 MiB on CUDA). The small size gives the latency alpha, the large
        one the bandwidth beta from the ring formula ``t = alpha + 2(n-1)/n * B / beta``. On more than
        one rank, the communication contention (``DeviceSpec.comm_contention``): a chain of the
        matmuls above about twice as long as the large all-reduce, the all-reduce, and the all-reduce
        issued asynchronously with the chain run beside it (``overlap_contention``); and the peer wait
        (``DeviceSpec.peer_wait``): a small all-reduce issued after about 5 ms of matmuls, the median of
        24 rounds of the ranks' mean wait, less the latency. Every time
        is the max over ranks, so all ranks return the same spec. The link measured is the group's
        slowest: intra-node when the cluster is one node, inter-node otherwise. fp32 matmuls run
        under the process's TF32 setting (off by default), as the model's matmuls will.
        """
        import torch
        import torch.distributed as dist

        if not dist.is_initialized():
            raise ClusterMismatchError("profile() needs an initialized process group; call "
                                       "torch.distributed.init_process_group (or run under torchrun)")
        world = dist.get_world_size(group)
        if world != self.num_devices:
            raise ClusterMismatchError(f"the process group has {world} ranks but the ClusterSpec "
                                       f"{self.name or ''} has {self.num_devices} devices; profile "
                                       f"a spec of {world} devices")
        cuda = self.device_type == "cuda"
        if cuda and not torch.cuda.is_available():
            raise ClusterMismatchError("the ClusterSpec is for CUDA devices but CUDA is not "
                                       "available in this process")
        dev = torch.device("cuda", torch.cuda.current_device()) if cuda else torch.device("cpu")
        sync = torch.cuda.synchronize if cuda else (lambda: None)
        small, large = sizes or (4096, (256 if cuda else 16) << 20)
        mm_n, copy_bytes = (8192, 1 << 30) if cuda else (1024, 64 << 20)

        def timed(fn, reps=3):
            fn()  # warm-up: allocator, kernels, communicator setup
            sync()
            best = math.inf  # the best run is the one least disturbed by other processes
            for _ in range(reps):
                t0 = time.perf_counter()
                fn()
                sync()
                best = min(best, time.perf_counter() - t0)
            return best

        def op_overhead():
            x = torch.ones(16, device=dev, requires_grad=True)
            c = torch.ones(16, device=dev)

            def chain():
                y = x
                for _ in range(_OVERHEAD_CHAIN):
                    y = y * c
                y.sum().backward()
            return timed(chain, reps=5) / (3 * _OVERHEAD_CHAIN)

        def matmul_time(dtype):
            a = torch.randn(mm_n, mm_n, device=dev, dtype=dtype)
            b = torch.randn(mm_n, mm_n, device=dev, dtype=dtype)
            return timed(lambda: torch.mm(a, b))

        # Collectives first: busy-waiting OpenMP workers left over from the matmuls would steal the
        # cores that gloo's threads need and inflate the latency several-fold.
        times = []
        for nbytes, reps in ((small, 20), (large, 3)):
            buf = torch.zeros(max(1, nbytes // 4), device=dev)
            dist.barrier(group)
            times.append(timed(lambda: dist.all_reduce(buf, group=group), reps))
        # Compute phases start together: ranks sharing a machine contend as they will in training.
        dist.barrier(group)
        times += [matmul_time(torch.float32), matmul_time(torch.bfloat16) if cuda else 0.0]
        src = torch.empty(copy_bytes // 4, device=dev)
        dst = torch.empty_like(src)
        times.append(timed(lambda: dst.copy_(src)))
        times.append(op_overhead())
        t = torch.tensor(times, dtype=torch.float64, device=dev)
        dist.all_reduce(t, op=dist.ReduceOp.MAX, group=group)
        t_small, t_large, t_fp32, t_bf16, t_copy, t_op = t.tolist()
        # One rank: nothing to overlap and no peer to wait for, keep the figures.
        contention, peer_wait = self.device.comm_contention, self.device.peer_wait
        if world > 1:
            # The chain runs about twice the all-reduce (from times every rank has), so the all-reduce
            # can hide whole behind it.
            a = torch.randn(mm_n, mm_n, device=dev)
            reps = max(1, math.ceil(2 * t_large / t_fp32))

            def chain():
                for _ in range(reps):
                    torch.mm(a, a)
            buf = torch.zeros(large // 4, device=dev)

            def both():
                work = dist.all_reduce(buf, group=group, async_op=True)
                chain()
                work.wait()
            best = [math.inf] * 3
            # Interleaved, so that drift in other processes' load falls on the three alike; the ranks
            # start each together.
            for _ in range(8):
                for k, fn in enumerate((chain, lambda: dist.all_reduce(buf, group=group), both)):
                    dist.barrier(group)
                    t0 = time.perf_counter()
                    fn()
                    sync()
                    best[k] = min(best[k], time.perf_counter() - t0)
            t = torch.tensor(best, dtype=torch.float64, device=dev)
            dist.all_reduce(t, op=dist.ReduceOp.MAX, group=group)
            contention = overlap_contention(*t.tolist())
            # The peer wait: a small all-reduce issued after a few milliseconds of matmuls run on every
            # rank from a common start, as a step's collectives follow its compute. The first rank to
            # arrive waits the skew and the last only the latency, and the step pays the skew once: a
            # round's figure is the mean over ranks, the spec's the median round less the latency.
            b = torch.randn(mm_n // 4, mm_n // 4, device=dev)
            segment = max(1, math.ceil(_PEER_WAIT_SEGMENT / (t_fp32 / 64)))     # 1/64 of the big matmul's FLOPs
            small_buf = torch.zeros(max(1, small // 4), device=dev)
            waits = []
            for _ in range(_PEER_WAIT_ROUNDS):
                dist.barrier(group)
                for _ in range(segment):
                    torch.mm(b, b)
                sync()
                t0 = time.perf_counter()
                dist.all_reduce(small_buf, group=group)
                sync()
                waits.append(time.perf_counter() - t0)
            w = torch.tensor(waits, dtype=torch.float64, device=dev)
            dist.all_reduce(w, group=group)
            peer_wait = max(0.0, sorted(w.tolist())[len(waits) // 2] / world - t_small)

        mm_flops = 2.0 * mm_n**3
        flops = {"float32": mm_flops / t_fp32}
        if cuda:
            flops["bfloat16"] = flops["float16"] = mm_flops / t_bf16
        device = dataclasses.replace(self.device, flops=flops, op_overhead=t_op, comm_contention=contention,
                                     peer_wait=peer_wait, memory_bandwidth=2.0 * copy_bytes / t_copy)  # read + write
        if world == 1:  # an all-reduce over one rank moves nothing: keep the link figures
            return dataclasses.replace(self, device=device)
        ring = 2.0 * (world - 1) / world
        latency = t_small
        # A large message under twice the small one's time means the difference is mostly noise:
        # charge all of it to bandwidth, which errs low.
        transfer = t_large - latency if t_large > 2 * latency else t_large
        bandwidth = ring * large / transfer
        link = ({"intra_node_bandwidth": bandwidth, "intra_node_latency": latency}
                if self.num_nodes == 1 else
                {"inter_node_bandwidth": bandwidth, "inter_node_latency": latency})
        return dataclasses.replace(self, device=device, **link)

    # ---- serialization ---------------------------------------------------------------------------

    def to_dict(self) -> dict:
        """A JSON-serializable dict; ``from_dict`` rebuilds an equal spec."""
        d = {f.name: getattr(self, f.name) for f in dataclasses.fields(self)}
        d["device"] = self.device.to_dict()
        for key in ("mesh_shape", "axis_names"):
            d[key] = None if d[key] is None else list(d[key])
        return d

    @classmethod
    def from_dict(cls, d: Mapping) -> "ClusterSpec":
        """Inverse of ``to_dict``. Missing, unknown or ill-typed entries raise PlanFormatError."""
        if isinstance(d, Mapping):                        # specs saved before host figures existed
            d = {**{f: None for f in _HOST_FIELDS}, **d}
        _check_keys("cluster spec", d, {f.name for f in dataclasses.fields(cls)})
        if isinstance(d["device"], Mapping):              # saved before these terms existed: none priced
            d = {**d, "device": {"op_overhead": 0.0, "comm_contention": 0.0, "peer_wait": 0.0, **d["device"]}}
        _check_keys("cluster spec 'device'", d["device"],
                    {f.name for f in dataclasses.fields(DeviceSpec)})
        try:
            return cls(**{**d, "device": DeviceSpec(**d["device"])})
        except (ValueError, MeshError) as e:
            raise PlanFormatError(f"invalid cluster spec: {e}") from e

    def __str__(self) -> str:
        dev = self.device
        mesh = ""
        if self.mesh_shape is not None:
            mesh = f"; mesh {self.mesh_shape}" + (f" {self.axis_names}" if self.axis_names else "")
        return (f"{self.name or f'{self.num_devices}x{dev.name}'}: {self.num_devices} {self.device_type} "
                f"devices in {self.num_nodes} node{'s' * (self.num_nodes > 1)} of {self.devices_per_node}; {dev.name} "
                f"{dev.peak_flops('bfloat16') / 1e12:.3g} TFLOP/s bf16, "
                f"{dev.peak_flops('float32') / 1e12:.3g} TFLOP/s fp32, "
                f"{dev.memory_bandwidth / 1e12:.3g} TB/s, {dev.op_overhead * 1e6:.3g} us/op, "
                f"comm contention {dev.comm_contention:.2f}, peer wait {dev.peer_wait * 1e3:.3g} ms, "
                f"{dev.memory / 1e9:.3g} GB "
                f"({self.memory_reserve / 1e9:.3g} GB reserved); "
                f"intra-node {self.intra_node_bandwidth / 1e9:.3g} GB/s {self.intra_node_latency * 1e6:.3g} us, "
                f"inter-node {self.inter_node_bandwidth / 1e9:.3g} GB/s {self.inter_node_latency * 1e6:.3g} us"
                + (f"; host {self.host_memory / 1e9:.4g} GB per node, link {self.host_link_bandwidth / 1e9:.3g} GB/s"
                   if self.has_host_figures else "; no host figures")
                + mesh)


def overlap_contention(compute: float, collective: float, both: float) -> float:
    """``DeviceSpec.comm_contention`` from three times: a compute alone, a collective alone, and the
    collective issued asynchronously with the compute run beside it. Overlapped whole and for free, both
    take the longer of the two; each second beyond it is a second of the shorter one that overlapping
    did not save. Clamped to [0, 1]: timing noise can put ``both`` a little outside the two bounds."""
    shorter = min(compute, collective)
    if shorter <= 0:
        return 0.0
    return min(1.0, max(0.0, (both - max(compute, collective)) / shorter))


def _node_aligned_shapes(n: int, per_node: int, max_axes: int) -> list[tuple[int, ...]]:
    """``(n,)``, then ``(n // p, *inner)`` for inner factors > 1 whose product p < n divides both n
    and ``per_node``, by number of axes and then lexicographically."""

    def inner_shapes(limit: int, depth: int):
        # ordered factorizations of the divisors of `limit` into `depth` factors > 1
        if depth == 0:
            yield ()
            return
        for k in range(2, limit + 1):
            if limit % k == 0:
                yield from ((k, *rest) for rest in inner_shapes(limit // k, depth - 1))

    shapes = [(n,)]
    for depth in range(1, max_axes):
        shapes += [(n // math.prod(t), *t) for t in inner_shapes(math.gcd(n, per_node), depth)
                   if math.prod(t) < n]
    return shapes


def _check_keys(what: str, d: Any, expected: set[str]) -> None:
    if not isinstance(d, Mapping):
        raise PlanFormatError(f"{what} must be a JSON object, got {type(d).__name__}")
    missing, unknown = expected - set(d), set(d) - expected
    if missing or unknown:
        raise PlanFormatError(f"{what}: missing keys {sorted(missing)}, unknown keys "
                              f"{sorted(map(str, unknown))}; expected {sorted(expected)}")


def _total_ram() -> float:
    """Physical memory of this machine in bytes (POSIX; 16 GB where sysconf is unavailable)."""
    try:
        return float(os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES"))
    except (AttributeError, ValueError, OSError):
        return 16e9


def _init_default_group(backend: str) -> None:
    """``init_process_group`` from torchrun's environment, with the group's store keys prefixed by the
    restart count. torchrun keeps one store across restarts; without the prefix a restarted rank can
    read the address a rank of the failed attempt published and wait on a closed port until the group
    times out."""
    import torch.distributed as dist

    restart = os.environ.get("TORCHELASTIC_RESTART_COUNT")
    if restart is None:
        dist.init_process_group(backend)
        return
    store, rank, world = next(dist.rendezvous("env://"))
    dist.init_process_group(backend, store=dist.PrefixStore(f"autopar/attempt_{restart}/", store),
                            rank=rank, world_size=world)
