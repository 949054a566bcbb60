"""Backend resolution (kivi/backends.py): decided once, explicit, and loud when the fast path is missing."""

from __future__ import annotations

import os
import re
import subprocess
import sys
import warnings
from pathlib import Path

import pytest

import kivi.backends as backends
from kivi.backends import resolve_attention_backend


def test_auto_without_numba_warns_with_the_fix(monkeypatch):
    monkeypatch.setattr(backends, "numba_problem", lambda: "numba is not installed")
    with pytest.warns(RuntimeWarning, match=r"pip install 'numba"):
        assert resolve_attention_backend("auto", "cpu") == "cpu"
    with pytest.warns(RuntimeWarning, match="numba is not installed"):
        assert resolve_attention_backend("cpu", None) == "cpu"


def test_no_warning_with_numba_or_for_reference(monkeypatch):
    monkeypatch.setattr(backends, "numba_problem", lambda: None)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert resolve_attention_backend("auto", "cpu") == "cpu"
    monkeypatch.setattr(backends, "numba_problem", lambda: "numba is not installed")
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert resolve_attention_backend("reference", "cpu") == "reference"


def _decode_in_a_process(**env: str) -> str:
    """stderr of a fresh process (``env`` added) that resolves the ``"cpu"`` backend and runs one decode step of a
    kivi layer through it, checked equal to the blocked torch path."""
    code = (
        "import torch, warnings; warnings.simplefilter('always')\n"
        "from kivi import KiviConfig; from kivi.backends import resolve_backend\n"
        "from kivi.attention.backend_attention import attend; from kivi.attention.blocked import blocked_attention\n"
        "from kivi.cache.layer import KiviLayer\n"
        "backend = resolve_backend('cpu', 'cpu', config=KiviConfig())\n"
        "layer, g = KiviLayer(KiviConfig(group_size=8, residual_length=16, block_size=32)), torch.Generator()\n"
        "for n in (100, 1):\n"
        "    views = layer.append(torch.randn(1, 2, n, 32, generator=g), torch.randn(1, 2, n, 32, generator=g))\n"
        "q = torch.randn(1, 4, 1, 32, generator=torch.Generator().manual_seed(0))\n"
        "out = attend(backend, q, *views, scaling=None, attention_mask=None)\n"
        "assert torch.equal(out, blocked_attention(q, *views)), 'not the blocked path'\n"
        "print(backend.name)\n"
    )
    root = Path(__file__).resolve().parents[1]
    done = subprocess.run([sys.executable, "-c", code], cwd=root, capture_output=True, text=True, timeout=300,
                          env=dict(os.environ, PYTHONPATH=str(root), **env))
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "cpu"
    return done.stderr


@pytest.mark.parametrize(("env", "says", "fix"), [
    ({"NUMBA_NUM_THREADS": "0"}, r"numba cannot be imported \(ValueError: Number of threads", "NUMBA_\\* environment"),
    ({"NUMBA_DISABLE_JIT": "1"}, r"numba's JIT is disabled \(NUMBA_DISABLE_JIT=1\)", "unset NUMBA_DISABLE_JIT"),
], ids=["import-fails", "jit-disabled"])
def test_a_numba_that_cannot_run_is_reported_with_its_real_reason(env, says, fix):
    """Not "not installed ... pip install": the reason numba cannot run, once, and decoding runs the blocked path."""
    err = _decode_in_a_process(**env)
    assert re.search(f"kivi: {says}.*blocked torch path.*Fix: .*{fix}", err), err
    assert "pip install" not in err and err.count("kivi: ") == 1, err


def test_unknown_backend_names_the_choices():
    with pytest.raises(ValueError, match=r"attention_backend='fast'.*'auto', 'reference', 'cpu', 'triton'"):
        resolve_attention_backend("fast")


class _Softcapped:
    attn_logit_softcapping = 50.0


def test_each_backend_lists_every_reason_it_cannot_run(monkeypatch):
    """``supports`` returns one list of reasons (empty = it runs); an explicit request's error names them all."""
    from kivi import KiviConfig
    from kivi.backends import CpuBackend, ReferenceBackend, TritonBackend, resolve_backend

    monkeypatch.setattr(backends, "triton_available", lambda: False)
    sym = KiviConfig(symmetric=True)
    why = TritonBackend().supports(device="cpu", config=sym, model_config=_Softcapped())
    assert len(why) == 4 and any("softcapping" in w for w in why) and any("'triton' package" in w for w in why)
    assert any("CUDA device" in w for w in why) and any("symmetric quantization" in w for w in why)
    assert CpuBackend().supports(model_config=_Softcapped()) and not CpuBackend().supports(device="cpu", config=sym)
    assert ReferenceBackend().supports(device="cpu", config=sym, model_config=_Softcapped()) == []
    with pytest.raises(RuntimeError) as e:
        resolve_backend("triton", "cpu", config=sym)
    assert all(part in str(e.value) for part in ("'triton' package", "CUDA device", "symmetric quantization"))


