"""GPU benchmark: Triton decode attention over a 2-bit KIVI cache vs fp16 SDPA over a full-precision cache.

One decode step (one query token) of one attention layer, for Llama-like shapes (Hq=32, Hkv=8, D=128) and
SmolLM2 shapes (Hq=9, Hkv=3, D=64), contexts 4K..128K, batch 1/4/16. First a correctness check of the
kernels against the torch references (max abs error), then CUDA-event timings (median of ``--iters`` after
``--warmup``), a table, and a JSON file (``--out``).

The KIVI cache mimics the real layout: keys quantized in whole groups of G=32 tokens with the last 128
tokens in full precision, values quantized per token with the last 100 tokens in full precision (so the
key and value tails differ, as in the cache). Effective GB/s = bytes the step must read / time. The fp16 baseline is the faster of SDPA with
``enable_gqa=True`` and SDPA with the query-head group folded into the query axis (flash kernel, no
repeated cache); both times are in the JSON.

Usage (H100/H200; about 2-4 minutes, stops starting new configurations after ``--max-seconds``)::

    python benchmarks/bench_triton_gpu.py --out bench_triton.json

``--dry-run`` runs tiny sizes on CPU under ``TRITON_INTERPRET=1`` (to check the script, not to time).
"""

from __future__ import annotations

import os
import sys

if "--dry-run" in sys.argv:  # triton reads this when first imported (kivi -> transformers may import it)
    os.environ.setdefault("TRITON_INTERPRET", "1")

import argparse  # noqa: E402
import json  # noqa: E402
import platform  # noqa: E402
import statistics  # noqa: E402
import time  # noqa: E402

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402

from kivi.kernels import (  # noqa: E402
    decode_attention_packed,
    quantize_pack_keys,
    quantize_pack_values,
    torch_decode_attention_packed,
)
from kivi.quant.kv import quantize_kv  # noqa: E402

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
    times = []
    for _ in range(iters):
        t0 = time.perf_counter()
        fn()
        times.append((time.perf_counter() - t0) * 1e3)
    return statistics.median(times)


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
    args = ap.parse_args(argv)

    t_start = time.time()
    if args.dry_run:
        device = torch.device("cpu")
        models = {k: DRY_MODELS[k] for k in (args.models or DRY_MODELS)}
        contexts = args.contexts or [160, 229]
        batches = args.batches or [1, 2]
        warmup, iters = args.warmup or 1, args.iters or 2
        check_T = 229
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

    rows, skipped = [], []
    header = (f"{'model':>13} {'B':>3} {'ctx':>7} | {'kivi ms':>8} {'GB/s':>7} {'MB':>8} | "
              f"{'sdpa* ms':>8} {'GB/s':>7} {'MB':>8} | {'speedup':>7}")
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
                    t_kivi = timeit(lambda: decode_attention_packed(q, pk, kf, pv, vf, scaling=scaling),
                                    warmup, iters, device)
                    fb = (k.numel() * k.element_size()) * 2 + q.numel() * q.element_size() * 2

                    def sdpa_gqa():
                        return F.scaled_dot_product_attention(q, k, v, scale=scaling, enable_gqa=True)

                    # the query-head group folded into the query-length axis: same maths for one decode
                    # token, reads each kv head once with the flash kernel (no repeat, no enable_gqa)
                    qf = q.reshape(B, m["hkv"], m["hq"] // m["hkv"], m["d"])

                    def sdpa_folded():
                        return F.scaled_dot_product_attention(qf, k, v, scale=scaling)

                    t_gqa = timeit(sdpa_gqa, warmup, iters, device)
                    t_fold = timeit(sdpa_folded, warmup, iters, device)
                    t_sdpa = min(t_gqa, t_fold)
                    row.update(kivi_ms=t_kivi, kivi_bytes=kb, kivi_gbps=kb / t_kivi / 1e6,
                               sdpa_gqa_ms=t_gqa, sdpa_folded_ms=t_fold,
                               sdpa_ms=t_sdpa, sdpa_bytes=fb, sdpa_gbps=fb / t_sdpa / 1e6,
                               speedup=t_sdpa / t_kivi)
                    print(f"{name:>13} {B:>3} {T:>7} | {t_kivi:8.3f} {row['kivi_gbps']:7.0f} {kb / 1e6:8.1f} | "
                          f"{t_sdpa:8.3f} {row['sdpa_gbps']:7.0f} {fb / 1e6:8.1f} | {row['speedup']:6.2f}x", flush=True)
                    del q, pk, kf, pv, vf, k, v
                except torch.OutOfMemoryError as e:  # pragma: no cover - GPU only
                    row["error"] = f"OOM: {e}"[:200]
                    print(f"{name:>13} {B:>3} {T:>7} | OOM", flush=True)
                rows.append(row)
                if device.type == "cuda":
                    torch.cuda.empty_cache()
    if skipped:
        print(f"skipped {len(skipped)} configurations after --max-seconds={args.max_seconds}")
    result = dict(env=env, dtype=str(dtype), bits=BITS, group_size=GROUP, key_fp_tail=K_TAIL, value_fp_tail=V_TAIL,
                  warmup=warmup, iters=iters, dry_run=args.dry_run, checks=checks, results=rows, skipped=skipped,
                  wall_s=time.time() - t_start)
    with open(args.out, "w") as f:
        json.dump(result, f, indent=2)
    print(f"wrote {args.out} ({time.time() - t_start:.1f} s)")
    return 0 if all(c["ok"] for c in checks) else 1


if __name__ == "__main__":
    sys.exit(main())
