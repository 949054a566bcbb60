"""Whether optional compiled pieces can run: numba (the fused CPU paths) and triton (GPU kernels).

The one place that answers these questions; neither call imports triton, and numba is imported
once (then remembered). numba is a core dependency of kivi, but a platform without its wheels can
still install kivi without it: the ``"cpu"`` backend then runs the blocked torch path, and
resolving ``"auto"`` says so loudly (:func:`kivi.backends.resolve_attention_backend`).
"""

from __future__ import annotations

import importlib.util
import sys

_NUMBA: bool | None = None


def numba_available() -> bool:
    """True when numba can be imported (imports it on the first call)."""
    global _NUMBA
    if _NUMBA is None:
        try:
            import numba  # noqa: F401

            _NUMBA = True
        except Exception:  # pragma: no cover - depends on the environment
            _NUMBA = False
    return _NUMBA


def triton_available() -> bool:
    """True when ``triton`` can be imported (it is not imported by this call)."""
    if sys.modules.get("triton") is not None:
        return True
    try:
        return importlib.util.find_spec("triton") is not None
    except (ImportError, ValueError):
        return False


__all__ = ["numba_available", "triton_available"]
