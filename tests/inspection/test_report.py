"""plan.to_html and `python -m autopar report`, without a browser: self-contained, complete, fast."""
from __future__ import annotations

import html
import json
import re

from autopar.__main__ import main


def expected_rows(plan) -> list[str]:
    """The per-op table's rows: every node outside repeated layers, and every node of the first
    instance of each layer class (the other instances share its layouts and are summarised)."""
    first = {}
    for n in plan.nodes:
        if n["layer"]:
            first.setdefault(n["layer_class"], n["layer"])
    return [n["name"] for n in plan.nodes if not n["layer"] or first[n["layer_class"]] == n["layer"]]


def check_report(plan, text: str) -> None:
    # Self-contained: the only links are in-page anchors, and nothing loads or fetches.
    assert all(u.startswith("#") for u in re.findall(r'(?:src|href)\s*=\s*"([^"]*)"', text))
    for needle in ("<link", "@import", "fetch(", "XMLHttpRequest", "http://", "https://"):
        assert needle not in text, needle
    assert not re.search(r"url\((?!#)", text), "only in-page url(#id) references"
    body = re.search(r'<table id="op-table".*?<tbody>(.*?)</tbody><tfoot>(.*?)</tfoot>', text, re.DOTALL)
    rows = [html.unescape(x) for x in re.findall(r'<tr data-name="([^"]*)"', body.group(1))]
    assert rows == expected_rows(plan)
    summarised = sum(int(x) for x in re.findall(r'data-ops="(\d+)"', body.group(2)))
    assert len(rows) + summarised == len(plan.nodes)
    data = json.loads(re.search(r'<script type="application/json" id="plan-data">(.*?)</script>', text, re.DOTALL)
                      .group(1).replace("<\\/", "</"))
    assert set(rows) <= set(data["explain"])
    assert data["explain"][rows[-1]] == plan.explain(rows[-1])


def test_report_is_self_contained_and_complete(gpt2_8, tmp_path):
    path = tmp_path / "gpt2.html"
    gpt2_8.to_html(path)
    text = path.read_text()
    check_report(gpt2_8, text)
    for section in ("summary", "graph", "ops", "params", "memory", "comm"):
        assert f'<section id="{section}">' in text
    assert "dp=8" in text and "8xH100" in text


def test_llama2_70b_on_512_gpus_writes_a_small_complete_report(llama2_70b, tmp_path):
    path = tmp_path / "llama2-70b.html"
    llama2_70b.to_html(path)
    assert path.stat().st_size < 5e6, f"the report is {path.stat().st_size / 1e6:.2f} MB"
    check_report(llama2_70b, path.read_text())


def test_report_cli(gpt2_8, plan_dir, tmp_path, capsys):
    out = tmp_path / "r.html"
    assert main(["report", str(plan_dir / "gpt2_8xH100.json"), "--html", str(out)]) == 0
    assert f"wrote {out}" in capsys.readouterr().out
    check_report(gpt2_8, out.read_text())
    assert main(["report", str(tmp_path / "missing.json")]) == 1
    assert "autopar report: error" in capsys.readouterr().err
