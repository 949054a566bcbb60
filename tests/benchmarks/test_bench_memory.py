"""benchmarks/bench_memory.py: its subcommands; ``soak`` on a tiny size runs its children, writes its JSON and table,
and the summary is right."""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("numba")

ROOT = Path(__file__).resolve().parents[2]
_PATH = ROOT / "benchmarks" / "bench_memory.py"
spec = importlib.util.spec_from_file_location("bench_memory", _PATH)
soak = importlib.util.module_from_spec(spec)
spec.loader.exec_module(soak)


def test_summary_band_and_slope():
    rows = [{"tokens": t, "rss": 1000 + 3 * t + (5 if t == 300 else 0), "nbytes": 2 * t, "seconds": t / 10}
            for t in (100, 200, 300, 400)]
    s = soak.summarize(rows, warmup=100)  # RSS - nbytes = 1000 + t (+5 at 300): slope 1 byte per token
    assert s["samples"] == 3 and s["rss_minus_nbytes_min"] == 1200 and s["rss_minus_nbytes_max"] == 1400
    assert s["band"] == 200 and 900 < s["slope_bytes_per_1k_tokens"] < 1100 and s["tok_per_s"] == 10.0


@pytest.mark.slow  # ~35 s: a real (tiny) soak end to end in subprocesses
def test_tiny_soak_writes_results(tmp_path):
    out, tout, table = tmp_path / "m.json", tmp_path / "t.json", tmp_path / "t.txt"
    cmd = [sys.executable, str(_PATH), "soak", "--tokens", "40", "--every", "20", "--warmup", "0", "--prompt", "1600",
           "--hidden", "128", "--layers", "1", "--kv-heads", "2", "--sliding-window", "16", "--thread-tokens", "4",
           "--models", "sliding", "--numba-layers", "workqueue", "--threads", "2",
           "--out", str(out), "--threads-out", str(tout), "--table", str(table)]
    p = subprocess.run(cmd, capture_output=True, text=True, cwd=ROOT, timeout=600,
                       env={**os.environ, "PYTHONPATH": str(ROOT)})
    assert p.returncode == 0, p.stderr[-2000:]
    mem = json.loads(out.read_text())
    (run,) = mem["runs"]
    assert [r["tokens"] for r in run["rows"]] == [20, 40] and run["rows"][-1]["seq_len"] == 1640
    assert run["summary"]["samples"] == 2 and all(r["nbytes"] > 0 and r["rss"] > r["nbytes"] for r in run["rows"])
    assert run["summary_anon"]["samples"] == 2 and all(0 < r["rss_anon"] <= r["rss"] for r in run["rows"])
    (row,) = json.loads(tout.read_text())["rows"]
    # prompts of 1,600+ tokens x 2 kv heads: the decode kernel takes numba's pool (SERIAL_BELOW)
    assert row["exit"] == 0 and row["layer"] == "workqueue" and row["threads"] == 2
    assert row["tokens_equal_sequential"] is True and row["tok_per_s"] > 0
    assert "workqueue" in table.read_text()


def test_bad_sizes_are_refused_with_the_flag():
    p = subprocess.run([sys.executable, str(_PATH), "soak", "--every", "0"], capture_output=True, text=True, cwd=ROOT,
                       env={**os.environ, "PYTHONPATH": str(ROOT)})
    assert p.returncode == 2 and "--every=0" in p.stderr


@pytest.mark.parametrize("argv", [[], ["leak"]], ids=["none", "unknown"])
def test_a_subcommand_is_required(argv):
    p = subprocess.run([sys.executable, str(_PATH), *argv], capture_output=True, text=True, cwd=ROOT,
                       env={**os.environ, "PYTHONPATH": str(ROOT)})
    assert p.returncode == 2 and "peak, reachable, weights, soak" in p.stderr


@pytest.mark.parametrize("command", ["peak", "reachable", "weights", "soak"])
def test_every_subcommand_parses_its_own_options(command):
    p = subprocess.run([sys.executable, str(_PATH), command, "--help"], capture_output=True, text=True, cwd=ROOT,
                       env={**os.environ, "PYTHONPATH": str(ROOT)})
    assert p.returncode == 0 and f"bench_memory.py {command}" in p.stdout
