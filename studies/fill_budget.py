"""Largest context that fits a fixed cache budget, measured by actually filling the caches.

    python studies/fill_budget.py [--budget 1GiB] [--dtype float16] [--json out.json]

SmolLM2-135M cache shapes (30 layers, 3 KV heads, head_dim 64), batch 1. Random keys/values are
appended in chunks of 1024 tokens (a prefill of 1024, then more chunks) to a transformers
DynamicCache and to a KiviCache (2/2, G=32, R=128; also 4/4), layer by layer as a model would, until
the cache's real bytes exceed the budget; the answer is the last token count that fit. No model
forward is needed: only storage is being measured.
"""

from __future__ import annotations

import argparse
import json
from functools import partial

import torch
from transformers import DynamicCache

from kivi import KiviCache, KiviConfig
from kivi.eval import cache_nbytes
from kivi.memory import parse_bytes

LAYERS, HEADS, HEAD_DIM = 30, 3, 64


def fill(make, budget: int, dtype, chunk: int) -> int:
    cache = make()
    g = torch.Generator().manual_seed(0)
    tokens = 0
    while True:
        k = torch.randn(1, HEADS, chunk, HEAD_DIM, generator=g).to(dtype)
        v = torch.randn(1, HEADS, chunk, HEAD_DIM, generator=g).to(dtype)
        for layer in range(LAYERS):
            cache.update(k, v, layer)
        if cache_nbytes(cache) > budget:
            return tokens
        tokens += chunk


def main() -> None:
    from kivi.allocator import reduce_fragmentation

    reduce_fragmentation()
    ap = argparse.ArgumentParser()
    ap.add_argument("--budget", default="1GiB")
    ap.add_argument("--dtype", default="float16", choices=["float16", "bfloat16", "float32"])
    ap.add_argument("--chunk", type=int, default=1024)
    ap.add_argument("--json", default=None)
    a = ap.parse_args()
    budget = parse_bytes(a.budget)
    dtype = getattr(torch, a.dtype)
    rows = {"budget_bytes": budget, "dtype": a.dtype, "chunk": a.chunk, "shape": [LAYERS, HEADS, HEAD_DIM]}
    rows["fp_dynamic_cache_tokens"] = fill(lambda: DynamicCache(), budget, dtype, a.chunk)
    for name, cfg in (("kivi_2_2", KiviConfig()), ("kivi_4_4", KiviConfig.preset("high"))):
        # A packed-attention cache: update() only stores (and returns views), nothing is dequantized.
        rows[f"{name}_tokens"] = fill(partial(KiviCache, cfg, attention_backend="cpu"), budget, dtype, a.chunk)
    rows["kivi_2_2_over_fp"] = rows["kivi_2_2_tokens"] / rows["fp_dynamic_cache_tokens"]
    rows["kivi_4_4_over_fp"] = rows["kivi_4_4_tokens"] / rows["fp_dynamic_cache_tokens"]
    print(json.dumps(rows, indent=2))
    if a.json:
        with open(a.json, "w") as f:
            json.dump(rows, f, indent=2)


if __name__ == "__main__":
    main()
