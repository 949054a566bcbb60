"""quantize_model / KiviCache on real transformers model families (tiny random weights, no download)."""

import pytest
import torch
from transformers import DynamicCache

from kivi import KiviCache, KiviConfig, dequantize_model, quantize_model

from tests.helpers import tiny_model

FAMILIES = {
    "llama": {},
    "mistral": {"sliding_window": 64},
    "qwen2": {},
    "qwen3": {"head_dim": 32},
    "gemma2": {"sliding_window": 64, "head_dim": 32},
    "gemma3_text": {"sliding_window": 64, "head_dim": 32},
    "phi3": {},
}
OFF = KiviConfig(quantize_key=False, quantize_value=False, residual_length=32, block_size=64)
SMALL = KiviConfig(residual_length=32, block_size=64)


def _chunked_logits(model, ids, cache, step):
    outs = []
    with torch.no_grad():
        for s in range(0, ids.shape[1], step):
            outs.append(model(ids[:, s : s + step], cache=cache).logits)
    return torch.cat(outs, 1)


@pytest.mark.parametrize("family", list(FAMILIES))
def test_family_quantization_off_matches_dynamic_cache_exactly(family):
    model = tiny_model(family, **FAMILIES[family])
    ids = torch.randint(1, 128, (1, 400), generator=torch.Generator().manual_seed(0))
    ref = _chunked_logits(model, ids, DynamicCache(config=model.config), 100)
    got = _chunked_logits(model, ids, KiviCache.from_model(model, OFF), 100)
    if "sliding_window" in FAMILIES[family]:
        # Sliding layers keep whole blocks a little past the window (the mask hides them), so the
        # attention kernel sums over a longer, masked row: equal up to float summation order.
        torch.testing.assert_close(got, ref, atol=1e-5, rtol=1e-5)
    else:
        assert torch.equal(ref, got)


@pytest.mark.parametrize("family", list(FAMILIES))
def test_family_quantized_generate_runs_and_stays_close(family):
    model = tiny_model(family, **FAMILIES[family])
    ids = torch.randint(1, 128, (1, 400), generator=torch.Generator().manual_seed(0))
    ref = _chunked_logits(model, ids, DynamicCache(config=model.config), 100)
    cache = KiviCache.from_model(model, KiviConfig(k_bits=4, v_bits=4, residual_length=32, block_size=64))
    got = _chunked_logits(model, ids, cache, 100)
    assert torch.isfinite(got).all()
    assert (got - ref).abs().max() < 0.1 * ref.abs().max()
    assert cache.memory_breakdown()["codes"] > 0
    quantize_model(model, SMALL)
    out = model.generate(ids[:, :80], attention_mask=torch.ones_like(ids[:, :80]), max_new_tokens=8, do_sample=False)
    assert out.shape == (1, 88)


def test_generate_uses_kivi_cache_by_default_and_dequantize_model_restores():
    model = quantize_model(tiny_model("llama"), SMALL)
    ids = torch.randint(1, 128, (1, 60))
    out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=4, do_sample=False,
                         return_dict_in_generate=True)
    assert isinstance(out.cache, KiviCache)
    dequantize_model(model)
    out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=4, do_sample=False,
                         return_dict_in_generate=True)
    assert isinstance(out.cache, DynamicCache)


def test_explicit_cache_passed_to_generate_is_used():
    model = tiny_model("llama")
    cache = KiviCache.from_model(model, SMALL)
    ids = torch.randint(1, 128, (1, 60))
    model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=5, do_sample=False, cache=cache)
    assert cache.get_seq_length() == 64  # the last generated token is never fed back


def test_beam_search_matches_dynamic_cache_when_quantization_is_off():
    model = tiny_model("llama")
    ids = torch.randint(1, 128, (2, 50), generator=torch.Generator().manual_seed(1))
    kw = dict(attention_mask=torch.ones_like(ids), max_new_tokens=12, num_beams=2, do_sample=False)
    ref = model.generate(**kw, input_ids=ids)
    quantize_model(model, OFF)
    assert torch.equal(model.generate(**kw, input_ids=ids), ref)
    quantize_model(model, SMALL)
    assert model.generate(**kw, input_ids=ids, num_return_sequences=2).shape == (4, 62)


def test_assisted_generation_crops_the_cache():
    model = tiny_model("llama", seed=0)
    assistant = tiny_model("llama", seed=1)
    ids = torch.randint(1, 128, (1, 70), generator=torch.Generator().manual_seed(2))
    kw = dict(attention_mask=torch.ones_like(ids), max_new_tokens=16, do_sample=False)
    ref = model.generate(ids, **kw)
    quantize_model(model, OFF)
    got = model.generate(ids, assistant_model=assistant, **kw)
    assert torch.equal(got, ref)  # exact when nothing is quantized: crop restores the cache
    quantize_model(model, SMALL)
    assert model.generate(ids, assistant_model=assistant, **kw).shape == ref.shape


def test_pad_token_of_left_padded_batch_changes_no_logit():
    model = quantize_model(tiny_model("llama"), SMALL)
    ids = torch.randint(1, 128, (2, 180), generator=torch.Generator().manual_seed(3))
    mask = torch.ones_like(ids)
    mask[1, :45] = 0
    results = []
    for pad in (0, 7, 99):
        x = ids.clone()
        x[1, :45] = pad
        cache = KiviCache.from_model(model, SMALL)
        with torch.no_grad():
            a = model(x[:, :130], attention_mask=mask[:, :130], cache=cache).logits
            b = model(x[:, 130:], attention_mask=mask, cache=cache).logits
        results.append(torch.cat([a, b], 1)[1, 45:])
    assert all(torch.equal(results[0], r) for r in results[1:])


def test_unsupported_models_get_a_clear_error():
    class NotAModel(torch.nn.Module):
        pass

    with pytest.raises(ValueError, match="not a transformers PreTrainedModel"):
        quantize_model(NotAModel(), SMALL)
    import transformers

    cfg = transformers.AutoConfig.for_model("t5", vocab_size=64, d_model=32, d_ff=32, num_layers=1, num_heads=2, d_kv=16)
    t5 = transformers.AutoModelForSeq2SeqLM.from_config(cfg)
    with pytest.raises(ValueError, match="encoder-decoder"):
        quantize_model(t5, SMALL)


def test_nbytes_is_real_storage():
    model = tiny_model("llama")
    cache = KiviCache.from_model(model, SMALL)
    _chunked_logits(model, torch.randint(1, 128, (1, 300)), cache, 300)
    tensors = 0
    for layer in cache.layers:
        for side in (layer.k, layer.v):
            for blk in side.store.blocks:
                tensors += sum(t.numel() * t.element_size() for t in blk.values())
            tensors += side.window.numel() * side.window.element_size()
    assert cache.nbytes == tensors == sum(cache.memory_breakdown().values())
