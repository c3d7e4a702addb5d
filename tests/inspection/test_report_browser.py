"""The HTML report in a real headless Chromium: loads without console errors, shows every section, has
a table row for every planned node (see test_report.expected_rows), explains a clicked row, and
renders a non-blank page."""
from __future__ import annotations

import json

import pytest

from tests.inspection.browser import Browser, find_chromium, png_distinct_pixels
from tests.inspection.test_report import expected_rows

CHROMIUM = find_chromium()
pytestmark = pytest.mark.skipif(CHROMIUM is None, reason="needs Chromium: apt-get install -y chromium")

SECTIONS = ("summary", "graph", "ops", "params", "memory", "comm")


@pytest.fixture
def browser():
    b = Browser(CHROMIUM)
    yield b
    b.close()


# usefixtures names the plans, which getfixturevalue hides: tests/conftest.py groups tests by the fixtures named.
@pytest.mark.usefixtures("gpt2_8", "llama3_8b")
@pytest.mark.parametrize("which", ["gpt2_8", "llama3_8b"])
def test_report_in_chromium(which, request, browser, tmp_path):
    plan = request.getfixturevalue(which)
    path = tmp_path / f"{which}.html"
    plan.to_html(path)
    browser.open(path.as_uri())

    for sid in SECTIONS:
        shown = browser.js(f"(() => {{ const e = document.getElementById('{sid}'); const r = e.getBoundingClientRect();"
                           f" return e.querySelector('h2') !== null && r.height > 60 && r.width > 300; }})()")
        assert shown, f"section {sid} is not shown"
    assert browser.js("document.querySelectorAll('#memory-chart polygon').length") == 5
    assert browser.js("document.querySelectorAll('#comm-chart rect').length") > 0
    assert browser.js("document.querySelectorAll('#graph-view svg .edge').length") > 0

    rows = browser.js("Array.from(document.querySelectorAll('#op-table tbody tr')).map(r => r.dataset.name)")
    assert rows == expected_rows(plan)
    summarised = browser.js("Array.from(document.querySelectorAll('#op-table tfoot tr'))"
                            ".reduce((s, r) => s + Number(r.dataset.ops), 0)")
    assert len(rows) + summarised == len(plan.nodes)

    # Clicking a row of the repeated layer shows that node's explanation.
    name = next(n["name"] for n in plan.nodes if n["layer"] and n["op"] in ("mm.default", "linear.default"))
    browser.click(f'#op-table tbody tr[data-name="{name}"]')
    assert browser.js("document.getElementById('explain').textContent") == plan.explain(name)
    assert browser.js(f"document.querySelector('#op-table tr[data-name=\"{name}\"]').classList.contains('selected')")

    # Sorting by compute puts the most expensive node first on the second click.
    browser.click("#op-table thead th:nth-child(7)")
    browser.click("#op-table thead th:nth-child(7)")
    top = max(float(f"{n['compute_seconds']:.6g}") for n in plan.nodes if n["name"] in set(rows))
    assert float(browser.js("document.querySelector('#op-table tbody tr td:nth-child(7)').dataset.v")) == top

    # The collapsed layer expands to its first instance; its nodes explain themselves too.
    before = browser.js("document.querySelectorAll('#graph-view [data-node]').length")
    browser.click("#graph-view [data-group]")
    assert browser.js("document.querySelectorAll('#graph-view [data-node]').length") > before
    browser.click(f'#graph-view [data-node="{name}"]')
    assert browser.js("document.getElementById('graph-explain').textContent").startswith(f"node {name}:")

    assert browser.errors == [], json.dumps(browser.errors, indent=1)
    browser.js("window.scrollTo(0, 0)")
    shot = browser.screenshot(tmp_path / f"{which}.png")
    assert png_distinct_pixels(shot) > 1, "the screenshot is blank"
