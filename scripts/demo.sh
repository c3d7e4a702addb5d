#!/usr/bin/env bash
# The main job: compile a small GPT-2 for 2 gloo processes, print the plan, train 20 steps and check
# every loss against a single-process run. Extra arguments go to `python -m autopar demo`.
set -euo pipefail
source "$(dirname "${BASH_SOURCE[0]}")/setup.sh"
exec "$PYTHON" -m autopar demo "$@"
