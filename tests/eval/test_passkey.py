import re

import pytest

from kivi import KiviConfig
from tests.helpers import tiny_model


@pytest.fixture(scope="module")
def tokenizer(smollm2):
    """The embedded SmolLM2's tokenizer (the session fixture converts the model once per machine)."""
    return smollm2[1]


def test_prompt_length_and_needle(tokenizer):
    from kivi.eval.passkey import passkey_prompt

    for length, depth in ((256, 0.0), (512, 0.5), (1024, 1.0)):
        text, ids = passkey_prompt(tokenizer, length, depth, "12345")
        assert ids.shape[1] <= length and ids.shape[1] > length * 0.8
        assert "The pass key is 12345" in text and text.rstrip().endswith("The pass key is")
    _, lo = passkey_prompt(tokenizer, 512, 0.1, "11111")
    _, hi = passkey_prompt(tokenizer, 512, 0.9, "11111")
    assert lo.shape == hi.shape or abs(lo.shape[1] - hi.shape[1]) < 10
    with pytest.raises(ValueError):
        passkey_prompt(tokenizer, 512, 1.5, "12345")


def test_passkey_runs_with_tiny_model(tokenizer):
    from kivi.eval.passkey import passkey

    model = tiny_model("llama", vocab_size=len(tokenizer))
    r = passkey(model, tokenizer, [None, KiviConfig(residual_length=32)], lengths=(256,), depths=(0.5,), seeds=2,
                max_new_tokens=3, progress=False)
    assert [x["name"] for x in r["results"]] == ["fp", "K2 V2 G32 R32"]
    fp, kivi = r["results"]
    prompts = [(t["key"], t["prompt_tokens"]) for t in fp["trials"]]
    assert prompts == [(t["key"], t["prompt_tokens"]) for t in kivi["trials"]]  # every spec sees the same prompts
    assert len({key for key, _ in prompts}) == 2  # one random key per seed
    for x in r["results"]:
        assert len(x["trials"]) == 2 and set(x["by_length"]) == {"256"}
        for t in x["trials"]:  # correct: the key's digits appear in the answer
            assert t["correct"] == (t["key"] in re.sub(r"\D", "", t["answer"]))
        assert x["accuracy"] == x["by_length"]["256"] == sum(t["correct"] for t in x["trials"]) / 2
