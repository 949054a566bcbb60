#!/usr/bin/env python
"""Total memory of weights + KV cache for weight widths x caches: planned, and measured where it is cheap.

For every ``--weight-bits`` width the model is loaded and quantized (``kivi.models.quantize_weights``) and
its real tensor bytes are measured (``kivi.models.weight_bytes``: the storages of its ``state_dict``, quanto's
codes and scales included) next to the planner's ``estimate_kv_memory(..., weight_bits=b).weights_bytes``.
The cache at ``--context`` comes from the planner (byte-exact against ``KiviCache.nbytes``, tests/test_memory.py);
with ``--measure-prefill N`` every (width, cache) pair also runs a real prefill of N tokens of WikiText-2 and
records the cache's bytes (``kivi.eval.cache_nbytes``) next to the planner's at N.

    OMP_NUM_THREADS=1 python benchmarks/weights_memory.py --context 8192 --measure-prefill 1024 \\
        --threads 1 --out results/weights/weights_memory_8k.json
"""

from __future__ import annotations

import argparse
import json
import sys
import time

import torch

from common import set_threads, write_json
from kivi import KiviConfig
from kivi.data import load_text, token_windows
from kivi.eval import cache_nbytes, make_cache
from kivi.memory import estimate_kv_memory
from kivi.models import load_model, quantize_weights, weight_bytes

CACHES = {"fp": None, "extreme": KiviConfig.preset("extreme"), "balanced": KiviConfig.preset("balanced")}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="smollm2")
    ap.add_argument("--weight-bits", default="16,8,4")
    ap.add_argument("--context", type=int, default=8192)
    ap.add_argument("--measure-prefill", type=int, default=0, help="tokens of a real prefill per pair (0 = none)")
    ap.add_argument("--threads", type=int, default=None)
    ap.add_argument("--out", required=True)
    a = ap.parse_args()
    if a.threads:
        set_threads(a.threads)
    rows = []
    ids = None
    for bits in (int(x) for x in a.weight_bits.split(",")):
        model, tok = quantize_weights(load_model(a.model)[0], bits), None
        if a.measure_prefill and ids is None:
            tok = load_model(a.model)[1]
            ids = token_windows(tok, load_text(), a.measure_prefill, 1)[:1]
        measured_w = weight_bytes(model)
        for name, cfg in CACHES.items():
            est = estimate_kv_memory(model, a.context, config=cfg or KiviConfig(), weight_bits=bits)
            cache = est.fp_total_bytes if cfg is None else est.kivi_total_bytes
            row = {"weight_bits": bits, "cache": name, "cache_config": cfg.describe() if cfg else "DynamicCache (fp)",
                   "context": a.context, "weights_bytes_planned": est.weights_bytes,
                   "weights_bytes_measured": measured_w, "weights_breakdown": est.weights_breakdown,
                   "cache_bytes_planned": cache, "total_bytes": measured_w + cache}
            if a.measure_prefill:
                t0 = time.time()
                c = make_cache(model, cfg)
                with torch.inference_mode():
                    model(input_ids=ids, cache=c, use_cache=True, logits_to_keep=1)
                short = estimate_kv_memory(model, a.measure_prefill, config=cfg or KiviConfig(), weight_bits=bits)
                row.update(prefill_tokens=a.measure_prefill, prefill_cache_bytes_measured=cache_nbytes(c),
                           prefill_cache_bytes_planned=short.fp_total_bytes if cfg is None else short.kivi_total_bytes,
                           prefill_seconds=round(time.time() - t0, 1))
                del c
            rows.append(row)
            print(json.dumps(row), file=sys.stderr, flush=True)
        del model
    out = {"model": a.model, "command": " ".join(["python", *sys.argv]), "torch_threads": torch.get_num_threads(),
           "note": "cache bytes at --context from the planner (byte-exact vs KiviCache.nbytes in the tests); weights "
                   "measured from the loaded quantized model's tensors", "rows": rows}
    write_json(a.out, out)
    print(f"{'weights':>8s} {'cache':>9s} {'weights B':>12s} {'cache B':>12s} {'total MiB':>10s}")
    for r in rows:
        print(f"{r['weight_bits']:>8d} {r['cache']:>9s} {r['weights_bytes_measured']:>12,d} "
              f"{r['cache_bytes_planned']:>12,d} {r['total_bytes'] / 2**20:>10.1f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
