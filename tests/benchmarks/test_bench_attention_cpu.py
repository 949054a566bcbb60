"""benchmarks/bench_attention_cpu.py: several widths in one run, each timed method checked against the reference."""

from __future__ import annotations

import importlib.util
import json
import sys
from pathlib import Path

import pytest

pytest.importorskip("numba")

_PATH = Path(__file__).resolve().parents[2] / "benchmarks" / "bench_attention_cpu.py"
spec = importlib.util.spec_from_file_location("bench_attention_cpu", _PATH)
bac = importlib.util.module_from_spec(spec)
spec.loader.exec_module(bac)


@pytest.mark.long  # the benchmark end to end (~17-70 s on a cold kernel cache)
def test_widths_in_one_run_with_errors_and_ratios(monkeypatch, capsys):
    # the machine's copy and matmul rates at small sizes (the defaults copy 256 MiB and multiply 2048^2)
    real_bw, real_mm = bac.copy_bandwidth, bac.matmul_gflops
    monkeypatch.setattr(bac, "copy_bandwidth", lambda: real_bw(mib=4, repeat=2))
    monkeypatch.setattr(bac, "matmul_gflops", lambda: real_mm(n=128, repeat=2))
    monkeypatch.setattr(sys, "argv", ["bench_attention_cpu.py", "--tokens", "300", "--bits", "2", "3", "--repeat", "1",
                                      "--skip", "reference,bf16", "--json"])
    bac.main()
    res = json.loads(capsys.readouterr().out)  # JSON: integer keys come back as strings
    assert res["bits"] == [2, 3]
    timed = {(r["method"], r["bits"]) for r in res["rows"]}
    for bits in (2, 3):
        assert {("blocked (kivi cpu)", bits), ("fused (numba)", bits)} <= timed
        errs = res["max_abs_err_vs_reference"][str(bits)]
        assert errs["blocked"] < 1e-4 and errs["fused"] < 1e-4
        assert res["ratios_of_medians"][str(bits)]["blocked_over_fused"] > 0
    assert ("sdpa fp cache float32", None) in timed and ("sdpa fp cache bfloat16", None) not in timed
    assert ("reference (dequant+attend)", 2) not in timed
    assert res["quantized_bytes"]["3"] > res["quantized_bytes"]["2"]  # 3-bit codes: 24 bytes per 64 channels
