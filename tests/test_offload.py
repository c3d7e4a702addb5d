"""Offload to host memory: optimizer states (ZeRO-Offload's pattern), chosen by the ILP per parameter,
and the saved activations of chosen layer instances, chosen per layer class with recompute.

Offline: the memory model moves an offloaded parameter's gradient, optimizer state and stepped copy
off the device, the cost model prices the host link and the host's Adam step, a cluster without host
figures refuses an offload request by naming what is missing, and a CPU cluster never offloads unless
pinned. On gloo ranks, offloaded plans (forced by pins: on CPU processes host and device are the same
memory, so the transfers are copies) train like eager training under the user's own AdamW, and their
measured peaks are within 10% of the predicted ones.
"""
from __future__ import annotations

import copy
import dataclasses

import pytest
import torch
from torch import nn

import autopar
from autopar.passes.costs import OptimizerSpec
from tests.distributed_utils import resumes_alike, run_distributed


class _Wide(nn.Module):
    def __init__(self):
        super().__init__()
        self.proj = nn.Linear(8192, 8192, bias=False)

    def forward(self, x):
        return self.proj(x).float().square().mean()


def _wide_plan(cluster, offload, zero=0):
    with torch.device("meta"):
        model = _Wide()
    x = torch.empty(64, 8192, device="meta")
    return autopar.plan(model, cluster, (x,), mesh_shape=(cluster.num_devices,), memory_budget=1e15, progress=False,
                        optimizer=OptimizerSpec(8.0), recompute=False,
                        pins={"proj.weight": {"output": ["R"], "offload": offload, "zero": zero}, "x": ["S(0)"],
                              "linear": {"inputs": [["S(0)"], ["R"]]}})


def test_offloaded_state_leaves_the_device_and_is_priced_by_the_host_link():
    """fp32 Adam on 8xH100, the weight replicated: offloaded, the device keeps the parameter alone
    (4 bytes a parameter of 16); the host holds the stepped copy, gradient and states; the optimizer
    step costs the gradient's download, the parameter's upload and the host's Adam at a node's share
    of host memory bandwidth."""
    cluster = autopar.ClusterSpec.preset("8xH100")
    psi = 8192 * 8192
    on, off = _wide_plan(cluster, False), _wide_plan(cluster, True)
    assert not on.offload and (on.memory["params"], on.memory["grads"], on.memory["optimizer"]) == \
        (4 * psi, 4 * psi, 8 * psi)
    assert (off.memory["params"], off.memory["grads"], off.memory["optimizer"]) == (4 * psi, 0, 0)
    assert off.offload == {"proj.weight": {"host_bytes": 16 * psi, "device_bytes_freed": 12 * psi}}
    assert off.memory["host"] == 16 * psi
    # No gradient outlives backward on the device: the optimizer step holds the parameter alone.
    at_step = [pt for pt in off.memory["timeline"] if pt["phase"] == "optimizer"][0]
    assert at_step["grads"] == 0 and at_step["optimizer"] == 0
    host_adam = (2 * 4 + 4 + 2 * 8) * psi / (cluster.host_memory_bandwidth / 8)
    assert off.breakdown["optimizer"] == pytest.approx((4 + 4) * psi / cluster.host_link_bandwidth + host_adam)
    assert on.breakdown["optimizer"] == pytest.approx(28 * psi / cluster.device.memory_bandwidth)
    text = off.summary()
    assert "offloaded to host memory" in text and "proj.weight" in text and "1.00 GiB" in text
    assert "host memory" in off.explain("proj.weight")


def test_offload_request_without_host_figures_names_them():
    cluster = dataclasses.replace(autopar.ClusterSpec.preset("8xH100"), host_memory=None, host_link_bandwidth=None)
    with pytest.raises(autopar.errors.ClusterMismatchError, match="host_memory, host_link_bandwidth"):
        _wide_plan(cluster, True)
    from autopar.models import GPT, GPTConfig

    gpt = GPT(GPTConfig(vocab_size=64, n_layer=2, n_head=2, d_model=16, d_ff=32, max_seq=16))
    ids = torch.zeros(8, 16, dtype=torch.long)
    with pytest.raises(autopar.errors.ClusterMismatchError, match="host_memory, host_link_bandwidth"):
        autopar.plan(gpt, cluster, (ids,), {"labels": ids.clone()}, recompute={"*": "offload"}, progress=False)
    # Without a request, such a cluster plans as before, offloading nothing.
    assert not _wide_plan(cluster, False).offload


