"""kivi.eval.longctx.objective: the suite's full-precision side built once (one prefill per sample, none per
scored config), a config scored on the same samples with its paired drop, and its argument checks; on the tiny
model (fast) and, marked ``long``, on SmolLM2, where a damaged config must lose points and a near-FP one not."""

from __future__ import annotations

import pytest

from kivi import KiviConfig
from kivi.data import load_text
from kivi.eval.longctx import runner
from kivi.eval.longctx.objective import SuiteReference, check_score_drop
from tests.helpers import ByteTokenizer, tiny_model

TEXT = load_text()[:40_000]
K2 = KiviConfig(k_bits=2, v_bits=2, group_size=16, residual_length=32, attention_backend="reference")


@pytest.fixture(scope="module")
def model():
    return tiny_model("llama", vocab_size=257, max_position_embeddings=512)


def test_one_prefill_per_sample_shared_by_every_scored_config(model, monkeypatch):
    prefills = []
    record = runner.record_prefill
    monkeypatch.setattr(runner, "record_prefill", lambda m, ids: prefills.append(len(ids)) or record(m, ids))
    ref = SuiteReference(model, ByteTokenizer(), TEXT, length=420, tasks=["niah_single", "niah_single_word"],
                         samples=2)
    assert len(prefills) == 4 and all(n < 420 for n in prefills)  # question-after: the context only
    same = ref.score(None, "fp-again")
    assert len(prefills) == 4  # scoring replays the kept prefills
    assert set(same) >= {"score", "score_fp", "score_drop", "score_drop_ci", "within_noise", "score_tasks", "n"}
    assert same["n"] == 4 and set(same["score_tasks"]) == {"niah_single", "niah_single_word"}
    assert same["score"] == same["score_fp"] and same["score_drop"] == 0.0 and same["score_drop_ci"] == [0.0, 0.0]
    d = ref.describe()
    assert d["prefills"] == 4 and d["prefill_bytes"] > 0 and d["protocol"] == "question-after"
    assert d["tasks"] == ["niah_single", "niah_single_word"] and d["samples"] == 2 and d["length"] == 420


def test_a_quantized_config_is_scored_on_the_same_samples(model, monkeypatch):
    ref = SuiteReference(model, ByteTokenizer(), TEXT, length=420, tasks=["niah_single"], samples=1)
    answers = []
    answer = runner.answer
    monkeypatch.setattr(runner, "answer", lambda m, t, spec, s, p, pre: answers.append((spec, s.index, id(pre)))
                        or answer(m, t, spec, s, p, pre))
    k2 = ref.score(K2, "k2")
    assert answers == [(K2, 0, id(ref.items[0][1]))]  # the kept prefill of sample 0
    assert k2["score_drop"] == pytest.approx(k2["score_fp"] - k2["score"]) and k2["n"] == 1
    assert k2["score_drop_ci"] is None and k2["within_noise"] is None  # one sample: nothing to resample


def test_one_shot_prefills_the_whole_prompt(model, monkeypatch):
    prefills = []
    record = runner.record_prefill
    monkeypatch.setattr(runner, "record_prefill", lambda m, ids: prefills.append(len(ids)) or record(m, ids))
    SuiteReference(model, ByteTokenizer(), TEXT, length=420, tasks=["niah_single"], samples=1, protocol="one-shot")
    assert prefills == [420]


@pytest.mark.parametrize("kw,message", [
    ({"tasks": ["niah"]}, "unknown task"),
    ({"samples": 0}, "samples=0"),
    ({"length": 0}, "length=0"),
    ({"protocol": "both"}, "unknown protocol"),
    ({"max_context": 430}, "longer than the model supports"),
])
def test_bad_arguments(model, kw, message):
    args = {"length": 420, "tasks": ["niah_single"], "samples": 1, **kw}
    with pytest.raises(ValueError, match=message):
        SuiteReference(model, ByteTokenizer(), TEXT, **args)


def test_score_drop_bound():
    assert check_score_drop(0) == 0.0 and check_score_drop(1.5) == 1.5
    for bad in (-0.1, 100.5, float("nan"), True, "1"):
        with pytest.raises(ValueError, match="between 0 and 100"):
            check_score_drop(bad)


@pytest.mark.long  # ~3-6 min on the shared 2-core box: SmolLM2 prefills and the packed decode kernel
def test_smollm2_damaged_config_loses_points_a_near_fp_one_does_not(smollm2):
    m, tok = smollm2
    ref = SuiteReference(m, tok, load_text()[:60_000], length=512, tasks=["niah_single"], samples=2)
    assert ref.fp["score"] == 100.0  # SmolLM2 finds the needle at 512 tokens: the test can see a loss
    bad = ref.score(KiviConfig(k_bits=1, v_bits=1, group_size=64, residual_length=0), "k1v1")
    good = ref.score(KiviConfig(k_bits=8, v_bits=8, group_size=32, residual_length=32), "k8v8")
    assert bad["score_drop"] > 50 and good["score_drop"] == 0.0
