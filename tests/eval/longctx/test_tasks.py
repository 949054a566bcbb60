"""kivi.eval.longctx.tasks: every task's prompt has exactly the requested tokens, is deterministic, holds
its needle exactly once, and its answer can be read off the document (byte tokenizer, WikiText-2 slice)."""

from __future__ import annotations

import re
from collections import Counter

import pytest

from kivi.data import load_text
from kivi.eval.longctx.haystack import Haystack, Template, decode
from kivi.eval.longctx.tasks import TASKS, check_tasks, make_sample
from tests.helpers import ByteTokenizer

TOK = ByteTokenizer()


@pytest.fixture(scope="module")
def hay():
    return Haystack.from_text(TOK, load_text()[:60_000])


def _doc(s):
    return decode(TOK, list(s.context[s.doc_start:]))


@pytest.mark.parametrize("task", list(TASKS))
@pytest.mark.parametrize("length", [1500, 2301])
def test_exact_length_and_deterministic(hay, task, length):
    tpl = Template.of(TOK)
    a = make_sample(hay, tpl, task, length, 1, samples=3, seed=7)
    assert len(a.ids) == length == len(a.context) + len(a.question)
    assert a == make_sample(hay, tpl, task, length, 1, samples=3, seed=7)
    assert a.ids != make_sample(hay, tpl, task, length, 1, samples=3, seed=8).ids
    assert a.ids != make_sample(hay, tpl, task, length, 2, samples=3, seed=7).ids


@pytest.mark.parametrize("task", [t for t in TASKS if t.startswith("niah")])
def test_needles_once_and_answer_derivable(hay, task):
    for i in range(3):
        s = make_sample(hay, Template.of(TOK), task, 2000, i, samples=3, seed=1)
        doc, q = _doc(s), decode(TOK, list(s.question))
        keys = re.findall(r"[a-z]+-[a-z]+", q)
        for v in s.expected:
            assert doc.count(v) == 1
            found = re.findall(rf"special magic \w+ for ([a-z]+-[a-z]+) is: {re.escape(v)}\.", doc)
            assert found and found[0] in keys  # the value sits in a needle of a key the question asks
    if task == "niah_multikey":
        assert len(re.findall(r"special magic numbers for", doc)) == 4  # 3 distractors


def test_depth_is_swept(hay):
    depths = [make_sample(hay, Template.of(TOK), "niah_single", 2000, i, samples=5, seed=0).depth for i in range(5)]
    assert depths[0] < 0.05 and depths[-1] > 0.9 and depths == sorted(depths)


def test_vt_chain_resolves_to_the_expected_variables(hay):
    s = make_sample(hay, Template.of(TOK), "vt", 2000, 1, samples=3, seed=0)
    value = re.search(r"assigned the value (\d+)", decode(TOK, list(s.question))).group(1)
    assign = dict(re.findall(r"VAR ([A-Z]{5}) = (\w+)\.", _doc(s)))
    holds = {v for v in assign if assign[v] == value}
    while True:
        more = {v for v in assign if assign[v] in holds} - holds
        if not more:
            break
        holds |= more
    assert holds == set(s.expected) and len(holds) == 5


def test_cwe_and_fwe_answers_are_the_counted_most_frequent(hay):
    s = make_sample(hay, Template.of(TOK), "cwe", 2500, 0, samples=1, seed=0)
    counts = Counter(re.findall(r"\d+\. ([a-z]+)", _doc(s)))
    top = sorted(counts, key=lambda w: -counts[w])[:10]
    assert set(top) == set(s.expected) and min(counts[w] for w in top) > max(
        c for w, c in counts.items() if w not in top)
    s = make_sample(hay, Template.of(TOK), "fwe", 2500, 0, samples=1, seed=0)
    counts = Counter(_doc(s).split())
    ranked = sorted(counts, key=lambda w: -counts[w])
    assert ranked[:3] == list(s.expected) and counts[ranked[2]] > counts[ranked[3]]


def test_qa_blank_is_a_sentence_of_the_document(hay):
    s = make_sample(hay, Template.of(TOK), "qa", 2000, 1, samples=3, seed=0)
    blanked = re.search(r': "(.*)" Which word', decode(TOK, list(s.question)), flags=re.S).group(1)
    before, after = blanked.split("____")
    doc = _doc(s)
    assert before + s.expected[0] + after in doc
    assert len(re.findall(rf"\b{s.expected[0]}\b", doc, flags=re.I)) == 1


def test_refusals(hay):
    with pytest.raises(ValueError, match="too short for task 'niah_single'"):
        make_sample(hay, Template.of(TOK), "niah_single", 200, 0, samples=1, seed=0)
    with pytest.raises(ValueError, match="give a longer --text"):
        make_sample(Haystack.from_text(TOK, load_text()[:3000]), Template.of(TOK), "niah_single", 4000, 0,
                    samples=1, seed=0)
    with pytest.raises(ValueError, match="unknown task"):
        check_tasks(["niah"])
