"""Plan inspection, reading only the Plan record (so it works on a saved plan file with no model,
graph or GPU): why a node or parameter got its layout (``explain``), what differs between two plans
(``diff``), and a self-contained HTML report (``to_html``). The package is ``autopar.inspection``, not
``inspect``, so that it is never mistaken for the standard library's module. The format of each view is
described in docs/inspection.md.
"""
from autopar.inspection.diff import CollectiveChange, LayoutChange, PlanDiff, diff
from autopar.inspection.explain import explain
from autopar.inspection.html import render_html, to_html

__all__ = ["CollectiveChange", "LayoutChange", "PlanDiff", "diff", "explain", "render_html", "to_html"]
