"""kivi.cache.support: the one definition of the layer types and head_dim KiviCache supports."""

from __future__ import annotations

import pytest
import transformers

from kivi import KiviCache, KiviConfig
from kivi.cache.support import (
    SUPPORTED_LAYER_TYPES,
    check_head_dim,
    check_layer_types,
    model_head_dim,
    model_layer_types,
)
from kivi.memory import ModelSpec, spec_from_hf_config


def _config(model_type="llama", **over):
    base = dict(vocab_size=64, hidden_size=64, intermediate_size=64, num_hidden_layers=3, num_attention_heads=2,
                num_key_value_heads=1)
    return transformers.AutoConfig.for_model(model_type, **{**base, **over})


def test_layer_types_with_their_windows():
    assert model_layer_types(_config()) == [("full_attention", None)] * 3
    assert model_layer_types(_config("gemma2", num_hidden_layers=4, sliding_window=64, head_dim=32)) == [
        ("sliding_attention", 64), ("full_attention", None)] * 2


def test_unsupported_layer_types_are_named_everywhere():
    cfg = _config(layer_types=["full_attention", "linear_attention", "linear_attention"])
    with pytest.raises(ValueError, match=r"\['linear_attention'\] \(layers 1, 2\); KiviCache supports"):
        model_layer_types(cfg)
    with pytest.raises(ValueError, match="linear_attention"):
        KiviCache.from_model_config(cfg, KiviConfig())
    with pytest.raises(ValueError, match="linear_attention"):
        spec_from_hf_config(cfg, count_params=False)
    with pytest.raises(ValueError, match=r"ModelSpec has layer types \['chunked_attention'\]"):
        ModelSpec(num_layers=2, num_kv_heads=1, head_dim=64, layer_types=["full_attention", "chunked_attention"])
    check_layer_types(list(SUPPORTED_LAYER_TYPES))  # no error


def test_head_dim():
    assert model_head_dim(_config()) == 32
    assert model_head_dim(_config(head_dim=16)) == 16


def test_group_size_must_divide_head_dim():
    check_head_dim(KiviConfig(group_size=32), 64, num_layers=2)
    check_head_dim(
        KiviConfig(group_size=48, residual_length=48, block_size=96, quantize_value=False), 64
    )  # keys only: fine
    with pytest.raises(ValueError, match=r"^group_size=48 must divide head_dim=64 \(values are grouped"):
        check_head_dim(KiviConfig(group_size=48, residual_length=48, block_size=96), 64)
    cfg = KiviConfig(layer_specific_config={1: {"group_size": 48, "residual_length": 144}}, block_size=288)
    check_head_dim(cfg, 64, num_layers=1)  # layer 1 not in the model
    with pytest.raises(ValueError, match=r"^layer_specific_config\[1\]\.group_size=48 must divide head_dim=64"):
        check_head_dim(cfg, 64, num_layers=2)
