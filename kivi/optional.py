"""Whether optional compiled pieces can run: numba (the fused CPU paths) and triton (GPU kernels).

The one place that answers these questions; neither call imports triton, and numba is imported
once (then remembered). numba is a core dependency of kivi, but a platform without its wheels can
still install kivi without it: the ``"cpu"`` backend then runs the blocked torch path, and
resolving ``"auto"`` says so loudly (:func:`kivi.backends.resolve_attention_backend`), naming what
:func:`numba_problem` found: numba absent, numba failing to import (its error), or its JIT turned off.
"""

from __future__ import annotations

import importlib.util
import sys

_UNKNOWN = object()
_NUMBA_PROBLEM: object = _UNKNOWN


def numba_problem() -> str | None:
    """``None`` when kivi's numba kernels can run; otherwise why not, in a few words (imports numba once).

    * ``"numba is not installed"``: importing ``numba`` finds no such module;
    * ``"numba cannot be imported (ValueError: ...)"``: numba is there but its import fails, e.g. with
      ``NUMBA_NUM_THREADS=0`` (the error as numba raised it, so the fix is the real one, not an install);
    * ``"numba's JIT is disabled (NUMBA_DISABLE_JIT=1)"``: numba then returns plain Python functions, which
      cannot run the kernels (they call LLVM intrinsics).
    """
    global _NUMBA_PROBLEM
    if _NUMBA_PROBLEM is _UNKNOWN:
        try:
            import numba
        except ModuleNotFoundError as e:
            _NUMBA_PROBLEM = ("numba is not installed" if e.name == "numba"
                              else f"numba cannot be imported ({type(e).__name__}: {e})")
        except Exception as e:  # an installed numba whose import fails: report its error
            _NUMBA_PROBLEM = f"numba cannot be imported ({type(e).__name__}: {e})"
        else:
            _NUMBA_PROBLEM = ("numba's JIT is disabled (NUMBA_DISABLE_JIT=1)" if numba.config.DISABLE_JIT else None)
    return _NUMBA_PROBLEM  # type: ignore[return-value]


def numba_available() -> bool:
    """True when kivi's numba kernels can run: numba imports and its JIT is on (:func:`numba_problem`)."""
    return numba_problem() is None


def triton_available() -> bool:
    """True when ``triton`` can be imported (it is not imported by this call)."""
    if sys.modules.get("triton") is not None:
        return True
    try:
        return importlib.util.find_spec("triton") is not None
    except (ImportError, ValueError):
        return False


__all__ = ["numba_available", "numba_problem", "triton_available"]
