"""benchmarks/bench_serving.py: the decode-heavy workload, the one-at-a-time rows, the budget sweep and its plot."""

from __future__ import annotations

import json

import pytest

import bench_serving as bs
from serving_rows import decode_heavy, identical, spread

TINY = ["--model", "tiny", "--workload", "decode-heavy", "--requests", "3", "--prompt-range", "40", "90",
        "--new-range", "3", "6", "--page-size", "32", "--threads", "1"]


def test_spread_covers_the_range_in_a_seeded_order():
    xs = spread(5, 512, 4096, seed=0)
    assert sorted(xs) == [512, 1408, 2304, 3200, 4096]
    assert spread(5, 512, 4096, seed=0) == xs and spread(1, 7, 9, seed=3) == [7]


def test_decode_heavy_prompts_are_consecutive_pieces_of_the_text():
    text = list(range(1000, 3000))
    w = decode_heavy(4, (100, 400), (128, 256), text, vocab=5000, seed=1)
    assert sorted(len(p) for p in w.prompts) == [100, 200, 300, 400]
    assert sorted(w.new_tokens) == [128, 171, 213, 256]
    joined = [t for p in w.prompts for t in p]
    assert joined == text[: len(joined)]  # real text, in order, no random ids


def test_identical_counts_requests_and_first_differences():
    r = identical([[1, 2, 3], [1, 5, 3], [1, 2]], [[1, 2, 3], [1, 2, 3], [1, 2, 3]])
    assert r == {"requests": 3, "identical": 1, "first_differing_token": [None, 1, 2]}


def test_budget_sweep_writes_rows_table_and_plot(tmp_path):
    pytest.importorskip("matplotlib")
    out, png = tmp_path / "serve.json", tmp_path / "serve.png"
    assert bs.main([*TINY, "--budgets", "400000", "800000", "--rows", "float", "kivi-2/2",
                    "--baselines", "dynamic", "kivi-2/2", "--max-batch-tokens", "64", "--same-process",
                    "--out", str(out), "--plot", str(png)]) == 0
    report = json.loads(out.read_text())
    rows = report["rows"]
    single = [r for r in rows if r["kind"] == "one-at-a-time"]
    batch = [r for r in rows if r["kind"] == "batch"]
    assert [r["cache"] for r in single] == ["dynamic", "kivi-2/2"]
    assert [(r["cache"], r["budget_bytes"]) for r in batch] == [
        ("float", 400000), ("kivi-2/2", 400000), ("float", 800000), ("kivi-2/2", 800000)]
    for r in rows:
        assert r["generated_tokens"] == sum(r["new_tokens"]) and r["generated_tokens_per_s"] > 0
        assert r["ttft_p50_s"] > 0 and r["per_token_p50_s"] > 0
    assert all(r["settings"]["max_batch_tokens"] == 64 for r in batch)
    assert batch[1]["same_tokens_as_one_at_a_time"]["requests"] == 3
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert "gen tok/s" in out.with_suffix(".txt").read_text()


def test_a_row_runs_in_a_fresh_process(tmp_path):
    out = tmp_path / "fresh.json"
    assert bs.main([*TINY, "--requests", "2", "--fp-requests", "3", "--rows", "kivi-2/2", "--out", str(out)]) == 0
    report = json.loads(out.read_text())
    assert report["fresh_process_per_row"] is True
    (row,) = report["rows"]
    assert row["cache"] == "kivi-2/2" and row["generated_tokens"] == sum(row["new_tokens"])
    longest = max(p + n for p, n in zip(row["prompt_tokens"], row["new_tokens"]))
    from kivi.batching import fp_block_bytes
    from tests.helpers import tiny_model

    model = tiny_model(num_hidden_layers=4)
    assert row["budget_bytes"] == 3 * -(-longest // 32) * fp_block_bytes(model.config, model.dtype, 32)


@pytest.mark.parametrize("bad, message", [
    (["--prompt-range", "90", "40"], "--prompt-range=90 40 must be 1 <= MIN <= MAX"),
    (["--max-batch-tokens", "0"], "--max-batch-tokens=[0] must all be >= 1"),
    (["--budgets", "lots"], "argument --budgets"),
])
def test_bad_options_are_refused_before_any_work(bad, message, capsys):
    with pytest.raises(SystemExit) as e:
        bs.main([*TINY, *bad])
    assert e.value.code == 2 and message in capsys.readouterr().err
