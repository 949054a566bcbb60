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


def test_clip_round_trips_and_overrides_per_layer():
    c = KiviConfig(clip=True, sink_tokens=4, layer_specific_config={1: {"clip": False}})
    assert KiviConfig.from_json(c.to_json()) == c
    assert json.loads(c.to_json())["clip"] is True
    assert c.for_layer(0).clip and not c.for_layer(1).clip
    assert "clip" in c.describe() and "clip" not in KiviConfig().describe()
    assert KiviConfig.from_dict({"k_bits": 2}).clip is False  # configs saved before the field still load
    v = KiviConfig(clip="values")
    assert KiviConfig.from_json(v.to_json()) == v and v.clips("token") and not v.clips("channel")
    assert KiviConfig(clip="keys").clips("channel") and "clip-keys" in KiviConfig(clip="keys").describe()


def test_key_rotation_round_trips_and_is_described():
    c = KiviConfig(key_rotation="hadamard", sink_tokens=4)
    assert KiviConfig.from_json(c.to_json()) == c and json.loads(c.to_json())["key_rotation"] == "hadamard"
    assert KiviConfig().key_rotation == "none" and KiviConfig.from_dict({"k_bits": 2}).key_rotation == "none"
    assert "rot-hadamard" in c.describe() and "rot" not in KiviConfig().describe()
    assert c.side_format("k").rotation == "hadamard" and c.side_format("v").rotation == "none"
    assert c.for_layer(0).key_rotation == "hadamard"
    with pytest.raises(ValueError, match=r"unknown field\(s\) \['key_rotation'\]"):  # one rotation per cache
        KiviConfig(layer_specific_config={0: {"key_rotation": "hadamard"}})


def test_key_rotation_needs_a_power_of_two_head_dim_when_applied():
    model = tiny_model("llama", hidden_size=96, num_attention_heads=4, head_dim=24)
    with pytest.raises(ValueError, match=r"key_rotation='hadamard' needs head_dim to be a power of two.*head_dim=24"):
        quantize_model(model, KiviConfig(group_size=8, residual_length=16, key_rotation="hadamard"))


