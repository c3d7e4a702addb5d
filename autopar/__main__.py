"""``python -m autopar <command>``: each command lives in autopar/cli/<command>.py and provides
``add_arguments(parser)`` and ``run(args) -> int``."""
from __future__ import annotations

import argparse
import importlib
import sys

COMMANDS = {
    "plan": "plan a model for a cluster offline and print the summary",
    "demo": "compile and train a small GPT-2 on local gloo processes, checking parity with one process",
    "report": "write a self-contained HTML report of a plan file",
    "diff": "compare two plan files",
    "explain": "show why a node or parameter got its layout",
}


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="python -m autopar", description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="command", required=True)
    for name, help_text in COMMANDS.items():
        mod = importlib.import_module(f"autopar.cli.{name}")
        p = sub.add_parser(name, help=help_text, description=help_text)
        mod.add_arguments(p)
    args = parser.parse_args(argv)
    return importlib.import_module(f"autopar.cli.{args.command}").run(args) or 0


if __name__ == "__main__":
    sys.exit(main())
