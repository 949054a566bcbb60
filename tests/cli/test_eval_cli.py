"""`kivi eval`, `kivi sweep`, `kivi profile`, `kivi tune`: in-process with a tiny random model
(model loading and tokenization are patched), plus a slow subprocess test on SmolLM2."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
import torch

from kivi import KiviConfig
from kivi.cli import main
from tests.helpers import tiny_model

PROTO = ["--context", "160", "--prefix", "64", "--chunk", "16", "--windows", "2", "--no-progress"]


@pytest.fixture()
def cli_on_tiny_model(monkeypatch):
    """The CLI loads the default tiny Llama (256-token vocabulary) and scores random token windows."""
    import kivi.data
    import kivi.models.load

    model = tiny_model("llama", vocab_size=256)
    monkeypatch.setattr(kivi.models.load, "load_model", lambda name="smollm2", dtype=None, **kw: (model, None))

    def windows(tok, text, context, num_windows, **kw):
        return torch.randint(0, 256, (num_windows, context), generator=torch.Generator().manual_seed(3))

    monkeypatch.setattr(kivi.data, "token_windows", windows)
    return model


def run_json(capsys, argv):
    rc = main(argv)
    out, err = capsys.readouterr()
    assert rc == 0, err
    return json.loads(out)


def test_eval_ppl_json(cli_on_tiny_model, capsys):
    r = run_json(capsys, ["eval", "ppl", "--json", *PROTO])
    assert r["name"] == "fp" and r["tokens_scored"] == 2 * 96 and r["bits_per_element"] == 32.0
    q = run_json(capsys, ["eval", "ppl", "--json", "--k-bits", "2", "--v-bits", "2", "--residual-length", "32", *PROTO])
    assert q["bits_per_element"] < 16 and q["ppl"] > 0


@pytest.mark.long  # ~50 s: the ppl CLI end to end twice more (the quantized ppl path is in the test above)
def test_eval_ppl_with_config_file_and_baseline(cli_on_tiny_model, capsys, tmp_path):
    path = tmp_path / "cfg.json"
    KiviConfig(k_bits=4, v_bits=4, residual_length=32).to_json(path)
    r = run_json(capsys, ["eval", "ppl", "--json", "--config", str(path), *PROTO])
    assert r["config"]["k_bits"] == 4
    rc = main(["eval", "ppl", "--json", "--baseline", "quanto-int4", *PROTO])
    out, err = capsys.readouterr()
    if rc == 0:
        assert json.loads(out)["name"] == "quanto-int4"
    else:  # optimum-quanto missing: one clear line
        assert rc == 2 and "unavailable" in err


def test_eval_kld_json(cli_on_tiny_model, capsys):
    r = run_json(capsys, ["eval", "kld", "--json", "--no-quantize-key", "--no-quantize-value", *PROTO])
    assert r["kl"] <= 1e-6 and r["top1_agreement"] == 1.0
    r = run_json(capsys, ["eval", "kld", "--json", "--preset", "extreme", "--residual-length", "32", *PROTO])
    assert r["kl"] > 0 and "delta_ppl_pct" in r


def test_sweep_csv_and_plot(cli_on_tiny_model, capsys, tmp_path):
    pytest.importorskip("matplotlib")
    csv_path, png = tmp_path / "rows.csv", tmp_path / "pareto.png"
    r = run_json(capsys, ["sweep", "--json", "--grid", "none", "--presets", "high,extreme", "--no-baselines",
                          "--csv", str(csv_path), "--plot", str(png), *PROTO])
    names = [x["name"] for x in r["rows"]]
    assert names[0] == "fp" and len(names) == 3
    assert csv_path.read_text().startswith("name,kind,bits_per_element")
    assert png.stat().st_size > 1000


def test_profile_and_tune(cli_on_tiny_model, capsys, tmp_path):
    prof_path, rec_path, tuned = tmp_path / "profile.json", tmp_path / "rec.json", tmp_path / "tuned.json"
    prof = run_json(capsys, ["profile", "--json", "-o", str(prof_path), "--upgrade-layers", "1",
                             "--write-config", str(rec_path), *PROTO])
    assert len(prof["layers"]) == 2
    assert KiviConfig.from_json(rec_path).layer_specific_config == {prof["ranking"][0]: {"k_bits": 4}}
    r = run_json(capsys, ["tune", "--json", "--max-ppl-increase", "1000%", "--profile", str(prof_path),
                          "--write-config", str(tuned), *PROTO])
    assert set(r) >= {"config", "ppl", "bits_per_element"}
    cfg = KiviConfig.from_json(tuned)
    assert cfg.to_dict() == KiviConfig.from_dict(r["config"]).to_dict()
    # the cheapest candidate of the grid fits a 1000% budget, so exactly one was measured
    assert len(r["evaluated"]) == 1


@pytest.mark.parametrize("argv, msg", [
    (["eval", "ppl", "--prefix", "200", "--context", "160"], "--prefix"),
    (["eval", "ppl", "--baseline", "quanto-int2", "--preset", "high"], "not both"),
    (["eval", "ppl", "--baseline", "nope"], "unknown baseline"),
    (["eval", "ppl", "--group-size", "48", "--residual-length", "96", "--context", "160", "--prefix", "64"],
     "group_size"),
    (["eval", "ppl", "--context", "5000", "--prefix", "64"], "longer than the model supports (4,096 tokens"),
    (["eval", "kld", "--context", "5000", "--prefix", "64"], "longer than the model supports (4,096 tokens"),
    (["tune"], "budget"),
    (["tune", "--max-ppl-increase", "lots"], "percentage"),
])
def test_bad_input_is_one_line_exit_2(cli_on_tiny_model, capsys, argv, msg):
    rc = main(argv + ["--windows", "1", "--no-progress"])
    _, err = capsys.readouterr()
    assert rc == 2
    assert msg in err and len(err.strip().splitlines()) == 1


@pytest.mark.parametrize("argv, msg", [
    (["--lengths", "5000"], "longer than the model supports (4,096 tokens"),
    (["--lengths", "0"], "argument --lengths: '0'"),
    (["--depths", "1.5"], "argument --depths: '1.5'"),
    (["--seeds", "0"], "argument --seeds: 0 is not a positive integer"),
    (["--max-new-tokens", "0"], "argument --max-new-tokens: 0 is not a positive integer"),
])
def test_passkey_bad_input_is_one_line_exit_2(cli_on_tiny_model, capsys, monkeypatch, argv, msg):
    import kivi.models.load

    loads = []
    real = kivi.models.load.load_model
    monkeypatch.setattr(kivi.models.load, "load_model", lambda *a, **kw: loads.append(1) or real(*a, **kw))
    rc = main(["eval", "passkey", "--no-progress", *argv])
    _, err = capsys.readouterr()
    assert rc == 2
    assert msg in err and len(err.strip().splitlines()) == 1
    assert loads == ([1] if "5000" in argv else [])  # argument errors come before the model loads


@pytest.mark.slow
def test_eval_ppl_subprocess_smollm2():
    cmd = [sys.executable, "-m", "kivi", "eval", "ppl", "--model", "smollm2", "--context", "256", "--prefix", "128",
           "--windows", "1", "--preset", "high", "--json", "--no-progress"]
    p = subprocess.run(cmd, capture_output=True, text=True, timeout=900)
    assert p.returncode == 0, p.stderr
    r = json.loads(p.stdout)
    assert r["tokens_scored"] == 128 and 1 < r["ppl"] < 200 and 4 < r["bits_per_element"] < 32


def test_profile_per_head_writes_a_head_bits_config(cli_on_tiny_model, capsys, tmp_path):
    rec_path = tmp_path / "heads.json"
    base = ["--k-bits", "2", "--v-bits", "2", "--group-size", "8", "--residual-length", "16", "--sink-tokens", "2"]
    prof = run_json(capsys, ["profile", "--per-head", "--json", "--max-bits", "6.8", "--write-config", str(rec_path),
                             *base, *PROTO])
    assert len(prof["heads"]) == 2 * 2 * 2 and prof["bits"] == [2, 4]
    assert prof["base_bits"] < prof["recommended_bits"] <= 6.8
    cfg = KiviConfig.from_json(rec_path)
    assert cfg.head_bits and cfg.to_dict() == prof["recommended"]
    r = run_json(capsys, ["eval", "ppl", "--json", "--config", str(rec_path), *PROTO])  # the file reads back
    assert r["config"]["head_bits"] == {str(k): v for k, v in cfg.head_bits.items()} and r["ppl"] > 0
    assert main(["profile", "--per-head", "--upgrade-layers", "1", *PROTO]) == 2
    assert "--per-head takes --head-upgrade-bits" in capsys.readouterr().err


def test_profile_per_head_widens_only_the_narrow_side(cli_on_tiny_model, capsys):
    """K4V2 + --head-upgrade-bits 4: the values are widened, the keys (already 4 bits) left alone."""
    base = ["--k-bits", "4", "--v-bits", "2", "--group-size", "8", "--residual-length", "16"]
    prof = run_json(capsys, ["profile", "--per-head", "--json", "--max-bits", "9", "--first-window", "1",
                             *base, *PROTO])
    cfg = KiviConfig.from_dict(prof["recommended"])
    assert cfg.head_bits and all(set(sides) == {"v_bits"} for sides in cfg.head_bits.values())
    assert main(["profile", "--per-head", "--k-bits", "4", "--v-bits", "4", *PROTO]) == 2
    assert "must be wider than a base width" in capsys.readouterr().err
