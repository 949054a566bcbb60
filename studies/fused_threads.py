"""Fused CPU decode kernel: thread pool vs calling thread, by call size (sets ``SERIAL_BELOW``).

For each batch and context, times ``fused_decode_attention(..., threaded=True)`` and
``threaded=False`` alternately (a torch matmul before every call, as between attention calls in a
decoder, so torch's own thread pool is awake) and prints the median ratio serial / threaded.
SmolLM2 shapes (9 query heads, 3 kv heads, head_dim 64), 2-bit K/V.

    python studies/fused_threads.py [--batches 1 4] [--contexts 512 1024 ...] [--repeat 30]

``NUMBA_THREADING_LAYER`` picks numba's pool (``omp``, ``tbb``, ``workqueue``).
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from kivi import KiviConfig
from kivi.cache.layer import KiviLayer


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--batches", type=int, nargs="+", default=[1, 4])
    ap.add_argument("--contexts", type=int, nargs="+", default=[512, 1024, 2048, 4096, 8192, 16384])
    ap.add_argument("--repeat", type=int, default=30)
    a = ap.parse_args()
    import numba

    from kivi.attention.fused_cpu import fused_decode_attention, warmup

    warmup()
    torch.manual_seed(0)
    w, x = torch.randn(576, 1536), torch.randn(4, 576)
    hq, hkv, d = 9, 3, 64
    print(f"numba threads {numba.get_num_threads()} (NUMBA_THREADING_LAYER={numba.config.THREADING_LAYER}), "
          f"torch threads {torch.get_num_threads()}")
    for b in a.batches:
        for t in a.contexts:
            layer = KiviLayer(KiviConfig(k_bits=2, v_bits=2, group_size=32, residual_length=128))
            k, v = torch.randn(b, hkv, t, d), torch.randn(b, hkv, t, d)
            layer.append(k[:, :, :-1], v[:, :, :-1])
            kv, vv = layer.append(k[:, :, -1:], v[:, :, -1:])
            q = torch.randn(b, hq, 1, d)
            times: dict[bool, list[float]] = {True: [], False: []}
            for _ in range(a.repeat):
                for threaded in (True, False):
                    _ = x @ w
                    t0 = time.perf_counter()
                    fused_decode_attention(q, kv, vv, threaded=threaded)
                    times[threaded].append(time.perf_counter() - t0)
            mt, ms = statistics.median(times[True]), statistics.median(times[False])
            if b == a.batches[0] and t == a.contexts[0]:
                print(f"threading layer in use: {numba.threading_layer()}")
            print(f"B={b} T={t:6d} units={b * hkv * t:7d}  threaded {mt * 1e3:7.3f} ms  serial {ms * 1e3:7.3f} ms  "
                  f"serial/threaded {ms / mt:.2f}")


if __name__ == "__main__":
    main()
