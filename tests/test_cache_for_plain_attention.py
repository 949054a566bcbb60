"""A KiviCache passed to a model whose attention is not kivi's (never quantized, or after
``dequantize_model``): ``KiviCache.from_model`` hands it tensors, so a prefill, a forward of 16 tokens into
the filled cache and decode steps all work; a cache that cannot be read so says how to fix it."""

import copy

import pytest
import torch
from transformers import DynamicCache

from kivi import KiviCache, KiviConfig, dequantize_model, quantize_model
from kivi.attention.interface import reading_views
from tests.helpers import tiny_model

# R = G = 8: tokens leave the full-precision window inside a 16-token forward.
CFG = KiviConfig(group_size=8, residual_length=8, block_size=32, attention_backend="reference")
IDS = torch.randint(1, 128, (1, 60), generator=torch.Generator().manual_seed(0))


def _steps(model, cache):
    """Logits of a 40-token prefill, one forward of 16 tokens, then 4 one-token steps through ``cache``."""
    with torch.no_grad():
        outs = [model(IDS[:, :40], cache=cache).logits, model(IDS[:, 40:56], cache=cache).logits]
        outs += [model(IDS[:, t : t + 1], cache=cache).logits for t in range(56, 60)]
    return outs


def _history(cache, layers):
    """Per layer, the keys/values a query reads of ``cache`` before the next forward (a decode step's view of
    a copy, without its token)."""
    probe = copy.deepcopy(cache)
    k = torch.zeros(1, 2, 1, 32)
    return [tuple(t[:, :, :-1] for t in probe.update(k, k, i)) for i in range(layers)]


def test_from_model_on_a_plain_model_works_for_a_chunk_after_the_prefill():
    model = tiny_model(weight_scale=4.0)  # peaked predictions: quantization error shows in the logits
    assert model.config._attn_implementation == "sdpa"
    cache = KiviCache.from_model(model, CFG)
    assert not cache.reads_views
    with torch.no_grad():
        model(IDS[:, :40], cache=cache)
        history = _history(cache, 2)
        chunk = model(IDS[:, 40:56], cache=cache).logits
    # Every query of the 16-token forward read the history as it was before the forward, plus the forward's
    # tokens exactly: a full-precision cache holding that history gives the same logits.
    ref_cache = DynamicCache(config=model.config)
    for i, (k, v) in enumerate(history):
        ref_cache.update(k, v, i)
    with torch.no_grad():
        ref = model(IDS[:, 40:56], cache=ref_cache).logits
    torch.testing.assert_close(chunk, ref, atol=1e-5, rtol=1e-5)
    assert cache.get_seq_length() == 56


def test_from_model_on_a_plain_model_stays_close_to_one_token_precision():
    """Prefill, a 16-token forward, decode steps: close to the per-query precision of the "kivi" attention
    (equal for the forward's first query, which reads the same history), well within the quantization error."""
    model = tiny_model()
    got = _steps(model, plain := KiviCache.from_model(model, CFG))
    per_query = KiviCache.from_model(model, CFG, reading_views=True)
    with reading_views(model, per_query):
        want = _steps(model, per_query)
    fp = _steps(model, DynamicCache(config=model.config))
    assert plain.get_seq_length() == per_query.get_seq_length() == 60
    torch.testing.assert_close(got[0], want[0], atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(got[1][:, 0], want[1][:, 0], atol=1e-5, rtol=1e-5)
    assert (got[1][:, -1] - want[1][:, -1]).abs().max() > 1e-4  # later queries: the documented difference
    for a, b, f in zip(got[1:], want[1:], fp[1:]):  # the difference is well below 2-bit quantization's own
        assert (a - b).abs().max() < 0.5 * (b - f).abs().max()


def test_a_cache_for_the_kivi_attention_read_by_another_says_how_to_fix_it():
    """Built after quantize_model, used after dequantize_model: a TypeError naming quantize_model (not an
    AttributeError inside transformers), at the prefill for a packed cache, at the chunk for a reference one."""
    model = quantize_model(tiny_model(), KiviConfig(group_size=8, residual_length=8, attention_backend="cpu"))
    packed = KiviCache.from_model(model)
    assert packed.attention_backend == "cpu"
    dequantize_model(model)
    with pytest.raises(TypeError, match=r"PackedStates.*quantize_model"), torch.no_grad():
        model(IDS[:, :40], cache=packed)
    quantize_model(model, CFG)
    reference = KiviCache.from_model(model)
    assert reference.reads_views
    dequantize_model(model)
    with torch.no_grad():
        model(IDS[:, :40], cache=reference)  # a prefill and decode steps read plain tensors
        model(IDS[:, 40:41], cache=reference)
        with pytest.raises(TypeError, match=r"'reference' KiviCache.*quantize_model"):
            model(IDS[:, 41:57], cache=reference)
    # rebuilt for the model as it runs, the cache works
    assert len(_steps(model, KiviCache.from_model(model, CFG))) == 6


def test_kivi_cache_without_a_model_refuses_a_chunk_under_another_attention():
    model = tiny_model()
    cache = KiviCache(CFG)
    with torch.no_grad():
        model(IDS[:, :40], cache=cache)
        with pytest.raises(TypeError, match=r"quantize_model.*KiviCache.from_model"):
            model(IDS[:, 40:56], cache=cache)


def test_reading_views_refuses_a_cache_built_for_plain_attention():
    model = tiny_model()
    cache = KiviCache.from_model(model, CFG)
    with pytest.raises(ValueError, match=r"reading_views=True"):
        with reading_views(model, cache):
            pass
    assert model.config._attn_implementation == "sdpa"


def test_a_loaded_cache_suits_the_model_it_is_loaded_for(tmp_path):
    model = tiny_model()
    cache = KiviCache.from_model(model, CFG)
    with torch.no_grad():
        model(IDS[:, :40], cache=cache)
    cache.save(tmp_path / "p.safetensors", fingerprint={})
    loaded = KiviCache.load(tmp_path / "p.safetensors", fingerprint={}, model=model, config=CFG)
    assert not loaded.reads_views
    with torch.no_grad():
        model(IDS[:, 40:56], cache=loaded)
    assert loaded.get_seq_length() == 56


def test_packed_states_read_as_a_tensor_raise_a_type_error():
    """What another attention does with keys first (``.shape``, ``torch.cat`` of a list) is refused the same way;
    copies still work."""
    cache = KiviCache(KiviConfig(group_size=8, residual_length=8), attention_backend="cpu")
    k, _ = cache.update(torch.randn(1, 2, 20, 32), torch.randn(1, 2, 20, 32), 0)
    for misuse in (lambda: k.shape, lambda: k.transpose(1, 2), lambda: torch.cat([k, torch.zeros(1)])):
        with pytest.raises(TypeError, match=r"PackedStates.*quantize_model"):
            misuse()
    assert copy.deepcopy(k).backend.name == "cpu"
