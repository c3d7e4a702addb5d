"""plan.explain: the chosen layout, the alternatives with their costs, and the resharding each causes."""
from __future__ import annotations

import re

import pytest

from autopar.__main__ import main


def _why_block(text: str, chosen: str, alternative: str) -> str:
    """The lines of the "why <chosen>" section that are about ``alternative``."""
    why = text[text.index(f"why {chosen}:"):]
    block = why[why.index(f"- {alternative}:"):]
    nxt = re.search(r"\n\s*- ", block[1:])
    return block[:nxt.start() + 1] if nxt else block


def test_wide_gpt_block_says_why_the_second_mlp_weight_is_row_split(wide_gpt):
    plan = wide_gpt
    # GPT-2's Conv1D stores its weight as (in, out): S(1) splits output features (column-parallel),
    # S(0) the contracted dim (row-parallel). Megatron's MLP is column- then row-parallel.
    assert plan.params["transformer.h.0.mlp.c_fc.weight"] == ["S(1)"]
    assert plan.params["transformer.h.0.mlp.c_proj.weight"] == ["S(0)"]
    text = plan.explain("transformer.h.0.mlp.c_proj.weight")
    assert text.startswith("parameter transformer.h.0.mlp.c_proj.weight: chosen [S(0)] on mesh tp=8")

    consumer = re.search(r"^consumed by (\S+) \(mm\.default\): .* -> outputs \[P\] \(row-parallel over tp\)$",
                         text, re.MULTILINE)
    assert consumer, text
    mm = consumer.group(1)
    entries = plan.alternatives[mm]
    chosen, column = entries[0], next(e for e in entries if e["layout"] == "[S(1)]")
    assert chosen["chosen"] and chosen["layout"] == "[P]"
    assert column["total_seconds"] > chosen["total_seconds"]

    def forward_gathers(e):
        return {(c["value"], c["bytes"]) for c in e["collectives"]
                if c["kind"] == "all_gather" and c["phase"] == "forward"}

    # The column split must gather the MLP's hidden activation (batch 4 x seq 512 x 4*8192 fp32) first.
    (value, nbytes), = forward_gathers(column) - forward_gathers(chosen)
    assert nbytes == 4 * 512 * 4 * 8192 * 4

    block = _why_block(text, "[P] (row-parallel over tp)", "[S(1)] (column-parallel over tp)")
    assert "slower per instance" in block.splitlines()[0]
    needs = block[block.index("needs, where [P] does not:"):block.index("avoids, where [P] needs:")]
    assert re.search(rf"all_gather\(tp, forward\) 256\.00 MiB .* {value} -> {mm}", needs), block
    # ... and the row split's own collective is the reduce-scatter of its partial output.
    avoids = block[block.index("avoids, where [P] needs:"):]
    assert re.search(rf"reduce_scatter\(tp, forward\) .* {mm} -> ", avoids), block


def test_every_node_parameter_and_input_explains(gpt2_8):
    for name in [n["name"] for n in gpt2_8.nodes] + list(gpt2_8.params) + list(gpt2_8.inputs):
        text = gpt2_8.explain(name)
        assert name in text.splitlines()[0]
        assert "options for" in text or "only one layout" in text


def test_later_layer_instances_map_to_the_shared_decision(gpt2_8):
    first = [n for n in gpt2_8.nodes if n["layer"] == "transformer.h.0"]
    later = [n for n in gpt2_8.nodes if n["layer"] == "transformer.h.7"]
    root = next(i for i, n in enumerate(first) if not n["follows"] and n["name"] in gpt2_8.alternatives)
    text = gpt2_8.explain(later[root]["name"])
    assert "12 instance(s)" in text
    assert f"decided by {first[root]['name']}" in text
    assert f"options for {first[root]['name']} " in text

    text = gpt2_8.explain("transformer.h.7.mlp.c_fc.weight")
    assert "the same decision as transformer.h.0.mlp.c_fc.weight" in text
    assert "options for transformer.h.0.mlp.c_fc.weight " in text


def test_unknown_names_suggest_close_matches(gpt2_8):
    with pytest.raises(KeyError, match=r"did you mean .*transformer\.h\.0\.mlp\.c_fc\.weight"):
        gpt2_8.explain("transformer.h.0.mlp.c_fc.weigth")
    with pytest.raises(KeyError, match="give a node name"):
        gpt2_8.explain("zzzz")


def test_explain_cli(gpt2_8, plan_dir, capsys):
    path = str(plan_dir / "gpt2_8xH100.json")
    assert main(["explain", path, "transformer.h.0.mlp.c_fc.weight"]) == 0
    assert capsys.readouterr().out.strip() == gpt2_8.explain("transformer.h.0.mlp.c_fc.weight")
    assert main(["explain", path, "no_such_node"]) == 1
    assert "plan has no node, parameter or input 'no_such_node'" in capsys.readouterr().err
