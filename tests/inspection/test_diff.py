"""autopar.diff and `python -m autopar diff`: the same model planned for two clusters."""
from __future__ import annotations

import dataclasses
import json
from collections import Counter

import autopar
from autopar.__main__ import main


def _splits(plan):
    """Each parameter's splits as (axis, axis size, placement), so that layouts compare across meshes."""
    return {f: [(a, n, p) for a, n, p in zip(plan.axis_names, plan.mesh_shape, lay) if p != "R"]
            for f, lay in plan.params.items()}


def _text(splits):
    return "[" + ", ".join(f"{a}{n}:{p}" for a, n, p in splits) + "]" if splits else "[R]"


def _states(plan):
    """Each parameter's layout text, with its optimizer state's ZeRO-1/2 sharding (axis and size)."""
    sizes = dict(zip(plan.axis_names, plan.mesh_shape))
    return {f: _text(s) + "".join(f" ZeRO-{z['stage']} {z['axis']}{sizes[z['axis']]}"
                                  for z in [plan.zero.get(f)] if z)
            for f, s in _splits(plan).items()}


def _collective_counts(plan):
    return Counter((c["kind"], c["axis"], c["phase"]) for c in plan.collectives)


def test_diff_of_gpt2_on_two_clusters(gpt2_8, gpt2_16):
    a, b = gpt2_8, gpt2_16
    assert a.mesh != b.mesh, "the two clusters should get different meshes for this test to mean much"
    d = autopar.diff(a, b)
    assert d.same_model
    assert d.step_time == (a.step_time, b.step_time)
    assert d.peak_memory == (a.memory["peak"], b.memory["peak"])

    la, lb = _states(a), _states(b)
    differing = {f for f in la if la[f] != lb[f]}
    assert 0 < len(differing) < len(la), "replicated on both meshes is no difference"
    assert sum(c.instances for c in d.params) == len(differing)
    assert len(d.params) < len(differing), "changes repeated in every layer are folded into one line"
    for c in d.params:
        assert (c.a, c.b) == (la[c.name], lb[c.name])

    ca, cb = _collective_counts(a), _collective_counts(b)
    assert {(c.kind, c.axis, c.phase) for c in d.added} == set(cb) - set(ca)
    assert {(c.kind, c.axis, c.phase) for c in d.removed} == set(ca) - set(cb)
    assert d.added, "the 2-axis plan runs collectives on an axis the 1-axis plan lacks"
    for c in d.collectives:
        assert (c.count_a, c.count_b) == (ca[(c.kind, c.axis, c.phase)], cb[(c.kind, c.axis, c.phase)])

    text = str(d)
    assert text.splitlines()[0].startswith("a: GPT2LMHeadModel on 8xH100 (mesh dp=8)")
    assert "b: GPT2LMHeadModel on 16xH100 (mesh " in text
    assert f"parameters with different layouts: {len(differing)} of {len(la)}" in text
    assert "step time: " in text and "peak memory per device: " in text
    first = d.added[0]
    assert f"added    {first.kind}({first.axis}, {first.phase}): x0 " in text


def test_diff_of_a_plan_with_itself_is_empty(gpt2_8):
    d = autopar.diff(gpt2_8, gpt2_8)
    assert not d.params and not d.nodes and not d.collectives
    assert "collectives (count, bytes and seconds per step):\n  the same" in str(d)


def test_diff_cli(gpt2_8, gpt2_16, plan_dir, capsys):
    a, b = str(plan_dir / "gpt2_8xH100.json"), str(plan_dir / "gpt2_16xH100.json")
    assert main(["diff", a, b]) == 0
    assert capsys.readouterr().out == str(autopar.diff(gpt2_8, gpt2_16)) + "\n"
    assert main(["diff", a, b, "--json"]) == 0
    assert json.loads(capsys.readouterr().out) == json.loads(json.dumps(dataclasses.asdict(autopar.diff(gpt2_8, gpt2_16))))
    assert main(["diff", a, str(plan_dir / "missing.json")]) == 1
    assert "autopar diff: error" in capsys.readouterr().err
