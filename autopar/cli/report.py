"""``python -m autopar report plan.json --html report.html``: write the self-contained HTML report of a
saved plan."""
from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("plan", metavar="PLAN.json", help="a plan saved by `python -m autopar plan --out` or Plan.save")
    p.add_argument("--html", default=None, metavar="REPORT.html",
                   help="where to write the report (default: the plan's path with .html)")


def run(args: argparse.Namespace) -> int:
    from autopar.errors import PlanFormatError
    from autopar.plan import Plan

    out = Path(args.html) if args.html else Path(args.plan).with_suffix(".html")
    try:
        plan = Plan.load(args.plan)
    except (OSError, PlanFormatError) as e:
        print(f"autopar report: error: {e}", file=sys.stderr)
        return 1
    t0 = time.perf_counter()
    plan.to_html(out)
    print(f"wrote {out} ({out.stat().st_size / 1e6:.2f} MB) in {time.perf_counter() - t0:.2f} s")
    return 0
