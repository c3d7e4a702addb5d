#!/usr/bin/env bash
# Sets up and runs the test suite. Extra arguments go to pytest.
set -uo pipefail
source "$(dirname "${BASH_SOURCE[0]}")/setup.sh" || exit 1
cd "$ROOT"
# Browser tests of the HTML report need Debian's chromium; install it when missing and we may.
if ! command -v chromium >/dev/null 2>&1 && [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null 2>&1; then
    (apt-get update -qq && apt-get install -y -qq chromium >/dev/null) || echo "could not install chromium" >&2
fi
# Every rank is its own process on a 2-core machine: one thread each keeps them from fighting.
export OMP_NUM_THREADS="${OMP_NUM_THREADS:-1}" TRITON_INTERPRET=1
"$PYTHON" -m pytest -q -p no:cacheprovider "$@"
rc=$?
if [ "$rc" -eq 5 ]; then
    echo "pytest collected no tests for this selection" >&2
    rc=0
fi
exit "$rc"
