"""The material long-context prompts are built from: a tokenized text, its sentence boundaries and
words, and the model's prompt template, all as token ids.

Prompts are assembled from token ids, never re-tokenized as one string, so their length is exact:
``template head + intro + document + question + template tail + answer prefix`` is exactly the
requested number of tokens (a string joined and tokenized again could merge tokens at the seams).
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from typing import Any

#: What the generators need of a tokenizer: ``tok(text, add_special_tokens=False)["input_ids"]``,
#: ``tok.decode(ids)``, and optionally ``chat_template`` / ``apply_chat_template`` and ``eos_token_id``.
Tokenizer = Any

_MARK = "\x00KIVI-CONTENT\x00"
_WORD = re.compile(r"\b[a-z]{4,12}\b")


def encode(tok: Tokenizer, text: str) -> list[int]:
    """Token ids of ``text`` without special tokens."""
    return [int(i) for i in tok(text, add_special_tokens=False)["input_ids"]]


def decode(tok: Tokenizer, ids: list[int]) -> str:
    return tok.decode(ids, skip_special_tokens=True)


@dataclass(frozen=True)
class Template:
    """Token ids around the user's message: ``head`` (BOS, chat template start) and ``tail`` (the end
    of the user turn and the assistant's turn start); both empty for a tokenizer without a chat template."""

    head: tuple[int, ...]
    tail: tuple[int, ...]

    @classmethod
    def of(cls, tok: Tokenizer) -> "Template":
        special = [int(i) for i in tok("", add_special_tokens=True)["input_ids"]]  # BOS, where the tokenizer adds one
        if getattr(tok, "chat_template", None):
            text = tok.apply_chat_template([{"role": "user", "content": _MARK}], tokenize=False,
                                           add_generation_prompt=True)
            head, tail = text.split(_MARK, 1)
            return cls(tuple(special + encode(tok, head)), tuple(encode(tok, tail)))
        return cls(tuple(special), ())


@dataclass
class Haystack:
    """A tokenized text: its ids, the positions where a sentence starts, and its lowercase words."""

    tok: Tokenizer
    ids: list[int]
    starts: list[int] = field(default_factory=list)
    words: list[str] = field(default_factory=list)

    @classmethod
    def from_text(cls, tok: Tokenizer, text: str) -> "Haystack":
        from ...data import token_ids  # noqa: PLC0415 - tokenization cached per (tokenizer, text)

        ids = [int(i) for i in token_ids(tok, text).tolist()]
        ends = {i for i in set(ids) if _ends_sentence(decode(tok, [i]))}
        starts = [p for p in range(1, len(ids)) if ids[p - 1] in ends]
        words = sorted(set(_WORD.findall(text[:400_000])))
        return cls(tok, ids, starts, words)

    def check_tokens(self, n: int, what: str) -> None:
        if n > len(self.ids):
            raise ValueError(f"the text has {len(self.ids):,} tokens; {what} needs {n:,}: give a longer --text")

    def snap(self, start: int, pos: int, span: int) -> int:
        """The sentence start nearest to ``start + pos`` inside ``[start, start + span]``, as an offset
        from ``start`` (``pos`` itself when no sentence starts there; 0 and ``span`` stay as they are)."""
        if pos <= 0 or pos >= span:
            return max(0, min(pos, span))
        import bisect  # noqa: PLC0415

        j = bisect.bisect_left(self.starts, start + pos)
        best = [self.starts[k] - start for k in (j - 1, j) if 0 <= k < len(self.starts)]
        best = [b for b in best if 0 < b < span]
        return min(best, key=lambda b: abs(b - pos)) if best else pos

    def next_start(self, start: int, pos: int) -> int | None:
        """The first sentence start after ``start + pos``, as an offset from ``start`` (``None``: none)."""
        import bisect  # noqa: PLC0415

        j = bisect.bisect_right(self.starts, start + pos)
        return self.starts[j] - start if j < len(self.starts) else None


def _ends_sentence(piece: str) -> bool:
    s = piece.rstrip(" ")
    return "\n" in piece or s.endswith((".", "!", "?"))


__all__ = ["Haystack", "Template", "Tokenizer", "decode", "encode"]
