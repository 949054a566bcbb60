"""The Triton kernels on a GPU, in three modes (``python benchmarks/bench_triton_gpu.py [MODE] --help``):

* ``kernels`` (the default when no mode is named): decode attention over a KIVI cache against fp16 SDPA, the cache
  layouts the ``"triton"`` backend reads, the batched paged decode kernel and kivi's vLLM plugin's layer step on the
  device, each checked against its torch reference, then timed (:func:`main_kernels`);
* ``check``: the device check ``bash scripts/gpu-check.sh`` runs (docs/kernels.md, "Checking on a GPU"):
  correctness in fp16 / bf16, the ``kernels`` timings, the spec's table at LLaMA-2-13B's shape, written to
  ``gpu_check.json`` / ``gpu_check.txt`` (:func:`main_check`);
* ``interpret``: on CPU under ``TRITON_INTERPRET=1``, the Triton decode path against the reference on real cache
  layouts, and what a decode step spends preparing the kernel's inputs (:func:`main_interpret`).

``--dry-run`` (``kernels``, ``check``) runs tiny shapes on CPU under ``TRITON_INTERPRET=1``, to check the script,
not to time.
"""

from __future__ import annotations

import os
import sys

if "--dry-run" in sys.argv or sys.argv[1:2] == ["interpret"]:  # triton reads this when first imported
    os.environ.setdefault("TRITON_INTERPRET", "1")

import argparse  # noqa: E402
import inspect  # noqa: E402
import json  # noqa: E402
import platform  # noqa: E402
import statistics  # noqa: E402
import subprocess  # noqa: E402
import time  # noqa: E402
from functools import partial  # noqa: E402
from pathlib import Path  # noqa: E402

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [p for p in (str(ROOT / "benchmarks"), str(ROOT)) if p not in sys.path]  # common; tests.helpers

from common import environment, time_calls, write_json  # noqa: E402
from kivi.attention.blocked import blocked_attention  # noqa: E402
from kivi.attention.fused_cpu.paged import RingRows, torch_paged_decode  # noqa: E402
from kivi.attention.reference import reference_attention  # noqa: E402
from kivi.attention.triton_backend import kernel_side_of, triton_view_attention  # noqa: E402
from kivi.cache.layer import KiviLayer  # noqa: E402
from kivi.cache.schedule import side_tokens  # noqa: E402
from kivi.cache.sliding import new_layer  # noqa: E402
from kivi.cache.view import materialize  # noqa: E402
from kivi.config import KiviConfig  # noqa: E402
from kivi.kernels import (  # noqa: E402
    decode_attention_packed,
    quantize_pack_keys,
    quantize_pack_values,
    torch_decode_attention_packed,
)
from kivi.kernels.triton_paged import triton_paged_decode  # noqa: E402
from kivi.paged.decode_call import decode_kernel  # noqa: E402
from kivi.paged.forward import StepBatch, paged_step  # noqa: E402
from kivi.paged.geometry import build_geometry  # noqa: E402
from kivi.quant.kv import quantize_kv  # noqa: E402
from kivi.quant.side_format import SideFormat  # noqa: E402


def _sync(device) -> None:
    if torch.device(device).type == "cuda":
        torch.cuda.synchronize()


# ------------------------------------------------------------------------------------------- kernels (the default mode)
MODELS = {
    "llama": dict(hq=32, hkv=8, d=128),
    "smollm2": dict(hq=9, hkv=3, d=64),
}
DRY_MODELS = {
    "llama-tiny": dict(hq=4, hkv=2, d=32),
    "smollm2-tiny": dict(hq=3, hkv=1, d=32),
}
BITS, GROUP, K_TAIL, V_TAIL = 2, 32, 128, 100


