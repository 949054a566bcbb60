"""benchmarks/bench_decode.py: row summaries (medians over rounds) and config-name checking."""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

_PATH = Path(__file__).resolve().parents[2] / "benchmarks" / "bench_decode.py"
spec = importlib.util.spec_from_file_location("bench_decode", _PATH)
bd = importlib.util.module_from_spec(spec)
spec.loader.exec_module(bd)


def test_summary_is_the_median_round_and_skips_errors():
    runs = [
        {"tok_s": t, "decode_s": 8 / t, "peak_rss_delta_MiB": m, "steps": 8}
        for t, m in ((2.0, 5.0), (4.0, 1.0), (3.0, 9.0))
    ]
    runs.append({"error": "boom"})
    r = bd._summarise(runs)
    assert r["tok_s"] == 3.0 and r["peak_rss_delta_MiB"] == 5.0
    assert r["ms_per_step"] == 1e3 * (8 / 3.0) / 8
    assert r["tok_s_all"] == [2.0, 4.0, 3.0]
    assert bd._summarise(runs[:2])["tok_s"] == 3.0  # an even count: the mean of the middle two
    assert "error" in bd._summarise([{"error": "boom"}])


def _refused(monkeypatch, capsys, *args: str) -> str:
    """bench_decode's ``main`` on ``args`` in this process: it must exit 2 before any row; returns its stderr."""
    monkeypatch.setattr(sys, "argv", [str(_PATH), *args])
    monkeypatch.setattr(bd, "set_threads", lambda *a, **k: pytest.fail("set_threads ran: work began"))
    with pytest.raises(SystemExit) as e:
        bd.main()
    assert e.value.code == 2
    out = capsys.readouterr()
    assert out.out == ""
    return out.err


def test_unknown_config_is_refused_before_any_work(monkeypatch, capsys):
    assert "'kivi2-gpu' is not one of" in _refused(monkeypatch, capsys, "--configs", "dynamic", "kivi2-gpu")


def test_config_file_row_is_named_after_its_stem_and_runs_its_config(tmp_path):
    from kivi import KiviConfig
    from tests.helpers import tiny_model

    cfg = KiviConfig(k_bits=2, v_bits=2, sink_tokens=4, head_bits={0: {"k_bits": [4, 2]}}, attention_backend="cpu")
    path = tmp_path / "heads_k2v2.json"
    cfg.to_json(path)
    assert bd.is_config_file(str(path)) and not bd.is_config_file("kivi2-cpu")
    assert bd.row_name(str(path)) == "heads_k2v2" and bd.row_name("kivi2-cpu") == "kivi2-cpu"
    model = tiny_model(num_attention_heads=4, num_key_value_heads=2)
    assert bd._prepare(model, str(path)) == cfg
    r = bd._row(model, str(path), 40, 1, 2, 1)
    assert "error" not in r, r
    assert r["config"] == "heads_k2v2" and r["config_file"] == str(path) and r["tok_s"] > 0


def test_unreadable_config_file_is_refused_before_any_work(tmp_path, monkeypatch, capsys):
    bad = tmp_path / "bad.json"
    bad.write_text('{"k_bits": 5}')
    err = _refused(monkeypatch, capsys, "--configs", "dynamic", str(bad))
    assert f"{str(bad)!r} is not a readable KiviConfig JSON file" in err and "k_bits" in err


def test_results_compare_every_row_with_kivi2_and_dynamic_and_skip_rows_not_run_yet():
    def run(t, cpu=None):
        r = {"tok_s": t, "decode_s": 8 / t, "peak_rss_delta_MiB": 1.0, "steps": 8, "config": "x"}
        return r if cpu is None else dict(r, tok_per_cpu_s=cpu, decode_cpu_s=8 / cpu)

    configs = ["dynamic", "kivi2-cpu", "heads.json", "kivitiers-cpu"]
    runs = {(8192, 1, "dynamic"): [run(2.0)], (8192, 1, "kivi2-cpu"): [run(4.0, 5.0), run(3.0, 4.0), run(9.0, 6.0)],
            (8192, 1, "heads.json"): [run(3.8, 4.5)], (8192, 1, "kivitiers-cpu"): []}  # an interrupted round
    rows = bd._results(runs, [8192], [1], configs)
    assert len(rows) == 3
    heads = rows[2]
    assert heads["speed_vs_kivi2"] == 3.8 / 4.0 and heads["speed_vs_dynamic"] == 3.8 / 2.0
    assert heads["cpu_speed_vs_kivi2"] == 4.5 / 5.0  # medians of the CPU-time speeds
    assert "cpu_speed_vs_kivi2" not in rows[0]  # the dynamic row had no CPU time recorded
    assert bd._kivi2_row(["dynamic", "kivi2-reference", "kivi2-cpu"]) == "kivi2-cpu"
    assert bd._kivi2_row(["dynamic"]) is None