@pytest.mark.parametrize("stage", [1, 2])
def test_offload_with_zero_1_or_2_is_refused_by_name(stage):
    """An offloaded optimizer state is not also sharded by ZeRO-1/2 (docs/cost-model.md): a pin asking
    for both names the parameter, the stage and what is not offered."""
    with pytest.raises(autopar.errors.ShardingError, match=f"proj.weight.*ZeRO-{stage}.*not with ZeRO-1/2"):
        _wide_plan(autopar.ClusterSpec.preset("8xH100"), True, zero=stage)


def test_host_memory_bounds_the_offloaded_states():
    """fp32 layers of width 4096 on one H100 under 75% of their free peak: offloading optimizer states
    is the cheapest saving, but with host memory for only 90% of those states the solver offloads
    less (fewer bytes, not necessarily fewer parameters) and recomputes a layer instead; with far
    less, no plan fits and the error says the host's memory is why."""
    from autopar.models import GPT, GPTConfig

    with torch.device("meta"):
        model = GPT(GPTConfig(vocab_size=1024, n_layer=4, n_head=32, d_model=4096, d_ff=16384, max_seq=1024))
    ids = torch.zeros(4, 1024, dtype=torch.long, device="meta")
    cluster = autopar.ClusterSpec.preset("1xH100")

    def plan(cluster, budget=None):
        return autopar.plan(model, cluster, (ids,), {"labels": ids.clone()}, progress=False, mesh_shape=(1,),
                            memory_budget=budget)

    # Under 80% the peak binds where recompute frees nothing (since an add's inputs share its output's
    # gradient, backward peaks lower): only offloading fits there, with or without the host's room.
    budget = 0.75 * plan(cluster).memory["peak"]
    roomy = plan(cluster, budget)
    assert roomy.offload and not roomy.recompute["layers"]
    small = dataclasses.replace(cluster, host_memory=0.9 * roomy.memory["host"])
    tight = plan(small, budget)
    assert tight.memory["host"] <= small.host_memory < roomy.memory["host"]
    assert tight.recompute["layers"] and tight.memory["peak"] <= budget
    with pytest.raises(autopar.InfeasiblePlanError, match="more than the node's .* GB \\(host_memory\\)"):
        plan(dataclasses.replace(cluster, host_memory=0.3 * roomy.memory["host"]), budget)


def test_cluster_host_figures_round_trip_and_old_specs_load():
    c = autopar.ClusterSpec.preset("8xH100")
    assert (c.host_memory, c.host_link_bandwidth, c.host_memory_bandwidth) == (2e12, 55e9, 614e9)
    assert autopar.ClusterSpec.from_dict(c.to_dict()) == c
    old = {k: v for k, v in c.to_dict().items() if not k.startswith("host_")}
    assert not autopar.ClusterSpec.from_dict(old).has_host_figures


