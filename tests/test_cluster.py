import dataclasses
import json
import math
import os
import socket

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from autopar.cluster import ClusterSpec, DeviceSpec, default_axis_names, overlap_contention
from autopar.errors import ClusterMismatchError, MeshError, PlanFormatError
from tests.distributed_utils import START_METHOD


@pytest.mark.parametrize("name,devices,per_node,nodes", [
    ("1xH100", 1, 1, 1), ("8xH100", 8, 8, 1), ("64xH100", 64, 8, 8),
    ("512xH100", 512, 8, 64), ("1024xh100", 1024, 8, 128), ("6xH100", 6, 6, 1),
])
def test_preset_sizes(name, devices, per_node, nodes):
    c = ClusterSpec.preset(name)
    assert (c.num_devices, c.devices_per_node, c.num_nodes) == (devices, per_node, nodes)
    assert c.name == f"{devices}xH100" and c.device_type == "cuda"
    assert c.device.peak_flops("bfloat16") == 989e12 and c.device.peak_flops("float32") == 67e12
    assert (c.device.memory_bandwidth, c.device.memory) == (3.35e12, 80e9)
    assert (c.intra_node_bandwidth, c.inter_node_bandwidth) == (450e9, 50e9)
    assert (c.intra_node_latency, c.inter_node_latency) == (5e-6, 1e-5)
    assert c.memory_reserve == pytest.approx(8e9) and c.usable_memory == pytest.approx(72e9)


def test_other_presets():
    a100 = ClusterSpec.preset("8xA100")
    assert a100.name == "8xA100" and a100.num_nodes == 1
    assert a100.device.flops == {"float32": 19.5e12, "bfloat16": 312e12, "float16": 312e12}
    assert (a100.device.memory_bandwidth, a100.device.memory) == (2.039e12, 80e9)
    assert (a100.intra_node_bandwidth, a100.inter_node_bandwidth) == (300e9, 25e9)
    assert ClusterSpec.preset("8xA100-80GB").device == a100.device
    a40 = ClusterSpec.preset("16xa100-40gb")
    assert (a40.name, a40.num_nodes, a40.device.memory) == ("16xA100-40GB", 2, 40e9)
    h200 = ClusterSpec.preset("8xH200")
    assert (h200.device.memory_bandwidth, h200.device.memory) == (4.8e12, 141e9)
    assert h200.device.peak_flops("bf16") == 989e12 and h200.num_nodes == 1


@pytest.mark.parametrize("bad", ["H100", "8xV100", "0xH100", "x8H100", "8 H100", "", 8])
def test_bad_preset_names(bad):
    with pytest.raises(ValueError, match="NxH100.*NxA100-40GB"):
        ClusterSpec.preset(bad)


def test_peak_flops_dtype_spellings():
    d = ClusterSpec.preset("8xH100").device
    for spelling in (torch.bfloat16, "torch.bfloat16", "bf16", "bfloat16", torch.float16, "half"):
        assert d.peak_flops(spelling) == 989e12
    for spelling in (torch.float32, "fp32", "float", torch.float64, "int8", "float8_e4m3fn"):
        assert d.peak_flops(spelling) == 67e12


def test_mesh_shape_must_multiply_to_device_count():
    with pytest.raises(MeshError, match=r"\(3, 2\) multiplies to 6 but the cluster has 8 devices"):
        ClusterSpec.preset("8xH100", mesh_shape=(3, 2))
    with pytest.raises(MeshError, match="multiplies to 32 .* 64 devices; .* product is 64"):
        ClusterSpec.preset("64xH100", mesh_shape=[4, 8])


@pytest.mark.parametrize("kwargs,pattern", [
    (dict(mesh_shape=(2, 4), axis_names=("dp",)), "1 axis names .* 2-axis mesh"),
    (dict(mesh_shape=(2, 4), axis_names=("dp", "dp")), "unique"),
    (dict(axis_names=("dp", "tp")), "without a mesh_shape"),
    (dict(mesh_shape=(8, 0)), ">= 1"),
    (dict(mesh_shape=(-2, -4)), ">= 1"),
    (dict(mesh_shape=()), "non-empty"),
    (dict(mesh_shape="8"), "tuple of integers"),
])
def test_mesh_validation(kwargs, pattern):
    with pytest.raises(MeshError, match=pattern):
        ClusterSpec.preset("8xH100", **kwargs)


