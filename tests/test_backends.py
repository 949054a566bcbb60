"""Backend resolution (kivi/backends.py): decided once, explicit, and loud when the fast path is missing."""

from __future__ import annotations

import warnings

import pytest

import kivi.backends as backends
from kivi.backends import resolve_attention_backend


def test_auto_without_numba_warns_with_the_fix(monkeypatch):
    monkeypatch.setattr(backends, "numba_available", lambda: False)
    with pytest.warns(RuntimeWarning, match=r"pip install 'numba"):
        assert resolve_attention_backend("auto", "cpu") == "cpu"
    with pytest.warns(RuntimeWarning, match="numba is not installed"):
        assert resolve_attention_backend("cpu", None) == "cpu"


def test_no_warning_with_numba_or_for_reference(monkeypatch):
    monkeypatch.setattr(backends, "numba_available", lambda: True)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert resolve_attention_backend("auto", "cpu") == "cpu"
    monkeypatch.setattr(backends, "numba_available", lambda: False)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert resolve_attention_backend("reference", "cpu") == "reference"


def test_unknown_backend_names_the_choices():
    with pytest.raises(ValueError, match=r"attention_backend='fast'.*'auto', 'reference', 'cpu', 'triton'"):
        resolve_attention_backend("fast")
