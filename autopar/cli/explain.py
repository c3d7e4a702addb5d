"""``python -m autopar explain plan.json NAME``: why a node or parameter got its layout."""
from __future__ import annotations

import argparse
import sys


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("plan", metavar="PLAN.json", help="a saved plan")
    p.add_argument("name", help="a node name (as in the report's table) or a parameter FQN")


def run(args: argparse.Namespace) -> int:
    from autopar.errors import PlanFormatError
    from autopar.plan import Plan

    try:
        print(Plan.load(args.plan).explain(args.name))
    except (OSError, PlanFormatError) as e:
        print(f"autopar explain: error: {e}", file=sys.stderr)
        return 1
    except KeyError as e:
        print(f"autopar explain: error: {e.args[0]}", file=sys.stderr)
        return 1
    return 0
