"""benchmarks/common.py: what the benchmark scripts share (fresh-process rows, timing, JSON output, /proc fields)."""

from __future__ import annotations

import json
import sys

import pytest

import common


def test_run_fresh_returns_the_last_json_line_and_imports_this_checkout(tmp_path):
    script = tmp_path / "child.py"
    script.write_text("import json, kivi\nprint('progress')\nprint(json.dumps({'a': 1}))\n"
                      "print(json.dumps({'kivi': kivi.__file__}))\n")
    r = common.run_fresh([script])
    assert r.returncode == 0 and r.result["kivi"].startswith(str(common.ROOT / "kivi"))


def test_run_fresh_reports_a_failed_child(tmp_path):
    script = tmp_path / "child.py"
    script.write_text("import sys\nprint('{not json')\nsys.stderr.write('boom')\nsys.exit(3)\n")
    r = common.run_fresh([script], env={"X": "1"})
    assert r.returncode == 3 and r.result is None and r.stderr.endswith("boom")


def test_time_calls_warms_up_then_times_each_call():
    calls = []
    times = common.time_calls(lambda: calls.append(1), repeat=4, warmup=3)
    assert len(calls) == 7 and len(times) == 4 and all(t >= 0 for t in times)


def test_write_json_creates_the_folder_and_ends_with_a_newline(tmp_path):
    p = common.write_json(tmp_path / "a" / "b.json", {"x": [1, 2]}, indent=1)
    text = p.read_text()
    assert text.endswith("}\n") and json.loads(text) == {"x": [1, 2]}


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="/proc/self/status is Linux")
def test_proc_status_fields():
    rss, peak = common.proc_status_bytes("VmRSS"), common.proc_status_bytes("VmHWM")
    assert 0 < rss <= peak and rss % 1024 == 0
    assert common.proc_status_bytes("NoSuchField") is None


def test_environment_names_versions():
    env = common.environment()
    assert env["python"].count(".") == 2 and env["torch"] and env["torch_threads"] >= 1
