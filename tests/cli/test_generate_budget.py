"""`kivi generate --cache-budget` (and `--full-precision-first`): the config picked for the request's length,
what is printed about it, and one-line errors; on a tiny saved model, in process."""

from __future__ import annotations

import json

import pytest

from kivi.cli import main
from kivi.config import KiviConfig
from kivi.memory.budget import config_for_budget

PROMPT = " ".join(["hello world kivi cache the a of and to is"] * 30)  # 300 tokens of the word-level tokenizer
NEW = 20


@pytest.fixture(scope="module")
def tiny_folder(tmp_path_factory):
    from tests.helpers import tiny_model
    from tests.test_models import tiny_tokenizer  # the loader tests' in-memory word-level tokenizer

    folder = tmp_path_factory.mktemp("gen") / "tiny-llama"
    tiny_model("llama", vocab_size=12, max_position_embeddings=1024, eos_token_id=None, pad_token_id=None) \
        .save_pretrained(folder)
    tiny_tokenizer().save_pretrained(folder)
    return folder


def _generate(folder, capsys, *extra):
    rc = main(["generate", "--model", str(folder), "--prompt", PROMPT, "--raw", "--max-new-tokens", str(NEW),
               *extra])
    out, err = capsys.readouterr()
    return rc, out, err


def _library_pick(folder, budget, **kw):
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(folder)
    return config_for_budget(model, budget, 300 + NEW, prefill=300, **kw)


def test_budget_picks_the_best_config_that_fits_the_request(tiny_folder, capsys):
    # between the candidates: 2/2 configs fit, the 4-bit ones do not (measured by the library itself)
    budget = 190_000
    lib = _library_pick(tiny_folder, budget)
    assert lib.name not in ("high", "balanced")
    rc, out, err = _generate(tiny_folder, capsys, "--cache-budget", str(budget), "--json")
    assert rc == 0, err
    r = json.loads(out)
    assert r["budget_pick"]["name"] == lib.name and KiviConfig.from_dict(r["config"]) == lib.config
    assert r["prompt_tokens"] == 300 and r["cache_bytes"] == r["predicted_cache_bytes"] <= lib.need_bytes <= budget
    rc, out, err = _generate(tiny_folder, capsys, "--cache-budget", str(budget))
    assert rc == 0
    assert f"for a 320-token cache x batch 1: picked {lib.name}" in err and "too large" in err  # why: the ladder
    assert "picked" not in out  # stdout is the generated text


def test_full_precision_first_keeps_short_requests_exact(tiny_folder, capsys):
    fp = 2 * 2 * 2 * 32 * 4 * 320  # layers x (k, v) x kv heads x head_dim x fp32 x tokens
    rc, out, err = _generate(tiny_folder, capsys, "--cache-budget", str(fp), "--full-precision-first", "--json")
    r = json.loads(out)
    assert rc == 0 and r["config"]["quantize_after"] >= 320
    assert r["cache_bytes"] == r["fp_cache_bytes"] == r["predicted_cache_bytes"]  # never quantized
    # a budget for 200 full-precision tokens: FP up to 200, then the ladder's pick; the peak stays within it
    budget = 2 * 2 * 2 * 32 * 4 * 200
    lib = _library_pick(tiny_folder, budget, full_precision_first=True)
    assert lib.config.quantize_after == 200 and lib.need_bytes <= budget
    rc, out, err = _generate(tiny_folder, capsys, "--cache-budget", str(budget), "--full-precision-first", "--json")
    r = json.loads(out)
    assert KiviConfig.from_dict(r["config"]) == lib.config
    assert r["cache_bytes"] == r["predicted_cache_bytes"] < r["fp_cache_bytes"]
    rc, out, err = _generate(tiny_folder, capsys, "--cache-budget", str(budget), "--full-precision-first")
    assert "full precision first: the cache stays in full precision up to 200 tokens (then KIVI)" in err


@pytest.mark.parametrize("extra, needles", [
    (["--cache-budget", "20000"], ["--cache-budget: budget", "too small for a 320-token cache", "smallest candidate",
                                   "lower --max-new-tokens"]),
    (["--cache-budget", "1MiB", "--preset", "high"], ["--cache-budget", "not both"]),
    (["--full-precision-first"], ["--full-precision-first goes with --cache-budget"]),
    (["--quantize-after", "-3"], ["quantize_after=-3 must be an integer >= 0"]),
], ids=["nothing-fits", "with-preset", "fp-first-alone", "bad-quantize-after"])
def test_errors_are_one_line(tiny_folder, capsys, extra, needles):
    rc, out, err = _generate(tiny_folder, capsys, *extra)
    lines = [line for line in err.splitlines() if line.startswith("kivi")]  # (loading progress aside)
    assert rc == 2 and len(lines) == 1 and lines[0].startswith("kivi generate: error:"), err
    assert not out
    for n in needles:
        assert n in lines[0]


def test_quantize_after_option_reaches_the_cache(tiny_folder, capsys):
    rc, out, err = _generate(tiny_folder, capsys, "--preset", "extreme", "--quantize-after", "310", "--json")
    r = json.loads(out)
    assert rc == 0 and r["config"]["quantize_after"] == 310
    assert r["cache_bytes"] == r["predicted_cache_bytes"] < r["fp_cache_bytes"]  # 319 cached tokens > 310
    rc, out, err = _generate(tiny_folder, capsys, "--preset", "extreme", "--quantize-after", "400", "--json")
    r = json.loads(out)
    assert r["cache_bytes"] == r["fp_cache_bytes"]
