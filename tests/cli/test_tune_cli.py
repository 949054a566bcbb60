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
