"""The generated per-rank program: its collectives are exactly the plan's, it reads as Python, and the
runtime refuses bad input with clear errors."""
import collections
import copy
import dataclasses

import pytest
import torch

from tests.distributed_utils import run_distributed
from tests.hf_models import MEGATRON, VOCAB_PARALLEL, VOCAB_PARALLEL_NODES, batch, build


def _count_executed(pm, ids, labels):
    """Collectives actually run by one training step, per (kind, axis, phase)."""
    from autopar.runtime import collectives as C

    axis_of = {pm.mesh.get_group(a).group_name: a for a in pm.plan.axis_names}
    counts = collections.Counter()
    phase = {"now": "forward"}
    # Every collective, one-call or split (codegen/overlap.py), forward or backward, is issued here.
    kinds = {"_start_gather": "all_gather", "_start_reduce_scatter": "reduce_scatter",
             "_start_all_reduce": "all_reduce", "_start_all_reduce_": "all_reduce",
             "_start_all_to_all": "all_to_all"}
    originals = {name: getattr(C, name) for name in kinds}

    def counting(name):
        def run(*args, **kwargs):
            counts[(kinds[name], axis_of[args[-1]], phase["now"])] += 1
            return originals[name](*args, **kwargs)
        return run

    for name in originals:
        setattr(C, name, counting(name))
    try:
        loss = pm(ids, labels=labels).loss
        phase["now"] = "backward"
        loss.backward()
        # ZeRO-1/2 parameters gather their updated shards after the optimizer's step.
        phase["now"] = "optimizer"
        torch.optim.SGD(pm.parameters(), lr=0.0).step()
    finally:
        for name, fn in originals.items():
            setattr(C, name, fn)
    return counts


def _graph_forward_counts(pm):
    from autopar.runtime.collectives import COLLECTIVE_KIND
    from autopar.runtime.sharded_ops import OP_COLLECTIVES

    axis_of = {pm.mesh.get_group(a).group_name: a for a in pm.plan.axis_names}
    counts = collections.Counter()
    graphs = [m.graph for m in pm.local_program.modules() if isinstance(m, torch.fx.GraphModule)]  # recomputed layers too
    for n in (n for g in graphs for n in g.nodes):
        if n.op == "call_function" and n.target in COLLECTIVE_KIND and n.target.__name__ != "grad_all_reduce":
            kind = COLLECTIVE_KIND[n.target]
            if kind is not None:
                counts[(kind, axis_of[n.args[-1]], "forward")] += 1
        elif n.op == "call_function" and n.target in OP_COLLECTIVES:
            for kind, phase in OP_COLLECTIVES[n.target]:
                counts[(kind, axis_of[n.args[-1]], phase)] += 1
    return counts


def _issue_before_wait(pm, graphs=None):
    """Every forward collective of the program (``graphs``: by default the top-level one and the bodies
    of its recomputed and offloaded layers) is split: issued, then waited just before the first use of
    its result. Returns how many run with compute between their issue and their wait."""
    from autopar.runtime.collectives import SPLIT, param_gather_start, param_gather_wait

    wait_of = {start: wait for start, wait, _ in SPLIT.values()} | {param_gather_start: param_gather_wait}
    starts, waits = set(wait_of), set(wait_of.values())
    hidden = 0
    for graph in graphs or [m.graph for m in pm.local_program.modules() if isinstance(m, torch.fx.GraphModule)]:
        nodes = list(graph.nodes)
        at = {n: i for i, n in enumerate(nodes)}
        assert not [n.name for n in nodes if n.target in SPLIT], "a one-call collective was left in the program"
        for n in (n for n in nodes if n.target in starts):
            (wait,) = n.users
            assert wait.target is wait_of[n.target], wait.name
            first_use = min(wait.users, key=at.__getitem__)
            assert all(m.target in starts or m.target in waits for m in nodes[at[wait] + 1:at[first_use]]), \
                f"{wait.name} waits before {nodes[at[wait] + 1].name}, not at the first use of its result"
            hidden += any(m.op == "call_function" and m.target not in starts and m.target not in waits
                          for m in nodes[at[n] + 1:at[wait]])
    return hidden


def _reduce_scatters_waited_after_compute(pm, ids, labels):
    """Backward's reduce-scatters, each as the number of ATen ops (not views) autograd ran between its
    issue and its wait; every issued one must be waited by the end of backward."""
    c10d = torch.ops._c10d_functional
    # On CPU a reduce-scatter is an all-to-all and a sum.
    return _waited_after_compute(pm, ids, labels, (c10d.reduce_scatter_tensor.default, c10d.all_to_all_single.default))


