"""fused_decode_attention (numba decode kernel) against reference_attention; cpu-backend dispatch."""

from __future__ import annotations

import subprocess
import sys

import pytest
import torch

pytest.importorskip("numba")

from kivi import KiviConfig  # noqa: E402
from kivi.attention import reference_attention  # noqa: E402
from kivi.attention.fused_cpu import (  # noqa: E402
    dispatch,
    fused_decode_attention,
    fused_decode_available,
    fused_decode_supported,
)
from kivi.cache.layer import KiviLayer  # noqa: E402
from kivi.cache.sliding import SlidingKiviLayer  # noqa: E402
from kivi.cache.view import QueryRegion  # noqa: E402


def _fill(cfg, B, hkv, D, lengths, dtype, valid=None, seed=0, const=False):
    """Prefill then appends of ``lengths`` tokens; return the views of the last append."""
    g = torch.Generator().manual_seed(seed)
    layer = KiviLayer(cfg)
    views, pos = None, 0
    for T in lengths:
        k = torch.randn(B, hkv, T, D, generator=g)
        v = torch.randn(B, hkv, T, D, generator=g)
        if const:  # every quantization group constant (scale 0)
            k = k[:, :, :1, :1].expand(B, hkv, T, D).clone()
            v = v[:, :, :1, :1].expand(B, hkv, T, D).clone()
        vv = None if valid is None else valid[:, pos : pos + T]
        views = layer.append(k.to(dtype), v.to(dtype), valid=vv)
        pos += T
    return views


def _check(q, views, mask=None, threaded=(True, False)):
    """Both entry points (thread pool and calling thread) against the reference."""
    assert fused_decode_supported(q, *views, mask)
    ref = reference_attention(q, *views, attention_mask=mask)
    tol = 2e-2 if q.dtype == torch.bfloat16 else 1e-4
    for th in threaded:
        out = fused_decode_attention(q, *views, attention_mask=mask, threaded=th)
        assert out.shape == ref.shape and out.dtype == q.dtype
        torch.testing.assert_close(out.float(), ref.float(), atol=tol, rtol=tol)


def _lengths(total):
    """Prefill then a few single-token decode appends (several blocks, fp tails of various lengths)."""
    if total <= 4:
        return [1] * total
    return [total - 3, 1, 1, 1]


