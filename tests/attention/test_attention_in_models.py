"""The "kivi" attention implementation inside transformers models (tiny random models)."""

from __future__ import annotations

import pytest
import torch
import transformers

from kivi import KiviCache, KiviConfig, dequantize_model, quantize_model
from kivi.attention import chunked_prefill, resolve_attention_backend
from kivi.cache.layer import KiviLayer
from tests.helpers import LOGIT_ATOL, assert_decode_close, forward_in_steps, tiny_model

# Tiny models here have 6 query heads over 2 KV heads (GQA ratio 3, not a power of two), head_dim 32.
GQA3 = dict(hidden_size=192, head_dim=32, num_attention_heads=6)
CFG = dict(group_size=8, residual_length=16, block_size=32, residual_bits=2)


def pair(model_type="llama", cfg=None, **kw):
    """The same model quantized with the reference backend and with the cpu backend."""
    c = {**CFG, **(cfg or {})}
    ref = quantize_model(tiny_model(model_type, **GQA3, **kw), KiviConfig(**c, attention_backend="reference"))
    fast = quantize_model(tiny_model(model_type, **GQA3, **kw), KiviConfig(**c, attention_backend="cpu"))
    return ref, fast


_forward_steps = forward_in_steps  # tests/helpers.py


def test_quantize_model_switches_and_restores_attention():
    model = tiny_model(**GQA3, attn_implementation="sdpa")
    quantize_model(model, KiviConfig(**CFG))  # auto -> cpu on CPU
    assert model.kivi_attention_backend == "cpu"
    assert model.config._attn_implementation == "kivi"
    cache = KiviCache.from_model(model)
    assert cache.attention_backend == "cpu" and "attention_backend='cpu'" in repr(cache)
    dequantize_model(model)
    assert model.config._attn_implementation == "sdpa"
    # "reference" runs the "kivi" attention too (per-query precision of multi-token forwards needs the
    # views); it hands the cache's dequantized tensors to SDPA otherwise.
    ref = quantize_model(tiny_model(**GQA3), KiviConfig(**CFG, attention_backend="reference"))
    assert ref.config._attn_implementation == "kivi"
    dequantize_model(ref)
    assert ref.config._attn_implementation == "sdpa"


def test_backend_resolution_is_explicit():
    assert resolve_attention_backend("auto", torch.device("cpu")) == "cpu"
    assert resolve_attention_backend("reference") == "reference"
    with pytest.raises((RuntimeError, ValueError)):
        resolve_attention_backend("triton", torch.device("cpu"))
    with pytest.raises(ValueError, match="attention_backend"):
        resolve_attention_backend("fast")
    with pytest.raises((RuntimeError, ValueError)):
        quantize_model(tiny_model(**GQA3), KiviConfig(**CFG, attention_backend="triton"))


@pytest.mark.parametrize("sink", [0, 3])
@pytest.mark.parametrize("chunks", [[40, 1, 1, 1, 1], [23, 17, 9, 1, 30, 1], [5, 3, 1, 6, 1]])
def test_logits_cpu_match_reference(chunks, sink):
    ref, fast = pair(cfg={"sink_tokens": sink})
    ids = torch.randint(1, 128, (2, sum(chunks)))
    lr, _ = _forward_steps(ref, ids, chunks)
    lf, cache = _forward_steps(fast, ids, chunks)
    assert cache.attention_backend == "cpu"  # update handed attention packed states, not tensors
    torch.testing.assert_close(lf, lr, atol=2e-4, rtol=2e-4)


@pytest.mark.parametrize("sink", [0, 3])
def test_padded_batch_logits_match_reference(sink):
    ref, fast = pair(cfg={"sink_tokens": sink})
    ids = torch.randint(1, 128, (3, 60))
    mask = torch.ones(3, 60, dtype=torch.long)
    mask[1, :7] = 0
    mask[2, :33] = 0
    chunks = [50, 1, 1, 8]
    lr, _ = _forward_steps(ref, ids, chunks, mask)
    lf, _ = _forward_steps(fast, ids, chunks, mask)
    real = mask.bool()
    torch.testing.assert_close(lf[real], lr[real], atol=2e-4, rtol=2e-4)