@pytest.mark.parametrize(
    "kwargs,match",
    [
        (dict(key_rotation="walsh"), r"key_rotation='walsh' is not allowed; choose one of \['none', 'hadamard'\]"),
        (dict(key_rotation=None), r"key_rotation=None is not allowed"),
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
        (dict(clip="mse"), r"clip='mse' is not allowed; choose one of \[False, True, 'keys', 'values'\]"),
        (dict(clip=1), r"clip=1 is not allowed"),
        (dict(clip=True, symmetric=True), r"clip=True is only implemented for asymmetric quantization"),
        (dict(symmetric=True, layer_specific_config={2: {"clip": True}}),
         r"layer_specific_config\[2\]\.clip=True is only implemented for asymmetric"),
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


# --------------------------------------------------------------------------- fuzz (hypothesis)
from dataclasses import fields as _fields  # noqa: E402

from hypothesis import HealthCheck, given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402

FIELDS = [f.name for f in _fields(KiviConfig)]
LAYER_FIELD_NAMES = ["k_bits", "v_bits", "group_size", "residual_length", "residual_bits", "quantize_key",
                     "quantize_value", "symmetric"]
# right and wrong types, in and out of range
SCALARS = st.one_of(
    st.sampled_from([0, 1, 2, 3, 4, 8, 16, 32, 64, 128, 256, -1, -32, 5, 7, 100, 4096, 4097, 10**12, 2**70]),
    st.integers(-10**6, 10**6),
    st.sampled_from([2.0, 0.5, float("nan"), float("inf"), -0.0]),
    st.booleans(), st.none(),
    st.sampled_from(["2", "auto", "float16", "bfloat16", "fp8", "cpu", "reference", "triton", "cuda", "", "no"]),
    st.just([1]), st.just({}),
)
LAYER_OVERRIDES = st.dictionaries(st.sampled_from(LAYER_FIELD_NAMES + ["bogus", "block_size"]), SCALARS, max_size=3)
LSC = st.one_of(
    st.dictionaries(st.one_of(st.integers(-2, 40), st.sampled_from(["0", "1", " 3", "x", "1.7", "-1"]),
                              st.sampled_from([1.7, True, None])),
                    st.one_of(LAYER_OVERRIDES, SCALARS), max_size=3),
    SCALARS,
)
KWARGS = st.dictionaries(st.sampled_from(FIELDS + ["kbits"]), SCALARS, max_size=6).flatmap(
    lambda d: st.one_of(st.just(d), LSC.map(lambda lsc: {**d, "layer_specific_config": lsc})))


def _names_a_field(message: str) -> bool:
    return any(name in message for name in FIELDS + ["KiviConfig field", "JSON"])


@settings(max_examples=400, derandomize=True, deadline=None, database=None,
          suppress_health_check=[HealthCheck.too_slow])
@given(kwargs=KWARGS)
def test_fuzz_kwargs_valid_config_or_error_naming_the_field(kwargs):
    """Random kwargs (right and wrong types, ranges): a valid config that round-trips through JSON
    and resolves every layer, or a ValueError/TypeError naming the field — never another exception."""
    try:
        cfg = KiviConfig(**kwargs)
    except TypeError as e:  # an unknown keyword: Python names it
        assert "kbits" in kwargs and "kbits" in str(e), (kwargs, e)
        return
    except ValueError as e:
        assert _names_a_field(str(e)), (kwargs, e)
        assert len(str(e).splitlines()) == 1, (kwargs, e)
        return
    assert KiviConfig.from_json(cfg.to_json()) == cfg
    for i in cfg.layer_specific_config:
        layer = cfg.for_layer(i)
        assert isinstance(layer.k_bits, int) and not isinstance(layer.k_bits, bool)


@settings(max_examples=200, derandomize=True, deadline=None, database=None,
          suppress_health_check=[HealthCheck.too_slow])
@given(kwargs=KWARGS, junk=st.sampled_from(["", "[1]", "5", "null", "{", '{"layer_specific_config": {"0": 4}}',
                                            "[" * 5000, '{"k_bits": NaN}', '{"k_bits": 1e999}']))
def test_fuzz_json_valid_config_or_value_error(kwargs, junk):
    """The same through JSON text (and text that is not a config): a config or one ValueError."""
    for text in (json.dumps(kwargs), junk):
        try:
            cfg = KiviConfig.from_json(text)
        except ValueError as e:
            assert _names_a_field(str(e)) or "must be a JSON object" in str(e), (text[:80], e)
            continue
        assert KiviConfig.from_json(cfg.to_json()) == cfg


# ---------------------------------------------------------------- per-head widths (head_bits)
def test_head_bits_round_trip_and_layer_widths(tmp_path):
    cfg = KiviConfig(
        layer_specific_config={2: {"v_bits": 4}}, head_bits={2: {"k_bits": [4, 2, 2]}, "5": {"v_bits": [8, 2, 2]}}
    )
    assert cfg.head_bits == {2: {"k_bits": [4, 2, 2]}, 5: {"v_bits": [8, 2, 2]}}
    assert KiviConfig.from_json(cfg.to_json()) == cfg
    cfg.to_json(tmp_path / "c.json")
    assert KiviConfig.from_json(str(tmp_path / "c.json")) == cfg
    assert cfg.layer_head_bits(2) == ([4, 2, 2], [4, 4, 4])  # the layer's v_bits on every head
    assert cfg.layer_head_bits(5) == ([2, 2, 2], [8, 2, 2])
    assert cfg.layer_head_bits(0) is None
    assert cfg.for_layer(2).head_bits == {}
    assert "2 per-head layers" in cfg.describe()


@pytest.mark.parametrize("head_bits, match", [
    ({0: {"k_bits": [5, 2]}}, r"head_bits\[0\]\.k_bits=5 is not supported; allowed values are \[1, 2, 3, 4, 8\]"),
    ({0: {"k_bits": [2, True]}}, r"head_bits\[0\]\.k_bits=True is not supported"),
    ({0: {"q_bits": [2]}}, r"head_bits\[0\] has unknown field\(s\) \['q_bits'\]; allowed: \['k_bits', 'v_bits'\]"),
    ({0: {"k_bits": [2, 2], "v_bits": [2]}}, r"k_bits has 2 widths but v_bits 1"),
    ({0: {"k_bits": []}}, r"head_bits\[0\]\.k_bits=\[\] must be a non-empty list"),
    ({0: {"k_bits": 2}}, r"head_bits\[0\]\.k_bits=2 must be a non-empty list"),
    ({0: {}}, r"head_bits\[0\]=\{\} must be a non-empty mapping"),
    ({"x": {"k_bits": [2]}}, r"head_bits key 'x' is not a layer index"),
    ([2, 2], r"head_bits=\[2, 2\] must be a mapping"),
], ids=["width", "bool", "field", "lengths", "empty", "scalar", "empty-entry", "key", "list"])
def test_head_bits_errors_name_field_value_and_allowed(head_bits, match):
    with pytest.raises(ValueError, match=match):
        KiviConfig(head_bits=head_bits)


def test_head_bits_checked_against_the_layer_and_the_model():
    with pytest.raises(ValueError, match=r"head_bits\[1\]\.k_bits is given but quantize_key=False for layer 1"):
        KiviConfig(head_bits={1: {"k_bits": [2, 2]}}, layer_specific_config={1: {"quantize_key": False}})
    with pytest.raises(ValueError, match=r"head_bits\[0\]\.v_bits has 1, not possible with symmetric=True"):
        KiviConfig(symmetric=True, head_bits={0: {"v_bits": [2, 1]}})
    cfg = KiviConfig(head_bits={7: {"k_bits": [2, 4]}})
    with pytest.raises(ValueError, match=r"head_bits has layer index 7, but the model has 4 layers"):
        cfg.validate(num_layers=4)
    with pytest.raises(ValueError, match=r"head_bits\[7\]\.k_bits has 2 widths, but the layer has 3 kv heads"):
        cfg.check_kv_heads(3)
    cfg.check_kv_heads(2)
# ------------------------------------------------------------- position tiers (docs/python.md, "Position tiers")

TIERS = [(128, None), (1024, 4), (None, 2)]


def test_tiers_normalise_and_round_trip_through_json(tmp_path):
    cfg = KiviConfig(k_bits=4, v_bits=2, sink_tokens=4, tiers=[[128, None], [1024, [4, 2]], [None, 2]],
                     layer_specific_config={1: {"tiers": None}, 2: {"tiers": [(128, None), (64, [4, 2]), (None, 1)]}})
    assert cfg.tiers == ((128, None), (1024, (4, 2)), (None, (2, 2)))
    path = tmp_path / "c.json"
    cfg.to_json(path)
    again = KiviConfig.from_json(path)
    assert again == cfg and again.to_dict() == cfg.to_dict()
    assert again.for_layer(1).tiers is None and again.for_layer(2).tiers[-1] == (None, (1, 1))
    assert "tiers 128@fp/1024@K4V2/rest@2" in cfg.describe()


@pytest.mark.parametrize("kwargs,needle", [
    (dict(tiers=TIERS), "tiers[1] widths (k, v)=(4, 4) must equal (k_bits, v_bits)=(2, 2)"),
    (dict(k_bits=4, v_bits=4, tiers=[(64, None), (1024, 4), (None, 2)]),
     "tiers[0]=(64, None) must be (residual_length, None)"),
    (dict(k_bits=4, v_bits=4, tiers=[(128, None), (1024, 4), (None, 3)]), "tiers[2] k_bits=3 cannot follow 4"),
    (dict(k_bits=4, v_bits=4, tiers=[(128, None), (100, 4), (None, 2)]),
     "tiers[1] token count 100 must be a positive multiple of group_size=32"),
    (dict(k_bits=4, v_bits=4, tiers=[(128, None), (1024, 4), (64, 2)]), "tiers[2]=(64, ...) is the last tier"),
    (dict(k_bits=4, v_bits=4, tiers=[(128, None)]), "needs the window and at least one quantized tier"),
    (dict(k_bits=4, v_bits=4, tiers=[(128, None), (1024, None), (None, 2)]), "tiers[1] width None"),
    (dict(k_bits=4, v_bits=4, tiers=[(128, None), (1024, 5), (None, 2)]), "tiers[1] k_bits=5 is not supported"),
    (dict(k_bits=4, v_bits=4, tiers=[(128, None), (1024, [4, 4, 4]), (None, 2)]),
     "must be an int, [k_bits, v_bits] or None"),
    (dict(k_bits=4, v_bits=4, tiers="128:fp"), "tiers='128:fp' must be a list of (tokens, bits) pairs"),
    (dict(k_bits=4, v_bits=4, tiers=[128, 4]), "tiers[0]=128 must be a (tokens, bits) pair"),
    (dict(k_bits=4, v_bits=4, symmetric=True, tiers=TIERS), "tiers need asymmetric quantization"),
    (dict(k_bits=4, v_bits=4, residual_bits=2, tiers=TIERS), "tiers need asymmetric quantization"),
    (dict(k_bits=4, v_bits=4, tiers=TIERS, layer_specific_config={3: {"residual_length": 64}}),
     "layer_specific_config[3].tiers[0]=(128, None) must be (residual_length, None) = (64, None)"),
])
def test_bad_tiers_are_one_line_errors(kwargs, needle):
    with pytest.raises(ValueError) as e:
        KiviConfig(**kwargs)
    assert needle in str(e.value) and "\n" not in str(e.value)


def test_one_list_of_bit_widths():
    """Every code-width list is SUPPORTED_BITS itself (kivi/quant/primitives.py), and every config width
    (layer, per-head, tier) is checked by its one validator, with the same message."""
    import kivi.config_checks as config_module
    from kivi.attention.fused_cpu import KERNEL_BITS
    from kivi.kernels._common import ATTENTION_BITS
    from kivi.quant.primitives import SUPPORTED_BITS, check_bits

    assert KERNEL_BITS is SUPPORTED_BITS and ATTENTION_BITS is SUPPORTED_BITS
    assert config_module.check_bits is check_bits
    for kw, name in ((dict(v_bits=6), "v_bits"), (dict(head_bits={0: {"v_bits": [6]}}), r"head_bits\[0\]\.v_bits"),
                     (dict(tiers=[(128, None), (256, (2, 2)), (None, (6, 2))]), r"tiers\[2\] k_bits")):
        with pytest.raises(ValueError, match=rf"^{name}=6 is not supported; allowed values are \[1, 2, 3, 4, 8\]$"):
            KiviConfig(**kw)
