"""kivi.eval.longctx.attribution: the lost samples, the deciding token, the ablated configs, the margin against
a plain forward without a cache, and the ranking's arithmetic; end to end on a tiny random model."""

from __future__ import annotations

import pytest
import torch

from kivi import KiviConfig
from kivi.data import load_text
from kivi.eval.longctx import attribution as att
from kivi.eval.longctx.haystack import Haystack, Template
from kivi.eval.longctx.runner import record_prefill
from kivi.eval.longctx.tasks import make_sample
from tests.helpers import ByteTokenizer, tiny_model

TEXT = load_text()[:40_000]
LENGTH = 420


@pytest.fixture(scope="module")
def model():
    return tiny_model("llama", vocab_size=257, max_position_embeddings=512)


def _row(config, sample, score, answer, task="niah_single", protocol="question-after"):
    return {"model": "tiny", "text": "t", "seed": 0, "samples": 2, "config": config, "length": LENGTH, "task": task,
            "protocol": protocol, "sample": sample, "score": score, "answer": answer, "expected": ["1234567"]}


def test_lost_pairs_are_the_samples_fp_wins():
    rows = [_row("fp", 0, 1.0, " 1234567"), _row("c", 0, 0.0, " 1234999"),
            _row("fp", 1, 1.0, " 1234567"), _row("c", 1, 1.0, " 1234567"),  # a tie: not lost
            _row("fp", 0, 0.0, " 9", task="vt"), _row("c", 0, 1.0, " 1234567", task="vt"),  # a win: not lost
            _row("c", 1, 0.0, " 5", task="vt")]  # no fp row: not comparable
    pairs = att.lost_pairs(rows, "c")
    assert [(f["sample"], r["task"], f["config"], r["config"]) for f, r in pairs] == [(0, "niah_single", "fp", "c")]


def test_first_divergence():
    assert att.first_divergence([1, 2, 3], [1, 2, 4]) == ([1, 2], 3, 4)
    assert att.first_divergence([5], [6, 7]) == ([], 5, 6)
    assert att.first_divergence([1, 2], [1, 2, 3]) is None  # a prefix: no token decides
    assert att.first_divergence([], [1]) is None


def test_ablations_turn_off_what_they_name():
    cfg = KiviConfig(k_bits=2, v_bits=2, group_size=16, residual_length=32, sink_tokens=2,
                     layer_specific_config={1: {"v_bits": 4}}, head_bits={0: {"k_bits": [2, 4], "v_bits": [4, 2]}})
    got = dict(att.ablations(cfg, 2))
    assert list(got) == ["keys fp", "values fp", "layer 0 fp", "layer 1 fp"]
    keys = got["keys fp"]
    assert not keys.quantize_key and keys.quantize_value and keys.head_bits == {0: {"v_bits": [4, 2]}}
    assert keys.layer_specific_config[1] == {"v_bits": 4, "quantize_key": False}
    assert got["values fp"].head_bits == {0: {"k_bits": [2, 4]}}
    layer0 = got["layer 0 fp"]
    assert layer0.head_bits == {} and layer0.layer_specific_config[0] == {"quantize_key": False,
                                                                          "quantize_value": False}
    assert got["layer 1 fp"].layer_specific_config[1] == {"v_bits": 4, "quantize_key": False, "quantize_value": False}
    for c in got.values():
        c.validate(num_layers=2)  # every ablation is a valid config for the model
    heads = dict(att.head_ablations(cfg, 0, 2))
    assert list(heads) == ["layer 0 head 0 K8b", "layer 0 head 0 V8b", "layer 0 head 1 K8b", "layer 0 head 1 V8b"]
    assert heads["layer 0 head 1 K8b"].head_bits[0] == {"k_bits": [2, 8], "v_bits": [4, 2]}
    assert heads["layer 0 head 1 V8b"].head_bits[0] == {"k_bits": [2, 4], "v_bits": [4, 8]}
    heads1 = dict(att.head_ablations(cfg, 1, 2))  # no per-head widths there: the layer's own (v_bits 4)
    assert heads1["layer 1 head 0 V8b"].head_bits[1] == {"k_bits": [2, 2], "v_bits": [8, 4]}
    keys_only = KiviConfig(k_bits=2, group_size=16, residual_length=32, quantize_value=False)
    assert [n for n, _ in att.head_ablations(keys_only, 0, 2)] == ["layer 0 head 0 K8b", "layer 0 head 1 K8b"]
    assert cfg.head_bits == {0: {"k_bits": [2, 4], "v_bits": [4, 2]}}  # the input is not changed


