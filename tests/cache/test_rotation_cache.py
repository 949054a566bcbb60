"""KiviConfig(key_rotation="hadamard") in the cache: stored keys are plain KIVI of the rotated keys, rotated back
when read; sink tokens, the window and values are bit-exact as without rotation; tiers keep the rotation; a saved
cache loads back bit for bit; every reader of packed codes refuses it in one clear line."""

from __future__ import annotations

import pytest
import torch

import kivi
from kivi.backends import resolve_backend
from kivi.cache.kivi_cache import KiviCache
from kivi.cache.layer import KiviLayer
from kivi.cache.view import materialize
from kivi.capabilities import host_reasons
from kivi.config import KiviConfig
from kivi.prefix import model_fingerprint
from kivi.quant.demote import demote_kv
from kivi.quant.kv import dequantize_kv, quantize_kv
from kivi.quant.rotation import rotation_matrix
from tests.helpers import tiny_model

G, R, S = 16, 32, 3


def _kv(t, d=32, seed=0):
    g = torch.Generator().manual_seed(seed)
    k = torch.randn(2, 2, t, d, generator=g)
    k[..., 3] *= 15.0  # an outlier channel
    return k, torch.randn(2, 2, t, d, generator=g)


def _seen(cfg, k, v, chunks):
    """Append ``chunks`` of all but the last token, then the last one: the layer, the stored range before that
    last append, and the keys / values its query reads (everything stored, the window, itself)."""
    layer = KiviLayer(cfg)
    s = 0
    for c in chunks:
        layer.append(k[:, :, s:s + c], v[:, :, s:s + c])
        s += c
    stored = layer.k.store.start, layer.k.store.length
    kv, vv = layer.append(k[:, :, s:s + 1], v[:, :, s:s + 1])
    return layer, stored, materialize(kv, torch.float32), materialize(vv, torch.float32)


@pytest.mark.parametrize("chunks", [[150], [100, 1, 1, 48], [40] + [1] * 30])
def test_stored_keys_are_rotated_kivi_and_the_rest_is_bit_exact(chunks):
    base = dict(group_size=G, residual_length=R, sink_tokens=S, block_size=64)
    k, v = _kv(sum(chunks) + 1)
    _, (start, end), keys, values = _seen(KiviConfig(**base, key_rotation="hadamard"), k, v, chunks)
    _, _, keys0, values0 = _seen(KiviConfig(**base), k, v, chunks)
    assert start == S and end > S + G
    assert torch.equal(keys[:, :, :S], k[:, :, :S])  # sinks: bit-exact, never rotated
    assert keys.shape[2] == k.shape[2]
    assert torch.equal(keys[:, :, end:], k[:, :, end:])  # window + the new token: bit-exact
    assert torch.equal(values, values0)  # values are not rotated
    rot = rotation_matrix("hadamard", 32)
    want = dequantize_kv(quantize_kv(k[:, :, start:end] @ rot, "channel", 2, G, param_dtype=torch.float32)) @ rot.T
    torch.testing.assert_close(keys[:, :, start:end], want, atol=1e-6, rtol=0)
    assert not torch.allclose(keys[:, :, start:end], keys0[:, :, start:end], atol=1e-3)
    err = (keys[:, :, start:end] - k[:, :, start:end]).norm()
    assert err < 0.5 * k[:, :, start:end].norm()  # what it stores is the keys, not their rotation


def test_tiers_keep_the_rotation():
    cfg = KiviConfig(group_size=G, residual_length=R, block_size=64, k_bits=4, v_bits=4,
                     tiers=[(R, None), (G * 2, 4), (None, 2)], key_rotation="hadamard")
    k, v = _kv(201, seed=1)
    layer, _, keys, _ = _seen(cfg, k, v, [200])
    oldest = layer.k.store.tier_stores()[0]
    seg = oldest.read()
    assert seg.bits == 2 and seg.rotation == "hadamard"
    rot = rotation_matrix("hadamard", 32)
    n = seg.num_tokens
    want = dequantize_kv(demote_kv(quantize_kv(k[:, :, :n] @ rot, "channel", 4, G, param_dtype=torch.float32), 2))
    torch.testing.assert_close(keys[:, :, :n], want @ rot.T, atol=1e-5, rtol=0)


