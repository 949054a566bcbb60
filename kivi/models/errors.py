"""The error a failed model load raises, and the one-line form of an underlying exception."""

from __future__ import annotations


class ModelLoadError(ValueError):
    """A model could not be loaded; the message says what was tried and how to fix it."""


def short_reason(error: BaseException, limit: int = 300) -> str:
    """``"TypeName: first line"`` of ``error``, cut to ``limit`` characters (for one-line messages)."""
    lines = str(error).strip().splitlines()
    text = lines[0] if lines else ""
    text = text if len(text) <= limit else text[: limit - 3] + "..."
    return f"{type(error).__name__}: {text}" if text else type(error).__name__


__all__ = ["ModelLoadError", "short_reason"]
