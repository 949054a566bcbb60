"""benchmarks/decode_breakdown.py: the cache-write and attention timers see every layer, by layer kind."""

from __future__ import annotations

import importlib.util
from pathlib import Path

from kivi import KiviCache, KiviConfig, quantize_model
from tests.helpers import tiny_model

_DIR = Path(__file__).resolve().parents[2] / "benchmarks"
spec = importlib.util.spec_from_file_location("decode_breakdown", _DIR / "decode_breakdown.py")
db = importlib.util.module_from_spec(spec)
spec.loader.exec_module(db)


def test_timers_see_every_layer_and_are_removed_after(monkeypatch):
    model = tiny_model(num_key_value_heads=2)
    cfg = KiviConfig(group_size=8, residual_length=16, attention_backend="reference",
                     head_bits={1: {"k_bits": [4, 2]}})
    quantize_model(model, cfg)
    monkeypatch.setattr(db.bench_decode, "_prepare", lambda m, name: cfg)
    from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

    update, attention = KiviCache.update, ALL_ATTENTION_FUNCTIONS["kivi"]
    with db.Timers() as timers:
        row = db.run_row(model, "x.json", context=40, steps=5, timers=timers)
        layers = model.config.num_hidden_layers
        assert set(timers.update) == set(timers.attention) == set(range(layers))
        assert all(t > 0 for t in (*timers.update.values(), *timers.attention.values()))
    assert KiviCache.update is update and ALL_ATTENTION_FUNCTIONS["kivi"] is attention
    assert row["config"] == "x" and row["per_head_layers"] == 1 and row["plain_layers"] == layers - 1
    assert row["per_head_update_us"] > 0 and row["plain_attention_us"] > 0 and row["step_ms"] > 0