def test_margin_of_fp_is_a_plain_forward(model):
    tok = ByteTokenizer()
    sample = make_sample(Haystack.from_text(tok, TEXT), Template.of(tok), "niah_single", LENGTH, 0, samples=2,
                         seed=0)
    prefix = [ord(" "), ord("4")]
    for protocol in ("question-after", "one-shot"):
        pre = record_prefill(model, sample.context if protocol == "question-after" else sample.ids)
        got = att.margin(model, "fp", sample, protocol, pre, prefix, ord("7"), ord("1"))
        with torch.inference_mode():
            logits = model(input_ids=torch.tensor([sample.ids + prefix])).logits[0, -1].float()
        assert got == pytest.approx(float(logits[ord("7")] - logits[ord("1")]), abs=1e-4)
    cfg = KiviConfig(k_bits=1, v_bits=1, group_size=16, residual_length=16, attention_backend="reference")
    assert att.margin(model, cfg, sample, "question-after", record_prefill(model, sample.context), prefix, ord("7"),
                      ord("1")) != pytest.approx(got, abs=1e-4)  # a 1-bit cache moves it


def test_summary_arithmetic():
    s = [{"task": "a", "consistent": True, "margins": {"fp": 2.0, "config": -2.0, "x": 0.0, "y": 3.0}},
         {"task": "b", "consistent": True, "margins": {"fp": 1.0, "config": -1.0, "x": -1.0, "y": 0.5}},
         {"task": "b", "consistent": False, "margins": {"fp": -1.0, "config": -2.0, "x": 5.0, "y": 5.0}}]
    rows = att._summarize(s, ["x", "y"])
    assert [r["ablation"] for r in rows] == ["y", "x"]
    y, x = rows
    assert y["mean_recovery"] == pytest.approx((1.25 + 0.75) / 2) and y["fixed"] == 2 and y["n"] == 2
    assert y["fixed_by_task"] == {"a": 1, "b": 1}
    assert x["mean_recovery"] == pytest.approx(0.25) and x["fixed"] == 0


def test_attribute_end_to_end(model):
    """A config that quantizes only layer 1: ablating layer 1 gives full precision's margin back."""
    tok = ByteTokenizer()
    cfg = KiviConfig(k_bits=1, v_bits=1, group_size=16, residual_length=16, attention_backend="reference",
                     layer_specific_config={0: {"quantize_key": False, "quantize_value": False}})
    rows = [_row("fp", 0, 1.0, " 1234567"), _row("k1", 0, 0.0, " 1299"), _row("fp", 1, 1.0, " 7"),
            _row("k1", 1, 0.0, " 7 and")]  # a prefix of the other: skipped
    out = att.attribute(model, tok, TEXT, rows, "k1", cfg, top=1, progress=False)
    assert out["lost"] == 2 and [s["sample"] for s in out["skipped"]] == [1] and len(out["samples"]) == 1
    s = out["samples"][0]
    assert (s["split_at"], s["fp_token"], s["config_token"]) == (3, "3", "9")  # after " 12": "3" vs "9"
    m = s["margins"]
    assert s["consistent"] == (m["fp"] > 0 > m["config"])
    base = {"fp", "config", "keys fp", "values fp", "layer 0 fp", "layer 1 fp"}
    # heads of the top layer are ablated once a consistent sample ranks the layers (the tiny model's margins
    # on made-up answers may have either sign)
    top = out["ablations"][0]["ablation"] if s["consistent"] else None
    heads = {f"{top} head {h} {side}8b".replace(" fp", "") for h in range(2) for side in "KV"} if s["consistent"] \
        else set()
    assert set(m) == base | heads
    assert m["layer 1 fp"] == pytest.approx(m["fp"], abs=1e-3)
    assert m["layer 0 fp"] == pytest.approx(m["config"], abs=1e-3)  # layer 0 was full precision already
    with pytest.raises(ValueError, match="no answers of config 'nope'"):
        att.attribute(model, tok, TEXT, rows, "nope", cfg, progress=False)
    with pytest.raises(ValueError, match="ablates a KiviConfig"):
        att.attribute(model, tok, TEXT, rows, "k1", "quanto-int2", progress=False)
