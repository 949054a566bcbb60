#!/usr/bin/env bash
# kivi on a GPU in one command (docs/kernels.md, "Checking on a GPU"): on a machine with torch, triton and a
# transformers 5.x already installed and nothing reachable, install what .whl/ carries, then run
# benchmarks/bench_triton_gpu.py check (a. correctness in fp16/bf16, b. kernel timings, c. the spec's table at LLaMA-2-13B's
# shape; each part stops on its own time budget), writing gpu_check.json / gpu_check.txt under $OUT.
#
#   bash scripts/gpu-check.sh              # on the GPU machine (about 7 minutes; OUT defaults to results/tmp/gpu-check)
#   bash scripts/gpu-check.sh --dry-run    # tiny shapes on CPU under TRITON_INTERPRET=1, no install (CI runs this)
#
# .whl/ (git-ignored) is filled on a machine with the package index, for the GPU machine's python (its
# --python-version: `kernels` ships per-version wheels; the rest are abi3 or pure python; 21 MB in all):
#   python -m pip wheel --no-deps -w .whl .
#   python -m pip download -d .whl --no-deps --only-binary=:all: --python-version 3.11 \
#       --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 \
#       'transformers==5.25.0' 'huggingface-hub>=2.4,<3' 'tokenizers>=0.23.1,<0.24' 'safetensors>=0.8' typer \
#       'kernels>=0.19.1,<0.20' optimum-quanto
# (transformers' other requirements are the preinstalled release's; when one is missing, pip refuses and the
# preinstalled transformers is kept, with a message.)
# kivi goes in with --no-deps (its numba dependency is only needed by the CPU kernel, which this does not run).
# Extra arguments go to benchmarks/bench_triton_gpu.py check (e.g. --contexts 4096 32768 --table-seconds 300).
set -uo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
PYTHON=${PYTHON:-python}
OUT=${OUT:-results/tmp/gpu-check}
export OUT
mkdir -p "$OUT"
dry=0
for a in "$@"; do [ "$a" = "--dry-run" ] && dry=1; done

if [ "$dry" = 1 ]; then
    export TRITON_INTERPRET=1
else
    if compgen -G ".whl/*.whl" >/dev/null; then
        # transformers: a release kivi is tested with (kivi/batching/version.py) when .whl carries it; the
        # preinstalled one otherwise (kivi's generate() needs only transformers>=5.0)
        if ! $PYTHON -c "import sys; from kivi.batching.version import transformers_version_problem as p; sys.exit(p() is not None)" 2>/dev/null; then
            $PYTHON -m pip install --quiet --no-index --find-links .whl 'transformers~=5.25.0' \
                || echo "gpu-check: transformers 5.25 from .whl did not install; keeping the preinstalled one" >&2
        fi
        $PYTHON -m pip install --quiet --no-index --find-links .whl optimum-quanto \
            || echo "gpu-check: optimum-quanto did not install (transformers' QuantizedCache rows will say so)" >&2
        if compgen -G ".whl/kivi-*.whl" >/dev/null; then
            $PYTHON -m pip install --quiet --no-index --no-deps --force-reinstall .whl/kivi-*.whl
        fi
    fi
    nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader || true
fi
# the checkout's kivi unless a wheel was installed above (the wheel is built from the same tree)
if ! $PYTHON -c "import kivi" 2>/dev/null; then
    export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
fi
$PYTHON -c "import kivi, torch, transformers; print('gpu-check: kivi', kivi.__file__, '| torch', torch.__version__, '| transformers', transformers.__version__)"
exec $PYTHON benchmarks/bench_triton_gpu.py check --out-dir "$OUT" "$@"
