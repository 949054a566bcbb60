"""Docs and code state the present: no numbered work sessions, no "this branch" or "main's plugin" narration.

What changed and when goes to CHANGELOG.md (not scanned). The patterns are narrow on purpose: an HTTP session, a
git branch in a script or a branch of a computation are ordinary words and stay allowed.
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent

NARRATION = re.compile(
    r"\bsessions? \d+|\bsession-\d+|\bthis branch\b|\bmain's (?:plugin|server|checkout|script|code|run)\b",
    re.IGNORECASE,
)


def scanned() -> list[Path]:
    files = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
    for folder in ("kivi", "benchmarks", "scripts"):
        files += sorted(p for p in (ROOT / folder).rglob("*") if p.suffix in (".py", ".md", ".sh"))
    return [p for p in files if p.is_file()]


def narration(text: str) -> list[str]:
    return [m.group(0) for m in NARRATION.finditer(text)]


@pytest.mark.parametrize("path", scanned(), ids=lambda p: str(p.relative_to(ROOT)))
def test_no_history_narration(path):
    found = [f"{path.relative_to(ROOT)}:{n}: {line.strip()[:120]}" for n, line in
             enumerate(path.read_text(encoding="utf-8", errors="replace").splitlines(), 1) if narration(line)]
    assert found == [], "history belongs in CHANGELOG.md (state the present here):\n" + "\n".join(found)


def test_the_pattern_catches_narration_and_spares_ordinary_words():
    assert narration("measured in session 19; sessions 14 and 15") == ["session 19", "sessions 14"]
    assert narration("main's plugin against this branch's") == ["main's plugin", "this branch"]
    for ordinary in ("an HTTP session", "git branch --show-current", "a branch of the kernel", "ClientSession",
                     "the main's loop", "session fixtures"):
        assert narration(ordinary) == [], ordinary
