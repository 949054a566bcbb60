"""benchmarks/bench_vllm.py --smoke: every row (bf16, fp8, KIVI 2/2, balanced) runs in its own process over one
budget and the JSON holds what each row measured; the checks are the ones the benchmark exists to show (KIVI
pages hold more tokens and more requests than bf16 on the same bytes)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = [pytest.mark.vllm, pytest.mark.slow]  # engine runs of minutes each: KIVI_SLOW=1

SCRIPT = Path(__file__).resolve().parents[2] / "benchmarks" / "bench_vllm.py"
ROWS = ["bf16", "fp8", "kivi-2/2", "balanced"]


@pytest.fixture(scope="module")
def smoke(tmp_path_factory):
    out = tmp_path_factory.mktemp("bench_vllm") / "smoke.json"
    proc = subprocess.run([sys.executable, str(SCRIPT), "--smoke", "--out", str(out)], capture_output=True, text=True,
                          timeout=1800)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-4000:]
    return json.loads(out.read_text()), out, proc.stdout


def test_every_row_ran_and_reports_its_fields(smoke):
    report, out, stdout = smoke
    rows = {r["row"]: r for r in report["rows"]}
    assert list(rows) == ROWS
    work = report["workload"]
    assert len(work["prompt_tokens"]) == work["requests"]
    import torch

    fp8_runs = torch.cpu._is_avx512_supported() or torch.cpu._is_amx_tile_supported()
    assert ("not_run" in rows["fp8"]) == (not fp8_runs), rows["fp8"]  # vLLM's rule for its CPU fp8 cache
    for name, r in rows.items():
        assert "error" not in r, (name, r.get("error"))
        if "not_run" in r:
            assert name == "fp8" and "AVX-512 or AMX" in r["not_run"] and "not run" in stdout, r
            continue
        assert r["generated_tokens"] == work["requests"] * work["new_tokens"], name
        assert 1 <= r["requests_held_at_once"] <= work["requests"], name
        assert r["kv_cache_tokens"] >= report["max_model_len"], name  # vLLM refuses less than one full request
        assert 0 < r["ttft_p50_s"] <= r["ttft_p95_s"] <= r["wall_s"], name
        assert r["generated_tokens_per_s"] == pytest.approx(r["generated_tokens"] / r["wall_s"]), name
    assert "bench_vllm.py" in report["command"] and "--smoke" in report["command"]
    assert out.with_suffix(".txt").read_text().strip() in stdout


def test_kivi_pages_hold_more_than_vllm_caches_on_the_same_budget(smoke):
    report, _, _ = smoke
    rows = {r["row"]: r for r in report["rows"]}
    bf16, fp8, kivi = rows["bf16"], rows["fp8"], rows["kivi-2/2"]
    if "not_run" not in fp8:  # a CPU without AVX-512 / AMX: vLLM has no fp8 cache there
        assert bf16["kv_cache_tokens"] < fp8["kv_cache_tokens"] < kivi["kv_cache_tokens"]
    assert rows["bf16"]["kv_cache_tokens"] < rows["balanced"]["kv_cache_tokens"] < kivi["kv_cache_tokens"]
    # the smoke budget holds one bf16 request: bf16 serves them one by one, KIVI 2/2 holds more at once
    assert bf16["requests_held_at_once"] == 1
    assert kivi["requests_held_at_once"] > bf16["requests_held_at_once"]
