"""tests/vllm/conftest.py's core choice for xdist workers (no vLLM needed)."""

from __future__ import annotations

from tests.vllm.conftest import worker_core


def test_each_worker_takes_its_own_core_in_turn():
    assert [worker_core(f"gw{i}", [0, 1]) for i in range(4)] == ["0", "1", "0", "1"]
    assert worker_core("gw1", [2, 5]) == "5"


def test_outside_xdist_nothing_is_bound():
    assert worker_core(None, [0, 1]) is None
    assert worker_core("master", [0, 1]) is None
