"""RULER-style long-context tasks, generated offline and deterministically from a text and a tokenizer.

Each task builds one :class:`Sample` per ``(seed, task, length, index)`` (a ``random.Random`` seeded by
those four, so a sample never depends on which others were built). Every prompt is **exactly**
``length`` tokens: ``template head + intro + document + question + template tail + answer prefix``,
assembled from token ids (:mod:`.haystack`); the document takes what the rest leaves. Needles sit at
sentence starts of a slice of the text; the target needle's depth (0 = start, 1 = end of the document)
is swept over the samples (``index / (n - 1)``).

The tasks (after RULER, Hsieh et al. 2024, NVIDIA/RULER; own generators):

* ``niah_single`` / ``niah_single_word`` / ``niah_single_uuid``: one needle "One of the special magic
  numbers for KEY is: VALUE." (a 7-digit number, a hyphenated word pair, a UUID-like key); the question
  names KEY.
* ``niah_multikey``: the target needle and 3 distractor needles with other keys.
* ``niah_multivalue``: 4 needles give the same key 4 values; all 4 are expected.
* ``niah_multiquery``: 4 needles with 4 keys; the question asks for all 4 values.
* ``vt``: variable tracking, a chain "VAR A = 12345." "VAR B = A." ... (4 hops) spread over the text;
  every variable holding the value is expected.
* ``cwe``: common-word extraction: a numbered list of the text's words where 10 words appear more
  often than every other; the 10 are expected.
* ``fwe``: frequent-word extraction: coded words drawn from a Zipf law (alpha 2); the 3 most frequent
  are expected.
* ``qa``: a cloze question built from the text itself: a sentence of the document with one word
  (that occurs once in the document) blanked out; the word is expected.

Scoring (:mod:`.scoring`) is RULER's: the fraction of expected strings found in the answer.
"""

from __future__ import annotations

import random
import re
from dataclasses import dataclass
from typing import Callable

from .haystack import Haystack, Template, decode, encode

ADJECTIVES = ("amber", "brave", "calm", "dusty", "eager", "faint", "gentle", "hollow", "icy", "jolly", "keen",
              "lucky", "misty", "noble", "odd", "proud", "quiet", "rapid", "silent", "tidy", "upbeat", "vivid",
              "wary", "young", "zesty", "bitter", "clever", "daring", "fierce", "golden")
NOUNS = ("falcon", "harbor", "lantern", "meadow", "orchid", "pebble", "quartz", "raven", "saddle", "thistle",
         "umbrella", "violin", "walrus", "yarrow", "zeppelin", "anchor", "beacon", "canyon", "dolphin", "ember",
         "fjord", "glacier", "hazel", "igloo", "jasmine", "kettle", "lagoon", "maple", "nectar", "otter")


@dataclass(frozen=True)
class Sample:
    """One prompt of ``length`` tokens: ``context`` (what the question-after protocol prefills: template
    head, intro, document; the document is ``context[doc_start:]``) then ``question`` (question,
    template tail, answer prefix). ``expected``: the strings a correct answer contains."""

    task: str
    length: int
    index: int
    context: tuple[int, ...]
    question: tuple[int, ...]
    doc_start: int
    expected: tuple[str, ...]
    max_new_tokens: int
    depth: float | None

    @property
    def ids(self) -> list[int]:
        return list(self.context) + list(self.question)


@dataclass(frozen=True)
class _Parts:
    intro: str
    question: str
    answer_prefix: str


