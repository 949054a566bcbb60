"""`kivi tune`'s new options (kivi/cli/tune.py): --bits-at, --head-profile-windows; in-process on a tiny model."""

from __future__ import annotations

import json

import pytest
import torch

from kivi.cli import main
from tests.cli.test_eval_cli import PROTO, run_json

BUDGET = ["--max-ppl-increase", "1000%"]  # the cheapest candidate fits: one is measured


@pytest.fixture()
def tiny_cli(monkeypatch):
    """The tiny-model CLI (tests/cli/test_eval_cli.py) that also records how many windows were loaded."""
    import kivi.data
    import kivi.models.load
    from tests.helpers import tiny_model

    model = tiny_model("llama", vocab_size=256)
    monkeypatch.setattr(kivi.models.load, "load_model", lambda name="smollm2", dtype=None, **kw: (model, None))
    loaded = []

    def windows(tok, text, context, num_windows, **kw):
        loaded.append(num_windows)
        return torch.randint(0, 256, (num_windows, context), generator=torch.Generator().manual_seed(3))

    monkeypatch.setattr(kivi.data, "token_windows", windows)
    return loaded


def test_default_ranks_by_planner_bits_at_32k_and_profiles_other_windows(tiny_cli, capsys):
    r = run_json(capsys, ["tune", "--json", *BUDGET, *PROTO])
    assert r["protocol"]["bits_at"] == 32768 and r["bits_basis"].startswith("planner, float16 model, 32768")
    assert r["bits_per_element"] == r["bits_planner"] < r["bits_at_eval"]
    assert tiny_cli == [2 + 2]  # 2 tuning windows, then 2 for the head profile
    assert r["protocol"]["profile_windows"] == 2 and r["search"]["per_head"] > 0
    assert r["search"]["tiers"].startswith("not searched")


def test_bits_at_eval_and_no_head_profile(tiny_cli, capsys):
    r = run_json(capsys, ["tune", "--json", "--bits-at", "eval", "--head-profile-windows", "0", *BUDGET, *PROTO])
    assert r["protocol"]["bits_at"] is None and r["bits_per_element"] == r["bits_at_eval"]
    assert tiny_cli == [2] and r["search"]["per_head"] == 0 and r["search"]["tiers"] == "searched"
    r = run_json(capsys, ["tune", "--json", "--bits-at", "1k", "--head-profile-windows", "0", *BUDGET, *PROTO])
    assert r["protocol"]["bits_at"] == 1024 and r["search"]["tiers"].startswith("not searched")  # 1K > 160


def test_human_output_lists_candidates_and_both_bits(tiny_cli, capsys):
    assert main(["tune", "--head-profile-windows", "1", *BUDGET, *PROTO]) == 0
    out = capsys.readouterr().out
    assert "candidate (in order of bits)" in out and "@eval" in out
    assert "planner, float16 model, 32768 tokens" in out and "held at the end of a 160-token window" in out
    assert "seconds: profile" in out
    skipped = [line for line in out.splitlines() if line.startswith("skipped ")]
    assert any("G64" in line and "and 10 more: group_size=64 must divide head_dim=32" in line for line in skipped)
    assert any("and 9 more: group_size=128 must divide head_dim=32" in line for line in skipped)


@pytest.mark.parametrize("value", ["soon", "0", "-5"])
def test_bad_bits_at_is_one_line(value, capsys):
    rc = main(["tune", "--max-bits", "4", "--bits-at", value])
    err = capsys.readouterr().err.strip()
    assert rc == 2 and len(err.splitlines()) == 1 and "--bits-at" in err and repr(value) in err
    assert "'eval' or a token count" in err


def test_nothing_fits_still_writes_what_was_measured(tiny_cli, capsys, tmp_path):
    out = tmp_path / "t.json"
    rc = main(["tune", "--max-ppl-increase", "0%", "--max-bits", "2", "--head-profile-windows", "0", "--k-bits", "1",
               "--v-bits", "1", "--residual-length", "0", "-o", str(out), *PROTO])
    err = capsys.readouterr().err.strip()
    assert rc == 2 and len(err.splitlines()) == 1 and "no candidate fits" in err and str(out) in err
    r = json.loads(out.read_text())
    assert r["config"] is None and "no candidate fits" in r["error"] and len(r["evaluated"]) >= 1


@pytest.fixture()
def no_model(monkeypatch):
    import kivi.models.load

    def refuse(*a, **k):
        raise AssertionError("the model must not load")

    monkeypatch.setattr(kivi.models.load, "load_model", refuse)


@pytest.mark.parametrize("argv,message", [
    (["--max-score-drop", "-1"], "--max-score-drop: '-1' is not a number of points between 0 and 100"),
    (["--max-score-drop", "101"], "'101' is not a number of points between 0 and 100"),
    (["--max-score-drop", "nan"], "--max-score-drop"),
    (["--max-score-drop", "lots"], "--max-score-drop"),
    (["--max-score-drop", "1", "--score-length", "0"], "--score-length"),
    (["--max-score-drop", "1", "--score-tasks", "niah"], "invalid choice: 'niah'"),
    (["--max-score-drop", "1", "--score-samples", "0"], "--score-samples: 0 is not a positive integer"),
    (["--max-score-drop", "1", "--score-protocol", "both"], "invalid choice: 'both'"),
    (["--max-bits", "4", "--score-tasks", "qa"], "--score-tasks needs --score-length L or --max-score-drop P"),
    (["--max-bits", "4", "--score-samples", "3"], "--score-samples needs --score-length"),
])
def test_bad_suite_options_are_one_line_before_the_model_loads(no_model, capsys, argv, message):
    rc = main(["tune", *argv])
    err = capsys.readouterr().err.strip()
    assert rc == 2 and len(err.splitlines()) == 1, err
    assert message in err


