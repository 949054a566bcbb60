"""RULER's score of one answer: the fraction of expected strings found in it (case-insensitive)."""

from __future__ import annotations

from typing import Sequence


def string_match_all(answer: str, expected: Sequence[str]) -> float:
    """``sum(ref in answer) / len(expected)``, case-insensitive (RULER's ``string_match_all``).

    It never decreases as the answer grows, so a greedy decode may stop once it reaches 1.0 and
    scores the same as the full answer (the runner does)."""
    if not expected:
        raise ValueError("expected is empty: a sample needs at least one expected string")
    low = answer.lower()
    return sum(ref.lower() in low for ref in expected) / len(expected)


__all__ = ["string_match_all"]
