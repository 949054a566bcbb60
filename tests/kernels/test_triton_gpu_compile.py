"""The decode kernels compile for a CUDA target (sm_90) on a machine without a GPU (a subprocess without
TRITON_INTERPRET: the compiled path checks types the interpreter does not)."""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys
from pathlib import Path

import pytest

SCRIPT = Path(__file__).with_name("aot_compile.py")


@pytest.mark.slow  # ~60 s: ten kernel variants through the CUDA backend and ptxas
@pytest.mark.skipif(importlib.util.find_spec("triton") is None, reason="triton is not installed")
def test_decode_kernels_compile_for_sm90(tmp_path):
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["TRITON_CACHE_DIR"] = str(tmp_path)  # compile for real, not from a cache
    env["PYTHONPATH"] = str(SCRIPT.parents[2]) + os.pathsep + env.get("PYTHONPATH", "")
    r = subprocess.run([sys.executable, str(SCRIPT)], capture_output=True, text=True, env=env, timeout=600)
    assert r.returncode == 0, r.stdout + r.stderr
    # seven split-kernel variants (3-bit included), three of the batched paged kernel, two of the paged writes
    # (four kernels each), the decode rows' inputs and the reduce
    assert r.stdout.count("OK ") == 14
