"""The one rule of kivi's version pins: whether an installed release of a host framework is a tested one, and the
one error. kivi's integrations that hook into a framework's private code (transformers' continuous batching,
:mod:`kivi.batching.version`; vLLM, :mod:`kivi.vllm.version`) name their tested releases and their message."""

from __future__ import annotations

from collections.abc import Iterable

from packaging.version import InvalidVersion, Version


def release_tested(installed: str, tested: Iterable[str]) -> bool:
    """Whether ``installed`` is one of ``tested``: each a release (``"0.32.0"``: that release, with any local
    label such as ``+cpu``) or a series (``"5.25"``: any 5.25.x). An unparsable version is never tested."""
    try:
        v = Version(installed)
    except InvalidVersion:
        return False
    for t in tested:
        want = Version(t)
        n = len(want.release)
        if (v.public == want.public) if n >= 3 else (v.release[:n] == want.release):
            return True
    return False


def raise_version_problem(problem: str | None) -> None:
    """Raise ``RuntimeError(problem)`` (one line naming the installed version) unless ``problem`` is ``None``."""
    if problem is not None:
        raise RuntimeError(problem)


__all__ = ["raise_version_problem", "release_tested"]