def test_cpu_cluster_never_offloads_unless_pinned():
    """On CPU processes the host is the device's memory: offload frees nothing and costs copies, so
    the planner does not offer it even under a budget too small for the plain plan; a pin forces it,
    and the plan then counts the host copies on the device."""
    from tests.memory_cases import build

    model, args, kwargs = build("gpt2", 32, 4, "cpu")
    cluster = autopar.ClusterSpec.local_cpu(2)
    plain = autopar.plan(model, cluster, args, kwargs, mesh_shape=(2,), recompute=False, progress=False)
    assert not plain.offload and "nothing offloaded: host and device are one memory" in plain.summary()
    with pytest.raises(autopar.InfeasiblePlanError) as e:
        autopar.plan(model, cluster, args, kwargs, mesh_shape=(2,), recompute=False, progress=False, memory_budget=1.0)
    smallest = e.value.min_feasible_budget
    assert smallest < plain.memory["peak"]
    budget = (smallest + plain.memory["peak"]) / 2       # below the plain plan's peak
    tight = autopar.plan(model, cluster, args, kwargs, mesh_shape=(2,), recompute=False, progress=False,
                         memory_budget=budget)
    assert not tight.offload and tight.memory["peak"] <= budget
    pins = {name: {"output": ["R"], "offload": True} for name, _ in model.named_parameters()}
    forced = autopar.plan(model, cluster, args, kwargs, mesh_shape=(2,), recompute=False, progress=False, pins=pins)
    assert set(forced.offload) == set(forced.params)
    assert all(v["device_bytes_freed"] == 0 for v in forced.offload.values())
    assert "nothing is freed" in forced.summary()
    from autopar.inspection.html import render_html

    html = render_html(forced)
    assert "Offloaded to host memory" in html and "optimizer states offloaded to host memory" in html


def test_llama2_70b_fits_one_h100_node_by_offloading():
    """LLaMA-2-70B, bf16-mixed (fp32 master weights, gradients and Adam states: 16 bytes a parameter),
    batch 8 x 4096 on one 8xH100 node, logits kept sharded: even fully sharded its states need about
    140 GB per device, beyond the 80 GB device; the plan fits the usable 72 GB by keeping optimizer
    states in host memory (within the node's 2 TB), and its summary says so."""
    from autopar import zoo

    model, args, kwargs = zoo.build("llama2-70b", batch=8, seq=4096)
    cluster = autopar.ClusterSpec.preset("8xH100")
    p = autopar.plan(model, cluster, args, kwargs, mesh_shape=(8,), sharded_outputs=True, precision="bf16-mixed",
                     progress=False)
    n = p.model["num_params"]
    assert 16 * n / 8 > cluster.device.memory
    assert p.offload and p.memory["peak"] <= cluster.usable_memory
    freed = sum(v["device_bytes_freed"] for v in p.offload.values())
    assert p.memory["params"] + p.memory["grads"] + p.memory["optimizer"] + freed == pytest.approx(16 * n / 8, rel=1e-2)
    assert p.memory["host"] * 8 <= cluster.host_memory
    assert "optimizer states offloaded to host memory" in p.summary()


def test_activation_offload_is_priced_by_the_link_and_chosen_where_it_beats_recompute():
    """fp32 layers of width 2048 on one H100 with a 450 GB/s host link (NVLink-C2C's figure): moving a
    layer's saved activations down and back costs less than its forward, so under a budget between
    keeping everything and offloading everything the solver offloads layers rather than recomputing
    them. Offloaded, a layer keeps at most what a recomputed one keeps on the device."""
    from autopar.models import GPT, GPTConfig

    with torch.device("meta"):
        model = GPT(GPTConfig(vocab_size=1024, n_layer=8, n_head=16, d_model=2048, d_ff=8192, max_seq=2048))
    ids = torch.zeros(8, 2048, dtype=torch.long, device="meta")
    cluster = dataclasses.replace(autopar.ClusterSpec.preset("1xH100"), host_link_bandwidth=450e9)

    def plan(**kw):
        return autopar.plan(model, cluster, (ids,), {"labels": ids.clone()}, progress=False, mesh_shape=(1,), **kw)

    free, rec, off = plan(recompute=False), plan(recompute={"*": "all"}), plan(recompute={"*": "offload"})
    assert off.recompute["offload"]["layers"] == [f"blocks.{i}" for i in range(8)] and not off.recompute["layers"]
    assert off.memory["peak"] <= rec.memory["peak"] < free.memory["peak"]
    assert off.breakdown["offload"] == pytest.approx(2 * off.recompute["offload"]["bytes"] / 450e9)
    assert off.step_time == pytest.approx(free.step_time + off.breakdown["offload"], rel=1e-6)
    assert off.breakdown["offload"] < rec.breakdown["recompute"]
    chosen = plan(memory_budget=(free.memory["peak"] + off.memory["peak"]) / 2)
    assert chosen.recompute.get("offload") and not chosen.recompute["layers"]
    assert "activations offloaded to host memory" in chosen.summary()
    # Over PCIe (55 GB/s) the same layers are cheaper to recompute.
    cluster = autopar.ClusterSpec.preset("1xH100")
    assert not plan(memory_budget=(free.memory["peak"] + off.memory["peak"]) / 2).recompute.get("offload")


