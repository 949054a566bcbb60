"""kivi/capabilities.py: every cell of the table (feature x host x backend) against what the host's entry points do.

For each cell a config (or a machine fact) with that feature goes through the host's entry points: refused
(``resolve_backend``; ``build_layout`` + ``pages_attention_backend``; the vLLM plugin's ``kivi_config``), or accepted
and then read by the decode kernel or not (``CpuBackend.kernel_reads_layouts`` and ``fused_decode_supported``; the
paged cache's kernel layouts; ``decode_kernel`` and its writer). Cells whose kernel choice needs a GPU to observe are
checked for acceptance only.
"""

from __future__ import annotations

import dataclasses
import importlib.util
import warnings
from types import SimpleNamespace

import pytest
import torch

import kivi.attention.fused_cpu.dispatch as dispatch
import kivi.backends as backends
import kivi.paged.decode_call as vdecode
from kivi import KiviConfig, KiviLayer
from kivi.capabilities import BACKENDS, HOSTS, KERNEL_BITS, OK, REFUSED, TABLE, TORCH, WRITES, host_reasons, reasons
from kivi.quant.primitives import SUPPORTED_BITS
from tests.helpers import tiny_model

BASE = dict(k_bits=2, v_bits=2, group_size=8, residual_length=8)


class _Softcapped:
    attn_logit_softcapping = 50.0


#: feature -> (config fields over BASE, machine facts): a cache with that feature and no other
SAMPLES = {
    "head_bits": ({"head_bits": {0: {"k_bits": [2, 4]}}}, {}),
    "unquantized_side": ({"quantize_key": False}, {}),
    "tiers": ({"tiers": [(8, None), (1024, 2), (None, 1)]}, {}),
    "quantize_after": ({"quantize_after": 64}, {}),
    "layer_specific_config": ({"layer_specific_config": {1: {"k_bits": 4}}}, {}),
    "key_rotation": ({"key_rotation": "hadamard"}, {}),
    "symmetric": ({"symmetric": True}, {}),
    "compensation": ({"residual_bits": 1}, {}),
    "odd_code_width": ({"k_bits": 3, "v_bits": 3}, {}),
    "value_groups": ({"group_size": 2}, {}),
    "clip": ({"clip": True}, {}),
    "unchecked": ({"check_finite": False}, {}),
    "model_attention": ({}, {"model_config": _Softcapped()}),
    "no_numba": ({}, {"numba": "numba is not installed"}),
    "no_triton": ({}, {"triton": False}),
    "not_cuda": ({}, {"device": "cpu"}),
    "not_cpu": ({}, {"device": "cuda"}),
    "param_dtype": ({}, {"dtype": torch.float64}),
    "write_dtypes": ({}, {"dtype": torch.float16}),
    "sliding_window": ({}, {"sliding": True}),
}
#: cells whose kernel choice is only seen on a GPU: checked for acceptance
ACCEPTANCE_ONLY = {("generate", "triton"), ("vllm", "triton", "not_cpu")}
HAS_TRITON = importlib.util.find_spec("triton") is not None


def _generate(cfg, backend, facts, mp):
    mp.setattr(backends, "triton_available", lambda: facts.get("triton", True))
    mp.setattr(backends, "numba_problem", lambda: facts.get("numba"))
    device = facts.get("device", "cuda" if backend == "triton" else "cpu")
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            chosen = backends.resolve_backend(backend, device, config=cfg, model_config=facts.get("model_config"))
    except (ValueError, RuntimeError) as e:
        return REFUSED, str(e)
    if backend != "cpu":
        return OK, ""
    if chosen.kernel_reads_layouts is False:
        return TORCH, ""
    mp.setattr(dispatch, "numba_available", lambda: not facts.get("numba"))
    layer, g = KiviLayer(KiviConfig(group_size=8, residual_length=16, block_size=32)), torch.Generator()
    for n in (100, 1):
        views = layer.append(torch.randn(1, 2, n, 32, generator=g), torch.randn(1, 2, n, 32, generator=g))
    q = torch.randn(1, 4, 1, 32, device="cpu" if device == "cpu" else "meta")
    return (OK if dispatch.fused_decode_supported(q, *views, formats_checked=True) else TORCH), ""


def _batching(cfg, backend, facts, mp):
    from transformers.generation.configuration_utils import ContinuousBatchingConfig

    import kivi.batching.manager as manager
    import kivi.batching.paged_cache as bcache
    import kivi.kernels._common as common
    from kivi.batching.layout import build_layout

    if backend == "triton" and facts.get("triton", True) and not HAS_TRITON:
        pytest.skip("triton is not installed: this cell's kernel choice is checked where it is")
    model = tiny_model("mistral", sliding_window=64) if facts.get("sliding") else tiny_model()
    cfg = dataclasses.replace(cfg, attention_backend=backend)
    device = facts.get("device", "cpu")
    mp.setattr(manager, "triton_available", lambda: facts.get("triton", True))
    mp.setattr(common, "require_triton", lambda device: None)  # the kernels' device rule: tested in tests/kernels
    try:
        layout = build_layout(model.config, cfg, 32, facts.get("dtype", torch.float32))
        fake = SimpleNamespace(device=torch.device(device), config=facts.get("model_config") or model.config)
        packed = manager.pages_attention_backend(cfg, fake)
    except ValueError as e:
        return REFUSED, str(e)
    if backend == "reference":
        return OK, ""
    assert packed == backend
    mp.setattr(vdecode, "numba_problem", lambda: facts.get("numba"))
    mp.setattr(vdecode, "triton_available", lambda: facts.get("triton", True))
    cb = ContinuousBatchingConfig(page_size=32, max_batch_tokens=512)
    cache = bcache.KiviPagedCache(model.config, cb, "cpu" if device == "cpu" else "meta", layout=layout,
                                  cache_memory=2 * 1024**2, packed_backend=packed)
    kernels = [k for k in cache._kernels if k is not None]
    return (TORCH if not kernels else WRITES if any(k.writer is None for k in kernels) else OK), ""