def split_counts(T: int, k_tail: int = K_TAIL, v_tail: int = V_TAIL, group: int = GROUP) -> tuple[int, int]:
    """Quantized token counts (keys, values) for a context of T tokens."""
    tqv = max(0, T - v_tail)
    tqk = max(0, (T - k_tail) // group * group)
    return tqk, tqv


def build_cache(B, hq, hkv, d, T, dtype, device, *, keep_fp: bool, seed: int = 0, tails=(K_TAIL, V_TAIL)):
    g = torch.Generator(device=device).manual_seed(seed)
    q = torch.randn(B, hq, 1, d, generator=g, device=device, dtype=dtype)
    k = torch.randn(B, hkv, T, d, generator=g, device=device, dtype=dtype)
    k[..., : d // 16] *= 8  # a few outlier channels, as real keys have
    v = torch.randn(B, hkv, T, d, generator=g, device=device, dtype=dtype)
    tqk, tqv = split_counts(T, *tails)
    pk = quantize_pack_keys(k[:, :, :tqk], SideFormat("channel", BITS, GROUP)) if tqk else None
    pv = quantize_pack_values(v[:, :, :tqv], SideFormat("token", BITS, GROUP)) if tqv else None
    kf = k[:, :, tqk:].contiguous()
    vf = v[:, :, tqv:].contiguous()
    fp = (k, v) if keep_fp else None
    if not keep_fp:
        del k, v
    return q, pk, kf, pv, vf, fp


def kivi_bytes(q, pk, kf, pv, vf) -> int:
    n = q.numel() * q.element_size() * 2  # read q, write out
    for p in (pk, pv):
        if p is not None:
            n += p.nbytes
    for t in (kf, vf):
        n += t.numel() * t.element_size()
    return n


def timeit(fn, warmup: int, iters: int, device) -> float:
    """Median milliseconds per call."""
    for _ in range(warmup):
        fn()
    if device.type == "cuda":
        torch.cuda.synchronize()
        times = []
        for _ in range(iters):
            a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            a.record()
            fn()
            b.record()
            b.synchronize()
            times.append(a.elapsed_time(b))
        return statistics.median(times)
    return 1e3 * statistics.median(time_calls(fn, iters, warmup=0))


def correctness(models, device, dtype, T) -> list[dict]:
    out = []
    for name, m in models.items():
        B = 2
        q, pk, kf, pv, vf, (k, v) = build_cache(B, m["hq"], m["hkv"], m["d"], T, dtype, device, keep_fp=True, seed=1)
        scaling = m["d"] ** -0.5
        got = decode_attention_packed(q, pk, kf, pv, vf, scaling=scaling)
        ref = torch_decode_attention_packed(q, pk, kf, pv, vf, scaling=scaling)
        err = (got.float() - ref.float()).abs().max().item()
        # quantize kernels vs the torch reference (codes are exact except float ties)
        tqk, tqv = split_counts(T)
        rk = quantize_kv(k[:, :, :tqk], "channel", BITS, GROUP)
        rv = quantize_kv(v[:, :, :tqv], "token", BITS, GROUP)
        mism_k = (pk.packed != rk.packed).float().mean().item()
        mism_v = (pv.packed != rv.packed).float().mean().item()
        scale_err = max((pk.scale.float() - rk.scale.float()).abs().max().item(),
                        (pv.scale.float() - rv.scale.float()).abs().max().item())
        row = dict(model=name, batch=B, context=T, attn_max_abs_err=err, ref_max_abs=ref.float().abs().max().item(),
                   key_byte_mismatch=mism_k, value_byte_mismatch=mism_v, scale_max_abs_err=scale_err,
                   ok=bool(err < 2e-2 and mism_k < 1e-3 and mism_v < 1e-3))
        out.append(row)
        print(f"check {name:>13} T={T}: attention max|err|={err:.2e} (|ref|max {row['ref_max_abs']:.2f}); "
              f"packed byte mismatch k={mism_k:.1e} v={mism_v:.1e}; scale max|err|={scale_err:.1e} "
              f"-> {'OK' if row['ok'] else 'FAIL'}")
        del q, pk, kf, pv, vf, k, v
    return out


LAYOUT_PRESETS = ("extreme", "balanced", "high")


def layered_views(B, hkv, d, T, extra, preset, dtype, device, *, block_size, group_size, residual_length, seed=0):
    """(layer, key view, value view) of one decode step of a KiviLayer holding ``T`` tokens: a prefill
    of ``T - extra - 1`` tokens, ``extra`` tokens appended in ``block_size`` chunks (one new storage block
    each), then the decode token."""
    cfg = KiviConfig.preset(preset, block_size=block_size, group_size=group_size, residual_length=residual_length)
    g = torch.Generator(device=device).manual_seed(seed)
    k = torch.randn(B, hkv, T, d, generator=g, device=device, dtype=dtype)
    k[..., : max(1, d // 16)] *= 8
    v = torch.randn(B, hkv, T, d, generator=g, device=device, dtype=dtype)
    layer = KiviLayer(cfg)
    pos = T - extra - 1
    layer.append(k[:, :, :pos], v[:, :, :pos])
    while pos < T - 1:
        n = min(block_size, T - 1 - pos)
        layer.append(k[:, :, pos : pos + n], v[:, :, pos : pos + n])
        pos += n
    kv, vv = layer.append(k[:, :, -1:], v[:, :, -1:])
    del k, v
    return layer, kv, vv


def concat_then_kernel(q, kv, vv, scaling):
    """The previous backend path (sink-free views): stored blocks concatenated (BlockStore.read), one segment."""
    ks, vs = kv.store.read(kv.split), vv.store.read(vv.split)
    return decode_attention_packed(q, ks, kv.fp, vs, vv.fp, scaling=scaling)


def layout_rows(models, device, dtype, contexts, batches, extra, geometry, warmup, iters, t_start, max_seconds):
    rows, skipped = [], []
    header = (f"{'model':>13} {'preset':>8} {'B':>3} {'ctx':>7} {'blocks':>6} | {'kivi ms':>8} {'blocked':>8} "
              f"{'concat':>8} {'sdpa*':>8} | {'blk/kivi':>8} {'max|err|':>9}")
    print("cache layouts (KiviLayer views, one decode step)")
    print(header)
    print("-" * len(header))
    for name, m in models.items():
        for preset in LAYOUT_PRESETS:
            for B in batches:
                for T in contexts:
                    if time.time() - t_start > max_seconds:
                        skipped.append(dict(model=name, preset=preset, batch=B, context=T))
                        continue
                    row = dict(model=name, preset=preset, batch=B, context=T, **m, **geometry)
                    try:
                        layer, kv, vv = layered_views(B, m["hkv"], m["d"], T, min(extra, T // 2), preset, dtype,
                                                      device, **geometry)
                        q = torch.randn(B, m["hq"], 1, m["d"], device=device, dtype=dtype)
                        scaling = m["d"] ** -0.5
                        blocks = sum(b is not None for b in layer.k.store.blocks)

                        # the timed calls, their arguments bound now (each is timed within this iteration)
                        kivi = partial(triton_view_attention, q, kv, vv, scaling=scaling, attention_mask=None)
                        blocked = partial(blocked_attention, q, kv, vv, scaling=scaling)
                        got = kivi()
                        ref = reference_attention(q, kv, vv, scaling=scaling)
                        err = (got.float() - ref.float()).abs().max().item()
                        t_kivi = timeit(kivi, warmup, iters, device)
                        t_blocked = timeit(blocked, warmup, iters, device)
                        t_concat = None
                        if kv.sink is None:
                            t_concat = timeit(partial(concat_then_kernel, q, kv, vv, scaling), warmup, iters, device)
                        kd, vd = materialize(kv, dtype), materialize(vv, dtype)
                        qf = q.reshape(B, m["hkv"], m["hq"] // m["hkv"], m["d"])
                        t_sdpa = timeit(partial(F.scaled_dot_product_attention, qf, kd, vd, scale=scaling),
                                        warmup, iters, device)
                        row.update(blocks=blocks, kivi_ms=t_kivi, blocked_ms=t_blocked, concat_ms=t_concat,
                                   sdpa_ms=t_sdpa, blocked_over_kivi=t_blocked / t_kivi, max_abs_err=err,
                                   ref_max_abs=ref.float().abs().max().item(), ok=bool(err < 2e-2))
                        cc = f"{t_concat:8.3f}" if t_concat is not None else f"{'-':>8}"
                        print(f"{name:>13} {preset:>8} {B:>3} {T:>7} {blocks:>6} | {t_kivi:8.3f} {t_blocked:8.3f} "
                              f"{cc} {t_sdpa:8.3f} | {t_blocked / t_kivi:7.2f}x {err:9.2e}", flush=True)
                        del layer, kv, vv, q, kd, vd, kivi, blocked
                    except torch.OutOfMemoryError as e:  # pragma: no cover - GPU only
                        row["error"] = f"OOM: {e}"[:200]
                        print(f"{name:>13} {preset:>8} {B:>3} {T:>7} | OOM", flush=True)
                    rows.append(row)
                    if device.type == "cuda":
                        torch.cuda.empty_cache()
    return rows, skipped


def paged_batch(N, hq, hkv, d, T, dtype, device, *, page_size=128, seed=0):
    """KIVI 2/2 pages of ``N`` requests holding ``T`` tokens each (the step's token the last), as kivi's vLLM
    plugin keeps them: ``(q, pool, layout, block_table, counts, k RingRows, v RingRows, w0, dense k, dense v)``."""
    cfg = KiviConfig.preset("extreme")
    geo = build_geometry(cfg, page_size=page_size, num_kv_heads=hkv, head_dim=d, dtype=dtype)
    layout = geo.kernel_layout(cfg, geo.block_bytes)
    g = torch.Generator(device=device).manual_seed(seed)
    k = torch.randn(N, hkv, T, d, generator=g, device=device, dtype=dtype)
    k[..., : max(1, d // 16)] *= 8
    v = torch.randn(N, hkv, T, d, generator=g, device=device, dtype=dtype)
    R, G = cfg.residual_length, cfg.group_size
    ks, vs = (side_tokens(axis, T - 1, R, G) for axis in ("channel", "token"))  # before the step's token
    counts = torch.tensor([[0, ks[1], T - ks[1], 0, vs[1], T - vs[1]]] * N, dtype=torch.int64)
    pages = -(-max(ks[1], vs[1]) // page_size)
    nb = N * pages + 1
    order = torch.randperm(nb, generator=torch.Generator().manual_seed(seed))
    table = order[: N * pages].view(N, pages).to(torch.int32)
    pool = torch.zeros(nb * geo.block_bytes, dtype=torch.uint8, device=device)
    for side, x, stored, axis in (("k", k, ks[1], "channel"), ("v", v, vs[1], "token")):
        for j in range(pages):
            part = x[:, :, j * page_size: min(stored, (j + 1) * page_size)]
            if not part.shape[2]:
                continue
            seg = quantize_kv(part, axis, 2, G, param_dtype=layout.param_dtype)
            for name, t in seg.tensors().items():
                view = layout.field(pool, side, name)  # [blocks, H, rows, C]
                view[table[:, j].long().to(device), :, : t.shape[2]] = t
    ring = max(T - ks[1], T - vs[1])  # every window row a slot of its own ring
    rows_per_block = 16
    nbr = -(-N * ring // rows_per_block) + 1
    fp = []
    for x, stored in ((k, ks[1]), (v, vs[1])):
        rows = torch.zeros(nbr, rows_per_block, hkv, d, dtype=dtype, device=device)
        ids = torch.randperm(nbr * rows_per_block, generator=torch.Generator().manual_seed(seed + 1))[: N * ring]
        slots = ids.view(N, ring).to(torch.int32)
        for t in range(stored, T - 1):
            r = slots[:, t % ring].long().to(device)
            rows[r // rows_per_block, r % rows_per_block] = x[:, :, t]
        fp.append(RingRows(rows, slots.to(device), x[:, :, T - 1].contiguous()))
    q = torch.randn(N, hq, d, generator=g, device=device, dtype=dtype)
    return q, pool, layout, table.to(device), counts.to(device), fp[0], fp[1], 0, k, v


def paged_rows(models, device, dtype, contexts, batches, warmup, iters, t_start, max_seconds):
    rows, skipped = [], []
    header = (f"{'model':>13} {'N':>3} {'ctx':>7} | {'paged ms':>8} {'GB/s':>7} {'MB':>8} | "
              f"{'sdpa* ms':>8} {'MB':>8} | {'speedup':>7} {'max|err|':>9}")
    print("\nbatched paged decode (triton_paged_decode: KIVI 2/2 pages of 128 tokens) vs fp16 SDPA, dense cache")
    print(header)
    print("-" * len(header))
    for name, m in models.items():
        for N in batches:
            for T in contexts:
                if time.time() - t_start > max_seconds:
                    skipped.append(dict(model=name, paged=True, batch=N, context=T))
                    continue
                row = dict(model=name, paged=True, batch=N, context=T, **m)
                try:
                    q, pool, lay, table, counts, kr, vr, w0, k, v = paged_batch(N, m["hq"], m["hkv"], m["d"], T,
                                                                                dtype, device)
                    scaling = m["d"] ** -0.5
                    call = partial(triton_paged_decode, q, pool, lay, table, counts, kr, vr, w0, scaling=scaling)
                    got = call()
                    ref = torch_paged_decode(q, pool, lay, table, counts, kr, vr, w0, scaling=scaling)
                    err = (got.float() - ref.float()).abs().max().item()
                    t_paged = timeit(call, warmup, iters, device)
                    # what the kernel must read: every page block of the batch, the window rows of both sides
                    kb = (table.numel() * lay.block_bytes
                          + counts[:, [2, 5]].sum().item() * m["hkv"] * m["d"] * k.element_size())
                    qf = q.reshape(N, m["hkv"], m["hq"] // m["hkv"], m["d"])
                    t_sdpa = timeit(partial(F.scaled_dot_product_attention, qf, k, v, scale=scaling), warmup, iters,
                                    device)
                    fb = 2 * k.numel() * k.element_size()
                    row.update(paged_ms=t_paged, paged_bytes=kb, paged_gbps=kb / t_paged / 1e6, sdpa_ms=t_sdpa,
                               sdpa_bytes=fb, speedup=t_sdpa / t_paged, max_abs_err=err,
                               ref_max_abs=ref.float().abs().max().item(), ok=bool(err < 2e-2))
                    print(f"{name:>13} {N:>3} {T:>7} | {t_paged:8.3f} {row['paged_gbps']:7.0f} {kb / 1e6:8.1f} | "
                          f"{t_sdpa:8.3f} {fb / 1e6:8.1f} | {row['speedup']:6.2f}x {err:9.2e}", flush=True)
                    del q, pool, table, counts, kr, vr, k, v, call
                except torch.OutOfMemoryError as e:  # pragma: no cover - GPU only
                    row["error"] = f"OOM: {e}"[:200]
                    print(f"{name:>13} {N:>3} {T:>7} | OOM", flush=True)
                rows.append(row)
                if device.type == "cuda":
                    torch.cuda.empty_cache()
    return rows, skipped


def plugin_rows(models, device, dtype, configs, page_size, check_steps, contexts, batches, steps, t_start,
                max_seconds) -> dict:
    """kivi's vLLM plugin's layer step with ``"triton"`` (:func:`plugin_check`, :func:`plugin_timing`): a check per
    config (the first model's shapes for every config, every other model's for the first) against the CPU reference,
    then timings of decode steps for the first config."""
    out = dict(checks=[], timings=[])
    print(f"\nvLLM plugin layer step (paged_step, 'triton'), pages of {page_size} tokens")
    first = next(iter(models))
    for name, m in models.items():
        for cfg in configs if name == first else configs[:1]:
            t0 = time.time()
            try:
                r = plugin_check(cfg, device, dtype, m["hq"], m["hkv"], m["d"], page_size=page_size,
                                      decode_steps=check_steps)
            except Exception as e:  # the first run on a device: report what broke, keep the script going
                r = dict(config=cfg.to_dict(), ok=False, error=f"{type(e).__name__}: {e}"[:500])
            r.update(model=name, seconds=time.time() - t0)
            out["checks"].append(r)
            print(f"check {name:>13} K{cfg.k_bits}V{cfg.v_bits} S{cfg.sink_tokens}: "
                  + (r.get("error") or f"{r['steps']} steps, max|err| {r['max_abs_err']:.2e}, pages equal "
                     f"{r['pages_equal']}, rings equal {r['rings_equal']}, wrapped {r['rings_wrapped']}"), flush=True)
    for name, m in models.items():
        for N in batches:
            for T in contexts:
                if time.time() - t_start > max_seconds:
                    continue
                try:
                    r = plugin_timing(configs[0], device, dtype, m["hq"], m["hkv"], m["d"], requests=N,
                                           context=T, page_size=page_size, decode_steps=steps)
                except Exception as e:
                    r = dict(error=f"{type(e).__name__}: {e}"[:500])
                r.update(model=name, requests=N, context=T)
                out["timings"].append(r)
                print(f"timing {name:>13} N={N:>3} T={T:>6}: " + (r.get("error") or (
                    f"step {r['step_ms']:.3f} ms, decode kernel {r['kernel_ms']:.3f} ms, rest {r['rest_ms']:.3f} ms")),
                    flush=True)
                if device.type == "cuda":
                    torch.cuda.empty_cache()
    return out


def main_kernels(argv=None) -> int:
    """GPU benchmark: Triton decode attention over a 2-bit KIVI cache vs fp16 SDPA over a full-precision cache.

    One decode step (one query token) of one attention layer, for Llama-like shapes (Hq=32, Hkv=8, D=128) and
    SmolLM2 shapes (Hq=9, Hkv=3, D=64), contexts 4K..128K, batch 1/4/16. First a correctness check of the
    kernels against the torch references (max abs error), then CUDA-event timings (median of ``--iters`` after
    ``--warmup``), a table, and a JSON file (``--out``).

    The KIVI cache mimics the real layout: keys quantized in whole groups of G=32 tokens with the last 128
    tokens in full precision, values quantized per token with the last 100 tokens in full precision (so the
    key and value tails differ, as in the cache). Effective GB/s = bytes the step must read / time. The fp16
    baseline is the faster of SDPA with ``enable_gqa=True`` and SDPA with the query-head group folded into the query
    axis (flash kernel, no repeated cache); both times are in the JSON.

    Then the cache layouts the ``"triton"`` attention backend reads in a model (``--layouts``, default on): a
    real :class:`~kivi.cache.layer.KiviLayer` filled with a prefill of ``context - extra`` tokens and ``extra``
    more tokens in ``block_size`` chunks (so the store holds a prefill block plus several ``block_size``
    blocks), then one decode step, for the presets ``extreme`` (K2V2, no sink), ``balanced`` (K4V2 + 4 sinks)
    and ``high`` (K4V4 + 4 sinks). Per layout: the backend's kernel path (sink + blocks read in place, one
    launch; ``kivi_ms``), the blocked torch path that ``high`` / ``balanced`` ran on GPUs before the kernel
    read sinks (``blocked_ms``), for sink-free layouts the previous kernel path (stored blocks concatenated
    each step, then a one-segment launch; ``concat_ms``), and fp16 SDPA over the dequantized cache
    (``sdpa_ms``); plus the max abs error of the kernel path against ``reference_attention``.

    Then the batched paged decode kernel (``--paged``, default on):
    :func:`kivi.kernels.triton_paged.triton_paged_decode`, the kernel kivi's vLLM plugin reads its pages with, over
    ``N`` requests of ``T`` tokens each in KIVI 2/2 pages of
    128 tokens (vLLM's block size; pages in shuffled blocks of one pool, ``extreme``'s window of 128 tokens in rings
    read in place, the schedule's counts from :func:`kivi.cache.schedule.side_tokens`), checked against
    :func:`kivi.attention.fused_cpu.paged.torch_paged_decode` and timed against fp16 SDPA over the same tokens held
    dense (``paged_ms`` / ``sdpa_ms``; bytes the kernel must read, its GB/s).

    Usage (H100/H200; about 3-5 minutes, stops starting new configurations after ``--max-seconds``)::

        python benchmarks/bench_triton_gpu.py --out bench_triton.json

    Then kivi's vLLM plugin's layer step on the device (``--plugin``, default on; :func:`plugin_check`,
    :func:`plugin_timing`):
    :func:`kivi.paged.forward.paged_step` with the ``"triton"`` page reader, the opt-in GPU path, over one layer's cache
    laid out as vLLM allocates it. Checks: a schedule of prefills, a chunk and decode steps wrapping the window rings,
    against the same steps on the CPU through ``"reference"`` (the GPU path's first run on CUDA tensors: a tensor
    left on the wrong device fails here). Timings: 8 / 32 requests of 4K tokens, a decode step's median ms and its
    decode kernel's share.

    ``--dry-run`` runs tiny sizes on CPU under ``TRITON_INTERPRET=1`` (to check the script, not to time).
    """
    ap = argparse.ArgumentParser(description=inspect.cleandoc(main_kernels.__doc__),
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", default="bench_triton_gpu.json", help="JSON results path")
    ap.add_argument("--dry-run", action="store_true", help="tiny sizes on CPU under TRITON_INTERPRET=1")
    ap.add_argument("--contexts", type=int, nargs="*", default=None)
    ap.add_argument("--batches", type=int, nargs="*", default=None)
    ap.add_argument("--models", nargs="*", default=None, help=f"subset of {list(MODELS)}")
    ap.add_argument("--warmup", type=int, default=None)
    ap.add_argument("--iters", type=int, default=None)
    ap.add_argument("--max-seconds", type=float, default=420.0, help="start no new configuration after this")
    ap.add_argument("--no-layouts", action="store_true", help="skip the cache-layout table (sinks + several blocks)")
    ap.add_argument("--layout-contexts", type=int, nargs="*", default=None)
    ap.add_argument("--layout-batches", type=int, nargs="*", default=None)
    ap.add_argument("--no-paged", action="store_true", help="skip the batched paged decode table")
    ap.add_argument("--paged-contexts", type=int, nargs="*", default=None)
    ap.add_argument("--paged-batches", type=int, nargs="*", default=None)
    ap.add_argument("--no-plugin", action="store_true", help="skip the vLLM plugin's layer step (checks, timings)")
    ap.add_argument("--plugin-contexts", type=int, nargs="*", default=None)
    ap.add_argument("--plugin-batches", type=int, nargs="*", default=None)
    args = ap.parse_args(argv)

    t_start = time.time()
    if args.dry_run:
        device = torch.device("cpu")
        models = {k: DRY_MODELS[k] for k in (args.models or DRY_MODELS)}
        contexts = args.contexts or [160, 229]
        batches = args.batches or [1, 2]
        warmup, iters = args.warmup or 1, args.iters or 2
        check_T = 229
        layout_contexts = args.layout_contexts or [229]
        layout_batches = args.layout_batches or [2]
        geometry = dict(block_size=32, group_size=16, residual_length=16)
        extra = 96
        paged_contexts, paged_batches = args.paged_contexts or [301], args.paged_batches or [3]
        plugin_contexts, plugin_batches = args.plugin_contexts or [100], args.plugin_batches or [2]
        plugin_configs = [KiviConfig(k_bits=2, v_bits=2, group_size=16, residual_length=16, sink_tokens=4)]
        plugin_page, plugin_checks_steps, plugin_steps = 32, 6, 2
    else:
        if not torch.cuda.is_available():
            print("no CUDA device; use --dry-run to check the script on CPU", file=sys.stderr)
            return 2
        device = torch.device("cuda")
        models = {k: MODELS[k] for k in (args.models or MODELS)}
        contexts = args.contexts or [4096, 16384, 32768, 65536, 131072]
        batches = args.batches or [1, 4, 16]
        warmup, iters = args.warmup or 5, args.iters or 20
        check_T = 4096 + 37
        layout_contexts = args.layout_contexts or [4096 + 37, 32768 + 37]
        layout_batches = args.layout_batches or [1, 4]
        geometry = dict(block_size=256, group_size=32, residual_length=128)
        extra = 2048  # 8 block_size blocks after the prefill block
        paged_contexts, paged_batches = args.paged_contexts or [4096 + 37, 32768 + 37], args.paged_batches or [8, 32]
        plugin_contexts, plugin_batches = args.plugin_contexts or [4096 + 37], args.plugin_batches or [8, 32]
        plugin_configs = [KiviConfig.preset("balanced"), KiviConfig.preset("extreme")]
        plugin_page, plugin_checks_steps, plugin_steps = 128, None, 20  # None: the rings wrap twice
    dtype = torch.float16
    env = dict(torch=torch.__version__, python=platform.python_version(),
               device=torch.cuda.get_device_name() if device.type == "cuda" else "cpu (TRITON_INTERPRET=1)")
    try:
        import triton

        env["triton"] = triton.__version__
    except Exception:  # pragma: no cover
        pass
    print(f"env: {env}")

    checks = correctness(models, device, dtype, check_T)

    plugin = dict(checks=[], timings=[])
    if not args.no_plugin:  # the GPU path's whole layer step on CUDA tensors, checked first (never run on a GPU)
        plugin = plugin_rows(models, device, dtype, plugin_configs, plugin_page, plugin_checks_steps, plugin_contexts,
                             plugin_batches, plugin_steps, t_start, args.max_seconds)
    rows, skipped, layouts, paged = [], [], [], []
    if not args.no_paged:  # first: the kernel kivi's vLLM plugin would run on a GPU (never timed on one yet)
        paged, skipped = paged_rows(models, device, dtype, paged_contexts, paged_batches, warmup, iters, t_start,
                                    args.max_seconds)
    if not args.no_layouts:  # first: the layouts the backend reads in a model (sinks, several blocks)
        layouts, more = layout_rows(models, device, dtype, layout_contexts, layout_batches, extra, geometry,
                                    warmup, iters, t_start, args.max_seconds)
        skipped += more
    header = (f"{'model':>13} {'B':>3} {'ctx':>7} | {'kivi ms':>8} {'GB/s':>7} {'MB':>8} | "
              f"{'sdpa* ms':>8} {'GB/s':>7} {'MB':>8} | {'speedup':>7}")
    print("\none segment per side (decode_attention_packed) vs fp16 SDPA")
    print(header)
    print("-" * len(header))
    for name, m in models.items():
        for B in batches:
            for T in contexts:
                if time.time() - t_start > args.max_seconds:
                    skipped.append(dict(model=name, batch=B, context=T))
                    continue
                row = dict(model=name, batch=B, context=T, **m)
                try:
                    q, pk, kf, pv, vf, (k, v) = build_cache(B, m["hq"], m["hkv"], m["d"], T, dtype, device,
                                                            keep_fp=True)
                    scaling = m["d"] ** -0.5
                    kb = kivi_bytes(q, pk, kf, pv, vf)
                    t_kivi = timeit(partial(decode_attention_packed, q, pk, kf, pv, vf, scaling=scaling),
                                    warmup, iters, device)
                    fb = (k.numel() * k.element_size()) * 2 + q.numel() * q.element_size() * 2

                    sdpa_gqa = partial(F.scaled_dot_product_attention, q, k, v, scale=scaling, enable_gqa=True)
                    # the query-head group folded into the query-length axis: same maths for one decode
                    # token, reads each kv head once with the flash kernel (no repeat, no enable_gqa)
                    qf = q.reshape(B, m["hkv"], m["hq"] // m["hkv"], m["d"])
                    sdpa_folded = partial(F.scaled_dot_product_attention, qf, k, v, scale=scaling)
                    t_gqa = timeit(sdpa_gqa, warmup, iters, device)
                    t_fold = timeit(sdpa_folded, warmup, iters, device)
                    t_sdpa = min(t_gqa, t_fold)
                    row.update(kivi_ms=t_kivi, kivi_bytes=kb, kivi_gbps=kb / t_kivi / 1e6,
                               sdpa_gqa_ms=t_gqa, sdpa_folded_ms=t_fold,
                               sdpa_ms=t_sdpa, sdpa_bytes=fb, sdpa_gbps=fb / t_sdpa / 1e6,
                               speedup=t_sdpa / t_kivi)
                    print(f"{name:>13} {B:>3} {T:>7} | {t_kivi:8.3f} {row['kivi_gbps']:7.0f} {kb / 1e6:8.1f} | "
                          f"{t_sdpa:8.3f} {row['sdpa_gbps']:7.0f} {fb / 1e6:8.1f} | {row['speedup']:6.2f}x", flush=True)
                    del q, pk, kf, pv, vf, k, v, sdpa_gqa, sdpa_folded
                except torch.OutOfMemoryError as e:  # pragma: no cover - GPU only
                    row["error"] = f"OOM: {e}"[:200]
                    print(f"{name:>13} {B:>3} {T:>7} | OOM", flush=True)
                rows.append(row)
                if device.type == "cuda":
                    torch.cuda.empty_cache()
    if skipped:
        print(f"skipped {len(skipped)} configurations after --max-seconds={args.max_seconds}")
    result = dict(env=env, dtype=str(dtype), bits=BITS, group_size=GROUP, key_fp_tail=K_TAIL, value_fp_tail=V_TAIL,
                  warmup=warmup, iters=iters, dry_run=args.dry_run, checks=checks, results=rows, layouts=layouts,
                  paged=paged, plugin=plugin,
                  skipped=skipped, wall_s=time.time() - t_start)
    write_json(args.out, result)
    print(f"wrote {args.out} ({time.time() - t_start:.1f} s)")
    ok = all(c["ok"] for c in checks + plugin["checks"]) and all(r.get("ok", True) for r in layouts + paged)
    return 0 if ok else 1


# ---------------------------------------------------------------------- the vLLM plugin's layer step (kernels, check)
# The vLLM plugin's layer step on a device, for the ``kernels`` and ``check`` modes.
#
# :func:`kivi.paged.forward.paged_step` with the ``"triton"`` page reader (the plugin's opt-in GPU path: SDPA prefill,
# chunks through kivi's Triton attention, decode rows through the batched paged Triton kernel, torch writes) over one
# layer's cache laid out as vLLM allocates it (:class:`LayerCache`). No vLLM is needed: ``paged_step`` is what the
# plugin's attention impl calls with vLLM's block tables.
#
# * :func:`plugin_check`: one schedule (prefills of odd lengths, a request joining later, a chunk into a request
#   that holds tokens, decode steps wrapping the window rings) run on ``device`` with ``"triton"`` and on the CPU with
#   ``"reference"`` (kivi's ground truth); the largest output difference over all steps, and whether pages and
#   rings end byte-identical (reported, not required: a GPU's float rounding may differ from the CPU's).
# * :func:`plugin_timing`: ``N`` requests of ``T`` tokens prefilled on ``device``, then decode steps: each step's
#   wall time (synchronised) and the decode kernel's share of it (the rest: the writes, the indices, the Python
#   around them).


class LayerCache:
    """One layer's KIVI pages ``[nblocks, H, P, C]`` and its ``k`` window rings as vLLM allocates them (the rings
    overlay one allocation, ring ``r``'s block ``b`` at ``(b * k + r)`` block bytes, as vLLM packs its groups), and
    block tables handed out per request from shuffled free lists (block 0 is vLLM's null block)."""

    def __init__(self, geo, nblocks: int, dtype: torch.dtype, device, seed: int = 0) -> None:
        H, P, D, k = geo.num_kv_heads, geo.page_size, geo.head_dim, geo.window_rings
        self.geo, self.device = geo, torch.device(device)
        g = torch.Generator().manual_seed(seed)
        self.free = torch.randperm(nblocks - 1, generator=g).add(1).tolist()
        self.rfree = [torch.randperm(nblocks - 1, generator=g).add(1).tolist() for _ in range(k)]
        size = dtype.itemsize
        self.pages = torch.zeros(nblocks, H, P, geo.state_bytes // size, dtype=dtype, device=device)
        bb = geo.block_bytes // size
        rbuf = torch.zeros(nblocks * k * bb, dtype=dtype, device=device)
        self.rings = [rbuf.as_strided((nblocks, H, geo.window_tokens, 2 * D),
                                      (k * bb, geo.window_tokens * 2 * D, 2 * D, 1), r * bb) for r in range(k)]
        self.ptab: dict[int, list[int]] = {}
        self.rtab: dict[int, list[int]] = {}

    def batch(self, rows) -> StepBatch:
        """``rows``: ``[(request, past, q_len)]`` -> the step's :class:`StepBatch` (tables on the cache's device)."""
        P = self.geo.page_size
        qs, seqs = [0], []
        for rid, past, q in rows:
            pt = self.ptab.setdefault(rid, [])
            while len(pt) * P < past + q:
                pt.append(self.free.pop())
            if rid not in self.rtab:
                self.rtab[rid] = [f.pop() for f in self.rfree]
            qs.append(qs[-1] + q)
            seqs.append(past + q)
        width = max(len(self.ptab[r]) for r, _, _ in rows) + 1
        pt = [self.ptab[r] + [0] * (width - len(self.ptab[r])) for r, _, _ in rows]
        return StepBatch(qs, seqs, torch.tensor(pt, dtype=torch.int32, device=self.device),
                         torch.tensor([self.rtab[r] for r, _, _ in rows], dtype=torch.int32, device=self.device))


def plugin_schedule(page_size: int, decode_steps: int) -> list[list[tuple[int, int, int]]]:
    """Prefills of 3, 2P + 5, P - 1 and 3P + 17 tokens; then a fifth request's prefill of 40 joins, its next step
    a chunk of 9; every other request decodes one token a step."""
    P = page_size
    held = {0: 3, 1: 2 * P + 5, 2: P - 1, 3: 3 * P + 17}
    steps = [[(rid, 0, n) for rid, n in held.items()]]
    for s in range(1, decode_steps + 1):
        rows = []
        for rid in sorted(held):
            q = 9 if (rid == 4 and s == 2) else 1
            rows.append((rid, held[rid], q))
            held[rid] += q
        if s == 1:
            rows.insert(2, (4, 0, 40))
            held[4] = 40
        steps.append(rows)
    return steps


def plugin_check(cfg: KiviConfig, device, dtype: torch.dtype, hq: int, hkv: int, d: int, *, page_size: int,
                 decode_steps: int | None = None, seed: int = 0) -> dict:
    """:func:`plugin_schedule` through ``paged_step`` on ``device`` (``"triton"``) and on the CPU (``"reference"``);
    ``decode_steps=None``: enough for the first request to wrap its window ring twice."""
    geo = build_geometry(cfg, page_size=page_size, num_kv_heads=hkv, head_dim=d, dtype=dtype)
    ring_part = geo.window_rings * geo.window_tokens - geo.sink_tokens
    if decode_steps is None:
        decode_steps = 2 * ring_part + geo.sink_tokens + 8
    steps = plugin_schedule(page_size, decode_steps)
    longest = max(past + q for rows in steps for _, past, q in rows)
    nblocks = 5 * (-(-longest // page_size) + 1) + 1
    fast, slow = LayerCache(geo, nblocks, dtype, device, seed), LayerCache(geo, nblocks, dtype, "cpu", seed)
    g = torch.Generator().manual_seed(seed + 1)
    scale, err = d ** -0.5, 0.0
    for rows in steps:
        n = sum(q for _, _, q in rows)
        q, k, v = (torch.randn(n, h, d, generator=g).to(dtype) for h in (hq, hkv, hkv))
        got = paged_step(cfg, geo, "triton", q.to(device), k.to(device), v.to(device), fast.pages, fast.rings,
                         fast.batch(rows), scale, torch.empty(n, hq, d, dtype=dtype, device=device))
        want = paged_step(cfg, geo, "reference", q, k, v, slow.pages, slow.rings, slow.batch(rows), scale,
                          torch.empty(n, hq, d, dtype=dtype), batched_decode=False)
        err = max(err, (got.cpu().float() - want.float()).abs().max().item())
    same = [torch.equal(a.cpu().view(torch.uint8), b.view(torch.uint8))
            for a, b in zip([fast.pages, *fast.rings], [slow.pages, *slow.rings])]
    return dict(config=cfg.to_dict(), page_size=page_size, steps=len(steps),
                rings_wrapped=3 + decode_steps - geo.sink_tokens > 2 * ring_part, max_abs_err=err,
                pages_equal=same[0], rings_equal=all(same[1:]), ok=err < (2e-5 if dtype == torch.float32 else 2e-2))


def plugin_timing(cfg: KiviConfig, device, dtype: torch.dtype, hq: int, hkv: int, d: int, *, requests: int,
                  context: int, page_size: int, decode_steps: int, seed: int = 0) -> dict:
    """``requests`` prompts of ``context`` tokens prefilled in one step on ``device``, then ``decode_steps`` decode
    steps through ``paged_step`` (``"triton"``, the layer's decode kernel made once as the plugin's impl keeps it):
    median ms of a step and of its decode kernel call."""
    from kivi.kernels import triton_paged

    geo = build_geometry(cfg, page_size=page_size, num_kv_heads=hkv, head_dim=d, dtype=dtype)
    nblocks = requests * (-(-(context + decode_steps) // page_size)) + 2
    cache = LayerCache(geo, nblocks, dtype, device, seed)
    g = torch.Generator(device=device).manual_seed(seed)
    scale = d ** -0.5
    n = requests * context
    q, k, v = (torch.randn(n, h, d, generator=g, device=device, dtype=dtype) for h in (hq, hkv, hkv))
    paged_step(cfg, geo, "triton", q, k, v, cache.pages, cache.rings, cache.batch([(i, 0, context)
               for i in range(requests)]), scale, torch.empty(n, hq, d, dtype=dtype, device=device))
    calls = []
    kernel_fn = triton_paged.triton_paged_decode

    def timed(*args, **kwargs):
        _sync(device)
        t0 = time.perf_counter()
        out = kernel_fn(*args, **kwargs)
        _sync(device)
        calls.append(time.perf_counter() - t0)
        return out

    kernel = decode_kernel(cfg, geo, "triton", cache.pages, cache.rings)
    if kernel is None:
        raise RuntimeError("the batched paged decode kernel does not apply to this cache")
    step_ms = []
    triton_paged.triton_paged_decode = timed  # kivi.paged.decode.run_paged_decode looks it up at each call
    try:
        for s in range(decode_steps):
            q, k, v = (torch.randn(requests, h, d, generator=g, device=device, dtype=dtype) for h in (hq, hkv, hkv))
            batch = cache.batch([(i, context + s, 1) for i in range(requests)])
            out = torch.empty(requests, hq, d, dtype=dtype, device=device)
            _sync(device)
            t0 = time.perf_counter()
            paged_step(cfg, geo, "triton", q, k, v, cache.pages, cache.rings, batch, scale, out, kernel=kernel)
            _sync(device)
            step_ms.append((time.perf_counter() - t0) * 1e3)
    finally:
        triton_paged.triton_paged_decode = kernel_fn
    step, kern = statistics.median(step_ms), statistics.median(calls) * 1e3
    return dict(config=cfg.to_dict(), requests=requests, context=context, page_size=page_size, steps=decode_steps,
                kernel_calls=len(calls), step_ms=step, kernel_ms=kern, rest_ms=step - kern)


# ------------------------------------------------------------------------------------------- check: the device script
CHECK_DTYPES = {"fp16": torch.float16, "bf16": torch.bfloat16}
#: the spec's rows (LLaMA-2-13B, A100-80GB, batch 4): KV bytes and generated tokens/s at 32K, speedups by context
SPEC = dict(kv_gb_32k=dict(bf16=25.6, kivi=3.2), tokens_per_s_32k=dict(bf16=1240, kivi=4300), ratio_32k=3.47,
            speedup=dict(zip(("4K", "16K", "32K", "64K"), (1.8, 2.9, 3.47, 3.5))))
SHAPE_13B = dict(hidden_size=5120, intermediate_size=13824, num_hidden_layers=40, num_attention_heads=40,
                 num_key_value_heads=40, head_dim=128, vocab_size=32000)
SHAPE_DRY = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=2,
                 num_key_value_heads=2, head_dim=32, vocab_size=128)


def device_environment(device) -> dict:
    import transformers

    env = dict(python=platform.python_version(), torch=torch.__version__, transformers=transformers.__version__,
               torch_cuda=torch.version.cuda)
    try:
        import triton

        env["triton"] = triton.__version__
    except Exception as e:  # pragma: no cover - triton is needed for every part
        env["triton"] = f"not importable: {e}"
    try:
        env["kivi_commit"] = subprocess.run(["git", "-C", str(ROOT), "rev-parse", "--short", "HEAD"],
                                            capture_output=True, text=True, timeout=10).stdout.strip() or None
    except Exception:
        env["kivi_commit"] = None
    if device.type == "cuda":
        p = torch.cuda.get_device_properties(device)
        env.update(device=f"{p.name}, {p.total_memory / 2**30:.0f} GiB, sm_{p.major}{p.minor}",
                   gpu_memory_bytes=p.total_memory)
        try:
            env["driver"] = subprocess.run(["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader"],
                                           capture_output=True, text=True, timeout=20).stdout.strip()
        except Exception as e:
            env["driver"] = f"nvidia-smi failed: {e}"
    else:
        env.update(device="cpu (TRITON_INTERPRET=1, dry run)", driver=None)
    return env


# ------------------------------------------------------------------------------------------ a. correctness
def _row(kind, dtype_name, err, ok, **extra) -> dict:
    row = dict(kind=kind, dtype=dtype_name, max_abs_err=err, ok=bool(ok), **extra)
    print(f"check {kind:<34} {dtype_name}: max|err| {err:.2e} -> {'OK' if ok else 'FAIL'}"
          + (f" ({extra['error']})" if "error" in extra else ""), flush=True)
    return row


def _guarded(kind, dtype_name, fn) -> list[dict]:
    """``fn()`` -> rows; an exception (a compile error on the device, an OOM) becomes one failed row."""
    try:
        return fn()
    except Exception as e:
        return [_row(kind, dtype_name, float("nan"), False, error=f"{type(e).__name__}: {e}"[:400])]


#: The layout checks' bound on max |kernel - reference| per output dtype. bfloat16 keeps 8 bits of mantissa: over 8
#: query draws of the dry run's `balanced` layout its error reached 2.15e-2 (the same on the kernel's previous
#: version), so its bound is twice float16's; a kernel that reads a wrong token or group errs by far more.
LAYOUT_ATOL = {torch.float16: 2e-2, torch.float32: 2e-2, torch.bfloat16: 4e-2}


def layout_checks(device, dtype, dtype_name, dry: bool) -> list[dict]:
    """The backend's kernel path over a KiviLayer's views against ``reference_attention``: per preset (plain,
    sinks), and a sliding layer whose store evicted its front."""
    geometry = (dict(block_size=32, group_size=16, residual_length=16) if dry
                else dict(block_size=256, group_size=32, residual_length=128))
    B, hq, hkv, d = (2, 4, 2, 32) if dry else (2, 32, 8, 128)
    T, extra = (150, 60) if dry else (4096 + 37, 1024)
    rows = []
    for preset in LAYOUT_PRESETS:
        def one(preset=preset):
            _, kv, vv = layered_views(B, hkv, d, T, extra, preset, dtype, device, **geometry)
            q = torch.randn(B, hq, 1, d, generator=torch.Generator().manual_seed(0)).to(device, dtype)
            got = triton_view_attention(q, kv, vv, scaling=d ** -0.5, attention_mask=None)
            ref = reference_attention(q, kv, vv, scaling=d ** -0.5)
            err = (got.float() - ref.float()).abs().max().item()
            return [_row(f"layout {preset} (sinks {kv.sink is not None})", dtype_name, err, err < LAYOUT_ATOL[dtype],
                         context=T, batch=B)]
        rows += _guarded(f"layout {preset}", dtype_name, one)

    def sliding():
        cfg = KiviConfig(**geometry)
        window = 2 * geometry["block_size"]
        g = torch.Generator(device=device).manual_seed(3)
        k = torch.randn(B, hkv, T, d, generator=g, device=device, dtype=dtype)
        v = torch.randn(B, hkv, T, d, generator=g, device=device, dtype=dtype)
        layer = new_layer(cfg, window)
        pos = T - extra
        layer.append(k[:, :, :pos], v[:, :, :pos])
        for t in range(pos, T - 1, max(1, extra // 8)):
            layer.append(k[:, :, t : min(T - 1, t + extra // 8)], v[:, :, t : min(T - 1, t + extra // 8)])
        kv, vv = layer.append(k[:, :, -1:], v[:, :, -1:])
        q = torch.randn(B, hq, 1, d, device=device, dtype=dtype)
        got = triton_view_attention(q, kv, vv, scaling=d ** -0.5, attention_mask=None)
        ref = reference_attention(q, kv, vv, scaling=d ** -0.5)
        err = (got.float() - ref.float()).abs().max().item()
        return [_row("layout sliding (front evicted)", dtype_name, err, err < 2e-2 and kv.start > 0,
                     context=T, evicted=kv.start)]

    return rows + _guarded("layout sliding", dtype_name, sliding)


def paged_checks(device, dtype, dtype_name, dry: bool) -> list[dict]:
    """The batched paged decode (shuffled page blocks, window rings) against ``torch_paged_decode``, and the vLLM
    plugin's layer step (paged writes, rings wrapped twice) against the CPU reference."""
    hq, hkv, d = (4, 2, 32) if dry else (32, 8, 128)
    N, T = (3, 301) if dry else (4, 4096 + 37)

    def paged():
        q, pool, lay, table, counts, kr, vr, w0, _, _ = paged_batch(N, hq, hkv, d, T, dtype, device)
        got = triton_paged_decode(q, pool, lay, table, counts, kr, vr, w0, scaling=d ** -0.5)
        ref = torch_paged_decode(q, pool, lay, table, counts, kr, vr, w0, scaling=d ** -0.5)
        err = (got.float() - ref.float()).abs().max().item()
        return [_row("paged decode (shuffled blocks, rings)", dtype_name, err, err < 2e-2, requests=N, context=T)]

    rows = _guarded("paged decode", dtype_name, paged)
    if dry:  # the fewest steps that still wrap the rings twice (one interpreted step takes ~2 s), fp16 only
        configs, page, steps = [KiviConfig(k_bits=2, v_bits=2, group_size=8, residual_length=8, sink_tokens=2)], 16, 32
        if dtype != torch.float16:
            return rows
    else:
        configs, page, steps = [KiviConfig.preset("balanced"), KiviConfig.preset("extreme")], 128, None
    for cfg in configs:
        name = f"plugin step K{cfg.k_bits}V{cfg.v_bits} S{cfg.sink_tokens} (paged write)"

        def step(cfg=cfg, name=name):
            r = plugin_check(cfg, device, dtype, hq, hkv, d, page_size=page, decode_steps=steps)
            ok = r["ok"] and r["pages_equal"] and r["rings_equal"] and r["rings_wrapped"]
            return [_row(name, dtype_name, r["max_abs_err"], ok, pages_equal=r["pages_equal"],
                         rings_equal=r["rings_equal"], rings_wrapped=r["rings_wrapped"], steps=r["steps"])]
        rows += _guarded(name, dtype_name, step)
    return rows


def generate_checks(device, dtype, dtype_name, dry: bool) -> list[dict]:
    """``quantize_model(model, cfg).generate()`` greedily with the ``"triton"`` backend against ``"reference"``:
    tokens equal up to a near-tie (``tests/helpers.py``), on small random-weight models."""
    from kivi import KiviCache, quantize_model
    from kivi.integration import generate_cache_key
    from tests.helpers import LOGIT_ATOL, assert_greedy_close, greedy, tiny_model

    atol = LOGIT_ATOL[torch.bfloat16]  # the half-precision bound (fp16 rounds finer than bf16)
    small = dict(group_size=8, residual_length=16, block_size=16)
    cases = [("llama", "extreme", {}), ("llama", "balanced", {}),
             ("llama", "per-head", dict(head_bits={0: {"k_bits": [2, 4, 2], "v_bits": [2, 2, 4]}}, sink_tokens=2)),
             ("mistral", "balanced", dict(sliding_window=24))]
    shape = dict(hidden_size=192, head_dim=32, num_attention_heads=6, num_key_value_heads=3,
                 num_hidden_layers=1 if dry else 2)
    P, n = (40, 4) if dry else (300, 24)
    rows = []
    if dry and dtype != torch.bfloat16:  # ~30 s per dtype in the interpreter: the dry run checks bf16's
        return rows
    for model_type, preset, extra in cases:
        name = f"generate {model_type} {preset}"

        def one(model_type=model_type, preset=preset, extra=extra, name=name):
            extra = dict(extra)
            window = extra.pop("sliding_window", None)
            kw = dict(shape, **({"sliding_window": window} if window else {}))
            model = tiny_model(model_type, weight_scale=2.0, **kw).to(device=device, dtype=dtype)
            cfg = (KiviConfig(**small, **extra) if preset == "per-head" else KiviConfig.preset(preset, **small))
            model = quantize_model(model, cfg)
            ids = torch.randint(0, model.config.vocab_size, (2, P), generator=torch.Generator().manual_seed(0))
            ids = ids.to(device)
            runs = {}
            for backend in ("triton", "reference"):
                cache = KiviCache.from_model_config(model.config, cfg, attention_backend=backend)
                runs[backend] = greedy(model, ids, new_tokens=n, **{generate_cache_key(model): cache})
            a, b = runs["triton"].scores, runs["reference"].scores
            both = torch.isfinite(a) & torch.isfinite(b)
            err = (a[both] - b[both]).abs().max().item()
            try:
                compared = assert_greedy_close(runs["triton"], runs["reference"], atol=atol)
                ok, note = True, {}
            except AssertionError as e:
                compared, ok, note = None, False, dict(error=str(e)[:400])
            same = bool(torch.equal(runs["triton"].sequences, runs["reference"].sequences))
            return [_row(name, dtype_name, err, ok, tokens_equal=same, steps_compared=compared, atol=atol,
                         prompt=P, new_tokens=n, **note)]
        rows += _guarded(name, dtype_name, one)
    return rows


def batching_checks(device, dtype, dtype_name, dry: bool) -> list[dict]:
    """Continuous batching over KIVI pages (``generate_batch``: transformers' scheduler, the paged core's step) with
    the ``"triton"`` backend against ``"reference"``, on a small random-weight model on ``device``: per request, the
    greedy tokens equal, or at the first token that differs a near-tie (the two runs' log-probabilities of their own
    tokens within the half-precision bound, as ``tests/helpers.assert_greedy_close``), and the log-probabilities of
    the tokens before it within that bound."""
    from kivi.batching import generate_batch
    from tests.helpers import LOGIT_ATOL, tiny_model

    atol = LOGIT_ATOL[torch.bfloat16]
    if dry and dtype != torch.bfloat16:  # the interpreter: the dry run checks bf16's
        return []
    shape = dict(hidden_size=192, head_dim=32, num_attention_heads=6, num_key_value_heads=3,
                 num_hidden_layers=1 if dry else 2)
    lengths, n = ((40, 23, 7), 4) if dry else ((300, 170, 45, 9), 24)

    def one() -> list[dict]:
        g = torch.Generator().manual_seed(0)
        model = tiny_model("llama", weight_scale=2.0, **shape).to(device=device, dtype=dtype)
        prompts = [torch.randint(0, model.config.vocab_size, (m,), generator=g).tolist() for m in lengths]
        runs = {}
        for backend in ("triton", "reference"):
            cfg = KiviConfig(group_size=8, residual_length=16, sink_tokens=2, attention_backend=backend)
            out = generate_batch(model, prompts, cfg, cache_memory=64 * 2**20, max_new_tokens=n, page_size=16,
                                 max_batch_tokens=256, return_logprobs=True)
            runs[backend] = [(o.generated_tokens, o.logprobs) for o in out.values()]
        err, ok, same, notes = 0.0, True, True, []
        for i, ((ta, la), (tb, lb)) in enumerate(zip(runs["triton"], runs["reference"])):
            j = next((k for k, (a, b) in enumerate(zip(ta, tb)) if a != b), len(ta))
            if j < len(ta):
                same = False
                if abs(la[j] - lb[j]) > atol:
                    ok = False
                    notes.append(f"request {i}: token {j} {ta[j]} vs {tb[j]}, log-probs {la[j]:.3f} vs {lb[j]:.3f}")
            if j:
                err = max(err, max(abs(a - b) for a, b in zip(la[:j], lb[:j])))
        ok = ok and err <= atol
        return [_row("batching llama", dtype_name, err, ok, tokens_equal=same, atol=atol, prompts=list(lengths),
                     new_tokens=n, **(dict(error="; ".join(notes)[:400]) if notes else {}))]

    return _guarded("batching llama", dtype_name, one)


def part_correctness(device, dry: bool, budget: float) -> dict:
    t0, rows, skipped = time.time(), [], []
    models = DRY_MODELS if dry else MODELS
    check_T = 229 if dry else 4096 + 37
    for dtype_name, dtype in CHECK_DTYPES.items():
        for what, fn in (("packed", None), ("layouts", layout_checks), ("paged", paged_checks),
                         ("generate", generate_checks), ("batching", batching_checks)):
            if time.time() - t0 > budget:
                skipped.append(f"{what} {dtype_name}")
                continue
            if fn is None:
                for r in _guarded("packed decode + quantize", dtype_name,
                                  lambda dtype=dtype: correctness(models, device, dtype, check_T)):
                    rows.append(dict(r, kind=r.get("kind", f"packed decode + quantize {r.get('model')}"),
                                     dtype=dtype_name, max_abs_err=r.get("attn_max_abs_err", r.get("max_abs_err"))))
            else:
                rows += fn(device, dtype, dtype_name, dry)
            if device.type == "cuda":
                torch.cuda.empty_cache()
    return dict(rows=rows, skipped=skipped, ok=all(r["ok"] for r in rows), seconds=time.time() - t0)


# ------------------------------------------------------------------------------------------ b. kernel timings
def part_kernels(device, dry: bool, budget: float, out_dir: Path) -> dict:
    t0 = time.time()
    path = out_dir / "bench_triton_gpu.json"
    argv = ["--out", str(path), "--max-seconds", str(budget), "--no-plugin"]  # the plugin step is checked in a.
    if dry:
        argv += ["--dry-run", "--models", "smollm2-tiny", "--contexts", "160", "--batches", "1", "--warmup", "1",
                 "--iters", "1", "--no-layouts", "--paged-contexts", "160", "--paged-batches", "2"]
    try:
        rc = main_kernels(argv)
        data = json.loads(path.read_text())
    except Exception as e:
        return dict(ok=False, error=f"{type(e).__name__}: {e}"[:400], seconds=time.time() - t0)
    keep = ("results", "paged", "layouts", "skipped")
    return dict(ok=rc == 0, json=path.name, seconds=time.time() - t0, **{k: data.get(k) for k in keep})


# ------------------------------------------------------------------------------------------ c. the 13B table
class _Clock:
    """A logits processor that records when ``generate`` has the prefill's logits (its first call)."""

    def __init__(self, device):
        self.device, self.first = device, None

    def __call__(self, input_ids, scores):
        if self.first is None:
            _sync(self.device)
            self.first = time.perf_counter()
        return scores


def build_model(shape: dict, device, dtype, max_positions: int):
    from transformers import LlamaConfig, LlamaForCausalLM

    cfg = LlamaConfig(**shape, max_position_embeddings=max_positions, tie_word_embeddings=False)
    torch.manual_seed(0)
    with torch.device(device):
        model = LlamaForCausalLM._from_config(cfg, dtype=dtype)
    return model.eval()


def _cache_for(name: str, model, dry: bool):
    """``(kivi config or None, cache object or None)``; ``None`` cache: generate's own (bf16 DynamicCache or
    kivi's via quantize_model)."""
    from kivi import quantize_model
    from kivi.integration import dequantize_model

    dequantize_model(model)
    if name == "bf16":
        return None, None
    if name == "quantized":
        from transformers import QuantizedCache

        return None, QuantizedCache(backend="quanto", config=model.config, nbits=2, q_group_size=64,
                                    residual_length=128)
    if not dry:
        cfg = KiviConfig.preset(name)  # attention_backend "auto": "triton" on CUDA
        quantize_model(model, cfg)
        return cfg, None
    # the dry run: "kivi" attention through a "reference" model config, the cache reading with "triton" (the
    # interpreter; "auto" would pick the numba kernel on CPU, and "triton" refuses a CPU model)
    from kivi import KiviCache

    cfg = KiviConfig.preset(name, group_size=16, residual_length=16, block_size=32, attention_backend="reference")
    quantize_model(model, cfg)
    return cfg, KiviCache.from_model_config(model.config, cfg, attention_backend="triton")


def generate_row(model, name: str, T: int, B: int, new_tokens: int, device, dry: bool) -> dict:
    from transformers import LogitsProcessorList

    from kivi.integration import generate_cache_key

    row = dict(cache=name, context=T, batch=B, new_tokens=new_tokens)
    cfg, cache = _cache_for(name, model, dry)
    ids = torch.randint(0, model.config.vocab_size, (B, T), generator=torch.Generator().manual_seed(T + B))
    ids = ids.to(device)
    clock = _Clock(device)
    kw = dict(max_new_tokens=new_tokens, min_new_tokens=new_tokens, do_sample=False, return_dict_in_generate=True,
              logits_processor=LogitsProcessorList([clock]), attention_mask=torch.ones_like(ids))
    if cache is not None:
        kw[generate_cache_key(model)] = cache
    if device.type == "cuda":
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats(device)
        base = torch.cuda.memory_allocated(device)
    _sync(device)
    t0 = time.perf_counter()
    with torch.no_grad():
        out = model.generate(ids, **kw)
    _sync(device)
    t1 = time.perf_counter()
    held = getattr(out, "cache", None) or getattr(out, "past_key_values", None)
    prefill_s, decode_s = clock.first - t0, t1 - clock.first
    row.update(prefill_s=prefill_s, decode_s=decode_s, prefill_tokens_per_s=B * T / prefill_s,
               decode_tokens_per_s=B * (new_tokens - 1) / decode_s if new_tokens > 1 else None,
               generated_tokens_per_s=B * new_tokens / (t1 - t0))
    if device.type == "cuda":
        row.update(kv_bytes=torch.cuda.memory_allocated(device) - base - out.sequences.nbytes,
                   peak_bytes=torch.cuda.max_memory_allocated(device), weights_bytes=base)
    if cfg is not None:
        row["attention_backend"] = str(getattr(getattr(held, "backend", None), "name", model.kivi_attention_backend))
        n = getattr(held, "nbytes", None)
        row["kivi_nbytes"] = n() if callable(n) else n
    if "kv_bytes" not in row:  # CPU (dry run): what the cache's tensors hold
        row["kv_bytes"] = row.get("kivi_nbytes") or _tensor_bytes(held)
    del out, held
    return row


def _tensor_bytes(cache) -> int:
    n = 0
    for layer in getattr(cache, "layers", []):
        for v in vars(layer).values():
            if isinstance(v, torch.Tensor):
                n += v.nbytes
    return n


def _fmt(row: dict) -> str:
    if "error" in row:
        return f"{row['cache']:>9} {row['context']:>6} {row['batch']:>4} | {row['error'][:90]}"
    gb = lambda x: f"{x / 1e9:8.2f}" if x is not None else f"{'-':>8}"  # noqa: E731
    dec = row.get("decode_tokens_per_s")
    return (f"{row['cache']:>9} {row['context']:>6} {row['batch']:>4} | {gb(row.get('kv_bytes'))} "
            f"{gb(row.get('peak_bytes'))} | {row['prefill_tokens_per_s']:9.0f} "
            f"{(f'{dec:9.1f}' if dec else '-'):>9} {row['generated_tokens_per_s']:9.1f}")


TABLE_HEADER = (f"{'cache':>9} {'ctx':>6} {'B':>4} | {'KV GB':>8} {'peak GB':>8} | {'prefill/s':>9} "
                f"{'decode/s':>9} {'gen/s':>9}")


def plan(contexts: list[int], caches: list[str]) -> list[tuple[str, int, object]]:
    """Runs in priority order: 32K (or the middle context) first — batch 1, the largest batch per cache —, then
    batch 1 / 4 / largest at the other contexts, 64K (or the longest) last."""
    key = 32768 if 32768 in contexts else sorted(contexts)[len(contexts) // 2]
    order = [key] + [c for c in sorted(contexts) if c != key]
    runs = []
    for T in order:
        for name in caches:
            runs += [(name, T, 1), (name, T, "max")]
        runs += [(name, T, 4) for name in caches]
    return runs


def part_table(device, dry: bool, budget: float, contexts: list[int], new_tokens: int, max_batch: int,
               caches: list[str], on_row) -> dict:
    t0 = time.time()
    shape = SHAPE_DRY if dry else SHAPE_13B
    dtype = torch.bfloat16
    rows, skipped = [], []
    try:
        model = build_model(shape, device, dtype, max(contexts) + new_tokens + 16)
    except Exception as e:
        return dict(ok=False, error=f"model: {type(e).__name__}: {e}"[:400], rows=[], seconds=time.time() - t0)
    weights = sum(p.nbytes for p in model.parameters())
    total = torch.cuda.get_device_properties(device).total_memory if device.type == "cuda" else None
    print(f"\n13B-shape table: {shape}, weights {weights / 1e9:.1f} GB (random bf16), {new_tokens} new tokens")
    print(TABLE_HEADER)
    print("-" * len(TABLE_HEADER))
    per_seq = {}  # (cache, T) -> peak bytes above the weights at batch 1
    seconds_1 = {}  # (cache, T) -> batch 1's generate() seconds
    done = set()
    for name, T, B in plan(contexts, caches):
        if time.time() - t0 > budget:
            skipped.append(dict(cache=name, context=T, batch=B))
            continue
        label, b_mem = B, None
        if B == "max":
            if (name, T) not in per_seq:
                skipped.append(dict(cache=name, context=T, batch=B, reason="batch 1 did not run"))
                continue
            if total is None:  # dry run: the memory model cannot be measured on CPU; a small batch stands in
                B = 3
            else:
                B = b_mem = max(1, min(max_batch, int((0.92 * total - weights) // per_seq[(name, T)])))
                # one generate() cannot be stopped: a batch whose estimated time (batch 1's, times B) does not
                # fit in what is left of the budget is cut to one that does, and says so
                left = budget - (time.time() - t0)
                fits = int(left // max(seconds_1[(name, T)], 1e-3))
                if fits < B:
                    print(f"{name} T={T}: largest batch {B} by memory, {max(fits, 1)} by the time left", flush=True)
                    B = max(1, fits)
        if (name, T, B) in done:
            continue
        if label == 4 and (name, T) in seconds_1 and 4 * seconds_1[(name, T)] > budget - (time.time() - t0):
            skipped.append(dict(cache=name, context=T, batch=B, reason="batch 1's time x 4 exceeds the budget left"))
            continue
        while True:
            try:
                row = generate_row(model, name, T, B, new_tokens, device, dry)
                row["plan"] = label  # 1, 4 or "max" (the largest batch that fits, estimated then run)
                row["max_batch_by_memory"] = b_mem  # "max" rows: the memory estimate (None: batch 1 / 4, dry run)
                break
            except torch.OutOfMemoryError as e:  # pragma: no cover - GPU only
                row = dict(cache=name, context=T, batch=B, error=f"OOM: {str(e)[:150]}")
                torch.cuda.empty_cache()
                if B > 1 and time.time() - t0 < budget:
                    print(_fmt(row), flush=True)
                    rows.append(row)
                    B = max(1, int(B * 0.8))
                    continue
                break
            except Exception as e:  # QuantizedCache without its backend, a kernel failure: reported, the rest runs
                row = dict(cache=name, context=T, batch=B, error=f"{type(e).__name__}: {e}"[:300])
                break
        done.add((name, T, B))
        if B == 1 and "error" not in row:
            per_seq[(name, T)] = row.get("peak_bytes", weights) - weights
            seconds_1[(name, T)] = row["prefill_s"] + row["decode_s"]
        rows.append(row)
        print(_fmt(row), flush=True)
        on_row(rows)
    del model
    if device.type == "cuda":
        torch.cuda.empty_cache()
    return dict(ok=True, shape=shape, weights_bytes=weights, new_tokens=new_tokens, rows=rows, skipped=skipped,
                seconds=time.time() - t0)


def largest(rows: list[dict], cache: str, T: int) -> dict | None:
    ok = [r for r in rows if r["cache"] == cache and r["context"] == T and "error" not in r]
    return max(ok, key=lambda r: (r["batch"], r["decode_tokens_per_s"] or 0), default=None)


def ratio_32k(rows: list[dict], T: int = 32768) -> dict | None:
    """kivi extreme's decode tokens/s at the largest batch it ran at ``T`` over bf16 DynamicCache's."""
    a, b = largest(rows, "extreme", T), largest(rows, "bf16", T)
    if not a or not b or not a["decode_tokens_per_s"] or not b["decode_tokens_per_s"]:
        return None
    return dict(ratio=a["decode_tokens_per_s"] / b["decode_tokens_per_s"], context=T,
                kivi_batch=a["batch"], bf16_batch=b["batch"],
                kivi_decode_tokens_per_s=a["decode_tokens_per_s"], bf16_decode_tokens_per_s=b["decode_tokens_per_s"],
                generated_ratio=a["generated_tokens_per_s"] / b["generated_tokens_per_s"])


# ------------------------------------------------------------------------------------------ d. results
def text_report(result: dict) -> str:
    lines = [f"device: {result['device']}", f"env: {json.dumps(result['env'])}", ""]
    a = result.get("correctness") or {}
    lines.append(f"a. correctness: {'OK' if a.get('ok') else 'FAIL'} ({len(a.get('rows', []))} checks)")
    for r in a.get("rows", []):
        lines.append(f"   {r['kind']:<44} {r['dtype']}  max|err| {r['max_abs_err']:.2e}  {'OK' if r['ok'] else 'FAIL'}")
    b = result.get("kernels") or {}
    lines.append(f"\nb. kernel timings: {len(b.get('results') or [])} decode rows, {len(b.get('paged') or [])} paged "
                 f"rows ({b.get('json')})")
    for r in b.get("results") or []:
        if "kivi_ms" in r:
            lines.append(f"   {r['model']:>13} B={r['batch']:>3} T={r['context']:>7}: kivi {r['kivi_ms']:.3f} ms "
                         f"({r['kivi_gbps']:.0f} GB/s), sdpa {r['sdpa_ms']:.3f} ms, {r['speedup']:.2f}x")
    c = result.get("table") or {}
    lines += ["", f"c. 13B-shape table ({c.get('new_tokens')} new tokens; tokens/s)", "   " + TABLE_HEADER]
    lines += ["   " + _fmt(r) for r in c.get("rows", [])]
    lines.append(f"\nratio_32k: {result.get('ratio_32k')} (spec: {SPEC['ratio_32k']})")
    return "\n".join(lines) + "\n"


def main_check(argv=None) -> int:
    """kivi on a GPU, one run (``bash scripts/gpu-check.sh``; docs/kernels.md, "Checking on a GPU").

    Four parts, each with its own time budget (a part stops starting new work after its ``--*-seconds``):

    a. correctness, in float16 and bfloat16: every Triton kernel against its torch reference (decode attention over
       one packed segment, quantize + pack, the backend's cache layouts: plain ``extreme``, sinks ``balanced`` /
       ``high``, a sliding layer that evicted its front; the batched paged decode over shuffled page blocks and
       wrapping window rings; the vLLM plugin's layer step, whose page and ring writes must equal the CPU
       reference's byte for byte), then ``quantize_model(...).generate()`` on small random-weight models
       (Llama: ``extreme``, ``balanced``, per-head widths; Mistral with a sliding window): greedy tokens of the
       ``"triton"`` backend against the ``"reference"`` backend's, under the near-tie rule of
       ``tests/helpers.py`` (:func:`assert_greedy_close`);
    b. kernel timings: the ``kernels`` mode (decode attention vs the faster of SDPA / flash, contexts
       4K-128K, batch 1-16, GB/s);
    c. the spec's table at LLaMA-2-13B's shape (40 layers, 40 heads, head dim 128; random bf16 weights built from a
       ``LlamaConfig``): ``generate()`` with ``min_new_tokens`` = ``max_new_tokens`` at 32K first, then 4K / 16K
       (64K last), batch 1, 4 and the largest batch that fits, per cache (bf16 ``DynamicCache``, transformers'
       ``QuantizedCache`` (quanto, 2 bits) where it runs, kivi ``extreme`` and ``balanced``): KV bytes (GPU memory
       the finished cache holds), peak GPU memory, prefill tokens/s, decode tokens/s. The largest batch is
       estimated from the batch-1 run's peak (linear in the batch) and then run; an OOM steps it down;
    d. ``gpu_check.json`` and ``gpu_check.txt`` in ``--out-dir``, rewritten after every part and table row. The JSON's
       top level holds ``device`` and ``ratio_32k`` (kivi ``extreme``'s decode tokens/s at the largest batch it fits
       at 32K over bf16 ``DynamicCache``'s at the largest batch it fits; ``None`` until both ran).

    ``--dry-run``: tiny shapes on CPU under ``TRITON_INTERPRET=1`` (a 2-layer stand-in for the 13B shape), every
    part end to end, to check the script, not to time. Exit code 1 when a correctness check failed.
    """
    ap = argparse.ArgumentParser(description=inspect.cleandoc(main_check.__doc__),
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out-dir", default=os.environ.get("OUT") or "results/tmp/gpu-check")
    ap.add_argument("--dry-run", action="store_true", help="tiny shapes on CPU under TRITON_INTERPRET=1")
    ap.add_argument("--check-seconds", type=float, default=None, help="part a (correctness): s; 90, dry run 3600")
    ap.add_argument("--kernel-seconds", type=float, default=None, help="part b (kernel timings): s; 100, dry run 3600")
    ap.add_argument("--table-seconds", type=float, default=None, help="part c (13B-shape table): s; 210, dry run 3600")
    ap.add_argument("--contexts", type=int, nargs="*", default=None, help="part c's contexts")
    ap.add_argument("--new-tokens", type=int, default=None, help="part c: min_new_tokens = max_new_tokens")
    ap.add_argument("--max-batch", type=int, default=64, help="part c: the largest batch tried")
    ap.add_argument("--caches", nargs="*", default=["bf16", "extreme", "balanced", "quantized"])
    ap.add_argument("--parts", default="abc", help="which of the parts a, b, c run")
    args = ap.parse_args(argv)
    t_start = time.time()
    # the dry run checks that every part runs to its end (the interpreter's speed varies with the machine's load)
    for name, val in (("check", 90.0), ("kernel", 100.0), ("table", 210.0)):
        if getattr(args, f"{name}_seconds") is None:
            setattr(args, f"{name}_seconds", 3600.0 if args.dry_run else val)
    if args.dry_run:
        device = torch.device("cpu")
        contexts, new_tokens = args.contexts or [48, 96], args.new_tokens or 3
    else:
        if not torch.cuda.is_available():
            print("no CUDA device; use --dry-run to check the script on CPU", file=sys.stderr)
            return 2
        device = torch.device("cuda")
        contexts, new_tokens = args.contexts or [4096, 16384, 32768, 65536], args.new_tokens or 32
    out_dir = Path(args.out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    env = device_environment(device)
    print(f"device: {env['device']}; driver {env.get('driver')}; torch {env['torch']} (CUDA {env['torch_cuda']}); "
          f"triton {env['triton']}; transformers {env['transformers']}; kivi {env['kivi_commit']}", flush=True)
    result = dict(device=env["device"], ratio_32k=None, env=env, dry_run=args.dry_run, spec=SPEC,
                  correctness=None, kernels=None, table=None, argv=sys.argv[1:] if argv is None else argv)

    def write():
        result["wall_s"] = time.time() - t_start
        (out_dir / "gpu_check.json").write_text(json.dumps(result, indent=2, default=str) + "\n")
        (out_dir / "gpu_check.txt").write_text(text_report(result))

    write()
    if "a" in args.parts:
        print("\n== a. correctness (fp16, bf16) ==", flush=True)
        result["correctness"] = part_correctness(device, args.dry_run, args.check_seconds)
        write()
    if "b" in args.parts:
        print("\n== b. kernel timings (the kernels mode) ==", flush=True)
        result["kernels"] = part_kernels(device, args.dry_run, args.kernel_seconds, out_dir)
        write()
    if "c" in args.parts:
        print("\n== c. the spec's table at LLaMA-2-13B's shape ==", flush=True)

        def on_row(rows):
            result["table"] = dict(rows=rows, partial=True)
            write()

        result["table"] = part_table(device, args.dry_run, args.table_seconds, contexts, new_tokens, args.max_batch,
                                     args.caches, on_row)
        key = 32768 if 32768 in contexts else sorted(contexts)[len(contexts) // 2]
        r = ratio_32k(result["table"]["rows"], key)
        result["ratio_32k"] = r["ratio"] if r else None
        result["ratio_32k_detail"] = r
    write()
    print("\n" + text_report(result))
    print(f"wrote {out_dir / 'gpu_check.json'} and gpu_check.txt ({time.time() - t_start:.1f} s)")
    ok = (result["correctness"] or {"ok": True})["ok"] and (result["kernels"] or {"ok": True})["ok"]
    return 0 if ok else 1


# --------------------------------------------------------------------------------- interpret: CPU, TRITON_INTERPRET=1
PRESETS = {
    "extreme": dict(k_bits=2, v_bits=2, sink_tokens=0),
    "balanced": dict(k_bits=4, v_bits=2, sink_tokens=4),
    "high": dict(k_bits=4, v_bits=4, sink_tokens=4),
    "k8v8": dict(k_bits=8, v_bits=8, sink_tokens=4),
    "k3v3": dict(k_bits=3, v_bits=3, sink_tokens=4),  # 3-bit codes may straddle two bytes
    "k3v2": dict(k_bits=3, v_bits=2, sink_tokens=0),
}
INTERPRET_DTYPES = {"fp32": torch.float32, "fp16": torch.float16, "bf16": torch.bfloat16}


def filled_layer(cfg, B, hkv, d, T, extra, dtype, seed=0):
    """Views of one decode step after a prefill of ``T - extra - 1`` tokens and ``extra`` tokens in
    ``block_size`` chunks."""
    g = torch.Generator().manual_seed(seed)
    k = (torch.randn(B, hkv, T, d, generator=g) * 1.5).to(dtype)
    k[..., 1] += 5.0
    v = torch.randn(B, hkv, T, d, generator=g).to(dtype)
    layer = KiviLayer(cfg)
    pos = T - extra - 1
    layer.append(k[:, :, :pos], v[:, :, :pos])
    while pos < T - 1:
        n = min(cfg.block_size, T - 1 - pos)
        layer.append(k[:, :, pos : pos + n], v[:, :, pos : pos + n])
        pos += n
    kv, vv = layer.append(k[:, :, -1:], v[:, :, -1:])
    return layer, kv, vv


def interpret_correctness(args) -> list[dict]:
    rows = []
    print(f"{'preset':>9} {'dtype':>5} {'Hq/Hkv':>6} {'T':>4} {'blocks k/v':>10} {'max|err|':>9} {'max|ref|':>8} "
          f"{'rel':>8}")
    for preset in args.presets:
        bits = PRESETS[preset]
        cfg = KiviConfig(group_size=16, residual_length=16, block_size=32, **bits)
        for dname, dtype in INTERPRET_DTYPES.items():
            for hq, hkv in ((9, 3), (8, 1)):
                T = args.context
                layer, kv, vv = filled_layer(cfg, 2, hkv, 32, T, args.extra, dtype, seed=hq)
                q = torch.randn(2, hq, 1, 32, generator=torch.Generator().manual_seed(1)).to(dtype)
                mask = torch.ones(2, 1, 1, T, dtype=torch.bool)
                mask[1, ..., :11] = False  # left padding over the sink and into the store
                got = triton_view_attention(q, kv, vv, scaling=32**-0.5, attention_mask=mask)
                ref = reference_attention(q, kv, vv, scaling=32**-0.5, attention_mask=mask)
                err = (got.float() - ref.float()).abs().max().item()
                top = ref.float().abs().max().item()
                nk = sum(b is not None for b in layer.k.store.blocks)
                nv = sum(b is not None for b in layer.v.store.blocks)
                rows.append(dict(preset=preset, dtype=dname, hq=hq, hkv=hkv, context=T, key_blocks=nk, value_blocks=nv,
                                 sink_tokens=bits["sink_tokens"], max_abs_err=err, ref_max_abs=top, rel=err / top))
                print(f"{preset:>9} {dname:>5} {hq:>3}/{hkv:<2} {T:>4} {nk:>5}/{nv:<4} {err:9.2e} {top:8.3f} "
                      f"{err / top:8.1e}",
                      flush=True)
    return rows


def preparation(args) -> dict:
    """Median microseconds per decode step to prepare both sides: kernel sides vs BlockStore.read."""
    cfg = KiviConfig(group_size=32, residual_length=128, block_size=256, k_bits=2, v_bits=2)
    T, extra = args.prep_context, args.prep_extra
    layer, kv, vv = filled_layer(cfg, 1, 3, 64, T, extra, torch.float16)  # SmolLM2 kv heads / head_dim
    dev = torch.device("cpu")

    def sides():
        return kernel_side_of(kv, dev), kernel_side_of(vv, dev)

    def concat():
        return kv.store.read(kv.split), vv.store.read(vv.split)

    sides()  # builds and memoises the tables (once per set of blocks)
    out = {}
    for name, fn in (("kernel_sides", sides), ("blockstore_read", concat)):
        out[name + "_us"] = 1e6 * statistics.median(time_calls(fn, args.repeat, warmup=0))
    out.update(context=T, blocks=sum(b is not None for b in layer.k.store.blocks), kv_heads=3, head_dim=64,
               dtype="fp16", bits=2, repeat=args.repeat)
    out["ratio"] = out["blockstore_read_us"] / out["kernel_sides_us"]
    print(f"\nper-step preparation, T={T} ({out['blocks']} key blocks), SmolLM2 kv shapes, K2V2 fp16 (CPU tensors): "
          f"kernel sides {out['kernel_sides_us']:.1f} us, "
          f"BlockStore.read of both sides {out['blockstore_read_us']:.1f} us "
          f"({out['ratio']:.1f}x)")
    return out


def main_interpret(argv=None) -> int:
    """CPU check of the Triton decode path on real cache layouts (TRITON_INTERPRET=1): a correctness table,
    and what a decode step spends preparing the kernel's inputs.

    1. Correctness: a :class:`~kivi.cache.layer.KiviLayer` per preset (``extreme`` K2V2, ``balanced``
       K4V2 + 4 sinks, ``high`` K4V4 + 4 sinks, ``k8v8`` + 4 sinks, 3-bit ``k3v3`` + 4 sinks and ``k3v2``;
       ``--presets`` picks some) and dtype, filled with a prefill and then
       ``block_size`` chunks (a prefill block + several ``block_size`` blocks per side, the last one
       partly filled), then one decode step with a left-padding mask; the max abs error of the
       ``"triton"`` backend (the kernel, in the interpreter) against ``reference_attention`` (materialize +
       softmax in float32). Interpreter times are meaningless for speed and are not reported.
    2. Preparation per decode step (CPU tensors, no kernel): building the kernel's sides from the views
       (block tables memoised in the store) against the previous path's ``BlockStore.read`` of both sides
       (every stored block concatenated every step), at a long context. Only the preparation is timed.

    Usage::

        OMP_NUM_THREADS=1 python benchmarks/bench_triton_gpu.py interpret --out results/triton/triton12_correctness.json
    """
    ap = argparse.ArgumentParser(description=inspect.cleandoc(main_interpret.__doc__),
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", default=None, help="JSON results path")
    ap.add_argument("--presets", nargs="+", choices=list(PRESETS), default=list(PRESETS),
                    help="cache layouts of the correctness table (default: all)")
    ap.add_argument("--context", type=int, default=171, help="tokens in the correctness layouts (odd)")
    ap.add_argument("--extra", type=int, default=96, help="tokens appended in block_size chunks after the prefill")
    ap.add_argument("--prep-context", type=int, default=32768 + 37)
    ap.add_argument("--prep-extra", type=int, default=4096)
    ap.add_argument("--repeat", type=int, default=50)
    args = ap.parse_args(argv)
    t0 = time.time()
    rows = interpret_correctness(args)
    prep = preparation(args)
    import triton

    result = dict(env=dict(environment(), triton=triton.__version__, interpreter=os.environ.get("TRITON_INTERPRET")),
                  correctness=rows, preparation=prep, wall_s=time.time() - t0)
    if args.out:
        write_json(args.out, result)
        print(f"wrote {args.out}")
    worst = max(r["rel"] for r in rows)
    return 0 if worst < 2e-2 else 1


MODES = {"kernels": main_kernels, "check": main_check, "interpret": main_interpret}


def main(argv=None) -> int:
    """``[MODE] ARGS``: the mode's ``main_*`` with the rest (``kernels`` when the first argument names no mode)."""
    argv = sys.argv[1:] if argv is None else list(argv)
    if argv and argv[0] in MODES:
        return MODES[argv[0]](argv[1:])
    return main_kernels(argv)


if __name__ == "__main__":
    sys.exit(main())
