import math

import pytest
import torch

from kivi import KiviConfig
from kivi.eval import bits_per_element, compare, kl_divergence, make_cache, perplexity, synthetic_bits

EXACT = KiviConfig(quantize_key=False, quantize_value=False)


def test_fp_kivi_cache_matches_dynamic_cache(peaked_model, windows):
    fp = perplexity(peaked_model, None, windows, None, prefix=64, chunk=16, progress=False)
    ex = perplexity(peaked_model, None, windows, EXACT, prefix=64, chunk=16, progress=False)
    assert fp["tokens_scored"] == ex["tokens_scored"] == 2 * (192 - 64)
    assert ex["ppl"] == pytest.approx(fp["ppl"], rel=1e-6)
    kl = kl_divergence(peaked_model, None, windows, EXACT, prefix=64, chunk=16, progress=False)
    assert kl["kl"] <= 1e-6
    assert kl["top1_agreement"] == 1.0
    assert fp["bits_per_element"] == 32.0  # float32 model, DynamicCache


def test_broken_cache_is_detected(peaked_model, model_text):
    out = compare(peaked_model, model_text,
                  [KiviConfig(k_bits=1, v_bits=1, residual_length=0), KiviConfig.preset("high")],
                  prefix=64, chunk=16, progress=False)
    broken, good = out["results"]
    assert broken["kl"] > 1e-2
    assert broken["kl"] > 10 * good["kl"]
    assert broken["ppl"] > out["fp"]["ppl"]
    assert broken["top1_agreement"] < good["top1_agreement"]


def test_noise_injected_cache_is_detected(peaked_model, windows, monkeypatch):
    import kivi.cache.layer as layer_mod

    orig = layer_mod.materialize

    def noisy(view, dtype=None):
        t = orig(view, dtype)
        return t + 2.0 * torch.randn_like(t)

    monkeypatch.setattr(layer_mod, "materialize", noisy)
    # fast=False: the noise sits in the reference path's dequantization (the fast path reads the packed
    # storage and never calls materialize; tests/eval/test_fast.py compares the two paths)
    r = kl_divergence(peaked_model, None, windows, EXACT, prefix=64, chunk=16, progress=False, fast=False)
    assert r["kl"] > 1e-2 and r["top1_agreement"] < 0.99


# ~20 s each on the 2-core box: the quantized K2V2 case runs by default, the others with KIVI_SLOW=1.
_SLOW = pytest.mark.slow
@pytest.mark.parametrize("cfg, rel", [pytest.param(None, 1e-5, marks=_SLOW), pytest.param(EXACT, 1e-5, marks=_SLOW),
                                      (KiviConfig(residual_length=32), 1e-5),
                                      pytest.param(KiviConfig(k_bits=4, v_bits=2, residual_length=0), 1e-5,
                                                   marks=_SLOW),
                                      pytest.param(KiviConfig.preset("balanced", residual_length=32), 1e-5,
                                                   marks=_SLOW),
                                      pytest.param(KiviConfig(k_bits=4, v_bits=4, residual_length=32, sink_tokens=4,
                                                              tiers=[(32, None), (32, 4), (None, 2)]), 1e-5,
                                                   marks=_SLOW)],
                         ids=["fp", "exact", "k2v2-R32", "k4v2-R0", "balanced-R32", "tiers-R32"])
def test_chunk_1_and_16_agree(peaked_model, windows, cfg, rel):
    # Every query of a chunk sees each earlier token at the precision token-by-token decoding gives it
    # (the views' per-query boundary), so chunk 16 equals chunk 1 up to float noise for every config.
    # fast=False: the fast mode would feed both one forward per continuation (tests/eval/test_fast.py)
    a = perplexity(peaked_model, None, windows, cfg, prefix=64, chunk=1, progress=False, fast=False)
    b = perplexity(peaked_model, None, windows, cfg, prefix=64, chunk=16, progress=False, fast=False)
    assert a["tokens_scored"] == b["tokens_scored"]
    assert a["nll"] == pytest.approx(b["nll"], rel=rel, abs=1e-6)
    assert a["bits_per_element"] == pytest.approx(b["bits_per_element"], rel=0.1)