# --- on gloo ranks -------------------------------------------------------------------------------

def _pins(model, mesh_axes, tp=None):
    pins = {name: {"output": ["R"] * mesh_axes, "offload": True} for name, _ in model.named_parameters()}
    for name, lay in (tp or {}).items():
        pins[name] = {"output": ["R"] * (mesh_axes - 1) + [lay], "offload": True}
    data = ["S(0)"] + ["R"] * (mesh_axes - 1)
    return {**pins, "input_ids": data, "labels": data}


def _check_offloaded(rank, world, mesh, checkpoint_dir=None):
    from tests.hf_models import MEGATRON, batch, build
    from tests.live_memory import step_peak_over_ranks
    from tests.eager_parity import train_and_compare

    torch.manual_seed(0)
    model = build("gpt2")
    ref = copy.deepcopy(model)
    ids, labels = batch()
    cluster = autopar.ClusterSpec.local_cpu(world)
    tp = dict(MEGATRON["gpt2"]) if len(mesh) == 2 else None
    # Optimizer states and every layer's saved activations in host memory.
    pm = autopar.compile(model, cluster, (ids,), {"labels": labels}, mesh_shape=mesh, pins=_pins(model, len(mesh), tp),
                         recompute={"*": "offload"})
    where = f"offloaded on mesh {mesh}"
    assert set(pm.plan.offload) == set(pm.plan.params), where
    assert pm.plan.recompute["offload"]["layers"] == ["transformer.h.0", "transformer.h.1"], where
    assert pm.code.count("offloaded(") == 2 and "checkpointed(" not in pm.code, where
    # The optimizer steps host copies, not the tensors the program reads.
    fqn = next(iter(pm.plan.offload))
    assert pm.local_parameter(fqn).data_ptr() != pm.local_tensor(fqn).data_ptr()
    opt = train_and_compare(pm, copy.deepcopy(ref), ids, labels, where)
    # Device gradients are freed once copied to the host.
    pm.train_step(ids, labels=labels)
    assert all(pm.local_tensor(f).grad is None and pm.local_parameter(f).grad is not None for f in pm.plan.offload)
    opt.zero_grad()

    def step():
        pm(ids, labels=labels).loss.backward()
        opt.step()
        opt.zero_grad()

    # Measured: every storage live during the steps on this process, the device tensors, their host
    # copies, the gradients on both sides and the optimizer states included (on CPU processes host and
    # device are one memory, and the plan predicts them all as device bytes).
    device_tensors = [pm.local_tensor(f) for f in pm.plan.offload]
    peak = step_peak_over_ranks(pm, opt, step, inputs=(ids, labels, device_tensors))
    predicted = pm.plan.memory["peak"]
    assert abs(peak / predicted - 1) <= 0.10, f"{where}: measured {peak} vs predicted {predicted}"

    # A checkpoint of the offloaded run (host copies and their optimizer states) resumes under a plan
    # that offloads nothing, with the losses the offloaded run goes on with.
    if checkpoint_dir is not None:
        plain = autopar.compile(model, cluster, (ids,), {"labels": labels}, mesh_shape=mesh, recompute=False,
                                pins={"input_ids": ["S(0)"], "labels": ["S(0)"]})
        assert not plain.plan.offload
        plain_opt = torch.optim.AdamW(plain.parameters(), lr=1e-3)
        resumes_alike(f"{checkpoint_dir}/offloaded", pm, opt, plain, plain_opt, ids, labels)


def test_offloaded_plans_train_save_and_load_on_two_ranks(tmp_path):
    run_distributed(_check_offloaded, 2, (2,), str(tmp_path), timeout=600)


def test_offloaded_plans_train_on_four_ranks_with_tensor_parallel():
    run_distributed(_check_offloaded, 4, (2, 2), timeout=600)
