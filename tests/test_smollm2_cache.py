"""KiviCache and quantize_model on the embedded default model (SmolLM2-135M, GQA: 9 query / 3 kv heads)."""

import pytest
import torch
from transformers import DynamicCache

from kivi import KiviCache, KiviConfig, dequantize_model, quantize_model

OFF = KiviConfig(quantize_key=False, quantize_value=False)


def test_quantization_off_matches_dynamic_cache_logits_exactly(smollm2, wikitext_ids):
    model, _ = smollm2
    ids = wikitext_ids[:300].unsqueeze(0)
    with torch.no_grad():
        dyn = DynamicCache(config=model.config)
        ref = torch.cat([model(ids[:, :200], cache=dyn).logits, model(ids[:, 200:], cache=dyn).logits], 1)
        kc = KiviCache.from_model(model, OFF)
        got = torch.cat([model(ids[:, :200], cache=kc).logits, model(ids[:, 200:], cache=kc).logits], 1)
    assert torch.equal(ref, got)


def test_beam_search_same_beams_as_dynamic_cache_when_off_or_8_bit(smollm2, wikitext_ids):
    model, _ = smollm2
    ids = wikitext_ids[:64].unsqueeze(0)
    kw = dict(attention_mask=torch.ones_like(ids), max_new_tokens=6, num_beams=2, do_sample=False)
    try:
        ref = model.generate(ids, **kw)
        quantize_model(model, OFF)
        got = model.generate(ids, **kw)
        quantize_model(model, KiviConfig(k_bits=8, v_bits=8, residual_length=32))
        quantized = model.generate(ids, **kw)
    finally:
        dequantize_model(model)
    assert torch.equal(ref, got)
    # 8-bit codes for the 32 prompt tokens before the window: beam scores move by ~2e-4, the same beams
    assert torch.equal(quantized, ref)


def test_window_is_bit_exact_on_real_model(smollm2, wikitext_ids):
    model, _ = smollm2
    ids = wikitext_ids[:400].unsqueeze(0)
    cache = KiviCache.from_model(model, KiviConfig())
    with torch.no_grad():
        model(ids, cache=cache)
        ref = DynamicCache(config=model.config)
        model(ids, cache=ref)
    for layer, ref_layer in zip(cache.layers, ref.layers):
        nk = layer.k.store.length
        assert torch.equal(layer.k.window, ref_layer.keys[:, :, nk:])
        assert torch.equal(layer.v.window, ref_layer.values[:, :, layer.v.store.length :])


@pytest.mark.slow
def test_left_padded_row_close_to_prompt_alone(smollm2, wikitext_ids):
    model, _ = smollm2
    cfg = KiviConfig(residual_length=32)
    a = wikitext_ids[:300]
    b = wikitext_ids[1000:1237]
    pad = 300 - b.shape[0]
    ids = torch.stack([a, torch.cat([torch.zeros(pad, dtype=torch.long), b])])
    mask = torch.ones_like(ids)
    mask[1, :pad] = 0
    quantize_model(model, cfg)
    try:
        with torch.no_grad():
            batched = model(ids, attention_mask=mask, cache=KiviCache.from_model(model, cfg)).logits[1, pad:]
            alone = model(b.unsqueeze(0), cache=KiviCache.from_model(model, cfg)).logits[0]
    finally:
        dequantize_model(model)
    # prefill sees its own tokens at full precision: only float noise from padding shapes
    assert (batched - alone).abs().max() < 1e-3