def test_numba_is_imported_with_the_kernel_only():
    """``import kivi`` and the package leave numba (and compilation) to the first fused call."""
    from kivi.quant.numba_quant import numba_available

    assert fused_decode_available is numba_available  # one availability check, in the lower layer
    code = ("import sys, kivi, kivi.attention.fused_cpu; "
            "print(sorted(m for m in ('numba', 'kivi.attention.fused_cpu.kernel') if m in sys.modules))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]"


@pytest.mark.parametrize("total", [1, 13, 67, 300, 1300])
@pytest.mark.parametrize("ratio", [1, 3, 7, 8])  # passes of 1, 3, 4 + 3 and 4 + 4 heads
@pytest.mark.parametrize("bits", [2, 3, 4])
def test_decode_matches_reference(total, ratio, bits):
    cfg = KiviConfig(group_size=8, residual_length=16, block_size=32, k_bits=bits, v_bits=bits)
    B, hkv, D = 2, 2, 32
    views = _fill(cfg, B, hkv, D, _lengths(total), torch.float32)
    q = torch.randn(B, hkv * ratio, 1, D)
    _check(q, views)


@pytest.mark.parametrize(
    "D,kbits,vbits,G,ratio",
    [
        (30, 2, 2, 6, 3),  # G % 4 != 0: refused (values are read 4 channels at a time)
        (36, 2, 2, 12, 3),  # 9 code bytes per row: words assembled from bytes (unaligned rows)
        (36, 4, 4, 12, 5),  # GQA 5: a 4-head pass, then a single head
        (32, 1, 1, 8, 1),  # 1-bit: 32 channels per word, 8 quads
        (32, 8, 8, 4, 8),  # 8-bit: one quad per word, value groups of 4 channels
        (64, 2, 4, 32, 2),  # SmolLM2-like head, mixed bits
        (64, 3, 3, 32, 3),  # 3-bit, 8 runs of 3 bytes per row: read as 3 words per 4 runs
        (128, 3, 3, 64, 1),  # 3-bit, 16 runs per row (word path), MHA
        (36, 3, 3, 12, 3),  # 3-bit, 5 runs (15 bytes) per row: runs assembled from bytes
        (40, 3, 3, 4, 5),  # 3-bit, last run half padding, value groups of 4 channels, GQA 5
        (64, 3, 2, 32, 2),  # mixed 3-bit keys, 2-bit values
        (32, 4, 3, 8, 3),  # mixed 4-bit keys, 3-bit values
        (36, 1, 1, 12, 1),  # 1-bit, 36 channels: 5 code bytes per row (the last one half padding)
        (44, 1, 1, 4, 3),  # 1-bit, 44 channels: 6 code bytes per row
    ],
)
def test_shapes_and_bit_widths(D, kbits, vbits, G, ratio):
    cfg = KiviConfig(group_size=G, residual_length=2 * G, block_size=4 * G, k_bits=kbits, v_bits=vbits)
    views = _fill(cfg, 2, 2, D, [203, 1, 1], torch.float32, seed=D + kbits)
    q = torch.randn(2, 2 * ratio, 1, D)
    if G % 4:  # values cannot be read 4 channels at a time: documented route to the blocked path
        assert not fused_decode_supported(q, *views)
        return
    _check(q, views)


@pytest.mark.parametrize("kbits", [1, 2, 3, 4])
def test_keys_with_partial_channel_quad(kbits):
    """D % 4 != 0 (keys only: quantized values need G % 4 == 0 and G | D): the last quad is padding."""
    cfg = KiviConfig(group_size=6, residual_length=12, block_size=48, k_bits=kbits, quantize_value=False)
    views = _fill(cfg, 2, 3, 30, [150, 1, 1], torch.float32, seed=kbits)
    _check(torch.randn(2, 9, 1, 30), views)


@pytest.mark.parametrize("bits", [2, 3, 4])
def test_bf16(bits):
    cfg = KiviConfig(group_size=8, residual_length=16, block_size=32, k_bits=bits, v_bits=bits)
    views = _fill(cfg, 2, 3, 32, [190, 1, 1], torch.bfloat16)
    _check(torch.randn(2, 9, 1, 32).to(torch.bfloat16), views)


@pytest.mark.parametrize("mask_kind", ["bool", "additive"])
@pytest.mark.parametrize("bits", [2, 3])
def test_left_padding_mask(mask_kind, bits):
    cfg = KiviConfig(group_size=8, residual_length=16, block_size=32, k_bits=bits, v_bits=bits)
    B, hkv, D, T = 2, 3, 32, 150
    valid = torch.ones(B, T + 2, dtype=torch.bool)
    valid[1, :37] = False  # left padding of the second sequence
    views = _fill(cfg, B, hkv, D, [T, 1, 1], torch.float32, valid=valid)
    mask = valid[:, None, None, :]  # [B, 1, 1, kv_len], the decode row
    if mask_kind == "additive":
        mask = torch.zeros(mask.shape).masked_fill(~mask, torch.finfo(torch.float32).min)
    _check(torch.randn(B, hkv * 3, 1, D), views, mask)


@pytest.mark.parametrize("bits", [2, 3])
def test_constant_groups(bits):
    cfg = KiviConfig(group_size=8, residual_length=16, block_size=32, k_bits=bits, v_bits=bits)
    views = _fill(cfg, 1, 2, 32, [100, 1, 1], torch.float32, const=True)
    _check(torch.randn(1, 6, 1, 32), views)


@pytest.mark.parametrize(
    "cfg",
    [
        KiviConfig(group_size=8, residual_length=16, block_size=32, residual_bits=2),  # compensation
        KiviConfig(group_size=8, residual_length=16, block_size=32, symmetric=True),
        KiviConfig(group_size=8, residual_length=16, block_size=32, k_bits=8, v_bits=8),
        KiviConfig(group_size=8, residual_length=0, block_size=16, k_bits=4, v_bits=2),
        KiviConfig(group_size=8, residual_length=16, block_size=32, quantize_key=False),
        KiviConfig(group_size=8, residual_length=16, block_size=32, quantize_value=False),
        KiviConfig(group_size=8, residual_length=16, block_size=32, k_bits=3, v_bits=3, residual_bits=2),
        KiviConfig(group_size=8, residual_length=16, block_size=32, k_bits=3, v_bits=3, symmetric=True),
        KiviConfig(group_size=8, residual_length=0, block_size=16, k_bits=3, v_bits=3),
        KiviConfig(group_size=8, residual_length=16, block_size=32, k_bits=3, quantize_value=False),
    ],
    ids=["comp2", "symmetric", "8bit", "k4v2-R0", "fp-keys", "fp-values", "3bit-comp2", "3bit-symmetric",
         "3bit-R0", "3bit-fp-values"],
)
def test_formats(cfg):
    views = _fill(cfg, 2, 3, 32, [150, 3, 41, 1], torch.float32)
    _check(torch.randn(2, 9, 1, 32), views)


@pytest.mark.parametrize("delta", [-1, 0, 1], ids=["below", "at", "above"])
def test_serial_threshold_boundary(monkeypatch, delta):
    """Automatic choice at the threshold (B * Hkv * kv_len vs SERIAL_BELOW), 300 tokens (not a multiple of G)."""
    cfg = KiviConfig(group_size=8, residual_length=16, block_size=32)
    B, hkv = 2, 3
    views = _fill(cfg, B, hkv, 32, _lengths(300), torch.float32)
    units = B * hkv * 300
    monkeypatch.setattr(dispatch, "SERIAL_BELOW", units - delta)
    assert dispatch._use_threads(B, hkv, 300) == (delta >= 0)
    _check(torch.randn(B, hkv * 3, 1, 32), views, threaded=(None,))


def test_decode_entries_of_a_kv_range_are_those_its_calls_run():
    """What a run decoding one sequence over a kv range loads (kivi demo's warm-up): the entry of each end, and
    only the threaded one when the whole range is above SERIAL_BELOW."""
    hkv, cut = 3, -(-dispatch.SERIAL_BELOW // 3)  # the first kv length that takes the pool
    assert dispatch.decode_entries(1, hkv, (2001, 2256)) == ("decode_threaded",)
    assert dispatch.decode_entries(1, hkv, (cut - 10, cut - 1)) == ("decode_serial",)
    assert dispatch.decode_entries(1, hkv, (cut - 1, cut)) == ("decode_threaded", "decode_serial")
    assert dispatch.decode_entries(1, hkv, (2001, 2256), threaded=False) == ("decode_serial",)
    for n in range(cut - 3, cut + 3):  # every length of a range runs one of the range's entries
        assert dispatch.decode_entry(1, hkv, n) in dispatch.decode_entries(1, hkv, (cut - 3, cut + 3))


def _count_fused_calls(monkeypatch) -> list:
    """Record every fused_decode_attention call the "cpu" backend makes (run_backend imports it per call)."""
    import kivi.attention.fused_cpu as pkg

    calls, real = [], pkg.fused_decode_attention

    def spy(*args, **kw):
        calls.append(1)
        return real(*args, **kw)

    monkeypatch.setattr(pkg, "fused_decode_attention", spy)
    return calls


def test_unsupported_goes_to_blocked(monkeypatch):
    cfg = KiviConfig(group_size=6, residual_length=0, block_size=24, k_bits=3, v_bits=1)
    views = _fill(cfg, 1, 2, 30, [70, 1], torch.float32)
    q = torch.randn(1, 4, 1, 30)
    assert not fused_decode_supported(q, *views)  # value groups of 6 channels
    assert not fused_decode_supported(torch.randn(1, 4, 2, 30), *views)  # n > 1
    from kivi.attention.interface import run_backend

    calls = _count_fused_calls(monkeypatch)
    out = run_backend("cpu", q, *views, scaling=None, attention_mask=None)
    assert calls == []
    torch.testing.assert_close(out, reference_attention(q, *views), atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("kbits,vbits", [(3, 3), (3, 2), (2, 3)], ids=["K3V3", "K3V2", "K2V3"])
def test_3bit_decode_runs_the_fused_kernel(monkeypatch, kbits, vbits):
    """3-bit codes (runs of 8 codes in 3 bytes) are read by the kernel: the "cpu" backend dispatches there."""
    cfg = KiviConfig(group_size=32, residual_length=64, block_size=128, k_bits=kbits, v_bits=vbits, sink_tokens=4)
    views = _fill(cfg, 1, 3, 64, [301, 1], torch.float32)
    q = torch.randn(1, 9, 1, 64)
    from kivi.attention.interface import run_backend

    calls = _count_fused_calls(monkeypatch)
    out = run_backend("cpu", q, *views, scaling=None, attention_mask=None)
    assert calls == [1]
    torch.testing.assert_close(out, reference_attention(q, *views), atol=1e-4, rtol=1e-4)


def test_generation_matches_reference_backend():
    from kivi import quantize_model
    from tests.helpers import LOGIT_ATOL, assert_decode_close, tiny_model

    cfg = dict(group_size=8, residual_length=16, block_size=32)
    ids = torch.randint(1, 128, (1, 45), generator=torch.Generator().manual_seed(0))
    ref, fast = (quantize_model(tiny_model("llama"), KiviConfig(**cfg, attention_backend=b))
                 for b in ("reference", "cpu"))
    assert_decode_close(fast, ref, ids, new_tokens=24, atol=LOGIT_ATOL[torch.float32])


@pytest.mark.parametrize("sink", [1, 5])
@pytest.mark.parametrize("lengths", [[20, 1], [150, 1, 1]])
@pytest.mark.parametrize("bits", [2, 3])
def test_sink_tokens_match_reference(sink, lengths, bits):
    cfg = KiviConfig(group_size=8, residual_length=16, block_size=32, sink_tokens=sink, k_bits=bits, v_bits=bits)
    B, hkv, D = 2, 3, 32
    valid = torch.ones(B, sum(lengths), dtype=torch.bool)
    valid[1, :3] = False  # left padding: the padded row's sink slots are padding, masked out
    views = _fill(cfg, B, hkv, D, lengths, torch.float32, valid=valid)
    assert (views[0].sink is not None) == (sum(lengths) - 1 > 16)
    _check(torch.randn(B, hkv * 3, 1, D), views)
    _check(torch.randn(B, hkv * 3, 1, D), views, valid[:, None, None, :])


def _decode_and_check(layer, B, hkv, D, steps, g, ratio=3):
    """``steps`` single-token appends, each checked against the reference; returns the last views."""
    views = None
    for _ in range(steps):
        views = layer.append(torch.randn(B, hkv, 1, D, generator=g), torch.randn(B, hkv, 1, D, generator=g))
        _check(torch.randn(B, hkv * ratio, 1, D, generator=g), views)
    return views


def test_descriptor_memo_is_reused_and_invalidated():
    """The per-block descriptor columns are memoised per store; every layout change must drop them."""
    cfg = KiviConfig(group_size=8, residual_length=16, block_size=32)
    B, hkv, D = 3, 2, 32
    g = torch.Generator().manual_seed(3)
    layer = KiviLayer(cfg)
    layer.append(torch.randn(B, hkv, 100, D, generator=g), torch.randn(B, hkv, 100, D, generator=g))
    _decode_and_check(layer, B, hkv, D, 2, g)
    memo = layer.v.store.derived["fused_cpu"]
    entry = memo[0]
    _decode_and_check(layer, B, hkv, D, 2, g)  # values append inside the last block
    assert layer.v.store.derived["fused_cpu"][0] is entry
    _decode_and_check(layer, B, hkv, D, 40, g)  # new blocks on both sides
    layer.reorder_cache(torch.tensor([2, 0, 1]))  # every block tensor replaced
    assert layer.v.store.derived == {} and layer.k.store.derived == {}
    _decode_and_check(layer, B, hkv, D, 3, g)
    layer.crop(-30)  # blocks truncated, then rewritten by the next appends
    _decode_and_check(layer, B, hkv, D, 40, g)


def test_sliding_eviction_with_memo():
    cfg = KiviConfig(group_size=8, residual_length=16, block_size=32)
    B, hkv, D = 1, 2, 32
    g = torch.Generator().manual_seed(4)
    layer = SlidingKiviLayer(cfg, sliding_window=40)
    layer.append(torch.randn(B, hkv, 90, D, generator=g), torch.randn(B, hkv, 90, D, generator=g))
    views = _decode_and_check(layer, B, hkv, D, 120, g)
    assert layer.k.store.start > 0 and layer.k.store.blocks[0] is None  # blocks were evicted
    assert views[0].start == layer.kv_offset


@pytest.mark.parametrize("tasks_bh,threads", [(1, 2), (3, 2), (4, 2), (3, 4), (12, 2), (5, 3), (2, 8)])
def test_task_count_divides_evenly(tasks_bh, threads):
    from kivi.attention.fused_cpu.kernel import SUB

    for ntok in (300, 8192, 8193, 32768):
        chunk = dispatch._chunk_tokens(ntok, tasks_bh, threads)
        nch = -(-ntok // chunk)
        assert chunk % 64 == 0 and chunk >= SUB
        if ntok >= 8192:  # long enough that the chunk floor does not decide
            assert (tasks_bh * nch) % threads == 0 and tasks_bh * nch >= 2 * threads, (ntok, chunk, nch)



# --------------------------------------------------------------------------- Python threads × numba layers

_THREADS_SCRIPT = r"""
import sys, threading, torch
from kivi import KiviConfig, quantize_model
from kivi.attention.fused_cpu import dispatch
from tests.helpers import tiny_model
import numba

dispatch.SERIAL_BELOW = 0  # every decode call takes the threaded entry (numba's pool)
torch.set_num_threads(1)
model = quantize_model(tiny_model("llama"), KiviConfig(group_size=8, residual_length=16, block_size=32,
                                                         attention_backend="cpu"))
prompts = [torch.randint(1, 128, (1, 40 + 7 * i), generator=torch.Generator().manual_seed(i)) for i in range(3)]

def gen(i, out):  # generate() builds its own KiviCache: one cache per thread, the model shared
    with torch.no_grad():
        out[i] = model.generate(prompts[i], max_new_tokens=40, do_sample=False)

seq, par = {}, {}
for i in range(3):
    gen(i, seq)
for _ in range(2):
    threads = [threading.Thread(target=gen, args=(i, par)) for i in range(3)]
    for t in threads: t.start()
    for t in threads: t.join()
    # the same kernel entry and split-K chunks (same thread count): the same arithmetic, bit-identical tokens
    assert all(torch.equal(seq[i], par[i]) for i in range(3)), "threads differ from the sequential run"
print(numba.threading_layer(), dispatch._pool_thread_safe)
"""


def _layer_available(layer: str) -> bool:
    if layer == "tbb":
        import importlib.util

        return importlib.util.find_spec("tbb") is not None
    return True


@pytest.mark.parametrize("layer", ["workqueue", pytest.param("omp", marks=pytest.mark.slow), "tbb"])  # omp: ~25 s
def test_threads_generate_what_sequential_runs_generate(layer):
    """Three threads, one KiviCache each, on numba's `layer`: exit 0 and the sequential tokens.

    workqueue aborted the process without the lock in dispatch._run_threaded (exit 134).
    """
    if not _layer_available(layer):
        pytest.skip(f"numba's {layer} threading layer is not installed")
    import os
    from pathlib import Path

    root = str(Path(__file__).resolve().parents[2])
    env = {**os.environ, "NUMBA_THREADING_LAYER": layer, "PYTHONPATH": root, "OMP_NUM_THREADS": "2",
           "NUMBA_NUM_THREADS": "2"}
    out = subprocess.run([sys.executable, "-c", _THREADS_SCRIPT], capture_output=True, text=True, env=env,
                         cwd=root, timeout=600)
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.split() == [layer, str(layer != "workqueue")]


def test_a_view_with_a_per_query_boundary_never_reaches_the_kernel():
    """The kernel reads one precision per token; only n > 1 forwards carry a boundary, and a view that
    carries one anyway is refused by the dispatch (the blocked path reads it)."""
    cfg = KiviConfig(group_size=8, residual_length=16, block_size=32)
    views = _fill(cfg, 1, 2, 32, [70, 1], torch.float32)
    q = torch.randn(1, 4, 1, 32)
    assert fused_decode_supported(q, *views)
    fp = views[1].fp
    views[1].region = QueryRegion(views[1].split, (fp[:, :, :1], fp[:, :, :1]), torch.ones(1, 1, dtype=torch.uint8), 0)
    assert not fused_decode_supported(q, *views)
