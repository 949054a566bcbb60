"""The GPU benchmark script imports and runs its --dry-run path (CPU, TRITON_INTERPRET=1)."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import pytest

from tests.helpers import triton_skip_reason

_SKIP = triton_skip_reason()
pytestmark = [pytest.mark.triton, pytest.mark.skipif(_SKIP is not None, reason=str(_SKIP))]

SCRIPT = Path(__file__).resolve().parents[2] / "benchmarks" / "bench_triton_gpu.py"


def test_bench_dry_run(tmp_path):
    spec = importlib.util.spec_from_file_location("bench_triton_gpu", SCRIPT)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    out = tmp_path / "bench.json"
    rc = mod.main(["--dry-run", "--out", str(out), "--models", "smollm2-tiny", "--contexts", "160",
                   "--batches", "1", "--warmup", "1", "--iters", "1", "--no-layouts"])
    assert rc == 0
    data = json.loads(out.read_text())
    assert data["dry_run"] and all(c["ok"] for c in data["checks"])
    (row,) = data["results"]
    assert row["kivi_ms"] > 0 and row["sdpa_ms"] > 0 and row["speedup"] > 0
    assert mod.split_counts(4096) == (3968, 3996)  # key tail 128 (whole groups), value tail 100
    assert data["layouts"] == []
    # the batched paged decode kernel (KIVI 2/2 pages of 128 tokens, 3 requests of 301), checked and timed
    (paged,) = data["paged"]
    assert paged["ok"] and paged["batch"] == 3 and paged["context"] == 301
    assert paged["paged_ms"] > 0 and paged["sdpa_ms"] > 0 and paged["paged_bytes"] > 0
    # the vLLM plugin's layer step with "triton" (plugin_check): checked against the CPU reference, timed
    (check,) = data["plugin"]["checks"]
    assert check["ok"] and check["max_abs_err"] < 2e-2 and check["steps"] == 7 and check["config"]["sink_tokens"] == 4
    (timing,) = data["plugin"]["timings"]
    assert timing["requests"] == 2 and timing["context"] == 100 and timing["kernel_calls"] == 2
    assert timing["step_ms"] >= timing["kernel_ms"] > 0


@pytest.mark.slow  # ~20 s: a dozen kernel calls in the interpreter
def test_bench_dry_run_cache_layouts(tmp_path):
    spec = importlib.util.spec_from_file_location("bench_triton_gpu", SCRIPT)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    out = tmp_path / "bench.json"
    rc = mod.main(["--dry-run", "--out", str(out), "--models", "smollm2-tiny", "--contexts", "160",
                   "--batches", "1", "--warmup", "1", "--iters", "1", "--layout-contexts", "150",
                   "--layout-batches", "1", "--no-paged", "--no-plugin"])
    assert rc == 0
    data = json.loads(out.read_text())
    # the cache layouts: one row per preset, a prefill block plus block_size blocks, checked against the reference
    assert [r["preset"] for r in data["layouts"]] == ["extreme", "balanced", "high"]
    for r in data["layouts"]:
        assert r["ok"] and r["blocks"] >= 3 and r["kivi_ms"] > 0 and r["blocked_ms"] > 0
    assert data["layouts"][0]["concat_ms"] > 0 and data["layouts"][1]["concat_ms"] is None  # no concat with sinks


def test_interpret_mode_checks_the_kernel_and_times_the_preparation(tmp_path):
    """``interpret`` (through ``main``'s mode dispatch): the correctness table on one preset, both GQA shapes and
    every dtype, within one unit in the last place; then the per-step preparation, kernel sides against the read."""
    spec = importlib.util.spec_from_file_location("bench_triton_gpu", SCRIPT)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    out = tmp_path / "interpret.json"
    rc = mod.main(["interpret", "--presets", "k3v2", "--context", "99", "--extra", "40", "--prep-context", "700",
                   "--prep-extra", "300", "--repeat", "2", "--out", str(out)])
    assert rc == 0
    data = json.loads(out.read_text())
    rows = data["correctness"]
    assert {(r["dtype"], r["hq"]) for r in rows} == {(d, h) for d in ("fp32", "fp16", "bf16") for h in (9, 8)}
    assert all(r["preset"] == "k3v2" and r["key_blocks"] >= 2 and r["rel"] < 2e-2 for r in rows)
    prep = data["preparation"]
    assert prep["context"] == 700 and prep["kernel_sides_us"] > 0 and prep["blockstore_read_us"] > 0
