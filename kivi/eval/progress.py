"""The progress bar of the evaluation functions and the CLI (stderr; tqdm, or nothing without it)."""

from __future__ import annotations

import sys
from typing import Any


class _NullBar:
    """What :func:`progress_bar` returns when disabled or without tqdm: every call does nothing."""

    def update(self, n: int = 1) -> None:
        pass

    def set_description(self, desc: str) -> None:
        pass

    def set_postfix_str(self, s: str) -> None:
        pass

    def close(self) -> None:
        pass


def progress_bar(total: int, desc: str, enabled: bool = True, unit: str = "it") -> Any:
    """A tqdm bar on stderr with ``total`` steps, or a no-op object (``enabled=False``, tqdm missing).

    ``unit`` names what a step counts (e.g. ``"tok"``). Either way the object has ``update(n=1)``,
    ``set_description(text)``, ``set_postfix_str(text)``
    and ``close()``; progress never goes to stdout (``--json`` output stays parseable).
    """
    if enabled:
        try:
            from tqdm.auto import tqdm  # noqa: PLC0415

            return tqdm(total=total, desc=desc, file=sys.stderr, leave=False, dynamic_ncols=True, unit=unit)
        except ImportError:
            pass
    return _NullBar()
