"""`kivi estimate --cache-budget`: the picked config, its JSON file, and one-line errors (in process: the
planner reads no weights, so no subprocess is needed to keep the test honest and quick)."""

from __future__ import annotations

import json

import pytest

from kivi.cli import main
from kivi.config import KiviConfig
from kivi.memory import ModelSpec
from kivi.memory.budget import config_for_budget

SHAPE = ["--num-layers", "32", "--num-kv-heads", "8", "--head-dim", "128", "--dtype", "float16"]


def test_cache_budget_picks_writes_and_matches_the_library(tmp_path, capsys):
    out = tmp_path / "picked.json"
    assert main(["estimate", *SHAPE, "--context", "32k", "--cache-budget", "1GiB", "--write-config", str(out),
                 "--json"]) == 0
    d = json.loads(capsys.readouterr().out)
    lib = config_for_budget(ModelSpec(num_layers=32, num_kv_heads=8, head_dim=128, dtype="float16"), "1GiB", "32k")
    assert d["budget_pick"]["name"] == lib.name and d["budget_pick"]["need_bytes"] == lib.need_bytes <= 2**30
    assert KiviConfig.from_json(out.read_text()) == lib.config
    assert d["config"] == lib.config.to_dict()  # the estimate shown is the picked config's
    assert main(["estimate", *SHAPE, "--context", "32k", "--cache-budget", "1GiB"]) == 0
    text = capsys.readouterr().out
    assert f"picked {lib.name}" in text and "too large" in text


@pytest.mark.parametrize("extra, needles", [
    (["--cache-budget", "1MiB"], ["budget 1.00 MiB", "smallest candidate", "needs"]),
    (["--cache-budget", "1GiB", "--preset", "high"], ["--cache-budget", "not both"]),
    (["--write-config", "x.json"], ["--write-config goes with --cache-budget"]),
], ids=["too-small", "with-preset", "write-without-budget"])
def test_cache_budget_errors_are_one_line(capsys, extra, needles):
    assert main(["estimate", *SHAPE, "--context", "32k", *extra]) == 2
    err = [line for line in capsys.readouterr().err.splitlines() if line.strip()]
    assert len(err) == 1 and err[0].startswith("kivi estimate: error:"), err
    for n in needles:
        assert n in err[0]


def test_full_precision_first_and_quantize_after(capsys):
    spec = ModelSpec(num_layers=32, num_kv_heads=8, head_dim=128, dtype="float16")
    assert main(["estimate", *SHAPE, "--context", "32k", "--cache-budget", "1GiB", "--full-precision-first",
                 "--json"]) == 0
    d = json.loads(capsys.readouterr().out)
    lib = config_for_budget(spec, "1GiB", "32k", full_precision_first=True)
    assert d["budget_pick"]["config"]["quantize_after"] == lib.config.quantize_after == 2**30 // (2 * 32 * 8 * 128 * 2)
    assert d["budget_pick"]["need_bytes"] == lib.need_bytes <= 2**30
    assert main(["estimate", *SHAPE, "--context", "32k", "--cache-budget", "1GiB", "--full-precision-first"]) == 0
    assert "full precision first: the cache stays in full precision up to 8,192 tokens (then KIVI)" in \
        capsys.readouterr().out
    # --quantize-after N: at N tokens a full-precision cache, past it the plain config's bytes (+ block reserve)
    assert main(["estimate", *SHAPE, "--context", "4096", "--quantize-after", "4096", "--json"]) == 0
    d = json.loads(capsys.readouterr().out)
    assert d["kivi_total_bytes"] == d["fp_total_bytes"] and d["config"]["quantize_after"] == 4096
    assert main(["estimate", *SHAPE, "--context", "4096", "--quantize-after", "4096"]) == 0
    assert "window (V 4096, K 4096 tokens)" in capsys.readouterr().out
    assert main(["estimate", *SHAPE, "--context", "4096", "--full-precision-first"]) == 2
    assert "--full-precision-first goes with --cache-budget" in capsys.readouterr().err
