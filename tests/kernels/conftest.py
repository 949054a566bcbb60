"""Kernel tests run the Triton kernels on CPU tensors through the interpreter.

Triton reads ``TRITON_INTERPRET`` when it is first imported, so it is set here, at conftest import
time (before any test module of this folder imports triton). Tests marked ``triton`` are skipped
when triton is not installed, or when something imported it earlier without the interpreter.
"""

from __future__ import annotations

import os

import pytest

os.environ.setdefault("TRITON_INTERPRET", "1")


def _triton_skip_reason() -> str | None:
    from kivi.kernels import triton_available

    if not triton_available():
        return "triton is not installed (pip install 'kivi[triton]')"
    if os.environ.get("TRITON_INTERPRET") != "1":
        return "TRITON_INTERPRET is not 1; CPU kernel tests need the interpreter"
    import triton.language as tl
    from triton.runtime.interpreter import InterpretedFunction

    if not isinstance(tl.sum, InterpretedFunction):
        return "triton was imported before TRITON_INTERPRET=1 was set (run as: TRITON_INTERPRET=1 pytest ...)"
    return None


def pytest_collection_modifyitems(config, items):
    reason = None
    checked = False
    for item in items:
        if "triton" in item.keywords and str(item.fspath).startswith(os.path.dirname(__file__)):
            if not checked:
                reason = _triton_skip_reason()
                checked = True
            if reason:
                item.add_marker(pytest.mark.skip(reason=reason))
