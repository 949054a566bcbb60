"""benchmarks/bench_serving.py: the decode-heavy workload, the one-at-a-time rows, the budget sweep and its plot."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

import bench_serving as bs
from bench_serving import decode_heavy, identical, spread

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


@pytest.mark.long  # ~10 s: a budget sweep end to end
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


@pytest.mark.long  # ~7 s: a child process per row
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


@pytest.mark.long  # ~35 s on a cold kernel cache: three serving rows run end to end
def test_rows_with_their_own_budget_run_once_at_it_and_fp_n_is_what_float_pages_need(tmp_path):
    out = tmp_path / "mixed.json"
    assert bs.main([*TINY, "--budgets", "400000", "--rows", "kivi-2/2@fp:2", "float", "kivi-2/2@900000",
                    "--same-process", "--out", str(out)]) == 0
    rows = json.loads(out.read_text())["rows"]
    longest = max(p + n for p, n in zip(rows[0]["prompt_tokens"], rows[0]["new_tokens"]))
    from kivi.batching import fp_block_bytes
    from tests.helpers import tiny_model

    model = tiny_model(num_hidden_layers=4)
    fp2 = 2 * -(-longest // 32) * fp_block_bytes(model.config, model.dtype, 32)
    # the rows without a budget of their own at each --budgets value first, then the others in command order
    assert [(r["cache"], r["budget_bytes"]) for r in rows] == [
        ("float", 400000), ("kivi-2/2", fp2), ("kivi-2/2", 900000)]
    assert all(r["generated_tokens"] == sum(r["new_tokens"]) for r in rows)


@pytest.mark.long  # ~20 s: every row twice, in child processes
def test_kivi_root_before_runs_the_batch_rows_again_with_that_checkouts_kivi(tmp_path):
    other = tmp_path / "checkout"
    other.mkdir()
    (other / "kivi").symlink_to(Path(bs.__file__).resolve().parents[1] / "kivi")
    (other / "tests").symlink_to(Path(bs.__file__).resolve().parents[1] / "tests")  # the tiny model's helpers
    out = tmp_path / "before.json"
    assert bs.main([*TINY, "--requests", "2", "--rows", "kivi-2/2@1000000", "--baselines", "kivi-2/2",
                    "--kivi-root-before", str(other), "--out", str(out)]) == 0
    single, before, after = json.loads(out.read_text())["rows"]
    assert before["kivi_root"] == str(other) and before["kivi_path"] == str(other / "kivi")
    assert "kivi_root" not in after and after["kivi_path"] == str(Path(bs.__file__).resolve().parents[1] / "kivi")
    for r in (before, after):  # the same requests, compared with the one-at-a-time row
        assert r["generated_tokens"] == sum(r["new_tokens"]) and r["same_tokens_as_one_at_a_time"]["requests"] == 2
    assert "(checkout)" in out.with_suffix(".txt").read_text()


@pytest.mark.long  # ~18 s: a kivi serve child process
def test_the_http_row_serves_every_request_its_tokens_through_kivi_serve(tmp_path):
    for name in ("fastapi", "uvicorn", "httpx"):
        pytest.importorskip(name)
    from tests.serving.server import save_tiny_checkpoint

    checkpoint = save_tiny_checkpoint(tmp_path / "tiny")
    out = tmp_path / "http.json"
    assert bs.main(["--model", str(checkpoint), "--shared-prefix", "0", "--requests", "3", "--prompt-len", "40",
                    "--new-tokens", "5", "--threads", "1", "--check-single", "0", "--rows", "kivi-2/2@2MiB",
                    "--http", "kivi-2/2@2MiB", "float@2MiB", "--http-clients", "2", "--same-process",
                    "--out", str(out)]) == 0
    report = json.loads(out.read_text())
    batch, *http = report["rows"]
    assert [(r["kind"], r["cache"], r["budget_bytes"]) for r in http] == [
        ("http", "kivi-2/2", 2 * 2**20), ("http", "float", 2 * 2**20)]
    for r in http:
        assert r["completion_tokens"] == r["requested_tokens"] == [5, 5, 5]
        assert r["generated_tokens"] == 15 and r["finish_reasons"] == ["length"] * 3 and r["clients"] == 2
        assert r["generated_tokens_per_s"] == pytest.approx(15 / r["wall_s"])
        assert 0 < r["ttft_p50_s"] <= r["ttft_p95_s"] < r["wall_s"] and r["cache_blocks"] > 0
        assert r["settings"]["max_batch_tokens"] == 512 and r["settings"]["ignore_eos"] is True
        assert r["settings"]["page_size"] == 256
    # greedy through the server: the text the batch row's tokens decode to
    assert http[0]["same_text_as_batch"] == {"requests": 3, "identical": 3}
    assert "http-kivi-2/2" in out.with_suffix(".txt").read_text()


def test_the_http_row_fails_naming_a_request_that_got_fewer_tokens():
    from bench_serving import Workload, check_counts

    work = Workload("w", [[5, 6], [7, 8, 9]], [4, 4])
    ok = {"usage": {"completion_tokens": 4, "prompt_tokens": 2}, "finish_reason": "length"}
    check_counts(work, [ok, {**ok, "usage": {"completion_tokens": 4, "prompt_tokens": 3}}])
    with pytest.raises(RuntimeError, match=r"request 1 got 2 of 4 tokens \(finish_reason 'stop'\).*without ignore_eos"):
        check_counts(work, [ok, {"usage": {"completion_tokens": 2, "prompt_tokens": 3}, "finish_reason": "stop"}])
    with pytest.raises(RuntimeError, match="request 1: kivi serve counted 2 prompt tokens, sent 3"):
        check_counts(work, [ok, ok])


@pytest.mark.parametrize("bad, message", [
    (["--rows", "kivi-9/9"], "'kivi-9/9': the row must be one of float, kivi-2/2"),
    (["--rows", "float@"], "needs a budget after @"),
    (["--budgets", "fp:0"], "fp:N needs a whole number N >= 1"),
    (["--http", "float"], "--http needs a model kivi serve loads"),
    (["--http-clients", "0"], "--http-clients=0 must be >= 1"),
    (["--kivi-root-before", "/nonexistent"], "is not a checkout"),
    (["--kivi-root-before", ".", "--same-process"], "drop --same-process"),
])
def test_bad_row_budget_and_http_options_are_refused(bad, message, capsys):
    with pytest.raises(SystemExit) as e:
        bs.main([*TINY, *bad])
    assert e.value.code == 2 and message in capsys.readouterr().err


def test_a_checkout_whose_server_has_no_page_size_is_refused_for_other_pages(tmp_path, capsys):
    """kivi serve takes --page-size now; a --kivi-root-before checkout from before it serves 256-token pages only."""
    for path in ("kivi/__init__.py", "kivi/serving/params.py", "kivi/cli/serve.py"):
        (tmp_path / path).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / path).write_text("")
    with pytest.raises(SystemExit) as e:
        bs.main([*TINY, "--http", "float", "--kivi-root-before", str(tmp_path)])
    assert e.value.code == 2 and "its kivi serve has no --page-size" in capsys.readouterr().err


def test_the_http_row_of_another_checkout_serves_that_checkouts_kivi(monkeypatch, tmp_path):
    """``python -m kivi`` imports kivi from its working directory first, so the server of a --kivi-root-before
    row starts in that checkout (started from here, it served this checkout's kivi whatever PYTHONPATH said)."""
    serving_http = bs
    from bench_serving import Workload

    seen = {}

    def popen(argv, **kwargs):
        seen.update(kwargs, argv=argv)
        raise OSError("not started")

    monkeypatch.setattr(serving_http.subprocess, "Popen", popen)
    monkeypatch.setattr(serving_http, "serve_features", lambda root: {"ignore_eos", "page_size"})
    with pytest.raises(OSError, match="not started"):
        serving_http.http_row("smollm2", None, Workload("w", [[5, 6]], [2]), 2**20, clients=1, threads=1,
                              max_batch_tokens=None, kivi_root=str(tmp_path))
    assert seen["cwd"] == str(tmp_path) and seen["env"]["PYTHONPATH"].split(os.pathsep)[0] == str(tmp_path)
