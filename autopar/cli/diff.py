"""``python -m autopar diff a.json b.json``: what differs between two saved plans."""
from __future__ import annotations

import argparse
import dataclasses
import json
import sys


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("a", metavar="A.json", help="the first plan")
    p.add_argument("b", metavar="B.json", help="the second plan")
    p.add_argument("--json", action="store_true", help="print the difference as JSON instead of text")


def run(args: argparse.Namespace) -> int:
    import autopar
    from autopar.errors import PlanFormatError

    try:
        a, b = autopar.Plan.load(args.a), autopar.Plan.load(args.b)
    except (OSError, PlanFormatError) as e:
        print(f"autopar diff: error: {e}", file=sys.stderr)
        return 1
    d = autopar.diff(a, b)
    print(json.dumps(dataclasses.asdict(d), indent=1) if args.json else d)
    return 0
