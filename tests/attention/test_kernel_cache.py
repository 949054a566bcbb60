"""The numba decode kernel runs as numba's on-disk cache gives it back, so every process gives the same bits.

Under ``fastmath``, code numba has just compiled rounds differently (about 1 ulp of float32) from the code it
saves and loads back (kivi/attention/fused_cpu/kernel.py, ``load_entries``); :func:`.dispatch._kernel` therefore
fills a cold cache in a child process and always loads. These tests check the loading, the probe of the cache
and that a fresh process reproduces this one's outputs bit for bit.
"""

from __future__ import annotations

import os
import subprocess
import sys
import types
from pathlib import Path

import pytest
import torch

from kivi.optional import numba_available

pytestmark = pytest.mark.skipif(not numba_available(), reason="numba not installed")

ROOT = Path(__file__).resolve().parents[2]
SAVE = ("import sys, torch; from tests.attention.test_kernel_cache import kernel_outputs; "
        "torch.save(kernel_outputs(), sys.argv[1])")


def kernel_outputs() -> dict[str, torch.Tensor]:
    """Every entry point, serial and threaded, on fixed inputs: the paged cases (gathered rows and rows in place)
    of test_paged_decode and a single-sequence layer (2-bit and 3-bit, GQA 3)."""
    from kivi import KiviConfig
    from kivi.attention.fused_cpu import fused_decode_attention
    from kivi.attention.fused_cpu.paged import paged_decode_attention
    from tests.attention.test_fused_cpu import _fill
    from tests.attention.test_paged_decode import CASES, RING_CASES, _batch, _layout, _ring_form

    outs = {}
    for ci, dtype, extra in RING_CASES:
        H, gqa, D, P, G, kb, vb, pdt, sym = CASES[ci]
        lay = _layout(H, D, P, G, kb, vb, pdt, sym)
        lens, sinks, w0 = [1, 7, 77, 301, 45, 130, 1500, 2047], [0, 0, 2, 4, 4, 0, 4, 0], 4
        pool, table, counts, k_fp, v_fp = _batch(lay, lens, sinks, w0)
        ring = int(counts[:, [2, 5]].max()) - 1 + extra
        kr, vr, k_fp, v_fp = _ring_form(k_fp, v_fp, counts, w0, ring, dtype)
        q = torch.randn(len(lens), H * gqa, D, generator=torch.Generator().manual_seed(1))
        q = q.to(torch.float32 if pdt == torch.float32 else pdt)
        for threaded in (False, True):
            outs[f"paged{ci}-{dtype}-{threaded}"] = paged_decode_attention(
                q, pool, lay, table, counts, k_fp, v_fp, w0, scaling=0.3, threaded=threaded)
            outs[f"ring{ci}-{dtype}-{threaded}"] = paged_decode_attention(
                q, pool, lay, table, counts, kr, vr, w0, scaling=0.3, threaded=threaded)
    for bits in (2, 3):
        cfg = KiviConfig(group_size=8, residual_length=16, block_size=32, k_bits=bits, v_bits=bits)
        views = _fill(cfg, 2, 2, 32, [1297, 1, 1, 1], torch.float32)
        q = torch.randn(2, 6, 1, 32, generator=torch.Generator().manual_seed(2))
        for threaded in (False, True):
            outs[f"layer{bits}-{threaded}"] = fused_decode_attention(q, *views, threaded=threaded)
    return outs


def _run(code: str, *args: str, cache_dir: str | None = None) -> subprocess.CompletedProcess:
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(p for p in (str(ROOT), os.environ.get("PYTHONPATH")) if p))
    if cache_dir is not None:
        env["NUMBA_CACHE_DIR"] = cache_dir
    return subprocess.run([sys.executable, "-c", code, *args], cwd=ROOT, env=env, capture_output=True, text=True,
                          check=True)


def _assert_same_bits(a: dict, b: dict) -> None:
    assert a.keys() == b.keys()
    differ = {k: (a[k].float() - b[k].float()).abs().max().item() for k in a if not torch.equal(a[k], b[k])}
    assert not differ, f"outputs differ between the two processes (max abs difference): {differ}"


def test_the_entries_run_as_loaded_from_numba_cache():
    """This process's entry points came from numba's cache (a hit each, no compile here), which now holds all."""
    from numba.core.caching import NullCache

    from kivi.attention.fused_cpu import dispatch

    kernel = dispatch._kernel()
    if isinstance(kernel.ENTRIES[0][0]._cache, NullCache):
        pytest.skip("numba cannot cache here (no writable cache directory)")
    for entry, sig in kernel.ENTRIES:
        stats = entry.stats
        assert stats.cache_hits[sig] == 1 and not stats.cache_misses, (entry.__name__, stats)
    assert kernel.cache_missing() == []


