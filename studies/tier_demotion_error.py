#!/usr/bin/env python
"""How much a 4 -> 2 bit demotion of KIVI codes loses, and whether re-fitting the range pays.

For keys (per channel, groups of 32 tokens) and values (per token, groups of 32 channels) of random
data and of SmolLM2's real keys/values (one WikiText-2 window, every layer), the error against the
full-precision input of:

* ``direct2``  — 2-bit quantization of the full-precision input (what a cache that kept an FP copy
  could store; the floor for any demotion);
* ``demote``   — ``kivi.quant.demote.demote_kv``: the 4-bit codes rounded onto the 2-bit grid of the
  same range (scale * 5, offset unchanged; what position tiers store);
* ``refit``    — min/max 2-bit quantization of the dequantized 4-bit values (a new range from them);
* ``refit_mse`` — 2-bit quantization of the dequantized 4-bit values with the library's MSE clipping
  (``quantize_kv(..., clip=True)``: per group, the range shrink that minimises the error against those
  4-bit values; docs/quality.md);
* ``four``     — the 4-bit codes themselves, for scale.

Reported: relative MSE ``sum (x - x_hat)^2 / sum x^2`` (lower is better) per side and data set.

    python studies/tier_demotion_error.py --out results/tiers/tiers12_demotion_error.json
"""

from __future__ import annotations

import argparse
import json
import shlex
import sys
from pathlib import Path

import torch

from kivi.quant.demote import demote_kv
from kivi.quant.kv import dequantize_kv, quantize_kv

G = 32


def errors(x: torch.Tensor, axis: str) -> dict[str, float]:
    x = x.float()
    p4 = quantize_kv(x, axis, 4, G)
    x4 = dequantize_kv(p4)

    def rel(y: torch.Tensor) -> float:
        return float(((x - y) ** 2).sum() / (x**2).sum())

    return {
        "four": rel(x4),
        "direct2": rel(dequantize_kv(quantize_kv(x, axis, 2, G))),
        "demote": rel(dequantize_kv(demote_kv(p4, 2))),
        "refit": rel(dequantize_kv(quantize_kv(x4, axis, 2, G))),
        "refit_mse": rel(dequantize_kv(quantize_kv(x4, axis, 2, G, clip=True))),
    }


def real_kv(context: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    from transformers import DynamicCache

    from kivi.data import load_text, token_windows
    from kivi.models import load_model

    model, tok = load_model("smollm2")
    ids = token_windows(tok, load_text(), context, 1)[0]
    cache = DynamicCache()
    with torch.inference_mode():
        model(ids.view(1, -1), past_key_values=cache, use_cache=True)
    return [(layer.keys, layer.values) for layer in cache.layers]


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--context", type=int, default=1024, help="tokens of the real window (multiple of 32)")
    ap.add_argument("--out", type=Path, default=None)
    args = ap.parse_args(argv)
    torch.manual_seed(0)
    rows = {}
    rnd = torch.randn(1, 4, 1024, 64)
    rows["random_normal"] = {"keys": errors(rnd, "channel"), "values": errors(rnd, "token")}
    heavy = torch.distributions.StudentT(3.0).sample((1, 4, 1024, 64))
    rows["random_student_t3"] = {"keys": errors(heavy, "channel"), "values": errors(heavy, "token")}
    layers = real_kv(args.context)
    k = torch.cat([kk for kk, _ in layers], dim=1)  # [1, layers x heads, T, D]
    v = torch.cat([vv for _, vv in layers], dim=1)
    rows["smollm2_wikitext"] = {"keys": errors(k, "channel"), "values": errors(v, "token")}
    cmd = "python " + " ".join(shlex.quote(a) for a in [sys.argv[0], *(argv if argv is not None else sys.argv[1:])])
    out = {"command": cmd, "group_size": G, "metric": "relative MSE sum((x - x_hat)^2) / sum(x^2)", "rows": rows}
    text = json.dumps(out, indent=2)
    print(text)
    if args.out:
        args.out.write_text(text + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
