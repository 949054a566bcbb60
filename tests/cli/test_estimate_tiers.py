"""`kivi estimate --config` with position tiers: the library's byte-exact count, one-line errors."""

from __future__ import annotations

import json

from kivi import KiviConfig
from kivi.memory import estimate_kv_memory
from kivi.memory.sources import ModelSpec
from tests.cli.test_cli_basic import assert_one_line_error, kivi

SHAPE = ("--num-layers", "4", "--num-kv-heads", "2", "--head-dim", "64", "--dtype", "float16")


def test_estimate_reads_tiers_from_a_config_file(tmp_path):
    cfg = KiviConfig(k_bits=4, v_bits=4, sink_tokens=4, tiers=[(128, None), (1024, 4), (None, 2)])
    path = tmp_path / "tiers.json"
    cfg.to_json(path)
    p = kivi("estimate", *SHAPE, "--context", "5000", "--prefill", "3001", "--config", str(path), "--json")
    assert p.returncode == 0, p.stderr
    d = json.loads(p.stdout)
    spec = ModelSpec(num_layers=4, num_kv_heads=2, head_dim=64, dtype="float16")
    want = estimate_kv_memory(spec, 5000, config=cfg, prefill=3001)
    assert d["kivi_total_bytes"] == want.kivi_total_bytes
    assert "tiers 128@fp/1024@4/rest@2" in d["config_description"]
    # the 2-bit tail makes it smaller than 4 bits everywhere, larger than 2 bits everywhere
    k4 = estimate_kv_memory(spec, 5000, config=KiviConfig(k_bits=4, v_bits=4, sink_tokens=4), prefill=3001)
    k2 = estimate_kv_memory(spec, 5000, config=KiviConfig(sink_tokens=4), prefill=3001)
    assert k2.kivi_total_bytes < d["kivi_total_bytes"] < k4.kivi_total_bytes


def test_bad_tiers_in_a_config_file_is_one_line(tmp_path):
    path = tmp_path / "bad.json"
    path.write_text(json.dumps({"k_bits": 4, "v_bits": 4, "tiers": [[128, None], [1024, 4], [None, 3]]}))
    assert_one_line_error(kivi("estimate", *SHAPE, "--context", "4k", "--config", str(path)), "tiers[2]", "k_bits=3")