def _waited_after_compute(pm, ids, labels, issues):
    """Backward's collectives issued by one of the ops ``issues``, each as the number of ATen ops (not
    views, nor the new tensor on an issued result's storage: runtime/collectives.py ``_released``)
    autograd ran between its issue and its wait; every issued one must be waited by the end of
    backward."""
    from torch.utils._python_dispatch import TorchDispatchMode

    c10d = torch.ops._c10d_functional
    aten = torch.ops.aten
    events = []

    class Log(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            out = func(*args, **(kwargs or {}))
            # A wait finds its collective by the result's storage.
            if func in issues:
                events.append(("issue", out.untyped_storage().data_ptr()))
            elif func is c10d.wait_tensor.default:
                events.append(("wait", args[0].untyped_storage().data_ptr()))
            elif func.namespace == "aten" and not func.is_view and func not in (aten.new_empty.default,
                                                                                 aten.set_.source_Tensor):
                events.append(("compute", None))
            return out

    loss = pm(ids, labels=labels).loss
    with Log():
        loss.backward()
    between = []
    for i, (what, issued) in enumerate(events):
        if what == "issue":
            waited = next((j for j in range(i + 1, len(events)) if events[j][0] == "wait" and events[j][1] == issued), None)
            assert waited is not None, f"a collective issued in backward (event {i}) was never waited"
            between.append(sum(e[0] == "compute" for e in events[i + 1:waited]))
    pm.zero_grad()
    return between


def _same_as_overlap_off(plain, pm, ids, labels):
    """``pm`` gives the numbers of ``plain``, its plan compiled with overlap off, bitwise: loss and every
    local gradient."""
    for m in (plain, pm):
        m.zero_grad()
        m.loss = m(ids, labels=labels).loss
        m.loss.backward()
    assert torch.equal(plain.loss, pm.loss)
    for (name, a), (_, b) in zip(plain.named_parameters(), pm.named_parameters()):
        assert torch.equal(a.grad, b.grad), name


def _same_over_two_backwards(plain, pm, ids):
    """``pm`` gives the numbers of ``plain``, its plan compiled with overlap off, bitwise over two
    backwards that accumulate (the model's labels are its inputs)."""
    for m in (plain, pm):
        for _ in range(2):
            m.loss = m(ids, labels=ids).loss
            m.loss.backward()
    assert torch.equal(plain.loss, pm.loss)
    for (name, a), (_, b) in zip(plain.named_parameters(), pm.named_parameters()):
        assert torch.equal(a.grad, b.grad), name


def _collectives_match(rank, world, model_name, mesh, pins, options):
    import autopar

    torch.manual_seed(0)
    model = build(model_name)
    ids, labels = batch()
    pm = autopar.compile(model, autopar.ClusterSpec.local_cpu(world), (ids,), {"labels": labels},
                         mesh_shape=mesh, pins=pins, **options)
    check_collectives(pm, ids, labels)
    hidden = _issue_before_wait(pm)
    if pins.get("*.weight") == ["S(0)"]:
        # ZeRO-3: each parameter's all-gather is issued while the compute before its first use runs,
        # and its gradient's reduce-scatter while the backward of the layers before it runs.
        assert hidden > 0, pm.code
        between = _reduce_scatters_waited_after_compute(pm, ids, labels)
        gathered = pm.code.count("grad = 'reduce_scatter'")
        assert gathered and len(between) >= gathered, (between, gathered)
        assert sum(n > 0 for n in between) >= gathered - 1, between       # all but the last one
        plain = autopar.compile(model, autopar.ClusterSpec.local_cpu(world), (ids,), {"labels": labels},
                                plan=pm.plan, overlap=False, **options)
        assert "_start(" not in plain.code and "_wait(" not in plain.code
        _same_as_overlap_off(plain, pm, ids, labels)


def _replicated_weights_read_in_chunks(rank, world, recompute):
    import autopar
    from autopar.models import GPT, GPTConfig

    torch.manual_seed(0)
    model = GPT(GPTConfig(vocab_size=64, n_layer=2, n_head=2, d_model=32, d_ff=128, max_seq=16))
    ids = torch.randint(0, 64, (4, 16), generator=torch.Generator().manual_seed(1))
    # DDP's parameter layout, with the MLP's first projection split by features: each rank reads its
    # chunk of the replicated weight, and the gradient's chunks are all-gathered in backward.
    pins = {**{n: {"output": ["R"], "zero": 0} for n, _ in model.named_parameters()},
            "input_ids": ["S(0)"], "labels": ["S(0)"], "linear_default_4": ["S(2)"]}
    cluster = autopar.ClusterSpec.local_cpu(world)
    pm = autopar.compile(model, cluster, (ids,), {"labels": ids}, pins=pins,
                         **({"recompute": recompute} if recompute else {}))
    plain = autopar.compile(model, cluster, (ids,), {"labels": ids}, plan=pm.plan, overlap=False)
    # Inside recomputed layers too (pm.code lists their bodies).
    assert not recompute or pm.plan.recompute["layers"]
    assert pm.code.count("param_chunk(") == 2 and "param_chunk(" not in plain.code, pm.code
    gathers = (torch.ops._c10d_functional.all_gather_into_tensor.default,)
    # The gradients' all-gathers wait at the next one's issue or at the end of backward, with the
    # backward of the layers before them run in between; with overlap off, each waits at once.
    assert sum(n > 0 for n in _waited_after_compute(pm, ids, ids, gathers)) >= 1
    assert not any(_waited_after_compute(plain, ids, ids, gathers))
    _same_over_two_backwards(plain, pm, ids)


@pytest.mark.parametrize("recompute", [False, {"*": "all"}], ids=["top-level", "recomputed"])
def test_replicated_weights_read_in_chunks_gather_their_gradients_deferred(recompute):
    run_distributed(_replicated_weights_read_in_chunks, 2, recompute, timeout=300)


def check_collectives(pm, ids, labels):
    """The collectives the program runs in forward, backward and after the optimizer's step are the
    plan's, by kind, axis and phase (gradient buckets counted as the runtime launches them)."""
    planned = collections.Counter(pm.plan.collective_counts())
    assert planned, "the plan has no collectives to check"
    # Data-parallel gradients reduced in buckets (codegen/grad_buckets.py): one all-reduce per bucket
    # in place of one per use of each parameter.
    axis_of = {pm.mesh.get_group(a).group_name: a for a in pm.plan.axis_names}
    for _, group, uses, _ in pm._program.grad_reductions:
        planned[("all_reduce", axis_of[group], "backward")] -= uses
    if pm._grad_buckets is not None:
        for group in pm._grad_buckets.groups:
            planned[("all_reduce", axis_of[group], "backward")] += 1
    # ZeRO-1/2 parameters' updated shards gathered in buckets (runtime/zero.py): one all-gather per
    # bucket in place of one per parameter.
    if pm._sharded_states is not None:
        for (_, group, _), members in pm._sharded_states.buckets().items():
            planned[("all_gather", axis_of[group], "optimizer")] -= len(members) - 1
    forward_planned = collections.Counter({k: v for k, v in planned.items() if k[2] == "forward"})
    assert _graph_forward_counts(pm) == forward_planned
    assert _count_executed(pm, ids, labels) == planned
    pm.zero_grad()
    code = pm.code
    assert "def forward" in code and "all_reduce" in code or "all_gather" in code


@pytest.mark.parametrize("model_name, world, mesh, kind", [
    ("llama", 2, (2,), "megatron"),
    ("gpt2", 2, (2,), "zero"),
    ("bert", 4, (2, 2), "megatron x data"),
    ("llama", 2, (2,), "vocab parallel"),
    ("gpt2", 2, (2,), "megatron, recomputed layers"),
])
def test_collective_counts_match_the_plan(model_name, world, mesh, kind):
    axes = len(mesh)
    if kind == "zero":
        # The projections split the batch, so their sharded weights are gathered whole (FSDP's pattern)
        # and the weights' gradients reduce-scattered.
        pins = {"*.weight": ["S(0)"], "input_ids": ["S(0)"], "labels": ["S(0)"], "mm_default*": ["S(0)"]}
    elif kind == "vocab parallel":
        pins = {k: [v] for k, v in {**MEGATRON[model_name], **VOCAB_PARALLEL[model_name]}.items()}
        pins.update(VOCAB_PARALLEL_NODES)
    else:
        pins = {k: ["R"] * (axes - 1) + [v] for k, v in MEGATRON[model_name].items()}
        if axes == 2:
            pins.update({"input_ids": ["S(0)", "R"], "labels": ["S(0)", "R"]})
    options = {"sharded_outputs": kind == "vocab parallel"}
    if "recomputed" in kind:
        # Every layer runs its forward again in backward, with its collectives (plan.recompute).
        options["recompute"] = {"*": "all"}
    run_distributed(_collectives_match, world, model_name, mesh, pins, options, timeout=300)


def _bad_inputs(rank, world):
    import autopar
    from autopar.errors import AutoparError, ClusterMismatchError, PlanFormatError
    from autopar.runtime.module import ShapeMismatchError

    torch.manual_seed(0)
    model = build("gpt2")
    ids, labels = batch()
    cluster = autopar.ClusterSpec.local_cpu(world)
    with pytest.raises(ClusterMismatchError, match="4 devices"):
        autopar.compile(model, autopar.ClusterSpec.local_cpu(4), (ids,), {"labels": labels})
    pm = autopar.compile(model, cluster, (ids,), {"labels": labels})
    with pytest.raises(ShapeMismatchError, match="plan was made for"):
        pm(ids[:, :8], labels=labels[:, :8])
    other = build("llama")
    with pytest.raises(PlanFormatError, match="another model"):
        autopar.compile(other, cluster, (ids,), {"labels": labels}, plan=pm.plan)
    skewed = copy.deepcopy(model)
    if rank == 1:
        with torch.no_grad():
            next(skewed.parameters()).add_(1e-3)
    with pytest.raises(AutoparError, match="differ between ranks"):
        autopar.compile(skewed, cluster, (ids,), {"labels": labels}, plan=pm.plan)


def test_bad_input_gets_clear_errors():
    run_distributed(_bad_inputs, 2, timeout=300)


def _meta_model_and_checkpoint(rank, world, ckpt_dir):
    import torch.distributed.checkpoint as dcp

    import autopar

    torch.manual_seed(0)
    real = build("llama")
    full = {k: v.detach().clone() for k, v in real.named_parameters()}
    buffers = {k: v.clone() for k, v in real.named_buffers()}      # rotary tables are not persistent
    with torch.device("meta"):
        meta = build("llama")
    ids, labels = batch()
    cluster = autopar.ClusterSpec.local_cpu(world)
    pm = autopar.compile(meta, cluster, (ids,), {"labels": labels})
    with pytest.raises(autopar.AutoparError, match="meta device"):
        pm(ids, labels=labels)
    pm.load_state_dict({**full, **buffers})
    ref = autopar.compile(real, cluster, (ids,), {"labels": labels}, plan=pm.plan)
    assert torch.equal(pm.train_step(ids, labels=labels), ref.train_step(ids, labels=labels))
    # Data parallel: the gradient buckets reduce the parameters made on loading.
    dp = {"*.weight": {"output": ["R"], "zero": 0}, "input_ids": ["S(0)"], "labels": ["S(0)"], "linear*": ["S(0)"]}
    dp_meta = autopar.compile(meta, cluster, (ids,), {"labels": labels}, pins=dp)
    dp_meta.load_state_dict({**full, **buffers})
    dp_real = autopar.compile(real, cluster, (ids,), {"labels": labels}, plan=dp_meta.plan)
    assert dp_meta._program.grad_reductions
    for m in (dp_meta, dp_real):
        m.train_step(ids, labels=labels)
    for (name, a), (_, b) in zip(dp_meta.named_parameters(), dp_real.named_parameters()):
        assert torch.equal(a.grad, b.grad), name

    state = pm.state_dict()
    assert all(type(v).__name__ == "DTensor" for v in state.values())
    dcp.save(state, checkpoint_id=ckpt_dir)
    fresh = autopar.compile(build("llama"), cluster, (ids,), {"labels": labels}, plan=pm.plan)
    target = fresh.state_dict()
    dcp.load(target, checkpoint_id=ckpt_dir)
    fresh.load_state_dict(target)
    for k, v in pm.full_state_dict().items():
        assert torch.equal(fresh.full_state_dict()[k], v), k
        assert torch.equal(v, full[k]), k
    model = build("llama")
    model.load_state_dict(pm.full_state_dict())                  # strict


def test_meta_model_load_state_dict_and_dcp_checkpoint(tmp_path):
    run_distributed(_meta_model_and_checkpoint, 2, str(tmp_path / "ckpt"), timeout=300)


def _sharded_outputs(rank, world):
    import autopar
    from torch.distributed.tensor import DTensor

    torch.manual_seed(0)
    model = build("gpt2")
    ids, labels = batch()
    cluster = autopar.ClusterSpec.local_cpu(world)
    # Data parallel, with the logits (the lm_head node, "linear") left split by batch.
    pins = {"input_ids": ["S(0)"], "labels": ["S(0)"], "*.weight": ["R"], "*.bias": ["R"], "linear": ["S(0)"]}
    full = autopar.compile(model, cluster, (ids,), {"labels": labels}, pins=pins)
    sharded = autopar.compile(model, cluster, (ids,), {"labels": labels}, plan=full.plan, sharded_outputs=True)
    out, ref = sharded(ids, labels=labels), full(ids, labels=labels)
    assert isinstance(out.logits, DTensor) and isinstance(out.loss, DTensor)
    assert out.logits.placements[0].is_shard(0) and out.logits.to_local().shape[0] == ids.shape[0] // world
    torch.testing.assert_close(out.logits.full_tensor(), ref.logits)
    torch.testing.assert_close(out.loss.full_tensor(), ref.loss)


def test_outputs_can_stay_sharded_as_dtensors():
    run_distributed(_sharded_outputs, 2, timeout=300)


def _data_parallel_gpt2(world, model_name="gpt2", zero=0, **node_pins):
    """GPT-2 (or ``model_name``), its batch, a cluster whose links are fast enough that splitting the
    batch pays, and pins that replicate every weight, its optimizer state at ZeRO stage ``zero`` (and
    pin ``node_pins``): data-parallel gradients."""
    import dataclasses

    import autopar

    torch.manual_seed(0)
    model = build(model_name)
    ids, labels = batch()
    cluster = dataclasses.replace(autopar.ClusterSpec.local_cpu(world), intra_node_bandwidth=1e13,
                                  intra_node_latency=1e-9)
    plain_dp = {"output": ["R"], "zero": zero}
    pins = {"*.weight": plain_dp, "*.bias": plain_dp, "input_ids": ["S(0)"], "labels": ["S(0)"], **node_pins}
    return model, ids, labels, cluster, pins


def _bucketed_gradients(rank, world):
    import autopar

    model, ids, labels, cluster, pins = _data_parallel_gpt2(world)
    one = autopar.compile(model, cluster, (ids,), {"labels": labels}, pins=pins, bucket_mb=25)
    # The runtime packs the plan's bucket size, and a plan runs at the size it was priced at.
    assert one.plan.bucket_mb == 25 and one._program.bucket_bytes == 25 * 2**20
    with pytest.raises(autopar.PlanFormatError, match="priced with gradient buckets of 25 MiB"):
        autopar.compile(model, cluster, (ids,), {"labels": labels}, plan=one.plan, bucket_mb=0)
    each = autopar.compile(model, cluster, (ids,), {"labels": labels}, plan=dataclasses.replace(one.plan, bucket_mb=0))
    assert each._program.bucket_bytes == 0
    plain = autopar.compile(model, cluster, (ids,), {"labels": labels}, plan=one.plan, overlap=False)
    reduced = one._program.grad_reductions
    assert len(reduced) >= 10, reduced
    assert all(f"grad_all_reduce(p_{t.replace('.', '_')}," not in one.code for t, *_ in reduced)
    assert all(f"grad_all_reduce(p_{t.replace('.', '_')}," in plain.code for t, *_ in reduced)
    assert len(one._grad_buckets.buckets) == 1 and len(each._grad_buckets.buckets) == len(reduced)

    # A Conv1D's bias split off by normalize_pass is added in the matmul again where nothing comes
    # between them (a whole or sharded result, not a Partial one reduced first).
    aten = torch.ops.aten
    conv1d = sum(type(m).__name__ == "Conv1D" for m in model.modules())
    nodes = list(one.local_program.graph.nodes)
    biased = [n for n in nodes if n.target is aten.addmm.default]
    plain_mm = [n for n in nodes if n.target is aten.mm.default]
    assert biased and len(biased) + len(plain_mm) == conv1d, one.code
    assert not [n for n in plain_mm if [u.target for u in n.users] == [aten.add.Tensor]], one.code

    # One bucket per parameter: all but the last bucket are launched before backward ends.
    last = each.local_parameter(reduced[-1][0])
    launched = []
    last.register_post_accumulate_grad_hook(lambda p: launched.append(len(each._grad_buckets.works)))
    for step in range(2):            # the second backward accumulates onto the first one's gradients
        for m in (one, each, plain):
            m(ids, labels=labels).loss.backward()
        assert launched[-1] == len(reduced), launched
        # The reduced gradients are views into their bucket's buffer (summed there, not copied back).
        storages = {one.local_parameter(t).grad.untyped_storage().data_ptr() for t, *_ in reduced}
        assert len(storages) == 1, f"step {step}: one bucket's gradients in {len(storages)} storages"
        for (name, a), (_, b), (_, c) in zip(one.named_parameters(), each.named_parameters(),
                                             plain.named_parameters()):
            assert torch.equal(a.grad, b.grad), f"step {step}: {name} differs between bucket sizes"
            torch.testing.assert_close(a.grad, c.grad, rtol=1e-5, atol=1e-7, msg=f"step {step}: {name}")


def test_bucketed_reductions_match_unbucketed_bitwise():
    run_distributed(_bucketed_gradients, 2, timeout=300)


def _bucketed_zero_one_gradients(rank, world):
    """ZeRO-1: each parameter's whole gradient (its read's, summed over the read's uses) is reduced in
    the runtime's buckets, not on each use in the program; its block's ``.grad`` is a view of the
    reduced gradient. Training is bitwise the same whatever the bucket size, and the same as one
    reduction per use where a parameter has one use."""
    import autopar
    from autopar.runtime import collectives as C
    from autopar.runtime import zero as Z

    model, ids, labels, cluster, pins = _data_parallel_gpt2(world, zero=1)
    one = autopar.compile(model, cluster, (ids,), {"labels": labels}, pins=pins, bucket_mb=25)
    each = autopar.compile(model, cluster, (ids,), {"labels": labels}, plan=dataclasses.replace(one.plan, bucket_mb=0))
    plain = autopar.compile(model, cluster, (ids,), {"labels": labels}, plan=one.plan, overlap=False)
    assert {stage for stage, _ in one.plan.zero_stages().values()} == {1}

    def reduced_reads(m, every: bool):
        """The parameters whose ZeRO-1 read's gradient the program all-reduces on every use (on any use)."""
        each = all if every else any
        return {n.args[0].name for n in m.local_program.graph.nodes if n.target is Z.whole_of and n.users
                and each(u.target is C.grad_all_reduce for u in n.users)}

    uses = {t: n for t, _, n, _ in one._program.grad_reductions}
    assert len(uses) >= 10 and {"p_" + t.replace(".", "_") for t in uses} == reduced_reads(plain, True), one.code
    # A parameter also read in chunks (GPT-2's tied embedding) keeps its reductions in the program.
    assert reduced_reads(one, False) == reduced_reads(plain, False) - reduced_reads(plain, True), one.code
    zero_one = set(uses)
    opts = [torch.optim.AdamW(m.parameters(), lr=1e-3) for m in (one, each, plain)]
    for step in range(2):
        for _ in range(2):           # the second backward accumulates onto the first one's gradients
            for m in (one, each, plain):
                m(ids, labels=labels).loss.backward()
        for t in zero_one:           # the optimizer's block reads the bucket's reduced gradient in place
            assert one.local_parameter(t).grad.untyped_storage().data_ptr() == \
                one.local_tensor(t).grad.untyped_storage().data_ptr(), t
        for (name, a), (_, b), (_, c) in zip(one.named_parameters(), each.named_parameters(),
                                             plain.named_parameters()):
            assert torch.equal(a.grad, b.grad), f"step {step}: {name} differs between bucket sizes"
            if uses.get(name) == 1:
                assert torch.equal(a.grad, c.grad), f"step {step}: {name} differs from its use's reduction"
            else:
                torch.testing.assert_close(a.grad, c.grad, rtol=1e-5, atol=1e-7, msg=f"step {step}: {name}")
        for opt in opts:
            opt.step()
            opt.zero_grad()
        for (name, a), (_, b) in zip(one.named_parameters(), each.named_parameters()):
            assert torch.equal(a, b), f"step {step}: {name} updated differently between bucket sizes"


def test_zero_one_gradients_reduce_in_buckets_bitwise_as_unbucketed():
    run_distributed(_bucketed_zero_one_gradients, 2, timeout=300)


def _bucketed_bf16_gradients(rank, world):
    """bf16-mixed data parallelism summing in bfloat16 (``reduce_dtype``): each weight read only through
    its bfloat16 copy has its gradient reduced once, in bfloat16, in the runtime's buckets, in place of
    the reduction of its copy's gradient in the program."""
    import autopar
    from autopar.runtime import collectives as C

    batch_split = {"linear*": ["S(0)"], "layer_norm*": ["S(0)"]}
    model, ids, labels, cluster, pins = _data_parallel_gpt2(world, "gpt", **batch_split)
    one = autopar.compile(model, cluster, (ids,), {"labels": labels}, pins=pins, precision="bf16-mixed",
                          reduce_dtype="bfloat16", kernels="aten", recompute=False, bucket_mb=25)
    each = autopar.compile(model, cluster, (ids,), {"labels": labels}, plan=dataclasses.replace(one.plan, bucket_mb=0),
                           kernels="aten")
    plain = autopar.compile(model, cluster, (ids,), {"labels": labels}, plan=one.plan, overlap=False, kernels="aten")
    narrowed = [t for t, _, _, dtype in one._program.grad_reductions if dtype == torch.bfloat16]
    assert len(narrowed) >= 8 and all(t.endswith(".weight") for t in narrowed), one._program.grad_reductions

    def copies_reduced(m):
        """The parameters whose bfloat16 copy the program all-reduces the gradient of."""
        return {n.args[0].args[0].name for n in m.local_program.graph.nodes
                if n.target is C.grad_all_reduce and n.args[0].target is torch.ops.aten._to_copy.default}

    names = {"p_" + t.replace(".", "_") for t in narrowed}
    assert names <= copies_reduced(plain), copies_reduced(plain)
    assert not names & copies_reduced(one), one.code
    # Both dtypes in buckets of their own, each bucket launched before backward ends.
    assert {one._grad_buckets.dtypes[i] for i in range(len(one._grad_buckets.buckets))} == \
        {torch.float32, torch.bfloat16}
    assert len(each._grad_buckets.buckets) == len(one._program.grad_reductions)
    last = each.local_parameter(narrowed[-1])
    launched = []
    last.register_post_accumulate_grad_hook(lambda p: launched.append(len(each._grad_buckets.works)))
    for step in range(2):            # the second backward accumulates onto the first one's gradients
        for m in (one, each, plain):
            m(ids, labels=labels).loss.backward()
        assert launched[-1] >= 1 and launched[-1] < len(each._grad_buckets.buckets), launched
        for (name, a), (_, b), (_, c) in zip(one.named_parameters(), each.named_parameters(),
                                             plain.named_parameters()):
            assert a.grad.dtype == torch.float32, name
            assert torch.equal(a.grad, b.grad), f"step {step}: {name} differs between bucket sizes"
            if name in narrowed:       # each copy has one reader: the same bfloat16 sums
                assert torch.equal(a.grad, c.grad), f"step {step}: {name} differs from one reduction per copy"
            else:
                torch.testing.assert_close(a.grad, c.grad, rtol=1e-5, atol=1e-7, msg=f"step {step}: {name}")


def test_bf16_mixed_weights_reduce_in_bf16_buckets_bitwise_as_unbucketed():
    run_distributed(_bucketed_bf16_gradients, 2, timeout=300)


def _recomputed_gradients_bucketed(rank, world):
    import autopar
    from autopar.runtime import collectives as C

    model, ids, labels, cluster, pins = _data_parallel_gpt2(world)
    pm = autopar.compile(model, cluster, (ids,), {"labels": labels}, pins=pins, recompute={"*": "all"},
                         bucket_mb=0)
    plain = autopar.compile(model, cluster, (ids,), {"labels": labels}, plan=pm.plan, overlap=False)
    assert pm.plan.recompute["layers"]
    reduced = [t for t, *_ in pm._program.grad_reductions]

    def reduced_in_layers(m):
        """The parameters ``m`` reduces on each use inside its recomputed layers."""
        bodies = [b for name, b in m.local_program.named_children() if name.startswith("recompute_")]
        return {n.args[0].name for b in bodies for n in b.graph.nodes
                if n.target is C.grad_all_reduce and n.args[0].op == "placeholder"}

    in_layers = reduced_in_layers(plain)
    assert in_layers and in_layers <= {"p_" + t.replace(".", "_") for t in reduced}, in_layers
    assert not reduced_in_layers(pm), pm.code

    # One bucket per parameter: every bucket is launched as its gradient is accumulated, during the
    # recomputed layers' backward, not when backward ends.
    last = pm.local_parameter(reduced[-1])
    launched = []
    last.register_post_accumulate_grad_hook(lambda p: launched.append(len(pm._grad_buckets.works)))
    for m in (pm, plain):
        m(ids, labels=labels).loss.backward()
    assert launched == [len(reduced)], launched
    for (name, a), (_, b) in zip(pm.named_parameters(), plain.named_parameters()):
        torch.testing.assert_close(a.grad, b.grad, rtol=1e-5, atol=1e-7, msg=name)


def _recomputed_layers_overlap(rank, world, kind):
    import autopar
    from autopar.runtime.recompute import checkpointed

    torch.manual_seed(0)
    model = build("gpt2")
    ids, labels = batch()
    options, outputs = {"recompute": {"*": "all"}}, {}
    if kind == "megatron":
        pins = {k: [v] for k, v in MEGATRON["gpt2"].items()}
    elif kind == "zero3":
        pins = {"*.weight": ["S(0)"], "input_ids": ["S(0)"], "labels": ["S(0)"], "mm_default*": ["S(0)"]}
    else:
        pins = {k: [v] for k, v in {**MEGATRON["gpt2"], **VOCAB_PARALLEL["gpt2"]}.items()} | VOCAB_PARALLEL_NODES
        options, outputs = {}, {"sharded_outputs": True}
    cluster = autopar.ClusterSpec.local_cpu(world)
    pm = autopar.compile(model, cluster, (ids,), {"labels": labels}, mesh_shape=(world,), pins=pins, **options,
                         **outputs)
    plain = autopar.compile(model, cluster, (ids,), {"labels": labels}, plan=pm.plan, overlap=False, **outputs)
    bodies = [getattr(pm.local_program, n.args[0].target).graph for n in pm.local_program.graph.nodes
              if n.target is checkpointed]
    assert bool(bodies) == (kind != "vocab") and all("_start(" in str(b.python_code("self").src) for b in bodies)
    hidden = _issue_before_wait(pm, bodies) if bodies else _issue_before_wait(pm)
    c10d = torch.ops._c10d_functional
    if kind == "zero3":
        # Each layer's weights are gathered while the layer's compute before their first use runs, in
        # forward and again in the layer's run again in backward; with overlap off, each waits at once.
        assert hidden >= 2 * len(bodies), pm.code
        # Their autograd nodes are made at their waits (codegen/overlap.py, param_gather_start).
        assert all("param_gather_start(" in str(b.python_code("self").src) for b in bodies), pm.code
        again = _waited_after_compute(pm, ids, labels, (c10d.all_gather_into_tensor.default,))
        assert sum(n > 0 for n in again) >= hidden, (again, hidden)
        assert not any(_waited_after_compute(plain, ids, labels, (c10d.all_gather_into_tensor.default,)))
    _same_as_overlap_off(plain, pm, ids, labels)


@pytest.mark.parametrize("kind", ["megatron", "zero3", "vocab"])
def test_recomputed_layers_and_sharded_ops_issue_before_they_wait_and_match_overlap_off(kind):
    """Inside a recomputed layer, each collective is issued early and waited at the first use of its
    result, in forward and in the layer's run again in backward (codegen/overlap.py); Megatron's and
    ZeRO-3's recomputed layers and the vocabulary-parallel embedding and loss give the numbers of
    ``compile(overlap=False)`` bitwise."""
    run_distributed(_recomputed_layers_overlap, 2, kind, timeout=300)


def test_recomputed_layers_reduce_their_gradients_in_buckets():
    """A replicated parameter read inside a recomputed layer has its gradient all-reduced in DDP's
    buckets, as outside one (the cost model prices it so), not once per use, waited in the layer's
    backward."""
    run_distributed(_recomputed_gradients_bucketed, 2, timeout=300)


def test_a_recomputed_layer_reads_its_zero_2_weights_inside_its_checkpoint():
    """A ZeRO-2 weight's read (``runtime.zero.whole_of``) is where backward reduce-scatters its gradient,
    and autograd runs it right after the weight's last reader's backward only if it was made right
    before the first reader: in a recomputed layer, inside the layer's checkpointed region. Made before
    the region, it would run after the whole layer's backward, later than the memory model and the
    overlap assume."""
    import autopar
    from autopar.codegen.local_program import local_program_pass
    from autopar.codegen.recompute import recompute_pass
    from autopar.pass_pipeline import front_end, new_runner
    from autopar.runtime.recompute import checkpointed
    from autopar.runtime.zero import whole_of
    from tests.memory_cases import build, options

    model, args, kwargs = build("gpt2", 32, 4, "cpu")
    plan = autopar.plan(model, autopar.ClusterSpec.local_cpu(2), args, kwargs, progress=False, kernels="aten",
                        **options("gpt2", "zero2-recompute", 2, model))
    assert plan.recompute["layers"] and {z.stage for z in plan.zero.values()} == {2}
    gm = local_program_pass(front_end(model, args, kwargs, new_runner()).gm, plan=plan, group_names=["g0"])
    gm = recompute_pass(gm, layers=tuple(plan.recompute["layers"]))
    reads = [n for n in gm.graph.nodes if n.target is whole_of]
    assert not [n.name for n in reads if any(u.target is checkpointed for u in n.users)], \
        "a ZeRO-2 weight read before the recomputed region that reads it"
    inside = sum(n.target is whole_of for name, m in gm.named_children() if name.startswith("recompute_")
                 for n in m.graph.nodes)
    layer_weights = sum(1 for fqn in plan.zero if ".h." in fqn)
    assert inside == layer_weights > 0, (inside, layer_weights)


def _column_linears(rank, world):
    import autopar
    from autopar.models import GPT, GPTConfig

    torch.manual_seed(0)
    model = GPT(GPTConfig(vocab_size=64, n_layer=2, n_head=2, d_model=32, d_ff=128, max_seq=16))
    ids = torch.randint(0, 64, (4, 16), generator=torch.Generator().manual_seed(1))
    # Megatron's split on a replicated batch: every backward all-reduce is an "f".
    pins = {"*.q.weight": ["S(0)"], "*.k.weight": ["S(0)"], "*.v.weight": ["S(0)"], "*.o.weight": ["S(1)"],
            "*.fc1.weight": ["S(0)"], "*.fc2.weight": ["S(1)"], "input_ids": ["R"], "labels": ["R"]}
    cluster = autopar.ClusterSpec.local_cpu(world)
    pm = autopar.compile(model, cluster, (ids,), {"labels": ids}, pins=pins, sharded_outputs=True)
    plain = autopar.compile(model, cluster, (ids,), {"labels": ids}, plan=pm.plan, overlap=False,
                            sharded_outputs=True)
    # Each layer's q, k and v share one call, and its fc1 has one.
    assert pm.code.count("column_linears(") == 4 and "column_linears(" not in plain.code, pm.code
    assert "grad_all_reduce(" not in pm.code and plain.code.count("grad_all_reduce(") == 4, plain.code
    # The plan prices each "f" as hidden behind its readers' weight gradients.
    f = [c for c in pm.plan.collectives if c.step == "grad_all_reduce"]
    assert len(f) == 4 and all(c.exposed < c.seconds for c in f), f
    # Backward issues each input gradient's all-reduce, computes the weights' gradients, then waits; with
    # overlap off, each waits at once.
    reduce = (torch.ops._c10d_functional.all_reduce.default,)
    between = _waited_after_compute(pm, ids, ids, reduce)
    assert len(between) == 4 and all(n > 0 for n in between), between
    assert not any(_waited_after_compute(plain, ids, ids, reduce))
    _same_over_two_backwards(plain, pm, ids)


def test_column_parallel_input_gradients_reduce_behind_weight_gradients():
    """Megatron's "f" before column-parallel layers (q, k and v; fc1): the
    all-reduce of the input's gradient is issued before the layers' weight gradients are computed and
    waited after (runtime/collectives.py ``column_linears``), as the plan prices it, and the gradients
    are bitwise those of ``compile(overlap=False)``."""
    run_distributed(_column_linears, 2, timeout=300)


def test_a_collective_used_before_the_previous_ones_first_use_is_issued_after_its_wait():
    # A ZeRO-3 bias gathered then read in strided chunks, beside its weight's all-to-all (GPT-2's c_attn
    # under bf16-mixed): the gather's result is used before the all-to-all's, so the all-to-all is
    # waited before the gather is issued, one collective in flight, in program order.
    from autopar.codegen.overlap import _split_collectives
    from autopar.runtime import collectives as C

    graph = torch.fx.Graph()
    weight, bias = graph.placeholder("weight"), graph.placeholder("bias")
    moved = graph.call_function(C.all_to_all, (weight, 0, 1, "0"), {"dst_groups": 3})
    gathered = graph.call_function(C.all_gather, (bias, 0, "0"), {"grad": "slice"})
    chunk = graph.call_function(C.local_chunk, (gathered, 0, "0"), {"groups": 3})
    out = graph.call_function(torch.ops.aten.add.Tensor, (moved, chunk))
    graph.output(out)
    assert _split_collectives(graph, set())
    graph.lint()
    order = [n.target for n in graph.nodes if n.op == "call_function"]
    assert order == [C.all_to_all_start, C.all_to_all_wait, C.all_gather_start, C.all_gather_wait, C.local_chunk,
                     torch.ops.aten.add.Tensor]
