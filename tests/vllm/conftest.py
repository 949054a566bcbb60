"""tests/vllm: tests that run vLLM with the plugin need ``vllm`` (the .venv-vllm made by
scripts/setup-vllm.sh); they are marked ``vllm`` and skipped where it is not importable. The plugin's
framework-free modules are tested without it."""

from __future__ import annotations

import importlib.util

import pytest

HAVE_VLLM = importlib.util.find_spec("vllm") is not None


def pytest_collection_modifyitems(config, items):
    skip = pytest.mark.skip(reason="vllm is not installed (bash scripts/setup-vllm.sh, then run with .venv-vllm)")
    for item in items:
        if item.get_closest_marker("vllm") is not None and not HAVE_VLLM:
            item.add_marker(skip)