def test_batching_does_not_change_results(peaked_model, windows):
    cfg = KiviConfig(residual_length=32)
    a = kl_divergence(peaked_model, None, windows, cfg, prefix=64, chunk=16, progress=False, batch_size=1)
    b = kl_divergence(peaked_model, None, windows, cfg, prefix=64, chunk=16, progress=False, batch_size=2)
    assert a["nll"] == pytest.approx(b["nll"], rel=1e-4)
    assert a["kl"] == pytest.approx(b["kl"], rel=1e-2, abs=1e-6)
    assert a["bits_per_element"] == pytest.approx(b["bits_per_element"])


def test_bits_per_element_from_real_cache(peaked_model, windows):
    r = perplexity(peaked_model, None, windows, KiviConfig(residual_length=32), prefix=64, chunk=16, progress=False)
    assert 2 < r["bits_per_element"] < 16
    # the synthetic fill reproduces the storage layout of the real run
    assert synthetic_bits(peaked_model, KiviConfig(residual_length=32), 192, prefix=64) == pytest.approx(
        r["bits_per_element"]
    )
    cache = make_cache(peaked_model, None)
    with pytest.raises(ValueError):
        bits_per_element(peaked_model, cache, 0)


def test_fill_random_appends_a_batch_of_tokens_to_every_layer_without_a_forward(peaked_model):
    from kivi.eval import fill_random

    for spec in (None, KiviConfig(residual_length=32)):
        cache = fill_random(peaked_model, make_cache(peaked_model, spec), 100, batch=3)
        assert cache.get_seq_length() == 100
        assert all(cache.get_seq_length(i) == 100 for i in range(peaked_model.config.num_hidden_layers))
        assert bits_per_element(peaked_model, cache, 100, batch=3) == pytest.approx(
            bits_per_element(peaked_model, fill_random(peaked_model, make_cache(peaked_model, spec), 100), 100))
    with pytest.raises(ValueError, match="batch=0 must be a positive int"):
        fill_random(peaked_model, make_cache(peaked_model, None), 8, batch=0)


def test_bad_input_raises_value_error(peaked_model, windows):
    with pytest.raises(ValueError, match="prefix"):
        perplexity(peaked_model, None, windows, None, prefix=192, progress=False)
    with pytest.raises(ValueError, match="chunk"):
        perplexity(peaked_model, None, windows, None, prefix=64, chunk=0, progress=False)
    with pytest.raises(ValueError, match="baseline"):
        perplexity(peaked_model, None, windows, "no-such-baseline", prefix=64, progress=False)
    with pytest.raises(ValueError, match="windows"):
        perplexity(peaked_model, None, windows.float(), None, prefix=64, progress=False)


def test_quanto_baseline_or_unavailable(peaked_model, windows):
    from kivi.eval import baseline_unavailable_reason

    out = compare(peaked_model, windows, ["quanto-int4", "quanto-int2"], prefix=64, chunk=16, progress=False)
    for r in out["results"]:
        if baseline_unavailable_reason(r["name"]):
            assert "unavailable" in r
        else:
            assert math.isfinite(r["ppl"]) and r["bits_per_element"] < 32


def test_invalid_config_is_reported_not_fatal_in_a_sweep(peaked_model, windows):
    bad = KiviConfig(group_size=64, residual_length=64)  # 64 does not divide head_dim=32
    out = compare(peaked_model, windows[:1], [bad, EXACT], prefix=64, chunk=16, progress=False)
    assert "group_size" in out["results"][0]["unavailable"]
    assert out["results"][1]["kl"] <= 1e-6
    with pytest.raises(ValueError, match="group_size"):
        perplexity(peaked_model, None, windows[:1], bad, prefix=64, progress=False)


