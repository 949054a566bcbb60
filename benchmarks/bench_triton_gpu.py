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

Then the batched paged decode kernel (``--paged``, default on): :func:`kivi.kernels.triton_paged.triton_paged_decode`,
the kernel kivi's vLLM plugin reads its pages with, over ``N`` requests of ``T`` tokens each in KIVI 2/2 pages of
128 tokens (vLLM's block size; pages in shuffled blocks of one pool, ``extreme``'s window of 128 tokens in rings
read in place, the schedule's counts from :func:`kivi.cache.schedule.side_tokens`), checked against
:func:`kivi.attention.fused_cpu.paged.torch_paged_decode` and timed against fp16 SDPA over the same tokens held
dense (``paged_ms`` / ``sdpa_ms``; bytes the kernel must read, its GB/s).

Usage (H100/H200; about 3-5 minutes, stops starting new configurations after ``--max-seconds``)::

    python benchmarks/bench_triton_gpu.py --out bench_triton.json

Then kivi's vLLM plugin's layer step on the device (``--plugin``, default on; ``benchmarks/plugin_step.py``):
:func:`kivi.vllm.paged.paged_step` with the ``"triton"`` page reader, the opt-in GPU path, over one layer's cache
laid out as vLLM allocates it. Checks: a schedule of prefills, a chunk and decode steps wrapping the window rings,
against the same steps on the CPU through ``"reference"`` (the GPU path's first run on CUDA tensors: a tensor
left on the wrong device fails here). Timings: 8 / 32 requests of 4K tokens, a decode step's median ms and its
decode kernel's share.

``--dry-run`` runs tiny sizes on CPU under ``TRITON_INTERPRET=1`` (to check the script, not to time).
"""

from __future__ import annotations

import os
import sys

if "--dry-run" in sys.argv:  # triton reads this when first imported (kivi -> transformers may import it)
    os.environ.setdefault("TRITON_INTERPRET", "1")

import argparse  # noqa: E402
import platform  # noqa: E402
import statistics  # noqa: E402
import time  # noqa: E402
from functools import partial  # noqa: E402

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402

import plugin_step  # noqa: E402
from common import time_calls, write_json  # noqa: E402
from kivi.attention.blocked import blocked_attention  # noqa: E402
from kivi.attention.fused_cpu.paged import RingRows, torch_paged_decode  # noqa: E402
from kivi.attention.reference import reference_attention  # noqa: E402
from kivi.attention.triton_backend import triton_view_attention  # noqa: E402
from kivi.cache.layer import KiviLayer  # noqa: E402
from kivi.cache.schedule import side_tokens  # noqa: E402
from kivi.cache.view import materialize  # noqa: E402
from kivi.config import KiviConfig  # noqa: E402
from kivi.kernels import (  # noqa: E402
    decode_attention_packed,
    quantize_pack_keys,
    quantize_pack_values,
    torch_decode_attention_packed,
)
from kivi.kernels.triton_paged import triton_paged_decode  # noqa: E402
from kivi.quant.kv import quantize_kv  # noqa: E402
from kivi.vllm.geometry import build_geometry  # noqa: E402

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
    pk = quantize_pack_keys(k[:, :, :tqk], BITS, GROUP) if tqk else None
    pv = quantize_pack_values(v[:, :, :tqv], BITS, GROUP) if tqv else None
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
    """kivi's vLLM plugin's layer step with ``"triton"`` (``benchmarks/plugin_step.py``): a check per config (the
    first model's shapes for every config, every other model's for the first) against the CPU reference, then
    timings of decode steps for the first config."""
    out = dict(checks=[], timings=[])
    print(f"\nvLLM plugin layer step (paged_step, 'triton'), pages of {page_size} tokens")
    first = next(iter(models))
    for name, m in models.items():
        for cfg in configs if name == first else configs[:1]:
            t0 = time.time()
            try:
                r = plugin_step.check(cfg, device, dtype, m["hq"], m["hkv"], m["d"], page_size=page_size,
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
                    r = plugin_step.timing(configs[0], device, dtype, m["hq"], m["hkv"], m["d"], requests=N,
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


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
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


if __name__ == "__main__":
    sys.exit(main())