def test_auto_reads_it_through_the_reference_backend_and_packed_backends_refuse():
    cfg = KiviConfig(key_rotation="hadamard")
    assert resolve_backend("auto", "cpu", config=cfg).name == "reference"
    assert resolve_backend("auto", None, config=cfg).name == "reference"
    for name in ("cpu", "triton"):
        with pytest.raises((ValueError, RuntimeError), match=r"key_rotation='hadamard'.*use 'reference'"):
            resolve_backend(name, "cuda" if name == "triton" else "cpu", config=cfg)
    with pytest.raises(ValueError, match=r"attention_backend='cpu' does not implement key_rotation='hadamard'"):
        KiviCache(KiviConfig(key_rotation="hadamard", attention_backend="cpu"), attention_backend="cpu")
    assert resolve_backend("auto", "cpu", config=KiviConfig()).name == "cpu"  # unchanged without rotation


def test_pages_refuse_it():
    for host in ("batching", "vllm"):
        assert [str(r) for r in host_reasons(KiviConfig(key_rotation="hadamard"), host)] == [
            "key_rotation='hadamard': rotated keys (the kernels and pages read codes in the keys' own basis; only the "
            "reference rotates them back)"]
    from kivi.vllm.config import kivi_config

    with pytest.raises(ValueError, match=r"key_rotation='hadamard'.*not supported by the vLLM plugin"):
        kivi_config({"kivi": {"key_rotation": "hadamard", "attention_backend": "reference"}})


def test_a_model_runs_it_and_refuses_a_head_dim_that_is_not_a_power_of_two():
    cfg = KiviConfig(group_size=8, residual_length=16, block_size=32, key_rotation="hadamard")
    model = kivi.quantize_model(tiny_model(hidden_size=192, head_dim=32, num_attention_heads=6), cfg)
    assert model.kivi_attention_backend == "reference"
    ids = torch.randint(1, 128, (1, 60), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        fp = model(ids).logits  # no cache given: exact attention
        cache = KiviCache.from_model(model)
        model(ids[:, :50], cache=cache, use_cache=True)
        out = torch.cat([model(ids[:, i:i + 1], cache=cache, use_cache=True).logits for i in range(50, 60)], 1)
    assert (out - fp[:, 50:]).abs().max() < 0.5 * fp.abs().max()
    with pytest.raises(ValueError, match=r"power of two.*head_dim=24"):
        kivi.quantize_model(tiny_model(hidden_size=144, head_dim=24, num_attention_heads=6),
                            KiviConfig(group_size=8, residual_length=16, key_rotation="hadamard"))


def test_saved_rotated_cache_loads_back_bit_for_bit(tmp_path):
    cfg = KiviConfig(group_size=16, residual_length=32, block_size=64, sink_tokens=2, key_rotation="hadamard")
    model = kivi.quantize_model(tiny_model(weight_scale=4.0), cfg)
    ids = torch.randint(1, 128, (1, 90), generator=torch.Generator().manual_seed(1))
    fp = model_fingerprint(model)
    cache = KiviCache.from_model(model)
    with torch.no_grad():
        model(ids, cache=cache, use_cache=True)
    cache.save(tmp_path / "p.kivi", fingerprint=fp)
    loaded = KiviCache.load(tmp_path / "p.kivi", fingerprint=fp, model=model)
    assert loaded.config.key_rotation == "hadamard"
    seg = next(seg for _, seg in loaded.layers[0].k.store.iter_blocks())
    assert seg.rotation == "hadamard"
    nxt = torch.tensor([[5]])
    with torch.no_grad():
        a = model(nxt, cache=cache, use_cache=True).logits
        b = model(nxt, cache=loaded, use_cache=True).logits
    assert torch.equal(a, b)
