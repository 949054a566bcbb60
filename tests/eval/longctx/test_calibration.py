"""kivi.eval.longctx.calibration: suite prompts for the per-head profile (the sample, then full precision's
greedy answer; question and answer scored), deterministic in the seed; on the tiny model and the byte
tokenizer."""

from __future__ import annotations

import pytest
import torch

from kivi.data import load_text
from kivi.eval.longctx.calibration import calibration_prompts, greedy_answer
from kivi.eval.longctx.haystack import Haystack, Template
from kivi.eval.longctx.tasks import make_sample
from tests.helpers import ByteTokenizer, tiny_model

TEXT = load_text()[:40_000]
KW = dict(length=420, tasks=["niah_single", "niah_single_word"], samples=2, progress=False)


@pytest.fixture(scope="module")
def model():
    return tiny_model("llama", vocab_size=257, max_position_embeddings=512, weight_scale=3.0)


def _by_hand(model, ids, n, eos):
    """Greedy decoding with a full forward per token, up to and including an end-of-sequence token: the
    plain reference of `greedy_answer`."""
    out = []
    with torch.inference_mode():
        for _ in range(n):
            nxt = int(model(torch.tensor([list(ids) + out])).logits[0, -1].argmax())
            out.append(nxt)
            if nxt in eos:
                break
    return out


def test_prompts_are_samples_then_fp_answers(model):
    tok = ByteTokenizer()
    prompts = calibration_prompts(model, tok, TEXT, seed=3, **KW)
    assert [(p.task, p.index) for p in prompts] == [("niah_single", 0), ("niah_single", 1),
                                                    ("niah_single_word", 0), ("niah_single_word", 1)]
    hay, tpl = Haystack.from_text(tok, TEXT), Template.of(tok)
    eos = model.generation_config.eos_token_id
    eos = set(eos) if isinstance(eos, (list, tuple)) else {eos} - {None}
    for p in prompts:
        s = make_sample(hay, tpl, p.task, 420, p.index, samples=2, seed=3)
        assert p.ids[:420] == tuple(s.ids) and len(s.ids) == 420 and p.scored_from == len(s.context) < 420
        answer = list(p.ids[420:])
        assert len(answer) == p.answer_tokens <= s.max_new_tokens
        assert answer == _by_hand(model, s.ids, s.max_new_tokens, eos)
    assert any(p.answer_tokens > 0 for p in prompts)


def test_deterministic_in_the_seed(model):
    tok = ByteTokenizer()
    a = calibration_prompts(model, tok, TEXT, seed=1, **KW)
    assert a == calibration_prompts(model, tok, TEXT, seed=1, **KW)
    assert [p.ids for p in a] != [p.ids for p in calibration_prompts(model, tok, TEXT, seed=2, **KW)]


def test_greedy_answer_stops_at_the_end_of_sequence(model, monkeypatch):
    ids = list(range(40, 80))
    first = _by_hand(model, ids, 1, set())[0]
    monkeypatch.setattr(model.generation_config, "eos_token_id", first)
    assert greedy_answer(model, ids, 5) == [first]  # the end of sequence stops it, and is kept
    monkeypatch.setattr(model.generation_config, "eos_token_id", None)
    assert greedy_answer(model, ids, 5) == _by_hand(model, ids, 5, set()) and len(greedy_answer(model, ids, 5)) == 5


@pytest.mark.parametrize("kw, message", [
    (dict(tasks=["nope"]), "unknown task"),
    (dict(samples=0), "samples=0 must be a positive integer"),
    (dict(length=10), "too short"),
])
def test_bad_arguments(model, kw, message):
    with pytest.raises(ValueError, match=message):
        calibration_prompts(model, ByteTokenizer(), TEXT, **{**KW, **kw})
