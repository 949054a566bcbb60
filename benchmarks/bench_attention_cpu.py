"""Decode attention alone over a long 2-bit KIVI cache (SmolLM2 shapes), CPU.

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

    python benchmarks/bench_attention_cpu.py [--tokens 32768] [--bits 2] [--json]
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import torch

from kivi import KiviConfig
from kivi.attention import blocked_attention, reference_attention
from kivi.cli.common import set_cpu_threads
from kivi.cache.layer import KiviLayer


def timeit(fn, repeat: int, warmup: int = 2) -> dict:
    for _ in range(warmup):
        fn()
    ts = []
    for _ in range(repeat):
        t0 = time.perf_counter()
        fn()
        ts.append(time.perf_counter() - t0)
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
    ap.add_argument("--bits", type=int, default=2)
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
    from kivi.attention.fused_cpu import fused_decode_available

    fused = None
    compile_s = None
    if fused_decode_available():
        from kivi.attention.fused_cpu import fused_decode_attention, warmup

        compile_s = warmup()  # compile, or load numba's on-disk cache
        fused = fused_decode_attention
    if a.threads:  # after the kernel load, which can reset torch's thread count to numba's
        set_cpu_threads(a.threads)
    torch.manual_seed(0)
    B, hq, hkv, D, T = a.batch, a.q_heads, a.kv_heads, a.head_dim, a.tokens
    cfg = KiviConfig(k_bits=a.bits, v_bits=a.bits, group_size=a.group_size, residual_length=a.residual_length)
    layer = KiviLayer(cfg)
    k = torch.randn(B, hkv, T, D)
    v = torch.randn(B, hkv, T, D)
    layer.append(k[:, :, :-1], v[:, :, :-1])
    kv, vv = layer.append(k[:, :, -1:], v[:, :, -1:])
    q = torch.randn(B, hq, 1, D)
    scaling = D**-0.5

    def view_bytes(view):
        st = sum(t.numel() * t.element_size() for _, seg in view.store.iter_blocks(view.split) for t in seg.tensors().values())
        return st + view.fp.numel() * view.fp.element_size()

    qbytes = view_bytes(kv) + view_bytes(vv)
    g = hq // hkv
    rows = []
    bw = copy_bandwidth()
    mm = matmul_gflops()
    flops = 2 * B * hq * T * (D + D)  # useful multiply-adds of one decode step, x2

    def add(name, fn, nbytes):
        t = timeit(fn, a.repeat)
        rows.append({
            "method": name, "ms_min": t["min_s"] * 1e3, "ms_median": t["median_s"] * 1e3, "bytes_read": nbytes,
            "eff_GBps": nbytes / t["min_s"] / 1e9, "pct_of_rw_bw": 100 * nbytes / t["min_s"] / 1e9 / bw["rw_GBps"],
            "pct_of_copy_bw": 100 * nbytes / t["min_s"] / 1e9 / bw["copy_GBps"],
            "useful_GFLOPs": flops / t["min_s"] / 1e9,
        })

    skip = set(filter(None, a.skip.split(",")))
    if "reference" not in skip:
        add("reference (dequant+attend)", lambda: reference_attention(q, kv, vv, scaling=scaling), qbytes)
    if "blocked" not in skip:
        add("blocked (kivi cpu)", lambda: blocked_attention(q, kv, vv, scaling=scaling, block_tokens=a.block_tokens), qbytes)
    if fused is not None:
        add("fused (numba)", lambda: fused(q, kv, vv, scaling=scaling), qbytes)
    for dt in (torch.float32, torch.bfloat16):
        if dt == torch.bfloat16 and "bf16" in skip:
            continue
        kf, vf, qf = k.to(dt), v.to(dt), q.to(dt).reshape(B, hkv, g, D)  # pack GQA as transformers does
        add(f"sdpa fp cache {str(dt).split('.')[-1]}",
            lambda kf=kf, vf=vf, qf=qf: torch.nn.functional.scaled_dot_product_attention(qf, kf, vf, scale=scaling),
            2 * kf.numel() * kf.element_size())
    # correctness of what was timed
    err = (blocked_attention(q, kv, vv, scaling=scaling) - reference_attention(q, kv, vv, scaling=scaling)).abs().max().item()
    result = {"tokens": T, "bits": a.bits, "shape": {"batch": B, "q_heads": hq, "kv_heads": hkv, "head_dim": D},
              "threads": torch.get_num_threads(), "quantized_bytes": qbytes, "bandwidth": bw, "rows": rows,
              "matmul_GFLOPs": mm, "useful_flops_per_call": flops,
              "GFLOPs_needed_for_50pct_copy_bw": flops / (qbytes / (0.5 * bw["copy_GBps"] * 1e9)) / 1e9,
              "max_abs_err_blocked_vs_reference": err, "fused_compile_or_load_s": compile_s}
    if fused is not None:
        result["max_abs_err_fused_vs_reference"] = (
            fused(q, kv, vv, scaling=scaling) - reference_attention(q, kv, vv, scaling=scaling)).abs().max().item()
    if a.json:
        print(json.dumps(result, indent=2))
        return
    print(f"{T} tokens, {a.bits}-bit K/V, B={B} Hq={hq} Hkv={hkv} D={D}, threads={torch.get_num_threads()}; "
          f"quantized cache read: {qbytes / 2**20:.2f} MiB; max|blocked-ref|={err:.2e}")
    if fused is not None:
        print(f"fused: max|fused-ref|={result['max_abs_err_fused_vs_reference']:.2e}, "
              f"numba compile/cache load {compile_s:.2f} s")
    print(f"copy bandwidth: {bw['copy_GBps']:.2f} GB/s copied ({bw['rw_GBps']:.2f} GB/s read+write); "
          f"float32 matmul: {mm:.1f} GFLOP/s")
    print(f"useful work per call: {flops / 1e6:.1f} MFLOP; reading the quantized cache at 50% of copy bandwidth "
          f"would need {result['GFLOPs_needed_for_50pct_copy_bw']:.1f} GFLOP/s "
          f"({100 * result['GFLOPs_needed_for_50pct_copy_bw'] / mm:.0f}% of the matmul rate)")
    print(f"{'method':30s} {'ms(min)':>9s} {'ms(med)':>9s} {'MiB read':>9s} {'eff GB/s':>9s} {'%rw bw':>7s} {'%copy':>7s} "
          f"{'GFLOP/s':>8s} {'%matmul':>8s}")
    for r in rows:
        print(f"{r['method']:30s} {r['ms_min']:9.3f} {r['ms_median']:9.3f} {r['bytes_read'] / 2**20:9.2f} "
              f"{r['eff_GBps']:9.2f} {r['pct_of_rw_bw']:7.1f} {r['pct_of_copy_bw']:7.1f} "
              f"{r['useful_GFLOPs']:8.1f} {100 * r['useful_GFLOPs'] / mm:8.1f}")


if __name__ == "__main__":
    main()