@pytest.mark.parametrize("sink", [0, 3])
def test_greedy_generate_identical(sink):
    ref, fast = pair(cfg={"sink_tokens": sink})
    ids = torch.randint(1, 128, (2, 45))
    mask = torch.ones_like(ids)
    mask[0, :5] = 0
    assert_decode_close(fast, ref, ids, new_tokens=24, atol=LOGIT_ATOL[torch.float32], mask=mask, pad_token_id=0)


def test_bf16_model_close():
    ref, fast = pair()
    ref, fast = ref.to(torch.bfloat16), fast.to(torch.bfloat16)
    ids = torch.randint(1, 128, (1, 70))
    lr, _ = _forward_steps(ref, ids, [60, 1, 1, 8])
    lf, _ = _forward_steps(fast, ids, [60, 1, 1, 8])
    assert (lf.float() - lr.float()).abs().max() < 0.1


def test_sliding_window_mistral():
    ref, fast = pair("mistral", sliding_window=24)
    ids = torch.randint(1, 128, (2, 120))
    chunks = [70, 1, 1, 30, 1, 17]
    lr, cr = _forward_steps(ref, ids, chunks)
    lf, cf = _forward_steps(fast, ids, chunks)
    assert cf.layers[0].kv_offset > 0  # eviction happened, mask has an offset
    torch.testing.assert_close(lf, lr, atol=2e-4, rtol=2e-4)


def test_unquantized_sliding_layer_beside_quantized_layers():
    """A sliding layer with nothing quantized is a KiviLayer of full-precision blocks (same eviction rule)."""
    lsc = {0: {"quantize_key": False, "quantize_value": False}}
    kw = dict(
        model_type="qwen2", sliding_window=24, use_sliding_window=True,
        layer_types=["sliding_attention", "full_attention"],
    )
    ref = quantize_model(
        tiny_model(**GQA3, **kw), KiviConfig(**CFG, attention_backend="reference", layer_specific_config=lsc)
    )
    fast = quantize_model(
        tiny_model(**GQA3, **kw), KiviConfig(**CFG, attention_backend="cpu", layer_specific_config=lsc)
    )
    ids = torch.randint(1, 128, (1, 90))
    lr, _ = _forward_steps(ref, ids, [60, 1, 29])
    lf, cf = _forward_steps(fast, ids, [60, 1, 29])
    assert isinstance(cf.layers[0], KiviLayer) and cf.layers[0].memory_breakdown()["codes"] == 0
    torch.testing.assert_close(lf, lr, atol=2e-4, rtol=2e-4)


def test_forward_without_cache_and_with_dynamic_cache():
    model = quantize_model(tiny_model(**GQA3), KiviConfig(**CFG))
    plain = tiny_model(**GQA3)
    ids = torch.randint(1, 128, (1, 20))
    with torch.no_grad():
        want = plain(ids, use_cache=False).logits
        torch.testing.assert_close(model(ids, use_cache=False).logits, want, atol=1e-5, rtol=1e-5)
        dc = transformers.DynamicCache(config=model.config)
        torch.testing.assert_close(model(ids, cache=dc).logits, want, atol=1e-5, rtol=1e-5)


def test_chunked_prefill_matches_reference_and_plain_forward():
    ref, fast = pair()
    ids = torch.randint(1, 128, (2, 77))
    with torch.no_grad():
        whole = fast(ids, cache=KiviCache.from_model(fast)).logits[:, -1]
    one = chunked_prefill(fast, ids, KiviCache.from_model(fast), chunk_size=77)
    torch.testing.assert_close(one, whole, atol=1e-5, rtol=1e-5)
    a = chunked_prefill(ref, ids, KiviCache.from_model(ref), chunk_size=16)
    cache = KiviCache.from_model(fast)
    b = chunked_prefill(fast, ids, cache, chunk_size=16)
    torch.testing.assert_close(b, a, atol=2e-4, rtol=2e-4)
    assert cache.get_seq_length() == 77


