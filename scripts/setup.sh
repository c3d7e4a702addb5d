#!/usr/bin/env bash
# Creates .venv with the CPU build of torch and autopar (editable, with its test extras). Idempotent:
# re-installs only when pyproject.toml changed. Sourced by demo.sh and test.sh.
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
VENV="${AUTOPAR_VENV:-$ROOT/.venv}"
STAMP="$VENV/.autopar-installed"
WANT="$(sha256sum "$ROOT/pyproject.toml" | cut -d' ' -f1)"
if [ ! -f "$STAMP" ] || [ "$(cat "$STAMP")" != "$WANT" ]; then
    echo "setting up $VENV (first run only)..." >&2
    python3 -m venv "$VENV"
    "$VENV/bin/pip" install -q --upgrade pip
    # Pin the CPU wheel first: a looser torch requirement would pull several GB of CUDA packages.
    "$VENV/bin/pip" install -q "torch==2.13.0"
    "$VENV/bin/pip" install -q -e "$ROOT[test]"
    echo "$WANT" > "$STAMP"
fi
PYTHON="$VENV/bin/python"
