"""The transformers versions kivi's paged cache is tested with, and the one check.

kivi's KIVI pages plug into transformers' continuous batching through private classes
(``PagedAttentionCache``, its allocators and ``ContinuousBatchingManager._create_batch_processor``),
which change between releases. Other versions are refused with one line naming the installed one.
"""

from __future__ import annotations

import transformers

from ..version_pin import raise_version_problem, release_tested

#: ``(major, minor)`` releases whose continuous-batching internals this package was tested against.
TESTED_TRANSFORMERS = ((5, 24), (5, 25))


def transformers_version_problem(version: str | None = None) -> str | None:
    """Why ``version`` (default: the installed transformers) cannot run kivi's paged cache, or ``None``."""
    text = transformers.__version__ if version is None else version
    if release_tested(text, (f"{a}.{b}" for a, b in TESTED_TRANSFORMERS)):
        return None
    tested = ", ".join(f"{a}.{b}.x" for a, b in TESTED_TRANSFORMERS)
    return (
        f"kivi continuous batching hooks into private transformers code tested with transformers {tested}; "
        f"the installed transformers is {text} (install transformers~={TESTED_TRANSFORMERS[-1][0]}."
        f"{TESTED_TRANSFORMERS[-1][1]}.0, or use kivi's single-request generate())"
    )


def check_transformers_version(version: str | None = None) -> None:
    """Raise ``RuntimeError`` (one line naming the installed version) on an untested transformers."""
    raise_version_problem(transformers_version_problem(version))


__all__ = ["TESTED_TRANSFORMERS", "transformers_version_problem", "check_transformers_version"]