def test_softcapping_resolves_auto_to_reference_and_rejects_explicit_cpu():
    model = quantize_model(tiny_model("gemma2", **GQA3, sliding_window=32), KiviConfig(**CFG))
    assert model.kivi_attention_backend == "reference"
    assert model.config._attn_implementation != "kivi"  # "kivi" does not implement softcapping
    with torch.no_grad():
        out = model(torch.randint(1, 128, (1, 10)), cache=KiviCache.from_model(model)).logits
    assert torch.isfinite(out).all()
    with pytest.raises(ValueError, match="softcapping"):
        quantize_model(
            tiny_model("gemma2", **GQA3, sliding_window=32), KiviConfig(**{**CFG, "attention_backend": "cpu"})
        )


def test_forward_with_nothing_stored_uses_plain_sdpa(monkeypatch):
    """A prefill (no stored token yet) is exact attention: it goes to SDPA, not to a kivi backend."""
    import kivi.attention.interface as iface

    calls = []
    real = iface.run_backend
    monkeypatch.setattr(iface, "run_backend", lambda *a, **k: calls.append(1) or real(*a, **k))
    ref, fast = pair()
    ids = torch.randint(1, 128, (2, 40))
    lf, _ = _forward_steps(fast, ids, [40])
    assert calls == []
    lr, _ = _forward_steps(ref, ids, [40])
    torch.testing.assert_close(lf, lr, atol=2e-5, rtol=2e-5)
    _forward_steps(fast, ids, [39, 1])  # the second forward reads the quantized store
    assert len(calls) == 2  # one per layer


def test_packed_states_reach_the_backend_through_the_call(monkeypatch):
    """What KiviCache.update returns is what the "kivi" attention function reads: a decode step of a
    quantized model calls the backend once per layer with the views that update produced."""
    import kivi.attention.interface as interface
    from kivi.cache.view import PackedStates

    model = quantize_model(tiny_model(**GQA3), KiviConfig(**CFG, attention_backend="cpu"))
    cache = KiviCache.from_model(model)
    seen_updates, seen_backend = [], []
    update = cache.update

    def spy_update(*a, **kw):
        out = update(*a, **kw)
        seen_updates.append(out)
        return out

    run = interface.run_backend

    def spy_run(backend, query, k_view, v_view, **kw):
        seen_backend.append((backend, k_view, v_view))
        return run(backend, query, k_view, v_view, **kw)

    monkeypatch.setattr(cache, "update", spy_update)
    monkeypatch.setattr(interface, "run_backend", spy_run)
    ids = torch.randint(1, 128, (1, 40))
    with torch.no_grad():
        model(ids, cache=cache, use_cache=True)  # prefill: nothing stored yet -> SDPA over the fp views
        assert seen_backend == []
        model(ids[:, :1], cache=cache, use_cache=True)
    n_layers = model.config.num_hidden_layers
    assert len(seen_backend) == n_layers
    for (k, v), (backend, kv, vv) in zip(seen_updates[-n_layers:], seen_backend):
        assert isinstance(k, PackedStates) and backend is cache.backend and backend.name == "cpu"  # the cache's object
        assert kv is k.view and vv is v.view


def test_packed_states_refuse_other_attention():
    """A cache built for packed attention used by a model whose attention is SDPA fails loudly."""
    from kivi.cache.view import PackedStates

    cache = KiviCache(KiviConfig(**CFG), attention_backend="cpu")
    k = torch.randn(1, 2, 40, 32)
    ks, vs = cache.update(k, k, 0)
    assert isinstance(ks, PackedStates) and isinstance(vs, PackedStates)
    with pytest.raises(TypeError, match="PackedStates"):
        torch.nn.functional.scaled_dot_product_attention(torch.randn(1, 2, 1, 32), ks, vs)
    # The default cache returns plain tensors that any attention reads.
    kr, vr = KiviCache(KiviConfig(**CFG)).update(k, k, 0)
    assert isinstance(kr, torch.Tensor) and torch.equal(kr, k)


def test_explicit_packed_backend_needs_kivi_attention():
    model = tiny_model(**GQA3)  # not quantized: its attention is SDPA
    with pytest.raises(ValueError, match="quantize_model"):
        KiviCache.from_model(model, KiviConfig(**CFG, attention_backend="cpu"))
    assert KiviCache.from_model(model, KiviConfig(**CFG)).attention_backend == "reference"