# --------------------------------------------------------------------------- contexts past max_position_embeddings

TINY_MAX_CONTEXT = 64


@pytest.fixture(scope="module")
def tiny_checkpoint(tmp_path_factory):
    """A tiny random Llama whose max_position_embeddings is 64, saved with a word-level tokenizer."""
    from tokenizers import Tokenizer
    from tokenizers import models as tk_models
    from transformers import PreTrainedTokenizerFast

    from tests.helpers import tiny_model

    folder = tmp_path_factory.mktemp("tiny-ctx64")
    tiny_model(max_position_embeddings=TINY_MAX_CONTEXT).save_pretrained(folder)
    backend = Tokenizer(tk_models.WordLevel({"[UNK]": 0, "[EOS]": 1}, unk_token="[UNK]"))
    PreTrainedTokenizerFast(tokenizer_object=backend, unk_token="[UNK]", eos_token="[EOS]").save_pretrained(folder)
    return folder


def _bench(*args):
    return subprocess.run([sys.executable, str(_PATH), *map(str, args)], capture_output=True, text=True, timeout=300,
                          env={**os.environ, "OMP_NUM_THREADS": "1"})


def test_context_past_max_position_embeddings_is_refused_in_one_line_without_the_flag(tiny_checkpoint):
    p = _bench("--model", tiny_checkpoint, "--contexts", 32, 96, "--batches", 1, "--configs", "dynamic")
    assert p.returncode == 2
    lines = p.stderr.strip().splitlines()
    assert len(lines) == 1, p.stderr
    assert "--contexts 96" in lines[0] and f"max_position_embeddings ({TINY_MAX_CONTEXT})" in lines[0]
    assert "--ignore-max-context" in lines[0]
    assert p.stdout == ""  # refused before any row ran


@pytest.mark.long  # ~35 s: rows past the model's limit, run for real
def test_ignore_max_context_measures_and_marks_rows_past_the_limit(tiny_checkpoint):
    p = _bench("--model", tiny_checkpoint, "--contexts", 48, 96, "--batches", 2, "--configs", "dynamic", "kivi2-cpu",
               "--steps", 2, "--ignore-max-context", "--fill", "random", "--isolate", "--json")
    assert p.returncode == 0, p.stderr[-2000:]
    doc = json.loads(p.stdout)
    assert doc["ignore_max_context"] is True and doc["fill"] == "random"
    rows = {(r["context"], r["config"]): r for r in doc["results"]}
    assert len(rows) == 4
    for (ctx, _), r in rows.items():
        assert "error" not in r, r
        assert r["tok_s"] > 0 and r["fill"] == "random"
        assert r.get("beyond_max_context", False) is (ctx > TINY_MAX_CONTEXT)
    assert rows[(96, "dynamic")]["max_context"] == TINY_MAX_CONTEXT
    # the cache really holds the context: 96 + 2 warm-up + 2 timed tokens of fp32 K/V (2 layers, 2 heads, 32 dims)
    assert rows[(96, "dynamic")]["cache_MiB"] * 2**20 == 2 * 2 * 2 * 32 * 4 * 100 * 2


def test_chunked_prefill_fills_the_same_cache_as_one_forward(tiny_checkpoint):
    from kivi.models import load_model

    model = load_model(str(tiny_checkpoint))[0]
    for name in ("dynamic", "kivi2-cpu"):
        whole = bd._row(model, name, 96, 2, 2, 1, max_context=TINY_MAX_CONTEXT)
        chunked = bd._row(model, name, 96, 2, 2, 1, prefill_chunk=40, max_context=TINY_MAX_CONTEXT)
        assert "error" not in whole and "error" not in chunked, (whole, chunked)
        assert chunked["cache_MiB"] == whole["cache_MiB"] and chunked["beyond_max_context"] is True
    bd._prepare(model, "dynamic")