def test_score_continuation_is_the_streaming_protocol_after_the_prefix(peaked_model, windows):
    """A caller that runs the prefill itself (kivi demo) gets compare()'s numbers from score_continuation."""
    from kivi.eval import score_continuation

    cfg = KiviConfig(residual_length=32)
    ref = kl_divergence(peaked_model, None, windows[:1], cfg, prefix=64, chunk=16, progress=False)
    ids = windows[:1]

    def prefill(spec):
        cache = make_cache(peaked_model, spec)
        with torch.inference_mode():
            out = peaked_model(ids[:, :64], cache=cache, use_cache=True, logits_to_keep=1)
        return cache, out.logits[:, -1]

    cache, last = prefill(None)
    steps = []
    fp = score_continuation(peaked_model, cache, last, ids[0, 64:], chunk=16, keep_logprobs=True,
                            on_chunk=lambda: steps.append(1))
    assert fp["tokens_scored"] == 192 - 64 and fp["logprobs"].shape == (1, 128, 256)
    assert fp["ppl"] == pytest.approx(ref["ppl_fp"], rel=1e-5)
    assert len(steps) == len(range(0, 127, 16))  # one call per forward that scores tokens
    assert cache.get_seq_length() == 192  # every token went through the cache
    cache, last = prefill(cfg)
    q = score_continuation(peaked_model, cache, last, ids[:, 64:], chunk=16, reference=fp["logprobs"])
    assert q["ppl"] == pytest.approx(ref["ppl"], rel=1e-5)
    assert q["kl"] == pytest.approx(ref["kl"], rel=1e-4, abs=1e-7)
    assert q["top1_agreement"] == ref["top1_agreement"]
    assert "logprobs" not in q
    with pytest.raises(ValueError, match="reference"):
        score_continuation(peaked_model, cache, last, ids[:, 64:100], reference=fp["logprobs"])


def test_token_agreement():
    from kivi.eval import token_agreement

    assert token_agreement([1, 2, 3, 4], [1, 2, 3, 4]) == {"same_tokens": 1.0, "common_prefix": 4}
    assert token_agreement([1, 9, 3, 4], [1, 2, 3, 4]) == {"same_tokens": 0.75, "common_prefix": 1}
    assert token_agreement([], []) == {"same_tokens": 0.0, "common_prefix": 0}


def test_spec_kind():
    from kivi.eval import spec_kind

    assert spec_kind(None) == spec_kind("fp") == "fp"
    assert spec_kind("quanto-int2") == "baseline"
    assert spec_kind(KiviConfig.preset("high")) == "preset:high"
    assert spec_kind(KiviConfig(group_size=64)) == "kivi"


def test_cache_nbytes_counts_every_kind_of_cache(peaked_model, windows):
    """One count for all caches: KiviCache's own accounting, DynamicCache and quanto tensors."""
    from kivi.eval import baseline_unavailable_reason, cache_nbytes

    ids = windows[:1]
    sizes = {}
    for spec in (None, KiviConfig(residual_length=32), "quanto-int2"):
        if isinstance(spec, str) and baseline_unavailable_reason(spec):
            continue
        cache = make_cache(peaked_model, spec)
        assert cache_nbytes(cache) == 0
        with torch.inference_mode():
            peaked_model(ids, cache=cache, use_cache=True)
        sizes[str(spec)] = cache_nbytes(cache)
        if not isinstance(spec, (str, type(None))):
            assert sizes[str(spec)] == cache.nbytes == sum(cache.memory_breakdown().values())
    # float32 DynamicCache: 2 layers x 2 sides x 2 kv heads x 32 channels x 192 tokens x 4 bytes
    assert sizes["None"] == 2 * 2 * 2 * 32 * 192 * 4
    assert all(0 < v < sizes["None"] for k, v in sizes.items() if k != "None")


@pytest.mark.parametrize("name,bits", [("hqq-int2", 2), ("hqq-int4", 4), ("quanto-int2", 2)])
def test_quantized_cache_bytes_are_codes_scales_and_zeros(peaked_model, windows, name, bits):
    """transformers' QuantizedCache after a 192-token prefill (more than its 128-token residual: everything is
    quantized): per layer and side the codes (bits per element) and one float32 scale and zero-point per group of
    64 elements. hqq keeps them in a ``(codes, meta dict)`` tuple, quanto in tensor subclasses: both counted."""
    from kivi.eval import baseline_unavailable_reason, cache_nbytes

    if baseline_unavailable_reason(name):
        pytest.skip(baseline_unavailable_reason(name))
    cache = make_cache(peaked_model, name)
    with torch.inference_mode():
        peaked_model(windows[:1], cache=cache, use_cache=True)
    per_side = 2 * 192 * 32  # kv heads x tokens x head_dim of the tiny model
    assert cache_nbytes(cache) == 2 * 2 * (per_side * bits // 8 + per_side // 64 * 2 * 4)
