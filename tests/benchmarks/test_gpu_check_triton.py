"""scripts/gpu-check.sh --dry-run: the GPU check's every part (correctness in fp16/bf16, kernel timings, the
13B-shape table on a tiny stand-in) end to end on CPU under TRITON_INTERPRET=1, so the script cannot rot
between device runs. Named for `-k triton` (CI step 2, where triton is installed)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.helpers import triton_skip_reason

_SKIP = triton_skip_reason()
pytestmark = [pytest.mark.triton, pytest.mark.skipif(_SKIP is not None, reason=str(_SKIP))]

ROOT = Path(__file__).resolve().parents[2]


def test_gpu_check_triton_dry_run(tmp_path):
    env = dict(os.environ, OUT=str(tmp_path), PYTHON=sys.executable, TRITON_INTERPRET="1", OMP_NUM_THREADS="1")
    r = subprocess.run(["bash", str(ROOT / "scripts" / "gpu-check.sh"), "--dry-run"], capture_output=True,
                       text=True, env=env, timeout=900, cwd=tmp_path)
    assert r.returncode == 0, r.stdout[-4000:] + r.stderr[-4000:]
    data = json.loads((tmp_path / "gpu_check.json").read_text())
    assert data["device"].startswith("cpu") and data["dry_run"] and "ratio_32k" in data
    assert data["env"]["triton"] and data["env"]["torch"] and data["env"]["transformers"]
    # a. every kernel family in both dtypes, generate() and generate_batch greedy against the reference backend,
    # all passing
    a = data["correctness"]
    assert a["ok"] and not a["skipped"]
    kinds = {(r["kind"].split(" (")[0], r["dtype"]) for r in a["rows"]}
    for dtype in ("fp16", "bf16"):
        for kind in ("layout extreme", "layout balanced", "layout sliding", "paged decode"):
            assert (kind, dtype) in kinds, (kind, dtype)
        assert any(k.startswith("packed decode + quantize") and d == dtype for k, d in kinds)
    plugin = [r for r in a["rows"] if r["kind"].startswith("plugin step")]
    assert plugin and all(r["pages_equal"] and r["rings_equal"] and r["rings_wrapped"] for r in plugin)
    gen = {r["kind"] for r in a["rows"] if r["kind"].startswith("generate")}
    assert gen == {"generate llama extreme", "generate llama balanced", "generate llama per-head",
                   "generate mistral balanced"}
    batching = [r for r in a["rows"] if r["kind"] == "batching llama"]  # generate_batch, "triton" vs "reference"
    assert [r["dtype"] for r in batching] == ["bf16"] and batching[0]["ok"]
    # b. the kernel timings (benchmarks/bench_triton_gpu.py) ran and wrote their JSON beside
    b = data["kernels"]
    assert b["ok"] and b["results"][0]["kivi_ms"] > 0 and b["paged"][0]["ok"]
    assert (tmp_path / b["json"]).is_file()
    # c. the table: every cache at both contexts, batch 1 / 4 / the largest, tokens/s and KV bytes; the ratio
    c = data["table"]
    assert c["ok"] and not c["skipped"] and c["shape"]["num_hidden_layers"] == 2
    ran = {(r["cache"], r["context"], r["plan"]) for r in c["rows"] if "error" not in r}
    for cache in ("bf16", "extreme", "balanced", "quantized"):
        for T in (48, 96):
            assert {(cache, T, 1), (cache, T, 4), (cache, T, "max")} <= ran, (cache, T)
    for r in c["rows"]:
        assert r["kv_bytes"] > 0 and r["prefill_tokens_per_s"] > 0 and r["decode_tokens_per_s"] > 0
    kivi = [r for r in c["rows"] if r["cache"] == "extreme"]
    assert all(r["attention_backend"] == "triton" for r in kivi)
    bf16 = {(r["context"], r["batch"]): r["kv_bytes"] for r in c["rows"] if r["cache"] == "bf16"}
    assert all(r["kv_bytes"] < bf16[(r["context"], r["batch"])] for r in kivi)  # 2-bit codes beside the window
    assert data["ratio_32k"] == pytest.approx(data["ratio_32k_detail"]["ratio"]) and data["ratio_32k"] > 0
    assert "ratio_32k" in (tmp_path / "gpu_check.txt").read_text()
