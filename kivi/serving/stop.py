"""Stop sequences over streamed text: what may be shown now, and whether a stop sequence has appeared."""

from __future__ import annotations


class StopMatcher:
    """Feed decoded text pieces; get back the text that can be emitted and whether to stop.

    Text that could still be the start of a stop sequence is held back until the next piece decides it
    (the stop sequence itself is never emitted, as in OpenAI's API). ``flush()`` returns what is held
    back once generation ends without a stop.
    """

    def __init__(self, stops: list[str]) -> None:
        if any(not s for s in stops):
            raise ValueError("stop sequences must be non-empty strings")
        self.stops = list(stops)
        self._hold = max((len(s) for s in self.stops), default=1) - 1
        self._pending = ""
        self.stopped = False

    def feed(self, text: str) -> str:
        """The text safe to emit after ``text``; sets :attr:`stopped` when a stop sequence completed."""
        if self.stopped:
            return ""
        buf = self._pending + text
        hits = [i for i in (buf.find(s) for s in self.stops) if i >= 0]
        if hits:
            self.stopped, self._pending = True, ""
            return buf[: min(hits)]
        keep = self._held_back(buf)
        self._pending = buf[len(buf) - keep:] if keep else ""
        return buf[: len(buf) - keep]

    def _held_back(self, buf: str) -> int:
        """Length of the longest suffix of ``buf`` that is a proper prefix of some stop sequence."""
        for n in range(min(self._hold, len(buf)), 0, -1):
            tail = buf[-n:]
            if any(s.startswith(tail) for s in self.stops):
                return n
        return 0

    def flush(self) -> str:
        out, self._pending = self._pending, ""
        return "" if self.stopped else out
