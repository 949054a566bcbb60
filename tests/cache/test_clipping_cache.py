"""KiviConfig(clip=True) in the real cache: every backend reads it, the fast value writer matches the
torch quantizer bit for bit, and it costs no byte (planner == cache.nbytes, same as without)."""

from __future__ import annotations

import pytest
import torch

import kivi.cache.side as side_mod
from kivi import KiviConfig, quantize_model
from kivi.capabilities import reasons
from kivi.memory.estimate import estimate_kv_memory
from tests.helpers import forward_in_steps, tiny_model

GQA3 = dict(hidden_size=192, head_dim=32, num_attention_heads=6)
CFG = dict(group_size=8, residual_length=16, block_size=32, clip=True)


def _model(backend, **cfg):
    return quantize_model(tiny_model(**GQA3, weight_scale=2.0), KiviConfig(**{**CFG, **cfg}, attention_backend=backend))


_run = forward_in_steps  # tests/helpers.py


@pytest.mark.parametrize("sink", [0, 3])
@pytest.mark.parametrize("chunks", [[41, 1, 1, 1, 1], [23, 17, 9, 1, 1]])
def test_cpu_backend_matches_reference_with_clipping(chunks, sink):
    ids = torch.randint(1, 128, (2, sum(chunks)), generator=torch.Generator().manual_seed(0))
    lr, _ = _run(_model("reference", sink_tokens=sink), ids, chunks)
    lf, cache = _run(_model("cpu", sink_tokens=sink), ids, chunks)
    assert cache.attention_backend == "cpu"
    torch.testing.assert_close(lf, lr, atol=2e-4, rtol=2e-4)


def test_padded_batch_with_clipping_matches_reference():
    ids = torch.randint(1, 128, (3, 60), generator=torch.Generator().manual_seed(1))
    mask = torch.ones(3, 60, dtype=torch.long)
    mask[1, :7] = 0
    mask[2, :33] = 0
    chunks = [50, 1, 1, 8]
    lr, _ = _run(_model("reference", sink_tokens=2), ids, chunks, mask)
    lf, _ = _run(_model("cpu", sink_tokens=2), ids, chunks, mask)
    real = mask.bool()
    torch.testing.assert_close(lf[real], lr[real], atol=2e-4, rtol=2e-4)


def test_fast_value_writer_equals_torch_quantizer(monkeypatch):
    """Decode steps write values through the compiled quantizer; forcing the torch path changes no bit."""
    ids = torch.randint(1, 128, (2, 70), generator=torch.Generator().manual_seed(2))
    chunks = [40] + [1] * 16
    fast, cache = _run(_model("reference"), ids, chunks)
    assert any(fast for lay in cache.layers for fast in lay.v._fast.values())  # the compiled path was taken
    monkeypatch.setattr(side_mod, "token_quantizer_supported", lambda *a, **k: False)
    slow, cache = _run(_model("reference"), ids, chunks)
    assert not any(fast for lay in cache.layers for fast in lay.v._fast.values())
    assert torch.equal(fast, slow)


def test_clipping_changes_what_is_stored_not_its_size():
    ids = torch.randint(1, 128, (1, 90), generator=torch.Generator().manual_seed(3))
    _, on = _run(_model("cpu"), ids, [80, 1, 1])
    _, off = _run(_model("cpu", clip=False), ids, [80, 1, 1])
    assert on.nbytes == off.nbytes
    a, b = on.layers[0].k.store.blocks[0], off.layers[0].k.store.blocks[0]
    assert not torch.equal(a["scale"], b["scale"])


@pytest.mark.parametrize("side", ["keys", "values"])
def test_one_side_only(side):
    ids = torch.randint(1, 128, (1, 90), generator=torch.Generator().manual_seed(3))
    _, one = _run(_model("cpu", clip=side), ids, [80, 1, 1])
    _, off = _run(_model("cpu", clip=False), ids, [80, 1, 1])
    a, b = one.layers[0], off.layers[0]
    same_k = torch.equal(a.k.store.blocks[0]["scale"], b.k.store.blocks[0]["scale"])
    same_v = torch.equal(a.v.store.blocks[0]["scale"], b.v.store.blocks[0]["scale"])
    assert (same_k, same_v) == ((False, True) if side == "keys" else (True, False))


@pytest.mark.parametrize("preset", ["extreme", "balanced"])
def test_planner_is_byte_exact_with_clipping(preset):
    model = quantize_model(tiny_model(**GQA3), KiviConfig.preset(preset, **CFG))
    cfg = model.kivi_config
    ids = torch.randint(1, 128, (1, 77))
    _, cache = _run(model, ids, [77])
    assert estimate_kv_memory(model, 77, config=cfg).kivi_total_bytes == cache.nbytes
    no_clip = KiviConfig.preset(preset, **{**CFG, "clip": False})
    assert estimate_kv_memory(model, 77, config=no_clip).kivi_total_bytes == cache.nbytes


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
def test_half_precision_models_close_to_reference(dtype):
    ids = torch.randint(1, 128, (1, 60), generator=torch.Generator().manual_seed(4))
    lr, _ = _run(_model("reference").to(dtype), ids, [50, 1, 1, 8])
    lf, _ = _run(_model("cpu").to(dtype), ids, [50, 1, 1, 8])
    assert torch.isfinite(lf).all() and (lf.float() - lr.float()).abs().max() < 0.1


def test_triton_backend_reads_the_clipped_format():
    """Clipping changes only the values of scale/offset: nothing for the kernels to refuse."""
    assert reasons(KiviConfig(clip=True), "generate", "triton") == []
