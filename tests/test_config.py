import json

import pytest

from kivi import KiviConfig, quantize_model
from kivi.config import PRESETS

from tests.helpers import tiny_model


def test_defaults_and_presets():
    c = KiviConfig()
    assert (c.k_bits, c.v_bits, c.group_size, c.residual_length, c.residual_bits) == (2, 2, 32, 128, 0)
    assert KiviConfig.preset("high").k_bits == 4 and KiviConfig.preset("HIGH").v_bits == 4
    b = KiviConfig.preset("balanced")
    assert (b.k_bits, b.v_bits, b.sink_tokens, b.residual_bits) == (4, 2, 4, 0)
    e = KiviConfig.preset("extreme")
    assert (e.k_bits, e.v_bits, e.sink_tokens, e.residual_bits) == (2, 2, 0, 0)  # plain KIVI-2
    assert KiviConfig.preset("extreme", group_size=64, residual_length=64).group_size == 64
    assert set(PRESETS) == {"high", "balanced", "extreme"}


def test_json_round_trip(tmp_path):
    c = KiviConfig(k_bits=4, layer_specific_config={0: {"k_bits": 8}, 3: {"quantize_value": False}})
    assert KiviConfig.from_json(c.to_json()) == c
    p = tmp_path / "c.json"
    c.to_json(p)
    assert KiviConfig.from_json(p) == c
    assert KiviConfig.from_json(json.dumps({"config": c.to_dict(), "ppl": 20.0})) == c  # `kivi tune --json` output


@pytest.mark.parametrize(
    "kwargs,match",
    [
        (dict(k_bits=5), r"k_bits=5 is not supported; allowed values are \[1, 2, 3, 4, 8\]"),
        (dict(v_bits=0), r"v_bits=0"),
        (dict(group_size=0), r"group_size=0 must be an integer >= 1"),
        (dict(residual_length=100), r"residual_length=100 must be a multiple of group_size=32"),
        (dict(residual_bits=5), r"residual_bits=5"),
        (dict(block_size=100), r"block_size=100 must be a multiple of group_size=32"),
        (dict(attention_backend="cuda"), r"attention_backend='cuda'"),
        (dict(layer_specific_config={0: {"k_bits": 7}}), r"layer_specific_config\[0\]\.k_bits=7"),
        (dict(layer_specific_config={0: {"bogus": 1}}), r"unknown field\(s\) \['bogus'\]"),
        (dict(layer_specific_config={"x": {}}), r"'x' is not a layer index"),
        (dict(quantize_key="yes"), r"quantize_key='yes' must be true or false"),
        (dict(sink_tokens=-1), r"sink_tokens=-1 must be an integer >= 0"),
        # types are checked up front (a float width used to pass and fail mid-generation)
        (dict(k_bits=2.0), r"k_bits=2.0 is not supported"),
        (dict(v_bits="2"), r"v_bits='2' is not supported"),
        (dict(check_finite="no"), r"check_finite='no' must be true or false"),
        (dict(layer_specific_config={1.7: {"k_bits": 4}}), r"key 1.7 is not a layer index"),
        (dict(layer_specific_config={True: {"k_bits": 4}}), r"key True is not a layer index"),
        (dict(layer_specific_config={"0": 4}), r"layer_specific_config\['0'\]=4 must be a mapping"),
        (dict(layer_specific_config=[1]), r"layer_specific_config=\[1\] must be a mapping"),
        (dict(sink_tokens=10**12), r"sink_tokens=1000000000000 is more than 4096"),
    ],
)
def test_validation_names_field_value_and_allowed(kwargs, match):
    with pytest.raises(ValueError, match=match):
        KiviConfig(**kwargs)


def test_unknown_preset_and_fields():
    with pytest.raises(ValueError, match="preset='medium' is unknown"):
        KiviConfig.preset("medium")
    with pytest.raises(ValueError, match=r"unknown KiviConfig field\(s\) \['kbits'\]"):
        KiviConfig.from_dict({"kbits": 2})
    with pytest.raises(ValueError, match="cannot read KiviConfig JSON file"):
        KiviConfig.from_json("/nonexistent/cfg.json")


def test_layer_index_beyond_model_is_rejected_when_applied():
    model = tiny_model("llama")  # 2 layers
    with pytest.raises(ValueError, match=r"layer index 5, but the model has 2 layers"):
        quantize_model(model, KiviConfig(layer_specific_config={5: {"k_bits": 4}}))


def test_group_size_must_divide_head_dim_when_applied():
    model = tiny_model("llama")  # head_dim 32
    with pytest.raises(ValueError, match="group_size=64 must divide head_dim=32"):
        quantize_model(model, KiviConfig(group_size=64, residual_length=64))


def test_for_layer_applies_overrides():
    c = KiviConfig(layer_specific_config={1: {"k_bits": 4, "residual_length": 64}})
    assert c.for_layer(0).k_bits == 2 and c.for_layer(1).k_bits == 4 and c.for_layer(1).residual_length == 64
    assert c.for_layer(1).layer_specific_config == {}
