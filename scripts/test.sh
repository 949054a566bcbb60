#!/usr/bin/env bash
# Set up .venv, then run the test suite. The default suite leaves out tests marked `slow` (the real
# SmolLM2 model end to end); KIVI_SLOW=1 runs everything. Extra arguments go to pytest, e.g.
#   bash scripts/test.sh tests/test_memory.py -x
#   KIVI_SLOW=1 bash scripts/test.sh
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
bash scripts/setup.sh
# shellcheck disable=SC1091
. .venv/bin/activate
if [ "${KIVI_SLOW:-0}" = "1" ]; then
    exec python -m pytest -q "$@"
else
    exec python -m pytest -q -m "not slow" "$@"
fi
