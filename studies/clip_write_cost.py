#!/usr/bin/env python
"""Write-path cost of KiviConfig.clip on SmolLM2's shapes (3 kv heads, head_dim 64, 2-bit, G=32):
one decode token's values (compiled numba writer and the torch reference) and one key group of 32 tokens
(torch; keys leave the window once every 32 tokens). Interleaved, best of 3 x 3 x 200 calls, 1 thread.

    OMP_NUM_THREADS=1 python studies/clip_write_cost.py
"""

from __future__ import annotations

import timeit
from functools import partial

import torch

from kivi.quant.fused_cpu import quantize_tokens_into
from kivi.quant.kv import quantize_kv


def main() -> None:
    torch.set_num_threads(1)
    v = torch.randn(1, 3, 1, 64)
    k = torch.randn(1, 3, 32, 64)
    pk = torch.empty(1, 3, 1, 16, dtype=torch.uint8)
    sc, of = torch.empty(1, 3, 1, 2), torch.empty(1, 3, 1, 2)
    cases = {
        "value token, numba": lambda c: quantize_tokens_into(v, 2, 32, pk, sc, of, clip=c),
        "value token, torch": lambda c: quantize_kv(v, "token", 2, 32, clip=c),
        "key group (32 tokens), torch": lambda c: quantize_kv(k, "channel", 2, 32, clip=c),
    }
    for f in cases.values():
        f(False), f(True)
    best: dict = {}
    for _ in range(3):
        for name, f in cases.items():
            for clip in (False, True):
                t = min(timeit.repeat(partial(f, clip), number=200, repeat=3)) / 200 * 1e6
                best[(name, clip)] = min(best.get((name, clip), float("inf")), t)
    for name in cases:
        a, b = best[(name, False)], best[(name, True)]
        print(f"{name:30s} min/max {a:9.1f} us   clip {b:9.1f} us   x{b / a:.1f}")


if __name__ == "__main__":
    main()