def _vllm(cfg, backend, facts, mp):
    from kivi.paged.geometry import build_geometry
    from kivi.vllm.config import kivi_config
    from tests.paged.test_decode_call import Cache

    try:
        got = kivi_config({"kivi": {**cfg.to_dict(), "attention_backend": backend}})
    except ValueError as e:
        return REFUSED, str(e)
    if backend == "reference":
        return OK, ""
    if backend == "triton" and facts.get("triton", True) and not HAS_TRITON:
        pytest.skip("triton is not installed: this cell's kernel choice is checked where it is")
    mp.setattr(vdecode, "numba_problem", lambda: facts.get("numba"))
    mp.setattr(vdecode, "triton_available", lambda: facts.get("triton", True))
    dtype = facts.get("dtype", torch.float32)
    geo = build_geometry(got, page_size=16, num_kv_heads=2, head_dim=16, dtype=dtype)
    cache = Cache(geo, dtype)
    pages = cache.pages if facts.get("device", "cpu") == "cpu" else cache.pages.to("meta")
    kernel = vdecode.decode_kernel(got, geo, backend, pages, cache.rings)
    return (TORCH if kernel is None else WRITES if kernel.writer is None else OK), ""


ENTRY = {"generate": _generate, "batching": _batching, "vllm": _vllm}
CELLS = [(f.name, h, b) for f in TABLE if f.name in SAMPLES for h in HOSTS for b in BACKENDS]


def test_every_feature_has_a_sample_but_the_vacuous_one():
    """Every row is exercised below; ``code_width`` has no sample because no config can hold it: every width a
    config takes is one the kernels read (the row stays for a width added to the quantizer first)."""
    assert set(SAMPLES) | {"code_width"} == {f.name for f in TABLE}
    assert set(SUPPORTED_BITS) <= set(KERNEL_BITS)


@pytest.mark.parametrize("feature, host, backend", CELLS, ids=["-".join(c) for c in CELLS])
def test_cell_is_what_the_host_does(feature, host, backend, monkeypatch):
    fields, facts = SAMPLES[feature]
    cfg = KiviConfig(**{**BASE, **fields})
    want = next(f for f in TABLE if f.name == feature).cells[host, backend]
    got, message = ENTRY[host](cfg, backend, facts, monkeypatch)
    if want == REFUSED or got == REFUSED:
        assert got == want, f"{feature} on {host}/{backend}: table says {want}, the host did {got}: {message}"
        detail = [r.detail for r in reasons(cfg, host, backend, **{k: v for k, v in facts.items()
                                                                   if k not in ("dtype", "sliding")})
                  if r.feature == feature]
        assert detail and detail[0] in message, message
    elif (host, backend) in ACCEPTANCE_ONLY or (host, backend, feature) in ACCEPTANCE_ONLY or backend == "reference":
        assert got != REFUSED
    else:
        assert got == want, f"{feature} on {host}/{backend}: table says {want}, the host did {got}"


def test_the_default_config_runs_every_kernel_it_can(monkeypatch):
    """No feature: every host and backend accepts it, and each kernel that can run here reads it."""
    for host in HOSTS:
        for backend in ("cpu",):
            assert ENTRY[host](KiviConfig(**BASE), backend, {}, monkeypatch)[0] == OK


def test_host_reasons_name_every_setting_pages_cannot_hold():
    assert host_reasons(KiviConfig(), "batching") == []
    assert host_reasons(KiviConfig(layer_specific_config={1: {"k_bits": 4}}), "batching") == []
    got = host_reasons(KiviConfig(quantize_after=64, head_bits={0: {"k_bits": [2, 4]}},
                                  layer_specific_config={2: {"quantize_value": False}, 3: {"k_bits": 4}}), "batching")
    assert [r.detail.split(":")[0] for r in got] == [
        "head_bits", "layer_specific_config[2].quantize_key=True, quantize_value=False", "quantize_after=64"]
    tiers = host_reasons(KiviConfig(tiers=[(128, None), (1024, 2), (None, 1)], k_bits=2, v_bits=2), "batching")
    assert len(tiers) == 1 and tiers[0].detail.startswith("tiers=[[128, None], [1024, (2, 2)], [None, (1, 1)]]: ")
    assert [r.feature for r in host_reasons(KiviConfig(layer_specific_config={1: {"k_bits": 4}}), "vllm")] == [
        "layer_specific_config"]


def test_the_paged_kernels_cells_agree_between_hosts():
    """batching and vllm run the same step (kivi.paged): a format or machine fact whose kernel or writes one host
    declines the other declines too, on both packed backends, unless a host refuses it on every backend, (triton
    missing) refuses the backend, or never reaches the step with it (the plugin refuses sliding-window models)."""
    for f in TABLE:
        if f.kind == "config" or f.name in ("model_attention", "no_triton", "sliding_window"):
            continue
        for backend in ("cpu", "triton"):
            assert f.cells["batching", backend] == f.cells["vllm", backend], (f.name, backend)


def test_unknown_host_or_backend_is_named():
    with pytest.raises(ValueError, match="host='hf'"):
        reasons(KiviConfig(), "hf", "cpu")
