"""Per-call cost of the ``"cpu"`` backend's dispatch (fused kernel or blocked path) at one decode step.

Times, for one layer at SmolLM2 shapes (9 query heads, 3 kv heads, head_dim 64, K2V2, G=32, R=128,
a mask-free decode step), ``run_backend`` over the step's views with the backend a cache holds
(``CpuBackend(config)``: stored formats decided once), with a backend named for the call (formats
scanned per call), the kernel alone (``fused_decode_attention``), and the qualification checks alone
(``fused_decode_supported``, scanning or not). Medians of ``--repeat`` calls each.

    python studies/dispatch_cost.py [--context 2048] [--repeat 2000]
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from kivi import KiviConfig
from kivi.cache.layer import KiviLayer


def _median_us(fn, repeat: int) -> float:
    times = []
    for _ in range(repeat):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times) * 1e6


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--context", type=int, default=2048)
    ap.add_argument("--repeat", type=int, default=2000)
    a = ap.parse_args()
    from kivi.attention.fused_cpu import fused_decode_attention, fused_decode_supported, warmup
    from kivi.attention.interface import run_backend
    from kivi.backends import CpuBackend, backend_named

    warmup()
    torch.manual_seed(0)
    cfg = KiviConfig(k_bits=2, v_bits=2, group_size=32, residual_length=128)
    layer = KiviLayer(cfg)
    hq, hkv, d, t = 9, 3, 64, a.context
    k, v = torch.randn(1, hkv, t, d), torch.randn(1, hkv, t, d)
    layer.append(k[:, :, :-1], v[:, :, :-1])
    kv, vv = layer.append(k[:, :, -1:], v[:, :, -1:])
    q = torch.randn(1, hq, 1, d)
    cached, named = CpuBackend(cfg), backend_named("cpu")
    rows = {"run_backend, cache's backend": lambda: run_backend(cached, q, kv, vv, scaling=None, attention_mask=None),
            "run_backend, named backend": lambda: run_backend(named, q, kv, vv, scaling=None, attention_mask=None),
            "fused_decode_attention (kernel)": lambda: fused_decode_attention(q, kv, vv),
            "checks, formats decided once": lambda: fused_decode_supported(q, kv, vv, None, formats_checked=True),
            "checks, formats scanned": lambda: fused_decode_supported(q, kv, vv, None)}
    for fn in rows.values():
        fn()
    res = {name: _median_us(fn, a.repeat) for name, fn in rows.items()}
    for name, us in res.items():
        print(f"{name:36s} {us:8.1f} us")
    full, _, kernel, _, _ = res.values()
    print(f"{'dispatch overhead (cache backend)':36s} {full - kernel:8.1f} us")


if __name__ == "__main__":
    main()
