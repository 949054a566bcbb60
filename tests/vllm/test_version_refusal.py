"""A vLLM other than the tested release is refused in one line, by the plugin's entry point and therefore by
vLLM itself (which calls it while it reads its arguments, before loading a model)."""

from __future__ import annotations

import subprocess
import sys
import types

import pytest

from kivi.vllm import register
from kivi.vllm.version import TESTED_VLLM


def test_register_refuses_another_vllm(monkeypatch):
    """No vLLM needed: the check runs before anything of vLLM's is imported."""
    monkeypatch.setitem(sys.modules, "vllm", types.SimpleNamespace(__version__="0.31.0"))
    with pytest.raises(RuntimeError) as e:
        register()
    msg = str(e.value)
    assert "\n" not in msg and "0.31.0" in msg and TESTED_VLLM in msg


@pytest.mark.vllm
@pytest.mark.parametrize("version", ["0.31.0", "0.33.0"])
def test_openai_server_refuses_another_vllm(version, tmp_path):
    """The server entry point with the installed vLLM reporting another version stops with the plugin's line,
    before it looks at the model (the folder does not exist)."""
    code = ("import runpy, sys, vllm; vllm.__version__ = sys.argv[1]; sys.argv[1:2] = []; "
            "runpy.run_module('vllm.entrypoints.openai.api_server', run_name='__main__')")
    proc = subprocess.run([sys.executable, "-c", code, version, "--model", str(tmp_path / "no-model"),
                           "--additional-config", '{"kivi": {"k_bits": 2, "v_bits": 2}}'],
                          capture_output=True, text=True, timeout=600)
    assert proc.returncode != 0
    last = proc.stderr.strip().splitlines()[-1]
    assert last.startswith("RuntimeError: kivi's vLLM plugin") and version in last and TESTED_VLLM in last, (
        proc.stderr[-3000:])
