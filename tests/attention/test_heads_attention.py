"""The "kivi" attention over layers with per-head widths (kivi/cache/heads.py): every backend against
the reference, GQA, padding, sinks, chunked (per-query) forwards."""

from __future__ import annotations

import pytest
import torch

from kivi import KiviCache, KiviConfig, quantize_model
from kivi.cache.heads import HeadSplitLayer
from tests.helpers import LOGIT_ATOL, assert_decode_close, tiny_model

# 6 query heads over 3 kv heads (GQA 2), head_dim 32: head groups with 1 and 2 kv heads.
MODEL = dict(hidden_size=192, head_dim=32, num_attention_heads=6, num_key_value_heads=3)
HEADS = {0: {"k_bits": [4, 2, 2], "v_bits": [2, 2, 4]}, 1: {"k_bits": [2, 8, 8]}}
CFG = dict(group_size=8, residual_length=16, block_size=32, head_bits=HEADS)


def _run(backend, chunks, ids, *, mask=None, sink=0, model_kw=None, model_type="llama", dtype=torch.float32):
    model = quantize_model(tiny_model(model_type, **MODEL, **(model_kw or {})).to(dtype),
                           KiviConfig(**CFG, sink_tokens=sink, attention_backend=backend))
    cache = KiviCache.from_model(model)
    assert isinstance(cache.layers[0], HeadSplitLayer) and len(cache.layers[0].groups) == 3
    outs, pos = [], 0
    with torch.no_grad():
        for n in chunks:
            kw = {}
            if mask is not None:
                kw = {"attention_mask": mask[:, : pos + n],
                      "position_ids": (mask.long().cumsum(-1) - 1).clamp_min(0)[:, pos : pos + n]}
            outs.append(model(input_ids=ids[:, pos : pos + n], cache=cache, use_cache=True, **kw).logits)
            pos += n
    return torch.cat(outs, dim=1), cache


@pytest.mark.parametrize("path", ["fused", "blocked"])
@pytest.mark.parametrize("sink", [0, 3])
@pytest.mark.parametrize("chunks", [[40, 1, 1, 1, 1, 1], [23, 17, 9, 1, 30, 1]], ids=["decode", "chunked"])
def test_cpu_backends_match_reference(path, sink, chunks, monkeypatch):
    calls, group_calls = [], []
    import kivi.attention.fused_cpu as fused

    real, real_group = fused.fused_decode_heads, fused.fused_decode_attention
    if path == "blocked":
        monkeypatch.setattr(fused, "fused_decode_supported", lambda *a, **k: False)
        monkeypatch.setattr(fused, "fused_decode_heads_supported", lambda *a, **k: False)
    else:
        monkeypatch.setattr(fused, "fused_decode_heads", lambda *a, **k: calls.append(1) or real(*a, **k))
        monkeypatch.setattr(
            fused, "fused_decode_attention", lambda *a, **k: group_calls.append(1) or real_group(*a, **k)
        )
    ids = torch.randint(1, 128, (2, sum(chunks)))
    lr, ref_cache = _run("reference", chunks, ids, sink=sink)
    lf, cache = _run("cpu", chunks, ids, sink=sink)
    torch.testing.assert_close(lf, lr, atol=2e-4, rtol=2e-4)
    assert cache.nbytes == ref_cache.nbytes
    if path == "fused":  # one kernel call per layer per decode step, whatever the number of head groups
        decode_steps = sum(1 for n in chunks[1:] if n == 1)
        assert len(calls) == decode_steps * 2 and not group_calls


def test_padded_batch_matches_reference():
    ids = torch.randint(1, 128, (3, 60))
    mask = torch.ones(3, 60, dtype=torch.long)
    mask[1, :7] = 0
    mask[2, :33] = 0
    chunks = [50, 1, 1, 8]
    lr, _ = _run("reference", chunks, ids, mask=mask, sink=2)
    lf, _ = _run("cpu", chunks, ids, mask=mask, sink=2)
    real = mask.bool()
    torch.testing.assert_close(lf[real], lr[real], atol=2e-4, rtol=2e-4)


def test_greedy_generate_identical_reference_and_cpu():
    ids = torch.randint(1, 128, (2, 45))
    mask = torch.ones_like(ids)
    mask[0, :5] = 0
    ref, fast = (quantize_model(tiny_model(**MODEL), KiviConfig(**CFG, sink_tokens=3, attention_backend=b))
                 for b in ("reference", "cpu"))
    assert_decode_close(fast, ref, ids, new_tokens=20, atol=LOGIT_ATOL[torch.float32], mask=mask, pad_token_id=0)


def test_bf16_model_close_to_reference():
    ids = torch.randint(1, 128, (1, 70))
    lr, _ = _run("reference", [60, 1, 1, 8], ids, dtype=torch.bfloat16)
    lf, _ = _run("cpu", [60, 1, 1, 8], ids, dtype=torch.bfloat16)
    assert (lf.float() - lr.float()).abs().max() < 0.1


def test_sliding_window_mistral_matches_reference():
    ids = torch.randint(1, 128, (2, 110))
    chunks = [70, 1, 1, 30, 1, 7]
    lr, _ = _run("reference", chunks, ids, model_type="mistral", model_kw={"sliding_window": 24})
    lf, cache = _run("cpu", chunks, ids, model_type="mistral", model_kw={"sliding_window": 24})
    layer = cache.layers[0]
    assert layer.kv_offset > 0 and len({(p.k.store.start, p.v.store.start) for p in layer.parts}) == 1  # evicted alike
    torch.testing.assert_close(lf, lr, atol=2e-4, rtol=2e-4)
