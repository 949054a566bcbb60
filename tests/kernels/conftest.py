"""Kernel tests run the Triton kernels on CPU tensors through the interpreter.

Triton reads ``TRITON_INTERPRET`` when it is first imported, so it is set here, at conftest import
time (before any test module of this folder imports triton; the root conftest sets it too). Tests
marked ``triton`` are skipped when triton is not installed, or when something imported it earlier
without the interpreter.
"""

from __future__ import annotations

import os

import pytest

os.environ.setdefault("TRITON_INTERPRET", "1")

from tests.helpers import triton_skip_reason  # noqa: E402


def pytest_collection_modifyitems(config, items):
    reason = None
    checked = False
    for item in items:
        if "triton" in item.keywords and str(item.fspath).startswith(os.path.dirname(__file__)):
            if not checked:
                reason = triton_skip_reason()
                checked = True
            if reason:
                item.add_marker(pytest.mark.skip(reason=reason))