class _Build:
    """What one sample's generator works with: the text, the template, its rng and token budget."""

    def __init__(self, hay: Haystack, tpl: Template, task: str, length: int, index: int, samples: int, seed: int):
        self.hay, self.tpl, self.task, self.length, self.index = hay, tpl, task, length, index
        self.rng = random.Random(f"kivi-longctx:{seed}:{task}:{length}:{index}")
        self.depth = index / (samples - 1) if samples > 1 else 0.5

    def tok(self, text: str) -> list[int]:
        return encode(self.hay.tok, text)

    def question_ids(self, parts: _Parts) -> list[int]:
        tail = list(self.tpl.tail)
        return self.tok("\n\n" + parts.question) + tail + self.tok(("" if tail else " ") + parts.answer_prefix)

    def budget(self, parts: _Parts) -> tuple[list[int], list[int], int]:
        """``(head + intro ids, question ids, document tokens)`` for a prompt of exactly ``length``."""
        head = list(self.tpl.head) + self.tok(parts.intro)
        q = self.question_ids(parts)
        doc = self.length - len(head) - len(q)
        if doc < 16:
            raise ValueError(f"length {self.length} is too short for task {self.task!r}: its prompt without a "
                             f"document already takes {len(head) + len(q)} tokens")
        return head, q, doc

    def finish(self, parts: _Parts, doc: list[int], expected: list[str], max_new: int, depth: float | None,
               head: list[int] | None = None, q: list[int] | None = None) -> Sample:
        if head is None or q is None:
            head, q, _ = self.budget(parts)
        context = head + doc
        if len(context) + len(q) != self.length:  # the construction's invariant, not a user error
            raise AssertionError(f"{self.task}: built {len(context) + len(q)} tokens for length {self.length}")
        return Sample(self.task, self.length, self.index, tuple(context), tuple(q), len(head), tuple(expected),
                      max_new, depth)

    def pad(self) -> int:
        ids = self.tok("\n")
        return ids[0] if len(ids) == 1 else self.tok(".")[0]

    def with_needles(self, span_doc: int, needles: list[tuple[float, list[int]]], must_be_unique: list[str]
                     ) -> tuple[list[int], list[int]] | None:
        """A document of ``span_doc`` tokens: a slice of the text with ``needles`` ``(depth, ids)`` inserted
        at sentence starts; ``None`` when a string of ``must_be_unique`` does not occur exactly once."""
        n = sum(len(ids) for _, ids in needles)
        span = span_doc - n
        if span < 0:
            raise ValueError(f"length {self.length} is too short for task {self.task!r}: its needles take {n} tokens")
        self.hay.check_tokens(span, f"a {self.length}-token {self.task} prompt")
        start = self.rng.randrange(0, len(self.hay.ids) - span + 1)
        base = self.hay.ids[start : start + span]
        pos = [self.hay.snap(start, round(d * span), span) for d, _ in needles]
        doc: list[int] = []
        at = [0] * len(needles)
        prev = 0
        for j in sorted(range(len(needles)), key=lambda j: (pos[j], j)):
            doc += base[prev : pos[j]]
            at[j] = len(doc)
            doc += needles[j][1]
            prev = pos[j]
        doc += base[prev:]
        text = decode(self.hay.tok, doc)
        if any(text.count(s) != 1 for s in must_be_unique):
            return None
        return doc, [a / max(1, span_doc) for a in at]

    def word_pair(self) -> str:
        return f"{self.rng.choice(ADJECTIVES)}-{self.rng.choice(NOUNS)}"

    def number(self, digits: int = 7) -> str:
        return str(self.rng.randint(10 ** (digits - 1), 10**digits - 1))

    def uuid(self) -> str:
        h = "".join(self.rng.choice("0123456789abcdef") for _ in range(32))
        return f"{h[:8]}-{h[8:12]}-{h[12:16]}-{h[16:20]}-{h[20:]}"


_ATTEMPTS = 50


def _retry(b: _Build, make: Callable[[], Sample | None]) -> Sample:
    for _ in range(_ATTEMPTS):
        s = make()
        if s is not None:
            return s
    raise ValueError(f"task {b.task!r}: no sample with unique needles in {_ATTEMPTS} attempts (a text that "
                     "repeats itself?); give another --text or --seed")


def _needle(kind: str, key: str, value: str) -> str:
    return f" One of the special magic {kind} for {key} is: {value}."


def _niah(b: _Build, *, value: Callable[[], str], kind: str, keys: int = 1, values: int = 1, queries: int = 1
          ) -> Sample:
    def make() -> Sample | None:
        names: list[str] = []
        while len(names) < keys:
            k = b.word_pair()
            if k not in names:
                names.append(k)
        vals = [[value() for _ in range(values)] for _ in names]
        flat = [v for vs in vals for v in vs]
        if len(set(flat)) != len(flat) or set(flat) & set(names):
            return None
        asked = names[:queries]
        if queries > 1:
            q = f"What are all the special magic {kind} for {', '.join(asked[:-1])} and {asked[-1]} mentioned in " \
                "the provided text?"
            ans = f"The special magic {kind} for {', '.join(asked[:-1])} and {asked[-1]} mentioned in the provided " \
                  "text are"
        elif values > 1:
            q = f"What are all the special magic {kind} for {asked[0]} mentioned in the provided text?"
            ans = f"The special magic {kind} for {asked[0]} mentioned in the provided text are"
        else:
            q = f"What is the special magic {kind[:-1]} for {asked[0]} mentioned in the provided text?"
            ans = f"The special magic {kind[:-1]} for {asked[0]} mentioned in the provided text is"
        parts = _Parts(f"Some special magic {kind} are hidden within the following text. Make sure to memorize "
                       f"them. I will quiz you about the {kind} afterwards.\n", q, ans)
        head, qids, span = b.budget(parts)
        needles = []
        for ki, key in enumerate(names):
            for vi, v in enumerate(vals[ki]):
                d = b.depth if ki == 0 and vi == 0 else b.rng.random()
                needles.append((d, b.tok(_needle(kind, key, v))))
        built = b.with_needles(span, needles, flat)
        if built is None:
            return None
        doc, depths = built
        expected = [v for ki in range(queries) for v in vals[ki]]
        return b.finish(parts, doc, expected, MAX_NEW_TOKENS[b.task], depths[0], head, qids)

    return _retry(b, make)


