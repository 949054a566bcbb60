#!/usr/bin/env bash
# The main demo on a fresh machine: set up .venv, then `kivi demo` (SmolLM2-135M on WikiText-2,
# full precision vs the KIVI presets). Extra arguments go to `kivi demo`, e.g.
#   bash scripts/demo.sh --context 4000 --json-out demo.json
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
bash scripts/setup.sh
# shellcheck disable=SC1091
. .venv/bin/activate
exec kivi demo "$@"
