"""kivi.vllm.config / version / geometry: what the plugin reads and refuses (no vLLM needed)."""

from __future__ import annotations

import pytest
import torch

from kivi.config import KiviConfig
from kivi.paged.geometry import build_geometry
from kivi.vllm.config import kivi_config
from kivi.vllm.version import TESTED_VLLM, vllm_version_problem


def test_no_kivi_key_means_no_plugin():
    assert kivi_config(None) is None
    assert kivi_config({}) is None
    assert kivi_config({"other_plugin": 1}) is None


def test_fields_and_presets():
    assert kivi_config({"kivi": {"k_bits": 2, "v_bits": 2}}) == KiviConfig(k_bits=2, v_bits=2)
    assert kivi_config({"kivi": {"preset": "extreme", "residual_length": 64}}) == KiviConfig.preset(
        "extreme", residual_length=64)


@pytest.mark.parametrize("bad, words", [
    ({"k_bit": 2}, ["k_bit", "unknown"]),
    ({"preset": "extreme", "v_bit": 2}, ["v_bit", "unknown"]),
    ({"preset": "nope"}, ["preset='nope'", "extreme"]),
    ({"k_bits": 5}, ["k_bits"]),
    ({"preset": "balanced", "quantize_after": 64}, ["quantize_after=64", "not supported"]),
    ({"attention_backend": "fast"}, ["attention_backend='fast'", "triton"]),
    ({"tiers": [[128, None], [None, 2]]}, ["tiers"]),
    ({"attention_backend": "triton", "symmetric": True}, ["'triton'", "GPU path", "symmetric quantization"]),
    ({"attention_backend": "triton", "residual_bits": 1}, ["'triton'", "residual_bits > 0"]),
], ids=["unknown-field", "unknown-override", "unknown-preset", "bad-bits", "quantize-after", "backend", "tiers",
        "triton-symmetric", "triton-compensation"])
def test_errors_name_the_field(bad, words):
    with pytest.raises(ValueError) as e:
        kivi_config({"kivi": bad})
    msg = str(e.value)
    assert msg.startswith('additional_config["kivi"]') and "\n" not in msg
    for w in words:
        assert w in msg


@pytest.mark.parametrize("backend", ["auto", "cpu", "reference", "triton"])
def test_every_page_reader_is_accepted(backend):
    """Which entry of vLLM's may take it is kivi.vllm.select's rule (``"triton"``: a GPU platform's)."""
    assert kivi_config({"kivi": {"attention_backend": backend}}).attention_backend == backend


@pytest.mark.parametrize("preset", ["balanced", "high"])
def test_presets_with_sinks_accepted(preset):
    cfg = kivi_config({"kivi": {"preset": preset}})
    assert cfg == KiviConfig.preset(preset) and cfg.sink_tokens == 4
    assert kivi_config({"kivi": {"k_bits": 2, "v_bits": 2, "sink_tokens": 5}}).sink_tokens == 5


def test_window_rings_hold_the_sink_and_the_window():
    """With S sink tokens a request keeps S + R + G - 1 full-precision rows: the rings grow to hold them."""
    for sink in (0, 4, 5, 40):
        cfg = KiviConfig(k_bits=2, v_bits=2, group_size=32, residual_length=32, sink_tokens=sink)
        geo = build_geometry(cfg, page_size=128, num_kv_heads=3, head_dim=64, dtype=torch.bfloat16)
        assert geo.sink_tokens == sink and geo.fp_slots == sink + 63
        assert (geo.window_rings - 1) * geo.window_tokens < geo.fp_slots <= geo.window_rings * geo.window_tokens


def test_not_an_object():
    with pytest.raises(ValueError, match='additional_config\\["kivi"\\] must be an object'):
        kivi_config({"kivi": "extreme"})


@pytest.mark.parametrize("version", [TESTED_VLLM, f"{TESTED_VLLM}+cpu"])
def test_tested_version_accepted(version):
    assert vllm_version_problem(version) is None


@pytest.mark.parametrize("version", ["0.31.0", "0.32.1", "0.33.0", "1.0", "not-a-version"])
def test_other_versions_refused_in_one_line(version):
    msg = vllm_version_problem(version)
    assert msg is not None and version in msg and TESTED_VLLM in msg and "\n" not in msg


def test_page_bytes_are_kivis_format():
    """SmolLM2 on one rank (3 kv heads of 64, bfloat16), 2/2, G=32: a block of 128 tokens holds exactly the
    PackedKV bytes kivi's own cache counts per token (keys, values, scales, offsets): 48 bytes per head and
    token against 256 in bfloat16 (5.33x); the window block holds the same bytes of full-precision rows."""
    cfg = KiviConfig(k_bits=2, v_bits=2)
    geo = build_geometry(cfg, page_size=128, num_kv_heads=3, head_dim=64, dtype=torch.bfloat16)
    per_head_token = sum(cfg.side_format(side).token_nbytes(64, torch.bfloat16) for side in ("k", "v"))
    assert geo.state_bytes == per_head_token
    assert geo.page_bytes == geo.block_bytes == 128 * 3 * geo.state_bytes
    assert (2 * 64 * 2) / geo.state_bytes == pytest.approx(16 / 3)
    assert geo.window_tokens * geo.fp_token_bytes <= geo.block_bytes
    assert geo.sliding_window == cfg.residual_length + cfg.group_size


def test_block_size_must_hold_whole_key_groups():
    with pytest.raises(ValueError, match="page_size=48 must be a multiple of vLLM block_size / group_size=32"):
        build_geometry(KiviConfig(), page_size=48, num_kv_heads=3, head_dim=64, dtype=torch.bfloat16)
