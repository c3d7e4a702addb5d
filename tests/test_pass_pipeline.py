"""The pass pipeline: one runner for every pass, which logs, times, lints, skips, checks requirements,
inserts a user's pass by name, names the passes run before a failure and dumps graphs on request; and
``compile`` runs the front end once, so skipping a pass plans and runs the same graph; normalize_pass runs
the written-out tanh GELU as one op."""
import functools
import math

import pytest
import torch
from torch import nn

import autopar
from autopar.passes.runner import PassError, PassRunner, requires
from autopar.pass_pipeline import PASS_NAMES
from tests.distributed_utils import run_distributed


class MLP(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc1, self.fc2 = nn.Linear(16, 32), nn.Linear(32, 16)

    def forward(self, x):
        return self.fc2(torch.relu(self.fc1(x))).pow(2).mean()


def _plan(**options):
    return autopar.plan(MLP(), autopar.ClusterSpec.local_cpu(2), (torch.randn(8, 16),), progress=False, **options)


def test_every_pass_runs_through_the_runner_in_pipeline_order():
    p = _plan()
    ran = [r["name"] for r in p.solver["passes"]]
    assert ran[:7] == list(PASS_NAMES[:7])                    # front end, then analysis
    assert set(ran[7:]) == {"strategies_pass"}                # then one per candidate mesh
    assert all(r["seconds"] >= 0 and not r["skipped"] for r in p.solver["passes"])
    assert {r["stage"] for r in p.solver["passes"][:5]} == {"front end"}


def test_a_skipped_pass_is_recorded_and_a_required_one_gives_a_clear_error():
    p = _plan(skip_passes=("normalize_pass",))
    assert p.solver["passes"][1] == {"name": "normalize_pass", "stage": "front end", "seconds": 0.0, "skipped": True}
    assert "add.Tensor" not in {n["op"] for n in p.nodes}      # normalize would have split the bias off
    with pytest.raises(PassError, match=r"strategies_pass requires \['mark_requires_grad_pass'\], which were "
                                        r"skipped; passes run so far: \['autocast_pass', 'normalize_pass', 'layers_pass'"):
        _plan(skip_passes=("mark_requires_grad_pass",))
    with pytest.raises(PassError, match="no pass is named.*'normalise_pass'"):
        _plan(skip_passes=("normalise_pass",))


def test_a_users_pass_runs_after_the_pass_it_names():
    seen = []

    def count_matmuls_pass(gm):
        seen.append(sum(n.target is torch.ops.aten.add.Tensor for n in gm.graph.nodes))

    p = _plan(insert_passes=[("normalize_pass", count_matmuls_pass)])
    names = [r["name"] for r in p.solver["passes"]]
    assert names[:4] == ["autocast_pass", "normalize_pass", "count_matmuls_pass", "layers_pass"]
    assert seen == [2]                                         # it saw the normalized graph (biases split off)


def test_a_failing_pass_names_the_passes_run_before_it():
    @requires("layers_pass")
    def broken_pass(gm):
        raise ValueError("bad graph")

    with pytest.raises(PassError, match=r"pass broken_pass \(stage front end\) failed after "
                                        r"\['autocast_pass', 'normalize_pass', 'layers_pass'\]: ValueError: bad graph"):
        _plan(insert_passes=[("layers_pass", broken_pass)])


def test_the_graph_is_linted_after_each_pass():
    def misordered_pass(gm):
        out = next(n for n in gm.graph.nodes if n.op == "output")
        with gm.graph.inserting_before(next(iter(gm.graph.nodes))):     # reads a value not yet computed
            gm.graph.call_function(torch.ops.aten.relu.default, (out.args[0][0],))

    with pytest.raises(PassError, match="pass misordered_pass .* failed .* used before it has been defined"):
        _plan(insert_passes=[("normalize_pass", misordered_pass)])


def test_debug_mode_writes_each_passs_graph(tmp_path, monkeypatch):
    monkeypatch.setenv("AUTOPAR_DEBUG", "passes")
    monkeypatch.setenv("AUTOPAR_DEBUG_DIR", str(tmp_path))
    _plan(mesh_shape=(2,))
    files = sorted(f.name for f in tmp_path.iterdir())
    assert files[:5] == ["00_capture.py", "01_autocast_pass.py", "02_normalize_pass.py", "03_layers_pass.py",
                         "04_mark_requires_grad_pass.py"]
    assert "strategies_pass" in files[-1]
    assert "torch.ops.aten.add.Tensor" in (tmp_path / "02_normalize_pass.py").read_text()


def test_strategies_are_kept_per_mesh():
    """strategies_pass keeps each mesh's strategies beside the others', so a problem built for an
    earlier mesh after a later one's pass reads its own mesh's layouts."""
    from autopar.passes.costs import CostModel
    from autopar.passes.ilp_build import build_problem
    from autopar.passes.strategies import strategies_on, strategies_pass
    from autopar.planner import prepare

    cluster = autopar.ClusterSpec.local_cpu(4)
    prep = prepare(MLP(), (torch.randn(8, 16),), None, cluster)
    for shape in ((4,), (2, 2)):
        strategies_pass(prep.gm, shape)
    for shape in ((4,), (2, 2)):
        kept = strategies_on(prep.gm, shape)
        assert kept.mesh_shape == shape
        assert {len(lay) for n in kept for s in kept[n] for lay in s.outputs} == {len(shape)}
        _, idx = build_problem(prep.gm, CostModel(cluster, shape), None)
        assert idx.strategies is kept
    with pytest.raises(autopar.AutoparError, match=r"no strategies for mesh \(8,\)"):
        strategies_on(prep.gm, (8,))


def test_partial_binds_options_and_keeps_the_name():
    from autopar.passes.strategies import strategies_pass

    runner = PassRunner()
    with pytest.raises(PassError, match="strategies_pass requires"):
        runner.run([functools.partial(strategies_pass, mesh_shape=(2,))], torch.fx.symbolic_trace(MLP()), "x")


def _skip_normalize(rank, world):
    torch.manual_seed(0)
    model = MLP()
    ref = MLP()
    ref.load_state_dict(model.state_dict())
    x = torch.randn(8, 16)
    pm = autopar.compile(model, autopar.ClusterSpec.local_cpu(world), (x,), skip_passes=("normalize_pass",))
    assert "add" not in pm.code                                # the graph that was planned is the one run
    loss = pm(x)
    loss.backward()
    expected = ref(x)
    expected.backward()
    torch.testing.assert_close(loss.detach(), expected.detach(), rtol=1e-5, atol=1e-6)
    if world == 1:
        torch.testing.assert_close(pm.local_parameter("fc1.weight").grad, ref.fc1.weight.grad)


@pytest.mark.parametrize("world", [1, 2])
def test_compile_with_a_skipped_pass_plans_and_runs_the_same_graph(world):
    run_distributed(_skip_normalize, world)


def test_node_metadata_is_one_frozen_record_kept_by_copies():
    import dataclasses

    from autopar.passes.meta import KEY, LayerTag, meta_of, set_meta

    gm = torch.fx.symbolic_trace(MLP())
    node = next(n for n in gm.graph.nodes if n.op == "call_module")
    set_meta(node, requires_grad=True)
    with pytest.raises(dataclasses.FrozenInstanceError):
        meta_of(node).requires_grad = False
    copy = torch.fx.Graph().node_copy(node, lambda a: a)
    set_meta(node, layer=LayerTag("blocks.0", "blocks.*#0", 0))
    assert meta_of(copy).requires_grad and meta_of(copy).layer is None    # the copy kept its own record
    assert meta_of(node).requires_grad and meta_of(node).layer.layer == "blocks.0"
    assert not any(k.startswith("autopar") and k != KEY for k in node.meta)


def _meta_namespace(rank, world):
    from autopar.passes.meta import KEY, meta_of, program_meta
    from tests.hf_models import MEGATRON, batch, build

    torch.manual_seed(0)
    ids, labels = batch()
    pm = autopar.compile(build("gpt2"), autopar.ClusterSpec.local_cpu(world), (ids,), {"labels": labels},
                         pins={k: [v] for k, v in MEGATRON["gpt2"].items()},
                         recompute={"transformer.h.*": 1})
    nodes = [n for m in pm.local_program.modules() if isinstance(m, torch.fx.GraphModule) for n in m.graph.nodes]
    assert not [k for n in nodes for k in n.meta if k.startswith("autopar") and k != KEY]
    steps = [n for n in nodes if meta_of(n).step is not None]
    assert steps and all(n.target.__module__ == "autopar.runtime.collectives" for n in steps)
    assert {meta_of(n).source for n in nodes if n.op == "call_function"} - {None}
    assert program_meta(pm.local_program).placeholders[0][0] in ("param", "buffer", "constant", "input")


def test_codegen_writes_its_metadata_under_the_one_namespace():
    run_distributed(_meta_namespace, 2)


class WrittenOutGELU(nn.Module):
    """Hugging Face's ``gelu_new`` (GPT-2's activation) between two projections; ``read_tanh`` reads an
    intermediate of it again, which must keep it written out."""
    def __init__(self, read_tanh: bool):
        super().__init__()
        self.fc1, self.fc2, self.read_tanh = nn.Linear(16, 32), nn.Linear(32, 16), read_tanh

    def forward(self, x):
        h = self.fc1(x)
        t = torch.tanh(math.sqrt(2.0 / math.pi) * (h + 0.044715 * torch.pow(h, 3.0)))
        y = self.fc2(0.5 * h * (1.0 + t))
        return (y.sum() + t.sum()) if self.read_tanh else y.sum()


@pytest.mark.parametrize("read_tanh", [False, True])
def test_the_written_out_tanh_gelu_runs_as_one_gelu(read_tanh):
    from autopar.pass_pipeline import front_end, new_runner

    aten = torch.ops.aten
    gm = front_end(WrittenOutGELU(read_tanh), (torch.randn(8, 16),), {}, new_runner()).gm
    targets = [n.target for n in gm.graph.nodes if n.op == "call_function"]
    gelus = [n for n in gm.graph.nodes if n.target is aten.gelu.default]
    if read_tanh:
        assert not gelus and aten.tanh.default in targets and aten.pow.Tensor_Scalar in targets, gm.code
    else:
        assert len(gelus) == 1 and gelus[0].kwargs == {"approximate": "tanh"}, gm.code
        assert aten.tanh.default not in targets and aten.pow.Tensor_Scalar not in targets, gm.code
