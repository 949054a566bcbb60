"""StopMatcher: stop sequences over streamed pieces, split anywhere."""

from __future__ import annotations

import pytest

from kivi.serving.stop import StopMatcher


def run(pieces, stops):
    m = StopMatcher(stops)
    out = "".join(m.feed(p) for p in pieces)
    return out + m.flush(), m.stopped


@pytest.mark.parametrize("split", [1, 2, 3, 100], ids=["chars", "pairs", "triples", "whole"])
def test_stop_split_across_pieces(split):
    text = "hello world, STOP here"
    pieces = [text[i:i + split] for i in range(0, len(text), split)]
    assert run(pieces, ["STOP"]) == ("hello world, ", True)
    assert run(pieces, ["zzz"]) == (text, False)
    assert run(pieces, ["here", "world"]) == ("hello ", True)  # the earliest match wins


def test_text_that_may_start_a_stop_is_held_back_then_released():
    m = StopMatcher(["abc"])
    assert m.feed("xa") == "x"  # "a" may start "abc"
    assert m.feed("b") == ""
    assert m.feed("d") == "abd"  # it did not
    assert m.feed("ab") == ""
    assert m.flush() == "ab" and not m.stopped


def test_after_a_stop_nothing_more_is_emitted():
    m = StopMatcher(["."])
    assert m.feed("one. two") == "one" and m.stopped
    assert m.feed("three") == "" and m.flush() == ""


def test_no_stops_passes_everything_and_empty_stop_is_refused():
    assert run(["a", "b"], []) == ("ab", False)
    with pytest.raises(ValueError, match="non-empty"):
        StopMatcher([""])
