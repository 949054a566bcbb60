#!/usr/bin/env bash
# Set up .venv, then run the test suite. The default suite leaves out tests marked `slow` (the real
# SmolLM2 model end to end) and `long` (coverage CI runs in its step 1c: `bash scripts/test.sh -m long`, a later
# -m replacing this one); KIVI_SLOW=1 runs everything. Extra arguments go to pytest, e.g.
#   bash scripts/test.sh tests/test_memory.py -x
#   KIVI_SLOW=1 bash scripts/test.sh
# Tests run in KIVI_TEST_WORKERS pytest-xdist processes (default 2: the 2-core CI machine; 0 runs them in this
# process; docs/cli.md, "Setup", gives the suite's measured time on the 2-core VM).
#: tests marked with one xdist_group run in one worker, in order (the rest as --dist load).
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
bash scripts/setup.sh
# shellcheck disable=SC1091
. .venv/bin/activate
workers=${KIVI_TEST_WORKERS:-2}
if [ "${KIVI_SLOW:-0}" = "1" ]; then
    exec python -m pytest -q -n "$workers" "$@"
else
    exec python -m pytest -q -n "$workers" -m "not slow and not long" "$@"
fi
