"""studies/pareto_table.py: bits per element at 32K from the planner, goal lines, rows of several files,
`kivi sweep -o` files read as they are written."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import pytest
import torch

from kivi import KiviConfig
from kivi.memory.estimate import estimate_kv_memory

_PATH = Path(__file__).resolve().parents[2] / "studies" / "pareto_table.py"
spec = importlib.util.spec_from_file_location("pareto_table", _PATH)
suite = importlib.util.module_from_spec(spec)
spec.loader.exec_module(suite)

SPEC = dict(num_layers=30, num_kv_heads=3, head_dim=64, dtype="float16")


def test_bits_at_32k_is_kivi_estimate_over_the_elements():
    cfg = KiviConfig(sink_tokens=4)
    e = estimate_kv_memory(SPEC, 32768, config=cfg, dtype="float16")
    want = 8 * e.kivi_total_bytes / (2 * 30 * 3 * 64 * 32768)
    assert suite.bits_at_32k(SPEC, cfg) == pytest.approx(want, rel=1e-12)
    assert 3.0 < want < 3.1  # K2V2 + sinks: codes 2 + fp16 scale/offset 1 + the window and sinks
    assert suite.bits_at_32k(SPEC, KiviConfig(sink_tokens=4, clip=True)) == suite.bits_at_32k(SPEC, cfg)


def test_goal_parsing():
    assert suite.parse_goal("3.3:5") == (3.3, 5.0)
    with pytest.raises(Exception, match="BITS:PCT"):
        suite.parse_goal("3.3")


def test_summary_table_and_plot_with_goals(tmp_path, capsys):
    pytest.importorskip("matplotlib")
    row = dict(name="K2 V2 G32 R128 sink4", config=KiviConfig(sink_tokens=4).to_dict(), ppl=21.0, nll=3.0,
               bits_per_element=8.0, cache_bytes=100, delta_ppl_pct=5.0, kl=0.1, top1_agreement=0.8,
               tokens_scored=10, windows=1)
    run = {"model": SPEC, "protocol": {"windows": 1, "context": 1024, "prefix": 512, "chunk": 16},
           "fp": dict(name="fp", ppl=20.0, bits_per_element=32.0, cache_bytes=400), "results": [row]}
    p = tmp_path / "a.json"
    p.write_text(json.dumps(run))
    png = tmp_path / "p.png"
    assert suite.summarize([str(p)], None, str(png), ((3.3, 5.0), (4.3, 0.5))) == 0
    out = capsys.readouterr().out
    assert "b@32K" in out and f"{suite.bits_at_32k(SPEC, KiviConfig(sink_tokens=4)):.3f}" in out
    assert png.stat().st_size > 1000


def test_summary_takes_only_the_named_rows_of_later_files(tmp_path, capsys):
    def row(name, **cfg):
        return dict(name=name, config=KiviConfig(**cfg).to_dict(), ppl=21.0, nll=3.0, bits_per_element=8.0,
                    cache_bytes=100, delta_ppl_pct=5.0, kl=0.1, top1_agreement=0.8, tokens_scored=10, windows=1)

    def run(rows):
        return {"model": SPEC, "protocol": {"windows": 1, "context": 1024, "prefix": 512, "chunk": 16},
                "fp": dict(name="fp", ppl=20.0, bits_per_element=32.0, cache_bytes=400), "results": rows}

    a, b = tmp_path / "a.json", tmp_path / "b.json"
    a.write_text(json.dumps(run([row("new", sink_tokens=4)])))
    b.write_text(json.dumps(run([row("old-kept", k_bits=4), row("old-dropped", v_bits=4)])))
    assert suite.summarize([str(a), str(b)], None, None, extra_rows=["old-kept"]) == 0
    out = capsys.readouterr().out
    assert "new" in out and "old-kept" in out and "old-dropped" not in out
    assert suite.summarize([str(a), str(b)], None, None) == 0
    assert "old-dropped" in capsys.readouterr().out


def test_nbytes_bits_read_a_real_cache_and_equal_the_planner(monkeypatch):
    from kivi.memory.sources import model_spec
    from tests.helpers import tiny_model

    model = tiny_model("llama")
    monkeypatch.setitem(suite._MODELS, "tiny", model)
    cfg = KiviConfig(sink_tokens=4, group_size=8, residual_length=16)
    got = suite._nbytes_bits("tiny", cfg, 301)
    spec = model_spec(model)
    e = estimate_kv_memory(spec, 301, config=cfg, dtype="float16")
    want = 8 * e.kivi_total_bytes / (2 * e.num_layers * e.num_kv_heads * e.head_dim * 301)
    assert got == pytest.approx(want, abs=1e-4) and got < 8
    assert suite._nbytes_bits("tiny", "quanto-int4", 301) is None and suite._nbytes_bits("tiny", cfg, None) is None


@pytest.mark.parametrize("fp_other, ok", [(20.0 * (1 + 5e-6), True), (20.0 * (1 + 1e-3), False)])
def test_summary_accepts_fp_rounding_but_not_other_windows(tmp_path, capsys, fp_other, ok):
    def run(fp):
        row = dict(name="r", config=KiviConfig().to_dict(), ppl=21.0, nll=3.0, bits_per_element=8.0, cache_bytes=1,
                   delta_ppl_pct=5.0, kl=0.1, top1_agreement=0.8, tokens_scored=10, windows=1)
        return {"model": SPEC, "protocol": {"windows": 1, "context": 1024, "prefix": 512, "chunk": 16},
                "fp": dict(name="fp", ppl=fp, bits_per_element=32.0, cache_bytes=4), "results": [row]}

    a, b = tmp_path / "a.json", tmp_path / "b.json"
    a.write_text(json.dumps(run(20.0)))
    b.write_text(json.dumps(run(fp_other)))
    if ok:
        assert suite.summarize([str(a), str(b)], None, None) == 0
        assert "rounding of another evaluation path" in capsys.readouterr().out
    else:
        with pytest.raises(SystemExit, match="not comparable"):
            suite.summarize([str(a), str(b)], None, None)


def test_a_sweep_output_file_is_read_as_written(tmp_path, capsys):
    """`kivi sweep -o` writes {"rows": [fp, ...]} with the protocol on every row: the same table as the suite shape."""
    from kivi.eval.sweep import sweep
    from tests.helpers import tiny_model

    model = tiny_model("llama")
    windows = torch.randint(1, 128, (1, 160), generator=torch.Generator().manual_seed(0))
    cfg = KiviConfig(group_size=8, residual_length=16, sink_tokens=4)
    rows = sweep(model, None, windows, [cfg], prefix=96, chunk=16, progress=False)
    p = tmp_path / "sweep.json"
    p.write_text(json.dumps({"model": SPEC, "rows": rows}, default=str))
    run = suite.load_run(str(p))
    assert run["fp"]["name"] == rows[0]["name"] and [r["name"] for r in run["results"]] == [rows[1]["name"]]
    assert run["protocol"]["windows"] == 1 and run["model"] == SPEC
    assert suite.summarize([str(p)], None, None) == 0
    out = capsys.readouterr().out
    assert rows[1]["name"] in out and f"{suite.bits_at_32k(SPEC, cfg):.3f}" in out
