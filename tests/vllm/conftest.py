"""tests/vllm: tests that run vLLM with the plugin need ``vllm`` (the .venv-vllm made by
scripts/setup-vllm.sh); they are marked ``vllm`` and skipped where it is not importable. The plugin's
framework-free modules are tested without it.

Under pytest-xdist (CI step 3 runs two workers) each worker's vLLM engines bind their threads to the worker's own
core (``VLLM_CPU_OMP_THREADS_BIND``, unless set): vLLM's default binds every engine to core 0, so two engines at once
would share one core; unbound, each takes every core and the two oversubscribe them."""

from __future__ import annotations

import importlib.util
import os

import pytest

HAVE_VLLM = importlib.util.find_spec("vllm") is not None


def worker_core(worker: str | None, cores: list[int]) -> str | None:
    """The core (of ``cores``) an xdist worker ("gw0", "gw1", ...) binds its engines to; None outside xdist."""
    if not worker or not worker.startswith("gw") or not cores:
        return None
    return str(cores[int(worker[2:]) % len(cores)])


_core = worker_core(os.environ.get("PYTEST_XDIST_WORKER"), sorted(os.sched_getaffinity(0)))
if _core is not None:
    os.environ.setdefault("VLLM_CPU_OMP_THREADS_BIND", _core)


def pytest_collection_modifyitems(config, items):
    skip = pytest.mark.skip(reason="vllm is not installed (bash scripts/setup-vllm.sh, then run with .venv-vllm)")
    for item in items:
        if item.get_closest_marker("vllm") is not None and not HAVE_VLLM:
            item.add_marker(skip)