def _vt(b: _Build, hops: int = 4) -> Sample:
    def make() -> Sample | None:
        names: list[str] = []
        while len(names) < hops + 1:
            v = "".join(b.rng.choice("ABCDEFGHIJKLMNOPQRSTUVWXYZ") for _ in range(5))
            if v not in names:
                names.append(v)
        value = b.number(5)
        parts = _Parts("Memorize and track the chain(s) of variable assignment hidden in the following text.\n",
                       f"Question: Find all variables that are assigned the value {value} in the text above.",
                       f"Answer: According to the chain(s) of variable assignment in the text above, {hops + 1} "
                       f"variables are assigned the value {value}, they are:")
        head, qids, span = b.budget(parts)
        stmts = [f" VAR {names[0]} = {value}."] + [f" VAR {names[i]} = {names[i - 1]}." for i in range(1, hops + 1)]
        lo = b.depth * 0.5  # the chain covers half the document, starting at the swept depth's half
        needles = [(lo + 0.5 * i / hops, b.tok(s)) for i, s in enumerate(stmts)]
        built = b.with_needles(span, needles, [f" {n} " for n in names] + [value])
        if built is None:
            return None
        doc, depths = built
        return b.finish(parts, doc, names, MAX_NEW_TOKENS[b.task], depths[0], head, qids)

    return _retry(b, make)


