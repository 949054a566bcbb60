#!/usr/bin/env python
"""Squared quantization error of SmolLM2's real keys and values, min/max vs MSE clipping (KiviConfig.clip),
with the scales / offsets stored in float32, float16 and bfloat16 (the screen's fp16 caveat).

Keys and values of ``--windows`` windows of ``--context`` tokens (one DynamicCache forward each, keys
after RoPE as the cache holds them) are quantized per layer with :func:`kivi.quant.kv.quantize_kv`;
the table gives, per side, bits and parameter dtype, the summed squared error with clipping relative to
min/max (lower is better; clipping can never exceed 1.0 by construction).

    python studies/clip_mse.py --windows 2 --out results/quality/clip12_mse.json
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch
from transformers import DynamicCache

from kivi.data import load_text, token_windows
from kivi.models import load_model
from kivi.quant.kv import dequantize_kv, quantize_kv

DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}


def sq_err(x: torch.Tensor, axis: str, bits: int, pdt: torch.dtype, clip: bool) -> float:
    p = quantize_kv(x, axis, bits, 32, param_dtype=pdt, clip=clip)
    return float(((dequantize_kv(p) - x) ** 2).sum())


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--windows", type=int, default=2)
    ap.add_argument("--context", type=int, default=1024)
    ap.add_argument("--out", required=True)
    a = ap.parse_args()
    torch.set_num_threads(1)
    model, tok = load_model("smollm2")
    wins = token_windows(tok, load_text(), a.context, a.windows)
    acc: dict[str, list[float]] = {}
    for w in range(wins.shape[0]):
        cache = DynamicCache()
        with torch.inference_mode():
            model(wins[w : w + 1], cache=cache, use_cache=True)
        for layer in cache.layers:
            for side, x, axis in (("keys", layer.keys, "channel"), ("values", layer.values, "token")):
                x = x.float()[:, :, : x.shape[-2] // 32 * 32]
                for bits in (2, 4):
                    for name, pdt in DTYPES.items():
                        key = f"{side} {bits}-bit, params {name}"
                        e = acc.setdefault(key, [0.0, 0.0])
                        e[0] += sq_err(x, axis, bits, pdt, False)
                        e[1] += sq_err(x, axis, bits, pdt, True)
    rows = [{"case": k, "sq_err_minmax": v[0], "sq_err_clip": v[1], "ratio": v[1] / v[0]} for k, v in acc.items()]
    for r in rows:
        print(f"{r['case']:32s} clip / min-max = {r['ratio']:.4f}")
    Path(a.out).write_text(json.dumps({"command": " ".join(sys.argv), "windows": a.windows, "context": a.context,
                                       "rows": rows}, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
