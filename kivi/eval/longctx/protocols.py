"""The two prefill protocols of the long-context suite (what each does: :mod:`.runner`)."""

from __future__ import annotations

from typing import Sequence

PROTOCOLS = ("question-after", "one-shot")


def check_protocols(names: Sequence[str]) -> list[str]:
    bad = [p for p in names if p not in PROTOCOLS]
    if bad or not names:
        raise ValueError(f"unknown protocol(s) {bad}; choose from {list(PROTOCOLS)}")
    return list(dict.fromkeys(names))


__all__ = ["PROTOCOLS", "check_protocols"]
