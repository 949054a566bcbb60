"""The one rule of kivi's version pins (kivi/version_pin.py)."""

from __future__ import annotations

import pytest

from kivi.version_pin import raise_version_problem, release_tested


@pytest.mark.parametrize("installed, tested, want", [
    ("0.32.0", ["0.32.0"], True), ("0.32.0+cpu", ["0.32.0"], True), ("0.32.1", ["0.32.0"], False),
    ("0.32.0.post1", ["0.32.0"], False), ("0.32.0rc1", ["0.32.0"], False),
    ("5.25.3", ["5.24", "5.25"], True), ("5.24.0", ["5.24", "5.25"], True), ("5.26.0", ["5.24", "5.25"], False),
    ("4.57.0", ["5.24", "5.25"], False), ("not-a-version", ["5.25"], False),
])
def test_release_or_series(installed, tested, want):
    assert release_tested(installed, tested) is want


def test_raise_version_problem():
    raise_version_problem(None)
    with pytest.raises(RuntimeError, match="^the installed x is 1.0$"):
        raise_version_problem("the installed x is 1.0")
