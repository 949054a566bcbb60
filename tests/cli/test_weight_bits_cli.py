"""`--weight-bits` on the command line: the planner (`kivi estimate`) and the model-loading path of
generate / eval / demo (`load_model_from_args`)."""

from __future__ import annotations

import argparse
import json

import pytest
import torch

from kivi.cli.loading import load_model_from_args
from kivi.cli.options import add_model_args
from kivi.memory import estimate_kv_memory, model_spec
from tests.cli.test_cli_basic import assert_one_line_error, kivi
from tests.helpers import tiny_model


def test_estimate_weight_bits_json(tmp_path):
    tiny_model("llama", hidden_size=256, intermediate_size=384).config.save_pretrained(tmp_path)
    p = kivi("estimate", "--model", str(tmp_path), "--context", "2k", "--preset", "balanced", "--weight-bits", "4",
             "--json")
    assert p.returncode == 0, p.stderr
    d = json.loads(p.stdout)
    want = estimate_kv_memory(model_spec(str(tmp_path)), 2048, config="balanced", weight_bits=4)
    assert d["weight_bits"] == 4 and d["weights_bytes"] == want.weights_bytes
    assert d["weights_breakdown"] == want.weights_breakdown
    assert d["total_kivi_bytes"] == d["weights_bytes"] + d["kivi_total_bytes"]
    assert d["total_fp_bytes"] == d["weights_bytes"] + d["fp_total_bytes"]


@pytest.mark.parametrize("args,needles", [
    (["estimate", "--num-layers", "4", "--num-kv-heads", "2", "--head-dim", "64", "--context", "1k", "--params", "1e6",
      "--weight-bits", "4"], ["weight bits=4 needs the shapes of the model's linear layers"]),
    (["estimate", "--model", "smollm2", "--weight-bits", "3"], ["--weight-bits", "invalid choice: 3"]),
])
def test_estimate_weight_bits_errors(args, needles):
    p = kivi(*args)
    if "invalid choice: 3" in needles:  # argparse's own usage error
        assert p.returncode == 2 and all(n in p.stderr for n in needles)
    else:
        assert_one_line_error(p, *needles)


@pytest.mark.parametrize("bits", [16, 8, 4])
def test_load_model_from_args_quantizes_the_weights(monkeypatch, bits):
    pytest.importorskip("optimum.quanto")
    import kivi.models.load

    monkeypatch.setattr(kivi.models.load, "load_model", lambda name, dtype=None: (tiny_model(), "tok"))
    p = argparse.ArgumentParser()
    add_model_args(p)
    model, tok = load_model_from_args(p.parse_args(["--weight-bits", str(bits)]))
    qlinear = type(model.model.layers[0].mlp.up_proj).__name__
    assert tok == "tok" and qlinear == ("Linear" if bits == 16 else "QLinear")
    assert getattr(model, "kivi_weight_bits", 16) == bits
    with torch.inference_mode():
        assert torch.isfinite(model(torch.tensor([[1, 2, 3]])).logits).all()


def test_weight_bits_choices_are_the_librarys():
    """Every ``--weight-bits`` offers the library's list (kivi.memory.weights.WEIGHT_BITS), not a copy."""
    from kivi.cli import build_parser
    from kivi.memory.weights import WEIGHT_BITS

    parser = build_parser()
    subs = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
    found = [a for sp in subs.choices.values() for a in sp._actions if "--weight-bits" in a.option_strings]
    assert found and all(a.choices is WEIGHT_BITS for a in found)
