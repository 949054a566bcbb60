"""Decode attention alone over a long 2-bit (or 1/3/4/8-bit) KIVI cache (SmolLM2 shapes), CPU.

Compares, per call (one decode query, all heads of one layer):

* reference — dequantize the whole cache, then attend (what transformers' QuantizedCache does);
* blocked   — kivi.attention.blocked_attention (reads the packed store block by block);
* fused     — kivi.attention.fused_cpu.fused_decode_attention (numba kernel on the packed codes;
  what the "cpu" backend runs for decode steps when numba is installed; skipped otherwise);
* sdpa fp32 / sdpa bf16 — torch SDPA over a full-precision cache of the same length.

"effective GB/s" = bytes of the cache representation the method reads / time (quantized store +
fp window for KIVI methods, the full fp tensors for SDPA). The machine's copy bandwidth is measured
in the same run (``dst.copy_(src)`` of a 256 MiB tensor; reported as read+write bytes / time and as
bytes copied / time).

Roofline: the same run also measures the machine's float32 matmul rate (``torch.mm`` of two
2048 x 2048 matrices, all torch threads) and reports each method's *useful* GFLOP/s — 2 x the
multiply-adds of exact attention, ``B * Hq * T * (D + Dv)`` (unpacking and dequantization not
counted) — and the rate that reading the cache at 50% of copy bandwidth would require. At 2 bits
the cache holds ~0.6 bytes per (token, kv head, channel) while attention does ``g = Hq / Hkv``
multiply-adds per channel for keys and as many for values, so a CPU decode kernel is compute-bound
well before it is memory-bound.

Several widths in one run (``--bits 2 3 4``): the KIVI rows for each width over the same keys, values and
query, interleaved round by round, so their ratios come from one run (the SDPA rows once).

    python benchmarks/bench_attention_cpu.py [--tokens 32768] [--bits 2] [--json]
    python benchmarks/bench_attention_cpu.py --tokens 8192 --bits 2 3 4 --threads 1 --skip reference,bf16
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from functools import partial

import torch

from common import set_threads, time_calls
from kivi import KiviConfig
from kivi.attention import blocked_attention, reference_attention
from kivi.attention.fused_cpu import SINGLE_SEQUENCE
from kivi.cache.layer import KiviLayer


def timeit(fn, repeat: int, warmup: int = 2) -> dict:
    ts = time_calls(fn, repeat, warmup)
    return {"min_s": min(ts), "median_s": statistics.median(ts)}


def copy_bandwidth(mib: int = 256, repeat: int = 10) -> dict:
    src = torch.randn(mib * 2**20 // 4)
    dst = torch.empty_like(src)
    t = timeit(lambda: dst.copy_(src), repeat)
    nbytes = src.numel() * 4
    return {"bytes": nbytes, "copy_GBps": nbytes / t["min_s"] / 1e9, "rw_GBps": 2 * nbytes / t["min_s"] / 1e9}


def matmul_gflops(n: int = 2048, repeat: int = 5) -> float:
    a, b = torch.randn(n, n), torch.randn(n, n)
    t = timeit(lambda: torch.mm(a, b), repeat)
    return 2 * n**3 / t["min_s"] / 1e9


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tokens", type=int, default=32768)
    ap.add_argument("--bits", type=int, nargs="+", default=[2], help="code widths (one row set each)")
    ap.add_argument("--batch", type=int, default=1)
    ap.add_argument("--q-heads", type=int, default=9)
    ap.add_argument("--kv-heads", type=int, default=3)
    ap.add_argument("--head-dim", type=int, default=64)
    ap.add_argument("--group-size", type=int, default=32)
    ap.add_argument("--residual-length", type=int, default=128)
    ap.add_argument("--block-tokens", type=int, default=2048)
    ap.add_argument("--repeat", type=int, default=10)
    ap.add_argument("--threads", type=int, default=0, help="torch and numba threads (0 = their defaults)")
    ap.add_argument("--json", action="store_true")
    ap.add_argument("--skip", default="", help="comma-separated methods to skip: reference,blocked,bf16")
    a = ap.parse_args()
    from kivi.attention.fused_cpu import fused_decode_attention

    compile_s = set_threads(a.threads, SINGLE_SEQUENCE)  # compile, or load numba's on-disk cache; None without numba
    fused = None if compile_s is None else fused_decode_attention
    torch.manual_seed(0)
    B, hq, hkv, D, T = a.batch, a.q_heads, a.kv_heads, a.head_dim, a.tokens
    k = torch.randn(B, hkv, T, D)
    v = torch.randn(B, hkv, T, D)
    q = torch.randn(B, hq, 1, D)
    scaling = D**-0.5

    def view_bytes(view):
        st = sum(t.numel() * t.element_size()
                 for _, seg in view.store.iter_blocks(view.split) for t in seg.tensors().values())
        return st + view.fp.numel() * view.fp.element_size()

    views = {}  # bits -> (key view, value view, bytes read)
    for bits in a.bits:
        cfg = KiviConfig(k_bits=bits, v_bits=bits, group_size=a.group_size, residual_length=a.residual_length)
        layer = KiviLayer(cfg)
        layer.append(k[:, :, :-1], v[:, :, :-1])
        kv, vv = layer.append(k[:, :, -1:], v[:, :, -1:])
        views[bits] = (kv, vv, view_bytes(kv) + view_bytes(vv))
    g = hq // hkv
    bw = copy_bandwidth()
    mm = matmul_gflops()
    flops = 2 * B * hq * T * (D + D)  # useful multiply-adds of one decode step, x2

    skip = set(filter(None, a.skip.split(",")))
    methods = []  # (name, bits or None, fn, bytes read)
    for bits, (kv, vv, qbytes) in views.items():
        if "reference" not in skip:
            methods.append(("reference (dequant+attend)", bits,
                            lambda kv=kv, vv=vv: reference_attention(q, kv, vv, scaling=scaling), qbytes))
        if "blocked" not in skip:
            methods.append(("blocked (kivi cpu)", bits, lambda kv=kv, vv=vv: blocked_attention(
                q, kv, vv, scaling=scaling, block_tokens=a.block_tokens), qbytes))
        if fused is not None:
            methods.append(("fused (numba)", bits, lambda kv=kv, vv=vv: fused(q, kv, vv, scaling=scaling), qbytes))
    for dt in (torch.float32, torch.bfloat16):
        if dt == torch.bfloat16 and "bf16" in skip:
            continue
        kf, vf, qf = k.to(dt), v.to(dt), q.to(dt).reshape(B, hkv, g, D)  # pack GQA as transformers does
        methods.append((f"sdpa fp cache {str(dt).split('.')[-1]}", None,
                        partial(torch.nn.functional.scaled_dot_product_attention, qf, kf, vf, scale=scaling),
                        2 * kf.numel() * kf.element_size()))
    times = {i: [] for i in range(len(methods))}
    for _, _, fn, _ in methods:  # warm-up
        fn()
        fn()
    for _ in range(a.repeat):  # rounds: every method once per round (ratios from the same conditions)
        for i, (_, _, fn, _) in enumerate(methods):
            t0 = time.perf_counter()
            fn()
            times[i].append(time.perf_counter() - t0)
    rows = []
    for i, (name, bits, _, nbytes) in enumerate(methods):
        t_min, t_med = min(times[i]), statistics.median(times[i])
        rows.append({
            "method": name, "bits": bits, "ms_min": t_min * 1e3, "ms_median": t_med * 1e3, "bytes_read": nbytes,
            "eff_GBps": nbytes / t_min / 1e9, "pct_of_rw_bw": 100 * nbytes / t_min / 1e9 / bw["rw_GBps"],
            "pct_of_copy_bw": 100 * nbytes / t_min / 1e9 / bw["copy_GBps"],
            "useful_GFLOPs": flops / t_min / 1e9,
        })
    # correctness of what was timed
    errs = {bits: {"blocked": (blocked_attention(q, kv, vv, scaling=scaling)
                               - reference_attention(q, kv, vv, scaling=scaling)).abs().max().item()}
            for bits, (kv, vv, _) in views.items()}
    if fused is not None:
        for bits, (kv, vv, _) in views.items():
            errs[bits]["fused"] = (fused(q, kv, vv, scaling=scaling)
                                   - reference_attention(q, kv, vv, scaling=scaling)).abs().max().item()
    qbytes = views[a.bits[0]][2]
    result = {"tokens": T, "bits": a.bits, "shape": {"batch": B, "q_heads": hq, "kv_heads": hkv, "head_dim": D},
              "threads": torch.get_num_threads(), "quantized_bytes": {b: x[2] for b, x in views.items()},
              "bandwidth": bw, "rows": rows, "matmul_GFLOPs": mm, "useful_flops_per_call": flops,
              "GFLOPs_needed_for_50pct_copy_bw": flops / (qbytes / (0.5 * bw["copy_GBps"] * 1e9)) / 1e9,
              "max_abs_err_vs_reference": errs, "fused_compile_or_load_s": compile_s}
    med = {(r["method"], r["bits"]): r["ms_median"] for r in rows}
    first = a.bits[0]
    result["ratios_of_medians"] = {
        bits: {key: val for key, val in (
            ("blocked_over_fused", med.get(("blocked (kivi cpu)", bits), 0) / med[("fused (numba)", bits)]
             if ("fused (numba)", bits) in med and ("blocked (kivi cpu)", bits) in med else None),
            (f"fused_over_fused_{first}bit", med[("fused (numba)", bits)] / med[("fused (numba)", first)]
             if ("fused (numba)", bits) in med else None),
        ) if val is not None} for bits in a.bits}
    if a.json:
        print(json.dumps(result, indent=2))
        return
    widths = "/".join(map(str, a.bits))
    print(f"{T} tokens, {widths}-bit K/V, B={B} Hq={hq} Hkv={hkv} D={D}, threads={torch.get_num_threads()}, "
          f"{a.repeat} interleaved rounds")
    for bits, (_, _, nbytes) in views.items():
        print(f"{bits}-bit: quantized cache read {nbytes / 2**20:.2f} MiB; "
              + ", ".join(f"max|{m}-ref|={e:.2e}" for m, e in errs[bits].items()))
    if fused is not None:
        print(f"numba compile/cache load {compile_s:.2f} s")
    print(f"copy bandwidth: {bw['copy_GBps']:.2f} GB/s copied ({bw['rw_GBps']:.2f} GB/s read+write); "
          f"float32 matmul: {mm:.1f} GFLOP/s")
    print(f"useful work per call: {flops / 1e6:.1f} MFLOP; reading the {a.bits[0]}-bit cache at 50% of copy bandwidth "
          f"would need {result['GFLOPs_needed_for_50pct_copy_bw']:.1f} GFLOP/s "
          f"({100 * result['GFLOPs_needed_for_50pct_copy_bw'] / mm:.0f}% of the matmul rate)")
    print(f"{'method':30s} {'bits':>4s} {'ms(min)':>9s} {'ms(med)':>9s} {'MiB read':>9s} {'eff GB/s':>9s} "
          f"{'%rw bw':>7s} {'%copy':>7s} {'GFLOP/s':>8s} {'%matmul':>8s}")
    for r in rows:
        print(f"{r['method']:30s} {r['bits'] or '-':>4} {r['ms_min']:9.3f} {r['ms_median']:9.3f} "
              f"{r['bytes_read'] / 2**20:9.2f} {r['eff_GBps']:9.2f} {r['pct_of_rw_bw']:7.1f} "
              f"{r['pct_of_copy_bw']:7.1f} {r['useful_GFLOPs']:8.1f} {100 * r['useful_GFLOPs'] / mm:8.1f}")
    for bits, ratios in result["ratios_of_medians"].items():
        if ratios:
            print(f"{bits}-bit, ratios of medians: " + ", ".join(f"{k} {v:.2f}" for k, v in ratios.items()))


if __name__ == "__main__":
    main()