def test_cache_missing_names_every_entry_of_an_empty_cache(tmp_path):
    """The probe reads numba's index only: in an empty cache directory it names all six entries, compiling none."""
    from kivi.attention.fused_cpu import dispatch

    # the kernel module imported as the filling child imports it (no torch: seconds less)
    code = dispatch.fill_code([]).replace("kernel.fill_entries([])", "print(kernel.cache_missing()); "
                                          "print([sum(e.stats.cache_misses.values()) for e, _ in kernel.ENTRIES])")
    out = _run(code, cache_dir=str(tmp_path)).stdout.splitlines()
    assert out == ["['decode_threaded', 'decode_serial', 'paged_decode_threaded', 'paged_decode_serial', "
                   "'paged_ring_decode_threaded', 'paged_ring_decode_serial']", "[0, 0, 0, 0, 0, 0]"]
    assert [p for p in tmp_path.rglob("*") if p.is_file()] == []  # nothing compiled, nothing written


def test_a_fresh_process_gives_this_process_bits(tmp_path):
    here = kernel_outputs()
    _run(SAVE, str(tmp_path / "there.pt"))
    _assert_same_bits(here, torch.load(tmp_path / "there.pt"))


def test_a_failed_fill_warns_and_names_the_failure(monkeypatch):
    """A child that cannot compile leaves a warning with its exit code (the caller then compiles in-process)."""
    from kivi.attention.fused_cpu import dispatch, kernel

    fake = types.SimpleNamespace(__file__=kernel.__file__, cache_missing=lambda names=None: ["decode_serial"])
    monkeypatch.setattr(sys, "executable", "/bin/false")
    with pytest.warns(RuntimeWarning, match=r"did not fill numba's cache \(exit code 1"):
        dispatch._fill_cache(fake, ["decode_serial"])
    monkeypatch.setattr(sys, "executable", "")
    with pytest.warns(RuntimeWarning, match="sys.executable is empty"):
        dispatch._fill_cache(fake, ["decode_serial"])


def test_a_numba_without_the_cache_internals_warns_and_loads_here(monkeypatch):
    """If a numba release renames what cache_missing reads, the first use warns and goes on (no crash)."""
    from kivi.attention.fused_cpu import dispatch, kernel

    dispatch._kernel()

    def renamed(names=None):
        raise AttributeError("'FunctionCache' object has no attribute '_cache_file'")

    monkeypatch.setattr(kernel, "cache_missing", renamed)
    monkeypatch.setattr(dispatch, "_ready", set())
    with pytest.warns(RuntimeWarning, match="cannot read numba .*'s cache index"):
        assert dispatch._kernel() is kernel
    assert all(entry.signatures for entry, _ in kernel.ENTRIES)


def serial_output() -> torch.Tensor:
    """The serial single-sequence entry on a fixed 2-bit layer (GQA 3)."""
    from kivi import KiviConfig
    from kivi.attention.fused_cpu import fused_decode_attention
    from tests.attention.test_fused_cpu import _fill

    views = _fill(KiviConfig(group_size=8, residual_length=16, block_size=32), 2, 2, 32, [1297, 1, 1, 1],
                  torch.float32)
    q = torch.randn(2, 6, 1, 32, generator=torch.Generator().manual_seed(2))
    return fused_decode_attention(q, *views, threaded=False)


DECODE = ("import sys, warnings, torch; warnings.simplefilter('always'); "
          "from tests.attention.test_kernel_cache import serial_output; torch.save(serial_output(), sys.argv[1])")


def test_a_single_sequence_decode_loads_only_its_entry():
    """A decode step loads the entry it runs (here the serial one), not the paged ones: first use compiles only what
    the call needs."""
    from kivi.attention.fused_cpu import dispatch

    dispatch._kernel()  # this checkout's cache holds every entry: the process below only loads
    code = ("from tests.attention.test_kernel_cache import serial_output; serial_output(); "
            "from kivi.attention.fused_cpu import kernel; "
            "print([e.__name__ for e, _ in kernel.ENTRIES if e.signatures])")
    assert _run(code).stdout.split("\n")[-2] == "['decode_serial']"