@pytest.fixture()
def tiny_with_tokenizer(monkeypatch):
    """The tiny model with the byte tokenizer (the suite builds its prompts with it), random tuning windows."""
    import kivi.data
    import kivi.models.load
    from tests.helpers import ByteTokenizer, tiny_model

    model = tiny_model("llama", vocab_size=257, max_position_embeddings=512)
    monkeypatch.setattr(kivi.models.load, "load_model", lambda name="smollm2", dtype=None, **kw: (model,
                                                                                                    ByteTokenizer()))
    monkeypatch.setattr(kivi.data, "token_windows", lambda tok, text, context, n, **kw: torch.randint(
        0, 256, (n, context), generator=torch.Generator().manual_seed(3)))


SUITE = ["--score-length", "420", "--score-tasks", "niah_single", "--score-samples", "1"]


def test_the_pick_is_reported_on_perplexity_and_the_suite(tiny_with_tokenizer, capsys, tmp_path):
    out = tmp_path / "t.json"
    assert main(["tune", "--head-profile-windows", "0", "--max-score-drop", "0", "-o", str(out), *BUDGET, *SUITE,
                 *PROTO]) == 0
    text = capsys.readouterr().out
    assert "score" in text.splitlines()[0] and "on the long-context suite (question-after, 420 tokens" in text
    r = json.loads(out.read_text())
    assert {"ppl", "delta_ppl_pct", "score", "score_fp", "score_drop", "score_drop_ci", "score_tasks"} <= set(r)
    assert r["budget"]["max_score_drop"] == 0.0 and r["score_drop"] <= 0.0
    s = r["suite"]
    assert (s["length"], s["tasks"], s["samples"], s["protocol"]) == (420, ["niah_single"], 1, "question-after")
    assert s["prefills"] == 1 and "score_drop" in r["evaluated"][-1]


def test_a_suite_length_past_the_context_is_refused(tiny_with_tokenizer, capsys):
    rc = main(["tune", "--head-profile-windows", "0", "--max-score-drop", "1", "--score-length", "600",
               "--score-tasks", "niah_single", *PROTO])
    err = capsys.readouterr().err.strip()
    assert rc == 2 and len(err.splitlines()) == 1 and "--score-length 600" in err and "512 tokens" in err


def test_profile_scores_its_recommendation_on_the_suite(tiny_with_tokenizer, capsys, tmp_path):
    out = tmp_path / "p.json"
    assert main(["profile", "--upgrade-layers", "1", "-o", str(out), *SUITE, *PROTO]) == 0
    assert "on the long-context suite (question-after, 420 tokens" in capsys.readouterr().out
    r = json.loads(out.read_text())
    assert r["suite"]["prefills"] == 1 and r["recommended_suite"]["n"] == 1
    assert r["recommended_suite"]["score_drop"] == r["recommended_suite"]["score_fp"] - r["recommended_suite"]["score"]


@pytest.mark.parametrize("argv", [["--score-tasks", "qa"], ["--per-head", "--score-samples", "2"]])
def test_profile_suite_options_need_a_length(no_model, capsys, argv):
    rc = main(["profile", *argv])
    err = capsys.readouterr().err.strip()
    assert rc == 2 and len(err.splitlines()) == 1 and "needs --score-length L (the long-context suite is off)" in err


CALIB = ["--calibrate-on", "suite", "--calib-length", "420", "--calib-tasks", "niah_single", "--calib-samples", "2"]


def test_per_head_profile_calibrated_on_suite_prompts(tiny_with_tokenizer, capsys, tmp_path):
    out, cfg = tmp_path / "p.json", tmp_path / "c.json"
    assert main(["profile", "--per-head", "-o", str(out), "--write-config", str(cfg), *CALIB, *PROTO]) == 0
    assert "2 suite prompts (420 tokens, seed 1; question and answer scored)" in capsys.readouterr().out
    r = json.loads(out.read_text())
    assert r["calibration"] == {"on": "suite", "length": 420, "tasks": ["niah_single"], "samples": 2, "seed": 1}
    assert r["protocol"]["prompts"] == 2 and 2 * 420 <= r["protocol"]["tokens"]
    assert r["metric"].endswith("mean over prompts") and json.loads(cfg.read_text())["head_bits"] == \
        r["recommended"]["head_bits"]
    assert main(["profile", "--per-head", "--json", *CALIB, "--calib-seed", "0", *PROTO]) == 0
    assert json.loads(capsys.readouterr().out)["calibration"]["seed"] == 0


@pytest.mark.parametrize("argv, message", [
    (["--per-head", "--calib-samples", "2"], "--calib-samples needs --calibrate-on suite"),
    (["--calibrate-on", "suite"], "--calibrate-on suite needs --per-head"),
    (["--per-head", "--calibrate-on", "suite", "--calib-samples", "0"], "--calib-samples"),
])
def test_calibration_options_are_refused_before_the_model_loads(no_model, capsys, argv, message):
    rc = main(["profile", *argv])
    err = capsys.readouterr().err.strip()
    assert rc == 2 and len(err.splitlines()) == 1 and message in err, err


def test_a_calibration_length_past_the_context_is_refused(tiny_with_tokenizer, capsys):
    rc = main(["profile", "--per-head", "--calibrate-on", "suite", "--calib-length", "600", *PROTO])
    err = capsys.readouterr().err.strip()
    assert rc == 2 and len(err.splitlines()) == 1 and "--calib-length 600" in err and "512 tokens" in err, err
