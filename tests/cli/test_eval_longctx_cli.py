"""`kivi eval longctx`: every bad argument is one line and exit 2 before a model loads; a length past the
model's context is refused before any work; a run on a tiny model writes the JSON, the JSONL and the plot."""

from __future__ import annotations

import json

import pytest

from kivi import KiviConfig
from kivi.cli import main
from tests.helpers import ByteTokenizer, tiny_model


@pytest.fixture()
def no_model(monkeypatch):
    import kivi.models.load

    def refuse(*a, **k):
        raise AssertionError("the model must not load")

    monkeypatch.setattr(kivi.models.load, "load_model", refuse)


@pytest.fixture()
def tiny(monkeypatch):
    import kivi.models.load

    model = tiny_model("llama", vocab_size=257, max_position_embeddings=512)
    monkeypatch.setattr(kivi.models.load, "load_model", lambda name="smollm2", dtype=None, **kw: (model,
                                                                                                    ByteTokenizer()))
    return model


def _err(capsys, argv):
    rc = main(["eval", "longctx", "--no-progress", *argv])
    out, err = capsys.readouterr()
    assert rc == 2, (out, err)
    assert len(err.strip().splitlines()) == 1, err
    return err


@pytest.mark.parametrize("argv,message", [
    (["--tasks", "niah"], "invalid choice: 'niah'"),
    (["--configs", "fp", "nosuch"], "is not 'fp', a preset"),
    (["--configs", "missing.json"], "no such KiviConfig JSON file"),
    (["--lengths", "0"], "--lengths"),
    (["--lengths", "lots"], "not a positive token count"),
    (["--protocol", "both"], "invalid choice: 'both'"),
    (["--samples", "0"], "--samples: 0 is not a positive integer"),
    (["--seed", "-1"], "--seed"),
    (["--text", "no/such/file.txt"], "does not exist"),
])
def test_refusals_before_the_model_loads(no_model, capsys, argv, message):
    assert message in _err(capsys, argv)


def test_bad_json_config_and_foreign_jsonl_refused_before_load(no_model, capsys, tmp_path):
    bad = tmp_path / "bad.json"
    bad.write_text('{"k_bits": 7}')
    assert "bad.json" in _err(capsys, ["--configs", str(bad)])
    rows = tmp_path / "rows.jsonl"
    rows.write_text(json.dumps({"model": "other", "text": "x", "seed": 0, "samples": 10, "config": "fp"}) + "\n")
    assert "holds rows of another run" in _err(capsys, ["--jsonl", str(rows)])


def test_length_past_the_context_is_refused(tiny, capsys):
    assert "longer than the model supports (512 tokens" in _err(capsys, ["--lengths", "600", "--tasks", "qa"])


def test_run_writes_json_jsonl_and_plot(tiny, capsys, tmp_path):
    pytest.importorskip("matplotlib")
    cfg = tmp_path / "k2.json"
    KiviConfig(k_bits=2, v_bits=2, group_size=16, residual_length=32, attention_backend="reference").to_json(cfg)
    out, rows, png = tmp_path / "out.json", tmp_path / "rows.jsonl", tmp_path / "p.png"
    rc = main(["eval", "longctx", "--no-progress", "--lengths", "420", "--tasks", "niah_single", "--samples", "2",
               "--configs", "fp", str(cfg), "--json", str(out), "--jsonl", str(rows), "--plot", str(png)])
    text, _ = capsys.readouterr()
    assert rc == 0 and "long-context suite" in text
    r = json.loads(out.read_text())
    got = {(x["config"], x["task"]) for x in r["rows"]}
    assert got == {("fp", "niah_single"), ("k2", "niah_single")}
    k2 = next(x for x in r["rows"] if x["config"] == "k2")
    assert k2["n"] == 2 and k2["ci_low"] <= k2["score"] <= k2["ci_high"] and k2["bits_per_element"] < 16
    assert k2["diff_vs_fp"] is not None and isinstance(k2["within_noise"], bool)
    assert len(rows.read_text().splitlines()) == 4 and png.stat().st_size > 1000


def test_report_only_summarizes_a_jsonl_without_a_model(no_model, capsys, tmp_path):
    rows = tmp_path / "rows.jsonl"
    meta = {"model": "smollm2", "seed": 0, "samples": 2}
    import hashlib

    from kivi.data import load_text

    meta["text"] = hashlib.sha1(load_text().encode("utf-8")).hexdigest()[:16]
    lines = [{**meta, "config": c, "length": 4096, "task": "qa", "protocol": "question-after", "sample": i,
              "score": s, "bits_per_element": b} for c, b, ss in (("fp", 32.0, (1, 1)), ("extreme", 5.0, (1, 0)))
             for i, s in enumerate(ss)]
    rows.write_text("".join(json.dumps(x) + "\n" for x in lines))
    out = tmp_path / "s.json"
    argv = ["--report-only", "--jsonl", str(rows), "--json", str(out), "--tasks", "qa", "--samples", "2",
            "--configs", "fp", "extreme"]
    rc = main(["eval", "longctx", "--no-progress", *argv])
    _, err = capsys.readouterr()
    assert rc == 0 and "rows.jsonl" not in err, err  # nothing written to the JSONL
    r = {x["config"]: x for x in json.loads(out.read_text())["rows"]}
    assert r["extreme"]["score"] == 50.0 and r["extreme"]["diff_vs_fp"] == -50.0 and r["extreme"]["n"] == 2
    assert "--report-only reads the rows" in _err(capsys, ["--report-only"])


@pytest.mark.parametrize("value", ["2/2", "1", "a/b", "-1/2", "0/0"])
def test_a_bad_shard_is_refused_before_the_model_loads(no_model, capsys, value):
    assert f"--shard: {value!r} is not a shard I/N" in _err(capsys, [f"--shard={value}"])


def test_shard_and_jsonl_combinations_are_refused(no_model, capsys, tmp_path):
    a, b = tmp_path / "a.jsonl", tmp_path / "b.jsonl"
    assert "a run streams to one file, got 2" in _err(capsys, ["--jsonl", str(a), str(b)])
    assert "--report-only computes nothing" in _err(capsys, ["--report-only", "--jsonl", str(a), "--shard", "1/2"])


def test_shard_runs_then_report_only_merges(tiny, capsys, tmp_path):
    argv = ["--lengths", "420", "--tasks", "niah_single", "--samples", "3", "--configs", "fp"]
    paths = [str(tmp_path / f"s{i}.jsonl") for i in range(2)]
    for i, p in enumerate(paths):
        assert main(["eval", "longctx", "--no-progress", *argv, "--jsonl", p, "--shard", f"{i}/2"]) == 0
        assert "the table holds this shard's rows only" in capsys.readouterr()[1]
    counts = [len(open(p).read().splitlines()) for p in paths]
    assert sorted(counts) == [1, 2]
    out = tmp_path / "s.json"
    assert main(["eval", "longctx", "--no-progress", *argv, "--report-only", "--jsonl", *paths,
                 "--json", str(out)]) == 0
    assert json.loads(out.read_text())["rows"][0]["n"] == 3
    capsys.readouterr()
    assert "both hold the row" in _err(capsys, [*argv, "--report-only", "--jsonl", paths[0], paths[0]])