def test_size_and_figure_validation():
    base = ClusterSpec.preset("8xH100")
    with pytest.raises(MeshError, match="num_devices must be an integer >= 1, got 0"):
        ClusterSpec(0, 8, base.device, 1e9, 0.0, 1e9, 0.0)
    with pytest.raises(MeshError, match="devices_per_node .* got 0"):
        ClusterSpec(8, 0, base.device, 1e9, 0.0, 1e9, 0.0)
    with pytest.raises(ValueError, match="intra_node_bandwidth must be a finite number > 0"):
        ClusterSpec(8, 8, base.device, 0.0, 0.0, 1e9, 0.0)
    with pytest.raises(ValueError, match="memory_reserve .* leaves nothing"):
        ClusterSpec(8, 8, base.device, 1e9, 0.0, 1e9, 0.0, memory_reserve=80e9)
    with pytest.raises(ValueError, match="'float32' entry"):
        DeviceSpec("x", {"bfloat16": 1e12}, 1e12, 1e9)


def test_pinned_mesh_is_normalized_and_hashable():
    c = ClusterSpec.preset("8xH100", mesh_shape=[4, 2], axis_names=["dp", "tp"])
    assert c.mesh_shape == (4, 2) and c.axis_names == ("dp", "tp")
    assert c.mesh_candidates() == [(4, 2)]
    assert hash(c) == hash(ClusterSpec.preset("8xH100", mesh_shape=(4, 2), axis_names=("dp", "tp")))
    assert "mesh (4, 2) ('dp', 'tp')" in str(c)


def test_axis_link_intra_vs_inter():
    c = ClusterSpec.preset("64xH100")
    intra, inter = (450e9, 5e-6), (50e9, 1e-5)
    assert c.axis_link((8, 8), 1) == intra and c.axis_link((8, 8), -1) == intra
    assert c.axis_link((8, 8), 0) == inter
    assert c.axis_link((64,), 0) == inter
    assert [c.axis_link((4, 2, 8), a) for a in range(3)] == [inter, inter, intra]
    assert [c.axis_link((16, 2, 2), a) for a in range(3)] == [inter, intra, intra]
    assert c.axis_link((2, 32), 1) == inter  # 32 consecutive ranks span 4 nodes
    assert ClusterSpec.preset("8xH100").axis_link((8,), 0) == intra
    with pytest.raises(MeshError, match="multiplies to 32"):
        c.axis_link((4, 8), 0)
    with pytest.raises(MeshError, match="axis 2 out of range"):
        c.axis_link((8, 8), 2)


def test_mesh_candidates():
    assert ClusterSpec.preset("8xH100").mesh_candidates() == [(8,), (4, 2), (2, 4)]
    assert ClusterSpec.preset("64xH100").mesh_candidates() == [(64,), (32, 2), (16, 4), (8, 8)]
    assert ClusterSpec.preset("1024xH100").mesh_candidates() == [
        (1024,), (512, 2), (256, 4), (128, 8)]
    assert ClusterSpec.preset("6xH100").mesh_candidates() == [(6,), (3, 2), (2, 3)]
    assert ClusterSpec.preset("1xH100").mesh_candidates() == [(1,)]
    assert ClusterSpec.preset("8xH100").mesh_candidates(max_axes=1) == [(8,)]
    assert ClusterSpec.preset("64xH100").mesh_candidates(max_axes=3)[4:] == [
        (16, 2, 2), (8, 2, 4), (8, 4, 2)]
    # 12 GPUs in nodes of 8: inner axes must divide both 12 and 8
    assert ClusterSpec.preset("12xH100").mesh_candidates() == [(12,), (6, 2), (3, 4)]


def test_default_axis_names():
    assert default_axis_names((8,)) == ("dp",)
    assert ClusterSpec.default_axis_names((8, 8)) == ("dp", "tp")
    assert default_axis_names((2, 4, 8)) == ("dp", "cp", "tp")
    assert default_axis_names((2, 2, 2, 8)) == ("pp", "dp", "cp", "tp")
    with pytest.raises(MeshError, match="5-axis"):
        default_axis_names((2,) * 5)


@pytest.mark.parametrize("spec", [
    ClusterSpec.preset("64xH100"),
    ClusterSpec.preset("8xA100", mesh_shape=(2, 4), axis_names=("dp", "tp")),
    ClusterSpec.local_cpu(3),
])
def test_round_trip(spec):
    d = spec.to_dict()
    again = ClusterSpec.from_dict(json.loads(json.dumps(d)))
    assert again == spec and again.to_dict() == d and hash(again) == hash(spec)
    assert d["device"]["flops"]["float32"] == spec.device.flops["float32"]
    assert d["device"]["op_overhead"] == again.device.op_overhead == spec.device.op_overhead
    assert d["device"]["comm_contention"] == again.device.comm_contention == spec.device.comm_contention
    assert d["device"]["peer_wait"] == again.device.peer_wait == spec.device.peer_wait