def test_resolution_gives_an_object_for_the_config():
    from kivi import KiviConfig
    from kivi.backends import CpuBackend, ReferenceBackend, resolve_backend

    cfg = KiviConfig()
    got = resolve_backend("auto", "cpu", config=cfg)
    assert isinstance(got, CpuBackend) and got.config is cfg and got.packed
    assert isinstance(resolve_backend("auto", "cpu", model_config=_Softcapped()), ReferenceBackend)


@pytest.mark.parametrize("cfg,reads", [
    ({}, True),
    ({"group_size": 6, "residual_length": 0, "block_size": 24}, False),  # value groups of 6 channels
    ({"layer_specific_config": {1: {"group_size": 6, "residual_length": 0}}, "block_size": 96}, False),
    ({"layer_specific_config": {1: {"group_size": 6, "residual_length": 0, "quantize_value": False}},
      "block_size": 96}, True),  # that layer stores no values: keys in any group size are read
    ({"k_bits": 3, "v_bits": 1, "tiers": [(128, None), (256, (3, 1)), (None, (3, 1))]}, True),
], ids=["default", "g6", "layer-g6", "layer-g6-fp-values", "tiers"])
def test_cpu_backend_decides_the_stored_formats_once_per_config(cfg, reads):
    from kivi import KiviConfig
    from kivi.backends import CpuBackend

    assert CpuBackend(KiviConfig(**cfg)).kernel_reads_layouts is reads
    assert CpuBackend().kernel_reads_layouts is None  # no config: each call's views are checked


def test_stored_formats_are_every_format_a_cache_stores():
    """Per-layer overrides, per-head widths (of their own layer only) and position tiers, each format once;
    the Triton check reads symmetric codes and compensation off them."""
    import dataclasses

    from kivi import KiviConfig
    from kivi.backends import TritonBackend, stored_formats

    cfg = KiviConfig(k_bits=4, v_bits=4, group_size=16, residual_length=32, block_size=64,
                     tiers=[(32, None), (64, 4), (None, 2)],
                     layer_specific_config={1: {"tiers": None, "symmetric": True, "quantize_value": False}},
                     head_bits={2: {"k_bits": [8, 4]}})
    k, v = cfg.side_format("k"), cfg.side_format("v")
    sym = dataclasses.replace(k, symmetric=True)
    assert stored_formats(cfg) == [dataclasses.replace(k, bits=2), k, dataclasses.replace(v, bits=2), v, sym,
                                   dataclasses.replace(k, bits=8)]
    assert TritonBackend().supports(config=cfg)[-1:] == ["does not implement symmetric quantization; use 'cpu' or "
                                                         "'reference'"]
    no_sym = dataclasses.replace(cfg, layer_specific_config={1: {"tiers": None, "quantize_value": False}})
    assert not any("symmetric" in w for w in TritonBackend().supports(config=no_sym))


def test_decode_steps_of_a_cache_do_not_rescan_formats(monkeypatch):
    """The cache's backend decided its formats when it was built: decode steps check only query and mask,
    and still run the fused kernel (same logits as a backend that scans every call)."""
    pytest.importorskip("numba")
    import torch

    import kivi.attention.fused_cpu as fused
    from kivi import KiviConfig, quantize_model
    from kivi.backends import CpuBackend
    from kivi.cache import KiviCache
    from tests.helpers import tiny_model

    cfg = KiviConfig(group_size=8, residual_length=8, block_size=16, attention_backend="cpu")
    model = quantize_model(tiny_model("llama", num_key_value_heads=2), cfg)
    scans, kernel_calls = [], []
    import kivi.attention.fused_cpu.dispatch as dispatch

    real_reasons, real_kernel = dispatch.kernel_reasons, fused.fused_decode_attention
    monkeypatch.setattr(dispatch, "kernel_reasons", lambda *a, **k: scans.append(a) or real_reasons(*a, **k))
    monkeypatch.setattr(fused, "fused_decode_attention", lambda *a, **k: kernel_calls.append(1) or real_kernel(*a, **k))
    cache = KiviCache.from_model(model)
    assert isinstance(cache.backend, CpuBackend) and cache.backend.kernel_reads_layouts is True
    scans.clear()
    ids = torch.randint(1, 100, (1, 40))
    with torch.no_grad():
        out = model(ids, cache=cache, use_cache=True).logits
        for t in range(3):
            out = model(ids[:, t:t + 1], cache=cache, use_cache=True).logits
    assert scans == [] and len(kernel_calls) == 3 * model.config.num_hidden_layers
    assert torch.isfinite(out).all()
