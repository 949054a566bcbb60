#!/usr/bin/env bash
# Per-layer profile, budgeted tuning and passkey retrieval on SmolLM2 (shipped WikiText-2).
# Sized for a busy 2-core CPU box; raise --windows / --seeds on a real machine.
set -euo pipefail
cd "$(dirname "$0")/.."
mkdir -p results
export OMP_NUM_THREADS=${OMP_NUM_THREADS:-1}
WINDOWS=${WINDOWS:-20}
# Main grid (FP reference + presets, 2-bit variants, quanto baselines); JSON rewritten after every 2 windows.
python benchmarks/run_eval_suite.py --suite main --windows "$WINDOWS" --batch-size 2 --threads 1 --out results/main_suite.json
python benchmarks/run_eval_suite.py --summarize results/main_suite.json --csv results/main_suite.csv --plot results/pareto.png
kivi profile --context 512 --prefix 256 --windows 1 --upgrade-layers 3 --json \
  -o results/layer_profile.json --write-config results/profile_recommended_config.json > /dev/null
kivi tune --max-ppl-increase 5% --profile results/layer_profile.json --windows 2 --json \
  -o results/tune_5pct.json --write-config results/tuned_config_5pct.json > /dev/null
kivi eval passkey --presets high,extreme --lengths 1024,2048,4096 --depths 0.5 --seeds 2 --json \
  -o results/passkey.json > /dev/null
