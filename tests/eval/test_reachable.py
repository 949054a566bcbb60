"""What a KiviCache keeps alive equals what it reports: every tensor reachable from the cache
object (attributes, lists, dicts; each storage counted once) adds up to ``cache.nbytes``."""

from __future__ import annotations

import pytest
import torch

from kivi import KiviCache, KiviConfig
from kivi.cache.layer import KiviLayer
from kivi.cache.sliding import SlidingKiviLayer
from kivi.eval.reachable import reachable_tensor_bytes as reachable_storage_bytes


def test_walker_sees_a_slice_pinning_its_base():
    """The check can fail: a zero-length slice kept on an object pins its whole storage."""
    class Holder:
        pass

    h = Holder()
    h.t = torch.zeros(1000)[:0]
    assert reachable_storage_bytes(h) == 4000


CFG = dict(group_size=16, residual_length=32, block_size=64)


def _kv(b, t, g, dtype=torch.float32):
    return torch.randn(b, 2, t, 32, generator=g).to(dtype), torch.randn(b, 2, t, 32, generator=g).to(dtype)


@pytest.mark.parametrize("cfg", [dict(CFG), dict(CFG, k_bits=4, v_bits=2, sink_tokens=4), dict(CFG, v_bits=4)],
                         ids=["2/2", "balanced", "k2v4"])
@pytest.mark.parametrize("backend", ["reference", "cpu"])
def test_reachable_bytes_equal_nbytes(cfg, backend):
    g = torch.Generator().manual_seed(0)
    cache = KiviCache(KiviConfig(**cfg), attention_backend=backend)
    layers = 3

    def step(n):
        k, v = _kv(2, n, g)
        for i in range(layers):
            cache.update(k, v, i)

    def check(when):
        assert reachable_storage_bytes(cache) == cache.nbytes, when

    step(300)  # prefill: one exact-size block per side and layer
    check("after prefill")
    for _ in range(64):
        step(1)
    check("after 64 decode steps")
    cache.crop(-40)
    check("after crop")
    cache.reorder_cache(torch.tensor([1, 0]))
    check("after reorder")
    step(5)
    check("after a chunk")


def test_reachable_bytes_with_sliding_window_eviction():
    g = torch.Generator().manual_seed(1)
    cfg = KiviConfig(**CFG)
    cache = KiviCache(cfg, layers=[SlidingKiviLayer(cfg, sliding_window=48), KiviLayer(cfg)], attention_backend="cpu")
    k, v = _kv(1, 200, g)
    for i in range(2):
        cache.update(k, v, i)
    for _ in range(300):
        k, v = _kv(1, 1, g)
        for i in range(2):
            cache.update(k, v, i)
    assert cache.layers[0].k.store.start > 0  # blocks were evicted
    assert reachable_storage_bytes(cache) == cache.nbytes


def test_model_forward_keeps_nothing_besides_the_cache():
    """After prefill and decode through a quantized model (packed attention), the cache holds no
    full-precision copy of the prompt: reachable bytes still equal nbytes."""
    from kivi import quantize_model
    from tests.helpers import tiny_model

    model = quantize_model(tiny_model("llama"), KiviConfig(**CFG))
    cache = KiviCache.from_model(model)
    ids = torch.randint(1, 100, (1, 150))
    with torch.no_grad():
        model(ids, cache=cache, use_cache=True)
        assert reachable_storage_bytes(cache) == cache.nbytes
        for i in range(20):
            model(ids[:, i : i + 1], cache=cache, use_cache=True)
    assert reachable_storage_bytes(cache) == cache.nbytes