def test_the_fill_child_imports_neither_torch_nor_transformers(tmp_path):
    """The child that fills numba's cache imports numba and the kernel module only (kivi's package inits import
    torch and transformers: seconds of CPU on a small machine), and the kernel module it imports is this one."""
    from kivi.attention.fused_cpu import dispatch, kernel

    code = dispatch.fill_code([]).replace("kernel.fill_entries([])", "print(kernel.__file__); print(sorted(m for m in "
                                          "sys.modules if m.split('.')[0] in ('torch', 'transformers')))")
    assert code != dispatch.fill_code([])
    out = _run(code, cache_dir=str(tmp_path)).stdout.splitlines()
    assert out == [kernel.__file__, "[]"]


@pytest.mark.long  # ~50-100 s: two cold compiles
def test_an_entry_filled_alone_gives_the_bits_of_one_filled_with_its_twin(tmp_path):
    """kivi demo fills only the entry its decode steps run; the other is filled by the next process that needs it.
    Either way an entry's saved code is compiled from the source in the filling child: the serial entry filled
    alone gives the bits of the serial entry filled together with the threaded one."""
    code = ("import sys, torch; from kivi.attention.fused_cpu import warmup; warmup(tuple(sys.argv[2].split(','))); "
            "from tests.attention.test_kernel_cache import serial_output; torch.save(serial_output(), sys.argv[1])")
    _run(code, str(tmp_path / "alone.pt"), "decode_serial", cache_dir=str(tmp_path / "alone"))
    _run(code, str(tmp_path / "both.pt"), "decode_threaded,decode_serial", cache_dir=str(tmp_path / "both"))
    assert torch.equal(torch.load(tmp_path / "alone.pt"), torch.load(tmp_path / "both.pt"))


@pytest.mark.long  # ~60-130 s: two cold compiles (tests/test_numba_cache.py covers the detection in seconds)
def test_an_unreadable_cache_file_is_set_aside_once_and_compiled_again(tmp_path):
    """A truncated data file of the entry a decode needs and a garbled index of another entry (a full disk, a bad
    copy): the next process warns once naming both, sets them aside, compiles the entry again (in its child) and
    decodes this process's bits; the process after it finds a clean cache and loads without a word."""
    from kivi.attention.fused_cpu import dispatch

    kernel = dispatch._kernel("decode_serial")
    here = serial_output()
    cache = tmp_path / "numba"
    paths = _run("from kivi.attention.fused_cpu import kernel as k; "
                 "print(*(e._cache._cache_file._index_path for e in (k.decode_serial, k.paged_decode_serial)))",
                 cache_dir=str(cache)).stdout.split()
    where = Path(paths[0]).parent
    where.mkdir(parents=True, exist_ok=True)
    for f in Path(kernel.decode_serial._cache._cache_path).glob("kernel.*.nb[ic]"):  # this checkout's cache
        (where / f.name).write_bytes(f.read_bytes())
    (data,) = where.glob(Path(paths[0]).name[: -len(".nbi")] + ".*.nbc")  # the entry's code, cut in half
    data.write_bytes(data.read_bytes()[: data.stat().st_size // 2])
    index = Path(paths[1])  # another entry's index, garbled
    index.write_bytes(b"\x80\x04garbled" * 8)

    first = _run(DECODE, str(tmp_path / "first.pt"), cache_dir=str(cache))
    assert first.stderr.count("unreadable file(s)") == 1, first.stderr
    assert data.name in first.stderr and index.name in first.stderr, first.stderr
    assert Path(f"{data}.unreadable").exists() and Path(f"{index}.unreadable").exists()
    assert torch.equal(torch.load(tmp_path / "first.pt"), here)

    second = _run(DECODE, str(tmp_path / "second.pt"), cache_dir=str(cache))
    assert "unreadable" not in second.stderr and "RuntimeWarning" not in second.stderr, second.stderr
    assert torch.equal(torch.load(tmp_path / "second.pt"), here)


@pytest.mark.slow
def test_a_cold_cache_gives_the_bits_of_a_warm_one(tmp_path):
    """A process that finds numba's cache empty (it compiles, in its child) and one that loads what that left:
    the same bits, and this process's (whose cache is its own). Compiles the kernel: 1.5 min on 2 cores."""
    cache = str(tmp_path / "numba")
    _run(SAVE, str(tmp_path / "cold.pt"), cache_dir=cache)
    _run(SAVE, str(tmp_path / "warm.pt"), cache_dir=cache)
    cold, warm = torch.load(tmp_path / "cold.pt"), torch.load(tmp_path / "warm.pt")
    _assert_same_bits(cold, warm)
    _assert_same_bits(kernel_outputs(), cold)