def test_comm_contention_round_trips_and_is_a_fraction():
    spec = ClusterSpec.preset("8xH100")
    assert spec.device.comm_contention == 0.0          # the GPU default: NCCL hides whole
    contended = dataclasses.replace(spec, device=dataclasses.replace(spec.device, comm_contention=0.8))
    again = ClusterSpec.from_dict(json.loads(json.dumps(contended.to_dict())))
    assert again == contended and again.device.comm_contention == 0.8 and hash(again) != hash(spec)
    assert "comm contention 0.80" in str(again)
    for bad in (-0.1, 1.5, float("nan")):
        with pytest.raises(ValueError, match="comm_contention"):
            dataclasses.replace(spec.device, comm_contention=bad)


def test_peer_wait_round_trips_and_is_seconds():
    spec = ClusterSpec.preset("8xH100")
    assert spec.device.peer_wait == 0.0          # the GPU default: ranks reach a collective in step
    waiting = dataclasses.replace(spec, device=dataclasses.replace(spec.device, peer_wait=1.5e-3))
    again = ClusterSpec.from_dict(json.loads(json.dumps(waiting.to_dict())))
    assert again == waiting and again.device.peer_wait == 1.5e-3 and hash(again) != hash(spec)
    assert "peer wait 1.5 ms" in str(again)
    for bad in (-1e-6, float("inf"), "1ms"):
        with pytest.raises(ValueError, match="peer_wait"):
            dataclasses.replace(spec.device, peer_wait=bad)


@pytest.mark.parametrize("compute,collective,both,expected", [
    (10.0, 4.0, 10.0, 0.0),     # hidden whole, for free
    (10.0, 4.0, 14.0, 1.0),     # nothing saved: the sum
    (10.0, 4.0, 12.0, 0.5),     # half the collective's time still paid
    (4.0, 10.0, 12.0, 0.5),     # the collective the longer: the compute's time is what overlaps
    (10.0, 4.0, 9.5, 0.0),      # noise below the bound
    (10.0, 4.0, 15.0, 1.0),     # and above
])
def test_overlap_contention(compute, collective, both, expected):
    assert overlap_contention(compute, collective, both) == pytest.approx(expected)


def test_a_spec_saved_before_the_device_terms_loads_without_them():
    d = ClusterSpec.preset("8xH100").to_dict()
    del d["device"]["op_overhead"], d["device"]["comm_contention"], d["device"]["peer_wait"]
    loaded = ClusterSpec.from_dict(d).device
    assert loaded.op_overhead == 0.0 and loaded.comm_contention == 0.0 and loaded.peer_wait == 0.0


def _good_dict():
    return ClusterSpec.preset("8xH100", mesh_shape=(4, 2)).to_dict()


@pytest.mark.parametrize("mutate,pattern", [
    (lambda d: d.pop("num_devices"), r"missing keys \['num_devices'\]"),
    (lambda d: d.update(bogus=1), r"unknown keys \['bogus'\]"),
    (lambda d: d["device"].pop("flops"), r"'device': missing keys \['flops'\]"),
    (lambda d: d.update(device=[1, 2]), "must be a JSON object"),
    (lambda d: d.update(num_devices="8"), "num_devices must be an integer"),
    (lambda d: d.update(num_devices=8.0), "num_devices must be an integer"),
    (lambda d: d.update(mesh_shape=[3, 2]), "multiplies to 6"),
    (lambda d: d.update(mesh_shape="4x2"), "mesh_shape must be a tuple"),
    (lambda d: d.update(intra_node_bandwidth=None), "intra_node_bandwidth must be a finite"),
    (lambda d: d.update(inter_node_latency=True), "inter_node_latency must be a finite"),
    (lambda d: d["device"].update(flops={"float32": "fast"}), r"flops\['float32'\]"),
    (lambda d: d["device"].update(memory=-1), "memory must be a finite number > 0"),
    (lambda d: d["device"].update(op_overhead=-1e-6), "op_overhead must be a finite number >= 0"),
    (lambda d: d["device"].update(op_overhead="5us"), "op_overhead must be a finite number >= 0"),
    (lambda d: d.update(device_type="tpu"), "'cuda' or 'cpu'"),
    (lambda d: d.update(device_type=["cuda"]), "'cuda' or 'cpu'"),
    (lambda d: d.update(mesh_shape=None, axis_names=7), "axis_names 7 given without a mesh_shape"),
    (lambda d: d.update(axis_names=["dp", 3]), "unique non-empty strings"),
])
def test_from_dict_rejects_malformed(mutate, pattern):
    d = _good_dict()
    mutate(d)
    with pytest.raises(PlanFormatError, match=pattern):
        ClusterSpec.from_dict(d)


