"""benchmarks/bench_vllm.py without vLLM: which rows this CPU cannot run (vLLM's own rule for its fp8 CPU cache)
and how the table shows them. The engine runs themselves are tests/vllm/test_bench_vllm.py."""

from __future__ import annotations

import pytest
import torch

import bench_vllm as bv


@pytest.mark.parametrize(("avx512", "amx"), [(False, False), (True, False), (False, True), (True, True)])
def test_fp8_row_is_not_run_exactly_without_avx512_or_amx(monkeypatch, avx512, amx):
    monkeypatch.setattr(torch.cpu, "_is_avx512_supported", lambda: avx512)
    monkeypatch.setattr(torch.cpu, "_is_amx_tile_supported", lambda: amx)
    why = bv.unavailable("fp8")
    assert (why is None) == (avx512 or amx)
    if why is not None:
        assert "AVX-512 or AMX" in why
    for name in bv.ROWS:  # no other row depends on the CPU's instruction set
        if name != "fp8":
            assert bv.unavailable(name) is None, name


def test_table_shows_a_row_not_run_and_keeps_the_others():
    row = {"kv_cache_tokens": 1280, "requests_held_at_once": 1, "preemptions": 0, "generated_tokens_per_s": 2.0,
           "ttft_p50_s": 1.5, "wall_s": 12.0}
    report = {"rows": [{"row": "bf16", **row}, {"row": "fp8", "not_run": "no fp8 here"},
                       {"row": "kivi-2/2", **row, "kv_cache_tokens": 3840}],
              "workload": {"requests": 3, "prompt_range": [640, 896], "new_tokens": 8}, "budget_bytes": 2**20,
              "max_model_len": 1024, "max_batch_tokens": 1024, "threads": 1, "command": "bench_vllm.py --smoke"}
    lines = bv.format_table(report).splitlines()
    assert "| fp8 | not run: no fp8 here |||||||" in lines
    assert any(line.startswith("| kivi-2/2 | 3,840 | 3.00x |") for line in lines)


def test_kivi_root_before_must_be_a_checkout(tmp_path, capsys):
    with pytest.raises(SystemExit):
        bv._args(["--kivi-root-before", str(tmp_path)])
    assert "is not a checkout (no kivi/__init__.py in it)" in capsys.readouterr().err
    (tmp_path / "kivi").mkdir()
    (tmp_path / "kivi" / "__init__.py").write_text("")
    assert bv._args(["--kivi-root-before", str(tmp_path)]).kivi_root_before == str(tmp_path)


def test_table_names_the_row_before_and_compares_the_row_after():
    row = {"row": "kivi-2/2", "kv_cache_tokens": 3840, "requests_held_at_once": 3, "preemptions": 0,
           "generated_tokens_per_s": 2.0, "ttft_p50_s": 1.5, "wall_s": 12.0}
    report = {"rows": [{**row, "kivi_root": "/work/wt/old"},
                       {**row, "generated_tokens_per_s": 3.0, "same_tokens_as_before": 2, "speed_vs_before": 1.5}],
              "workload": {"requests": 3, "prompt_range": [640, 896], "new_tokens": 8}, "budget_bytes": 2**20,
              "max_model_len": 1024, "max_batch_tokens": 1024, "threads": 1, "command": "bench_vllm.py --smoke"}
    lines = bv.format_table(report).splitlines()
    assert any(line.startswith("| kivi-2/2 (kivi from old) | 3,840 |") for line in lines)
    assert any(line.startswith("| kivi-2/2 (now: 1.50x before, same tokens 2/3) | 3,840 |") for line in lines)
