"""quantize_model / KiviCache on real transformers model families (tiny random weights, no download)."""

import pytest
import torch
from transformers import DynamicCache

from kivi import KiviCache, KiviConfig, dequantize_model, quantize_model
from tests.helpers import LOGIT_ATOL, assert_greedy_close, greedy, tiny_model

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
Q8 = KiviConfig(k_bits=8, v_bits=8, residual_length=32, block_size=64)  # close enough to FP for equal greedy tokens
# Logits of a model on an 8-bit KV cache against full precision: the quantization error of 8-bit codes
# (~2e-3 on these models, whose logits stay below 1), ten times over; tokens equal up to a near-tie.
Q8_ATOL = 2e-2


def _chunked_logits(model, ids, cache, step):
    # Chunks after the first give each query its own precision: an unprepared model reads the KIVI
    # cache's views through the "kivi" attention for them (docs/python.md, "Speculative decoding").
    from kivi.attention.interface import reading_views

    outs = []
    with torch.no_grad(), reading_views(model, cache):
        for s in range(0, ids.shape[1], step):
            outs.append(model(ids[:, s : s + step], cache=cache).logits)
    return torch.cat(outs, 1)


def _greedy(model, prompt, cache, new_tokens):
    """Greedy decoding by hand through ``cache``: the prompt in one forward, then one token per forward."""
    out = prompt
    with torch.no_grad():
        logits = model(prompt, cache=cache).logits[:, -1]
        for _ in range(new_tokens):
            out = torch.cat([out, logits.argmax(-1, keepdim=True)], 1)
            logits = model(out[:, -1:], cache=cache).logits[:, -1]
    return out


@pytest.mark.parametrize("family", list(FAMILIES))
def test_family_quantization_off_matches_dynamic_cache_exactly(family):
    model = tiny_model(family, **FAMILIES[family])
    ids = torch.randint(1, 128, (1, 400), generator=torch.Generator().manual_seed(0))
    ref = _chunked_logits(model, ids, DynamicCache(config=model.config), 100)
    got = _chunked_logits(model, ids, KiviCache.from_model(model, OFF, reading_views=True), 100)
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
    cache = KiviCache.from_model(model, KiviConfig(k_bits=4, v_bits=4, residual_length=32, block_size=64),
                                 reading_views=True)
    got = _chunked_logits(model, ids, cache, 100)
    assert torch.isfinite(got).all()
    assert (got - ref).abs().max() < 0.1 * ref.abs().max()
    assert cache.memory_breakdown()["codes"] > 0
    prompt = ids[:, :80]
    mask = torch.ones_like(prompt)
    fp = greedy(model, prompt, new_tokens=8, mask=mask)
    quantize_model(model, Q8)
    assert_greedy_close(greedy(model, prompt, new_tokens=8, mask=mask), fp, atol=Q8_ATOL)  # 8-bit KV: FP's tokens
    quantize_model(model, SMALL)
    out = greedy(model, prompt, new_tokens=8, mask=mask)
    # generate builds a KiviCache of the model's config and decodes through it exactly as by hand: the same
    # forwards in the same order, so the same arithmetic and bit-identical tokens
    assert isinstance(out.cache, KiviCache) and out.cache.get_seq_length() == 87
    assert torch.equal(out.sequences, _greedy(model, prompt, KiviCache.from_model(model, SMALL), 8))


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
    # nothing quantized: the logits of DynamicCache bit for bit (test above), so the same beams exactly
    assert torch.equal(model.generate(**kw, input_ids=ids), ref)


def test_quantized_beam_search_scores_each_beam_with_its_own_history():
    """Beam search reorders the cache at every step. Each returned beam's score must equal the score of
    its tokens decoded on their own through a fresh cache: a wrong reorder of the quantized store
    would score a beam against another beam's history (seen as errors of ~1e-4 here)."""
    cfg = KiviConfig(group_size=8, residual_length=8, block_size=16)  # generated tokens reach the store
    model = quantize_model(tiny_model("llama", eos_token_id=None), cfg)  # no EOS: every beam is 20 tokens
    ids = torch.randint(1, 128, (1, 40), generator=torch.Generator().manual_seed(1))
    out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=20, num_beams=3,
                         num_return_sequences=3, do_sample=False, return_dict_in_generate=True, output_scores=True)
    beams = out.sequences
    assert beams.shape == (3, 60) and len({tuple(b.tolist()) for b in beams}) == 3
    cache = KiviCache.from_model(model, cfg)
    with torch.no_grad():
        logits = [model(beams[:, :40], cache=cache).logits[:, -1]]
        logits += [model(beams[:, t : t + 1], cache=cache).logits[:, -1] for t in range(40, 59)]
    logp = torch.log_softmax(torch.stack(logits, 1).float(), -1)
    scores = logp.gather(-1, beams[:, 40:, None]).squeeze(-1).sum(-1) / 20  # length_penalty 1: mean log-prob
    torch.testing.assert_close(scores, out.sequences_scores, atol=2e-5, rtol=0)


