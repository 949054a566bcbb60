"""`kivi eval attribute`: bad input is one line and exit 2 before a model loads; a run on a tiny model writes
every margin and the ranking."""

from __future__ import annotations

import hashlib
import json

from kivi import KiviConfig
from kivi.cli import main
from kivi.data import load_text
from tests.cli.test_eval_longctx_cli import no_model, tiny  # noqa: F401 - fixtures

TEXT_HASH = hashlib.sha1(load_text().encode("utf-8")).hexdigest()[:16]


def _rows(path, model="smollm2", text=TEXT_HASH):
    rows = [{"model": model, "text": text, "seed": 0, "samples": 2, "config": c, "length": 420,
             "task": "niah_single", "protocol": "question-after", "sample": 0, "score": s, "answer": a,
             "expected": ["1234567"]} for c, s, a in (("fp", 1.0, " 1234567"), ("k1", 0.0, " 1299"))]
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def _err(capsys, argv):
    rc = main(["eval", "attribute", "--no-progress", *argv])
    out, err = capsys.readouterr()
    assert rc == 2, (out, err)
    assert len(err.strip().splitlines()) == 1, err
    return err


def test_refusals_before_the_model_loads(no_model, capsys, tmp_path):  # noqa: F811
    cfg = tmp_path / "k1.json"
    KiviConfig(k_bits=1, v_bits=1, group_size=16, residual_length=16).to_json(cfg)
    assert "does not exist" in _err(capsys, ["--jsonl", str(tmp_path / "none.jsonl"), "--config", str(cfg)])
    assert "another model or text" in _err(capsys, ["--jsonl", str(_rows(tmp_path / "a.jsonl", model="other")),
                                                    "--config", str(cfg)])
    bad = tmp_path / "bad.jsonl"
    bad.write_text("{not json\n")
    assert "line 1 is not JSON" in _err(capsys, ["--jsonl", str(bad), "--config", str(cfg)])
    assert "is not 'fp', a preset" in _err(capsys, ["--jsonl", str(bad), "--config", "nosuch"])
    assert "--top: 0 is not a positive integer" in _err(capsys, ["--jsonl", str(bad), "--config", str(cfg),
                                                                "--top", "0"])
    assert "holds no rows of these --lengths / --protocol" in _err(
        capsys, ["--jsonl", str(_rows(tmp_path / "b.jsonl")), "--config", str(cfg), "--lengths", "2048"])


def test_run_writes_margins_and_ranking(tiny, capsys, tmp_path):  # noqa: F811
    cfg = tmp_path / "k1.json"
    KiviConfig(k_bits=1, v_bits=1, group_size=16, residual_length=16, attention_backend="reference").to_json(cfg)
    out = tmp_path / "attr.json"
    rows = _rows(tmp_path / "r.jsonl")
    other = [json.loads(x) for x in rows.read_text().splitlines()]
    rows.write_text(rows.read_text() + "".join(json.dumps({**r, "length": 400}) + "\n" for r in other))
    rc = main(["eval", "attribute", "--no-progress", "--jsonl", str(rows), "--config",
               str(cfg), "--top", "1", "--json", str(out), "--lengths", "420", "--protocol", "question-after"])
    text, err = capsys.readouterr()
    assert rc == 0, err
    r = json.loads(out.read_text())
    assert r["config"] == "k1" and r["lost"] == 1 and len(r["samples"]) == 1 and r["layers"] == 2
    s = r["samples"][0]
    assert {"fp", "config", "keys fp", "values fp", "layer 0 fp", "layer 1 fp"} <= set(s["margins"])
    assert all(isinstance(v, float) for v in s["margins"].values())
    assert "answers lost vs fp" in text
    if s["consistent"]:
        assert r["ablations"] and all(a["n"] == 1 for a in r["ablations"])
    else:
        assert r["ablations"] == []


def test_report_only_counts_failed_answers(no_model, capsys, tmp_path):  # noqa: F811
    rows = tmp_path / "rows.jsonl"
    meta = {"model": "smollm2", "seed": 0, "samples": 2, "text": TEXT_HASH}
    lines = [{**meta, "config": "fp", "length": 4096, "task": "qa", "protocol": "question-after", "sample": i,
              "score": 1.0, "bits_per_element": 32.0} for i in range(2)]
    lines += [{**meta, "config": "hqq-int2", "length": 4096, "task": "qa", "protocol": "question-after", "sample": i,
               "score": None, "error": "RuntimeError: packing", "bits_per_element": None} for i in range(2)]
    rows.write_text("".join(json.dumps(x) + "\n" for x in lines))
    out = tmp_path / "s.json"
    rc = main(["eval", "longctx", "--no-progress", "--report-only", "--jsonl", str(rows), "--json", str(out),
               "--tasks", "qa", "--samples", "2", "--configs", "fp", "hqq-int2"])
    _, err = capsys.readouterr()
    assert rc == 0, err
    r = json.loads(out.read_text())
    assert {x["config"] for x in r["rows"]} == {"fp"}
    assert r["failures"] == {"hqq-int2": {"failed": 2, "answers": 2, "error": "RuntimeError: packing"}}
    assert "hqq-int2: 2 of 2 answers failed, left out of the table (RuntimeError: packing)" in err
