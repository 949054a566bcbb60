"""`KiviCache.update` refuses, before anything changes, keys/values no layer can take and layer indices
beyond the model's layers (or, for a cache that creates its layers on first use, beyond the next one)."""

from __future__ import annotations

import copy

import pytest
import torch

from kivi import KiviCache, KiviConfig
from tests.helpers import tiny_model

CFG = KiviConfig(group_size=8, residual_length=8, block_size=32)


def _kv(b=1, h=2, t=10, d=32, dtype=torch.float32):
    return torch.randn(b, h, t, d, dtype=dtype)


BAD_INPUTS = {
    "tokens": ((_kv(t=10), _kv(t=12)), ValueError, r"differ in tokens 10 vs 12"),
    "batch": ((_kv(b=1), _kv(b=2)), ValueError, r"differ in batch 1 vs 2"),
    "kv-heads": ((_kv(h=2), _kv(h=4)), ValueError, r"differ in kv_heads 2 vs 4"),
    "head-dim": ((_kv(d=32), _kv(d=16)), ValueError, r"differ in head_dim 32 vs 16"),
    "3-d": ((_kv()[0], _kv()[0]), ValueError, r"key_states must be 4-D .* got shape \(2, 10, 32\)"),
    "int-dtype": ((torch.zeros(1, 2, 10, 32, dtype=torch.long), _kv()), ValueError, r"key_states.dtype=torch.int64"),
    "dtypes-differ": ((_kv(), _kv(dtype=torch.float16)), ValueError, r"same dtype and device"),
    "not-a-tensor": ((_kv(), [[1.0]]), TypeError, r"value_states must be a torch.Tensor .* got list"),
}


@pytest.mark.parametrize("case", list(BAD_INPUTS), ids=list(BAD_INPUTS))
@pytest.mark.parametrize("history", [0, 20], ids=["empty", "with-history"])
def test_bad_keys_or_values_are_refused_and_change_nothing(case, history):
    cache = KiviCache(CFG)
    if history:
        for i in range(2):
            cache.update(_kv(t=history), _kv(t=history), i)
    untouched, nbytes = copy.deepcopy(cache), cache.nbytes
    (k, v), error, match = BAD_INPUTS[case]
    with pytest.raises(error, match=match):
        cache.update(k, v, 0)
    assert len(cache.layers) == len(untouched.layers) and cache.get_seq_length() == history
    assert cache.nbytes == nbytes
    k, v = _kv(t=1), _kv(t=1)  # the next update returns what an untouched copy returns
    for got, want in zip(cache.update(k, v, 0), untouched.update(k, v, 0)):
        assert torch.equal(got, want)


@pytest.mark.parametrize(
    "bad", [-1, 2, 10**6, True, "0", 1.0], ids=["negative", "one-past", "huge", "bool", "str", "float"]
)
def test_layer_idx_beyond_the_models_layers_is_refused(bad):
    model = tiny_model()  # 2 decoder layers
    cache = KiviCache.from_model(model, CFG)
    assert cache.num_layers == 2
    error = TypeError if isinstance(bad, (bool, str, float)) else ValueError
    with pytest.raises(error, match="layer_idx"):
        cache.update(_kv(), _kv(), bad)
    assert len(cache.layers) == 2 and cache.get_seq_length() == 0
    if error is ValueError:
        with pytest.raises(ValueError, match=r"this cache has 2 layers \(allowed 0\.\.1\)"):
            cache.update(_kv(), _kv(), bad)


def test_a_cache_without_a_model_creates_its_layers_in_order():
    cache = KiviCache(CFG)
    with pytest.raises(ValueError, match=r"layer_idx=1 .* has 0, so layer_idx must be in 0\.\.0"):
        cache.update(_kv(), _kv(), 1)
    with pytest.raises(ValueError, match=r"layer_idx=1000000 .* has 0"):
        cache.update(_kv(), _kv(), 10**6)  # refused at once: no layer is built
    assert len(cache.layers) == 0
    for i in range(3):
        cache.update(_kv(), _kv(), i)
    cache.update(_kv(t=1), _kv(t=1), 1)  # an existing layer
    with pytest.raises(ValueError, match=r"must be in 0\.\.3"):
        cache.update(_kv(), _kv(), 5)
    assert len(cache.layers) == 3 and cache.num_layers is None