def test_assisted_generation_crops_the_cache():
    model = tiny_model("llama", seed=0)
    assistant = tiny_model("llama", seed=1)
    ids = torch.randint(1, 128, (1, 70), generator=torch.Generator().manual_seed(2))
    mask = torch.ones_like(ids)
    ref = greedy(model, ids, new_tokens=16, mask=mask)
    # The verify forward attends over several queries at once (another summation order than one-token
    # decoding): equal up to rounding when nothing is quantized, so crop restores the cache.
    quantize_model(model, OFF)
    got = greedy(model, ids, new_tokens=16, mask=mask, assistant_model=assistant)
    assert_greedy_close(got, ref, atol=LOGIT_ATOL[torch.float32])
    quantize_model(model, Q8)  # rejected candidates are cropped off a cache with a quantized history
    assert_greedy_close(greedy(model, ids, new_tokens=16, mask=mask, assistant_model=assistant), ref, atol=Q8_ATOL)


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

    cfg = transformers.AutoConfig.for_model(
        "t5", vocab_size=64, d_model=32, d_ff=32, num_layers=1, num_heads=2, d_kv=16
    )
    t5 = transformers.AutoModelForSeq2SeqLM.from_config(cfg)
    with pytest.raises(ValueError, match="encoder-decoder"):
        quantize_model(t5, SMALL)


def test_nbytes_is_real_storage():
    model = tiny_model("llama")
    cache = KiviCache.from_model(model, SMALL, reading_views=True)
    _chunked_logits(model, torch.randint(1, 128, (1, 300)), cache, 300)
    tensors = 0
    for layer in cache.layers:
        for side in (layer.k, layer.v):
            for blk in side.store.blocks:
                tensors += sum(t.numel() * t.element_size() for t in blk.values())
            tensors += side.window.numel() * side.window.element_size()
    assert cache.nbytes == tensors == sum(cache.memory_breakdown().values())


def test_prefill_chunk_size_is_set_on_request_and_dequantize_restores():
    model = tiny_model("llama")
    assert model.generation_config.prefill_chunk_size is None
    quantize_model(model, KiviConfig())  # default: transformers' one-shot prefill
    assert model.generation_config.prefill_chunk_size is None
    quantize_model(model, KiviConfig(), prefill_chunk_size=512)
    assert model.generation_config.prefill_chunk_size == 512
    quantize_model(model, KiviConfig(), prefill_chunk_size=64)  # re-quantizing updates kivi's own setting
    assert model.generation_config.prefill_chunk_size == 64
    dequantize_model(model)
    assert model.generation_config.prefill_chunk_size is None
    model.generation_config.prefill_chunk_size = 100  # the user's choice is never overridden
    quantize_model(model, KiviConfig(), prefill_chunk_size=512)
    assert model.generation_config.prefill_chunk_size == 100
    dequantize_model(model)
    assert model.generation_config.prefill_chunk_size == 100
    for bad in (0, -1, 2.5, True):
        with pytest.raises(ValueError, match="prefill_chunk_size"):
            quantize_model(tiny_model("llama"), KiviConfig(), prefill_chunk_size=bad)


def test_generate_chunked_prefill_equals_explicit_chunked_prefill():
    """generate()'s default chunked prefill is kivi's chunked_prefill followed by greedy decoding."""
    from kivi.attention import chunked_prefill

    cfg = KiviConfig(group_size=8, residual_length=16, block_size=32)
    model = quantize_model(tiny_model("llama"), cfg, prefill_chunk_size=24)
    ids = torch.randint(1, 128, (1, 100))
    out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=12, do_sample=False,
                         pad_token_id=0)
    cache = KiviCache.from_model(model)
    with torch.no_grad():
        logits = chunked_prefill(model, ids, cache, chunk_size=24)
        tokens = []
        for _ in range(12):
            nxt = logits.argmax(-1, keepdim=True)
            tokens.append(nxt)
            logits = model(input_ids=nxt, cache=cache, use_cache=True).logits[:, -1]
    assert torch.equal(out[:, 100:], torch.cat(tokens, dim=1))


def test_generate_puts_the_cache_under_the_keyword_the_forward_takes():
    """transformers before 5.2x (5.19, which vLLM 0.32 pins) keeps generate's cache under
    ``past_key_values``; a KiviCache stored under ``cache`` there is ignored and generate decodes with its
    own full-precision cache. The keyword follows the model's forward signature."""
    from transformers import GenerationConfig

    model = quantize_model(tiny_model("llama"), SMALL)
    kwargs = {}
    model._prepare_cache_for_generation(GenerationConfig(), kwargs, None, 1, 100)
    assert isinstance(kwargs.get("cache"), KiviCache) and "past_key_values" not in kwargs

    forward = model.forward  # a forward with transformers 5.19's signature

    def old_forward(input_ids=None, attention_mask=None, position_ids=None, past_key_values=None, **kw):
        return forward(input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids,
                       cache=past_key_values, **kw)

    model.forward = old_forward
    kwargs = {}
    model._prepare_cache_for_generation(GenerationConfig(), kwargs, None, 1, 100)
    assert isinstance(kwargs.get("past_key_values"), KiviCache) and "cache" not in kwargs
