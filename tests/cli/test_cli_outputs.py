"""Files the CLI writes are checked before the work; a write that still fails at
the end prints the result on stdout and one error line (exit 2) — a computed result is never dropped."""

from __future__ import annotations

import json
import shutil

import pytest

from kivi.cli import main
from tests.cli.test_eval_cli import PROTO, cli_on_tiny_model  # noqa: F401 - fixture


@pytest.fixture()
def loads(monkeypatch):
    """Counts model loads (the checks must come before any)."""
    import kivi.models.load

    calls = []
    real = kivi.models.load.load_model
    monkeypatch.setattr(kivi.models.load, "load_model", lambda *a, **kw: calls.append(a) or real(*a, **kw))
    return calls


@pytest.mark.parametrize("argv, needles", [
    (["eval", "ppl", *PROTO, "-o", "/nonexistent/x.json"], ("-o/--output", "/nonexistent", "does not exist")),
    (["eval", "kld", *PROTO, "--output", "{tmp}"], ("-o/--output", "is a folder")),
    (["eval", "passkey", "-o", "/nonexistent/x.json"], ("-o/--output",)),
    (["sweep", *PROTO, "--csv", "/nonexistent/rows.csv"], ("--csv",)),
    (["sweep", *PROTO, "--plot", "{tmp}"], ("--plot", "is a folder")),
    (["profile", *PROTO, "--write-config", "/nonexistent/c.json"], ("--write-config",)),
    (["tune", *PROTO, "--max-bits", "4", "--out", "{tmp}"], ("--write-config/--out", "is a folder")),
    (["demo", "--json-out", "{tmp}"], ("--json-out", "is a folder")),
    (["demo", "--json-out", "/nonexistent/demo.json"], ("--json-out", "does not exist")),
])
@pytest.mark.usefixtures("cli_on_tiny_model")
def test_unwritable_output_is_refused_before_the_model_loads(loads, capsys, tmp_path, argv, needles):
    rc = main([a.replace("{tmp}", str(tmp_path)) for a in argv])
    out, err = capsys.readouterr()
    assert rc == 2 and out == "", (rc, out)
    assert len(err.strip().splitlines()) == 1 and "Traceback" not in err, err
    for n in needles:
        assert n in err, err
    assert loads == []  # nothing loaded, nothing computed


@pytest.mark.parametrize("json_flag", [True, False], ids=["json", "text"])
@pytest.mark.usefixtures("cli_on_tiny_model")
def test_eval_result_printed_when_the_write_fails_at_the_end(capsys, tmp_path, monkeypatch, json_flag):
    """The folder of -o disappears during the evaluation: the result still reaches stdout."""
    import kivi.eval

    out_dir = tmp_path / "results"
    out_dir.mkdir()
    real = kivi.eval.perplexity

    def perplexity_then_folder_gone(*a, **kw):
        r = real(*a, **kw)
        shutil.rmtree(out_dir)
        return r

    monkeypatch.setattr(kivi.eval, "perplexity", perplexity_then_folder_gone)
    rc = main(["eval", "ppl", *PROTO, "-o", str(out_dir / "ppl.json"), *(["--json"] if json_flag else [])])
    out, err = capsys.readouterr()
    assert rc == 2
    assert (
        err.strip().splitlines() == [line for line in err.strip().splitlines() if "cannot write -o/--output" in line]
        and len(err.strip().splitlines()) == 1
    ), err
    body = out if json_flag else out[out.index("{"):]
    r = json.loads(body)
    assert r["name"] == "fp" and r["ppl"] > 0 and r["tokens_scored"] == 2 * 96


@pytest.mark.usefixtures("cli_on_tiny_model")
def test_tune_writes_what_it_can_and_prints_the_rest(capsys, tmp_path, monkeypatch):
    import kivi.eval.tuning

    gone = tmp_path / "gone"
    gone.mkdir()
    real = kivi.eval.tuning.tune

    def tune_then_folder_gone(*a, **kw):
        r = real(*a, **kw)
        shutil.rmtree(gone)
        return r

    monkeypatch.setattr(kivi.eval.tuning, "tune", tune_then_folder_gone)
    kept = tmp_path / "tune.json"
    rc = main(["tune", *PROTO, "--max-ppl-increase", "1000%", "--json", "-o", str(kept),
               "--write-config", str(gone / "cfg.json")])
    out, err = capsys.readouterr()
    assert rc == 2 and "cannot write --write-config" in err and len(err.strip().splitlines()) == 1, err
    printed = json.loads(out)
    assert json.loads(kept.read_text()) == json.loads(json.dumps(printed))  # -o was still written
    assert printed["config"]["k_bits"] in (1, 2, 3, 4, 8)


@pytest.fixture()
def tiny_saved_model(tmp_path):
    from tests.helpers import tiny_model
    from tests.test_models import tiny_tokenizer  # the loader tests' in-memory word-level tokenizer

    folder = tmp_path / "tiny-llama"
    tiny_model("llama", vocab_size=12, max_position_embeddings=128, eos_token_id=1, pad_token_id=None) \
        .save_pretrained(folder)
    tiny_tokenizer().save_pretrained(folder)
    return folder


def test_demo_result_printed_when_json_out_fails_at_the_end(tiny_saved_model, capsys, tmp_path, monkeypatch):
    import kivi.cli.demo as demo

    out_dir = tmp_path / "out"
    out_dir.mkdir()
    real = demo.warm_up

    def warm_up_then_folder_gone(*a, **kw):
        shutil.rmtree(out_dir)
        return real(*a, **kw)

    monkeypatch.setattr(demo, "warm_up", warm_up_then_folder_gone)
    rc = main(["demo", "--model", str(tiny_saved_model), "--context", "32", "--max-new-tokens", "2",
               "--eval-tokens", "8", "--chunk", "4", "--presets", "extreme", "--threads", "1", "--json",
               "--json-out", str(out_dir / "demo.json")])
    out, err = capsys.readouterr()
    assert rc == 2
    assert [line for line in err.splitlines() if line.startswith("kivi")] == [
        line for line in err.splitlines() if "cannot write --json-out" in line], err
    r = json.loads(out)
    assert [row["name"] for row in r["rows"]] == ["fp", "extreme"]