def test_from_dict_rejects_non_mapping():
    with pytest.raises(PlanFormatError, match="must be a JSON object, got list"):
        ClusterSpec.from_dict([])


def test_str_is_one_line():
    s = str(ClusterSpec.preset("64xH100"))
    assert "\n" not in s
    assert s.startswith("64xH100: 64 cuda devices in 8 nodes of 8; H100 989 TFLOP/s bf16")
    assert "80 GB (8 GB reserved)" in s and "inter-node 50 GB/s 10 us" in s


def test_local_cpu():
    c = ClusterSpec.local_cpu(2)
    ram = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    assert (c.num_devices, c.devices_per_node, c.num_nodes, c.device_type) == (2, 2, 1, "cpu")
    assert c.name == "2xcpu" and c.device.memory == pytest.approx(ram / 2)
    assert c.memory_reserve == pytest.approx(0.2 * ram / 2)
    assert c.device.peak_flops(torch.bfloat16) == c.device.peak_flops("float32") == 5e10
    assert c.axis_link((2,), 0) == (2e9, 5e-5)
    with pytest.raises(MeshError, match="world_size must be an integer >= 1, got 0"):
        ClusterSpec.local_cpu(0)


def test_profile_needs_a_process_group():
    assert not dist.is_initialized()
    with pytest.raises(ClusterMismatchError, match="initialized process group"):
        ClusterSpec.local_cpu(2).profile()


def test_from_env_outside_torchrun(monkeypatch):
    monkeypatch.delenv("WORLD_SIZE", raising=False)
    with pytest.raises(ClusterMismatchError, match="WORLD_SIZE unset"):
        ClusterSpec.from_env()


def _profile_worker(rank, world, port, queue):
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank),
                      WORLD_SIZE=str(world), LOCAL_RANK=str(rank), LOCAL_WORLD_SIZE=str(world))
    try:
        spec = ClusterSpec.from_env()  # initializes gloo from the torchrun-style variables
        # Figures no timing gives exactly: the profile's own must replace them.
        planted = dataclasses.replace(spec.device, comm_contention=0.5, peer_wait=0.5)
        measured = dataclasses.replace(spec, device=planted).profile()
        try:
            ClusterSpec.local_cpu(3).profile()
            mismatch = None
        except ClusterMismatchError as e:
            mismatch = str(e)
        queue.put((rank, spec.to_dict(), measured.to_dict(), mismatch))
    finally:
        dist.destroy_process_group()


def _free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_from_env_and_profile_on_two_gloo_ranks():
    # Forked from run_distributed's fork server, which has torch and autopar imported already.
    ctx = mp.get_context(START_METHOD)
    queue = ctx.SimpleQueue()
    mp.start_processes(_profile_worker, args=(2, _free_port(), queue), nprocs=2, join=True,
                       start_method=START_METHOD)
    results = sorted(queue.get() for _ in range(2))
    (_, env0, m0, err0), (_, env1, m1, _) = results
    assert env0 == env1
    assert (env0["num_devices"], env0["devices_per_node"], env0["device_type"]) == (2, 2, "cpu")
    assert m0 == m1, "every rank must return the same measured spec"
    measured = ClusterSpec.from_dict(m0)
    assert measured.to_dict() == m0
    figures = [measured.device.flops["float32"], measured.device.memory_bandwidth,
               measured.intra_node_bandwidth, measured.intra_node_latency, measured.device.op_overhead]
    assert all(math.isfinite(x) and x > 0 for x in figures), figures
    assert 1e8 < measured.device.flops["float32"] < 1e13  # a CPU core, within reason
    assert 1e-8 < measured.device.op_overhead < 1e-3      # an eager op: microseconds, not the default copied
    assert 0.0 <= measured.device.comm_contention <= 1.0 and measured.device.comm_contention != 0.5
    assert 0.0 <= measured.device.peer_wait < 0.1 and measured.device.peer_wait != 0.5   # milliseconds at most
    assert measured.device.flops.keys() == {"float32"}
    # one node: the inter-node figures and the capacity stay as given
    assert (measured.inter_node_bandwidth, measured.inter_node_latency) == (
        env0["inter_node_bandwidth"], env0["inter_node_latency"])
    assert measured.device.memory == env0["device"]["memory"]
    assert "2 ranks but the ClusterSpec 3xcpu has 3 devices" in err0