def _cwe(b: _Build, common: int = 10) -> Sample:
    parts = _Parts("Below is a numbered list of words. In these words, some appear more often than others. "
                   "Memorize the ones that appear most often.\n",
                   f"Question: What are the {common} most common words in the above list?",
                   f"Answer: The top {common} words that appear most often in the list are:")
    head, qids, span = b.budget(parts)
    pool = [w for w in b.hay.words if len(w) >= 5]
    if len(pool) < 4 * common:
        raise ValueError(f"task 'cwe' needs at least {4 * common} distinct words of 5+ letters in the text; "
                         f"it has {len(pool)}")
    words = b.rng.sample(pool, len(pool))
    top, rest = words[:common], words[common:]
    wid = {w: b.tok(f" {w}") for w in words}
    num = [b.tok(f" {i + 1}.") for i in range(span)]
    avg = 1 + sum(len(wid[w]) + 1 for w in top) / common
    c = max(2, min(30, int(span / avg * 0.5 / common)))
    u = max(1, min(3, c // 10))

    def total(m: int) -> int:
        n = common * c + m * u
        return sum(len(x) for x in num[:n]) + c * sum(len(wid[w]) for w in top) + u * sum(len(wid[w]) for w in rest[:m])

    m = min(len(rest), int(span / avg))
    while m > 0 and total(m) > span:
        m -= max(1, int((total(m) - span) / (avg * u)) // 2)
    m = max(m, 0)
    if total(m) > span:
        raise ValueError(f"length {b.length} is too short for task 'cwe'")
    items = top * c + rest[:m] * u
    b.rng.shuffle(items)
    doc: list[int] = []
    for i, w in enumerate(items):
        doc += num[i] + wid[w]
    doc += [b.pad()] * (span - len(doc))
    return b.finish(parts, doc, top, MAX_NEW_TOKENS[b.task], None, head, qids)


def _fwe(b: _Build, top: int = 3, vocab: int = 60, alpha: float = 2.0) -> Sample:
    parts = _Parts("Read the following coded text and track the frequency of each coded word. Find the three most "
                   "frequently appeared coded words.\n",
                   "Question: Do not provide any explanation. What are the three most frequently appeared words in "
                   "the above coded text?",
                   "Answer: According to the coded text above, the three most frequently appeared words are:")
    head, qids, span = b.budget(parts)
    for _ in range(_ATTEMPTS):
        words: list[str] = []
        while len(words) < vocab:
            w = "".join(b.rng.choice("abcdefghijklmnopqrstuvwxyz") for _ in range(6))
            if w not in words:
                words.append(w)
        wid = {w: b.tok(f" {w}") for w in words}
        weights = [1 / (r + 1) ** alpha for r in range(vocab)]
        doc: list[int] = []
        counts = dict.fromkeys(words, 0)
        while True:
            w = b.rng.choices(words, weights)[0]
            if len(doc) + len(wid[w]) > span:
                break
            doc += wid[w]
            counts[w] += 1
        ranked = sorted(words, key=lambda w: -counts[w])
        if counts[ranked[top - 1]] > counts[ranked[top]]:  # the top 3 are unambiguous
            doc += [b.pad()] * (span - len(doc))
            return b.finish(parts, doc, ranked[:top], MAX_NEW_TOKENS[b.task], None, head, qids)
    raise ValueError(f"task 'fwe': no unambiguous top {top} at length {b.length}; use a longer length")


_CANDIDATE = re.compile(r"\b[a-zA-Z]{5,14}\b")


def _qa(b: _Build) -> Sample:
    tok = b.hay.tok
    parts0 = _Parts("Read the following text. I will ask you to complete one of its sentences.\n", "", "")
    intro = list(b.tpl.head) + b.tok(parts0.intro)
    for _ in range(_ATTEMPTS):
        q_guess = len(b.question_ids(_Parts("", "Question: " + "word " * 80, "Answer: The missing word is"))) + 16
        span = b.length - len(intro) - q_guess
        if span < 64:
            raise ValueError(f"length {b.length} is too short for task 'qa'")
        b.hay.check_tokens(span + q_guess, f"a {b.length}-token qa prompt")
        start = b.rng.randrange(0, len(b.hay.ids) - span - q_guess + 1)
        at = b.hay.next_start(start, round(b.depth * (span - 200)) - 1)  # a real sentence start, not the slice's
        nxt = None if at is None or at > span - 64 else b.hay.next_start(start, at + 4)
        if nxt is None or not 4 <= nxt - at <= 96:
            continue
        sentence = decode(tok, b.hay.ids[start + at : start + nxt]).strip()
        if len(re.findall(r"[A-Za-z]{2,}", sentence)) < 6 or len(sentence) > 400:  # words, not a table row
            continue
        cands = _CANDIDATE.findall(sentence)
        b.rng.shuffle(cands)
        for word in cands:
            blanked = re.sub(rf"\b{word}\b", "____", sentence, count=1)
            parts = _Parts(parts0.intro, f'Question: One word of this sentence from the text above is replaced by '
                                         f'"____": "{blanked}" Which word is it?', "Answer: The missing word is")
            head, qids, doc_len = b.budget(parts)
            if doc_len < nxt:
                continue
            doc = b.hay.ids[start : start + doc_len]
            if len(re.findall(rf"\b{word}\b", decode(tok, doc), flags=re.IGNORECASE)) != 1:
                continue
            return b.finish(parts, doc, [word], MAX_NEW_TOKENS[b.task], at / doc_len, head, qids)
    raise ValueError(f"task 'qa': no sentence with a unique word found in {_ATTEMPTS} attempts; give another --text")


#: task name -> the most tokens a greedy answer may take (RULER's budgets, shortened to what the answer needs).
MAX_NEW_TOKENS: dict[str, int] = {"niah_single": 12, "niah_single_word": 12, "niah_single_uuid": 32,
                                  "niah_multikey": 12, "niah_multivalue": 48, "niah_multiquery": 48, "vt": 32,
                                  "cwe": 64, "fwe": 24, "qa": 8}

#: task name -> generator (each ``(build) -> Sample``).
TASKS: dict[str, Callable[[_Build], Sample]] = {
    "niah_single": lambda b: _niah(b, value=b.number, kind="numbers"),
    "niah_single_word": lambda b: _niah(b, value=b.word_pair, kind="words"),
    "niah_single_uuid": lambda b: _niah(b, value=b.uuid, kind="uuids"),
    "niah_multikey": lambda b: _niah(b, value=b.number, kind="numbers", keys=4),
    "niah_multivalue": lambda b: _niah(b, value=b.number, kind="numbers", values=4),
    "niah_multiquery": lambda b: _niah(b, value=b.number, kind="numbers", keys=4, queries=4),
    "vt": _vt,
    "cwe": _cwe,
    "fwe": _fwe,
    "qa": _qa,
}


def check_tasks(names: list[str]) -> list[str]:
    bad = [n for n in names if n not in TASKS]
    if bad or not names:
        raise ValueError(f"unknown task(s) {bad}; choose from {list(TASKS)}")
    return list(dict.fromkeys(names))


def make_sample(hay: Haystack, tpl: Template, task: str, length: int, index: int, *, samples: int, seed: int
                ) -> Sample:
    """Sample ``index`` (of ``samples``, which sets its depth) of ``task`` at exactly ``length`` tokens."""
    check_tasks([task])
    if not 0 <= index < samples:
        raise ValueError(f"index {index} is outside 0..{samples - 1}")
    return TASKS[task](_Build(hay, tpl, task, length, index, samples, seed))


__all__ = ["MAX_NEW_TOKENS", "TASKS", "Sample", "check_tasks", "make_sample"]
