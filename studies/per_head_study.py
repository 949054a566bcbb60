"""Per-head widths on a real model: a profile-chosen per-head mix vs the base config and vs a per-layer
mix at the same bits per element (docs/per-head.md).

1. ``head_profile`` on ``--profile-windows`` windows taken AFTER the evaluation windows (disjoint text);
2. ``recommend_head_bits`` at ``--max-bits`` (bits per element as the planner counts them: float16 model, 32K tokens),
   per head and per layer (same proxy, same greedy rule, whole layer-sides);
3. ``compare`` (the streaming protocol of ``kivi eval ppl``) of FP, base, per-head, per-layer on the
   first ``--windows`` windows; bits per element also from ``cache.nbytes`` after a 32K float16 fill.

    python studies/per_head_study.py --windows 1 --profile-windows 1 --context 512 --prefix 256 \
        --max-bits 3.3 --nbytes-tokens 8192 -o results/quality/perhead_smollm2
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import time
from pathlib import Path

import torch

from kivi import KiviConfig, quantize_model
from kivi.data import load_text, token_windows
from kivi.eval.caches import synthetic_bits
from kivi.eval.head_profile import bits_per_element, head_profile, recommend_head_bits
from kivi.eval.stream import compare
from kivi.memory.sources import model_spec
from kivi.models import load_model


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--model", default="smollm2")
    p.add_argument("--windows", type=int, default=4)
    p.add_argument("--profile-windows", type=int, default=2)
    p.add_argument("--context", type=int, default=1024)
    p.add_argument("--prefix", type=int, default=512)
    p.add_argument("--chunk", type=int, default=16)
    p.add_argument("--max-bits", type=float, default=3.3)
    p.add_argument("--sink-tokens", type=int, default=4)
    p.add_argument("--nbytes-tokens", type=int, default=32768,
                   help="tokens of the float16 fill (one prefill) whose cache.nbytes gives the measured bits")
    p.add_argument("-o", "--output", default="results/quality/perhead_smollm2")
    args = p.parse_args()

    torch.manual_seed(0)
    model, tok = load_model(args.model)
    wins = token_windows(tok, load_text(), args.context, args.windows + args.profile_windows)
    evalw, profw = wins[: args.windows], wins[args.windows:]
    base = KiviConfig(k_bits=2, v_bits=2, sink_tokens=args.sink_tokens, attention_backend="cpu")
    t0 = time.perf_counter()
    prof = head_profile(model, profw, base, bits=(2, 4), prefix=args.prefix)
    t_prof = time.perf_counter() - t0
    spec = model_spec(model)
    head_cfg, head_bits = recommend_head_bits(prof, spec, args.max_bits)
    layer_cfg, layer_bits = recommend_head_bits(prof, spec, head_bits, granularity="layer")
    cands = {"base K2V2+sink": base, "per-head mix": head_cfg, "per-layer mix": layer_cfg}
    quantize_model(model, base)  # the "kivi" attention: every cache below reads through the cpu backend
    out = compare(model, evalw, list(cands.values()), prefix=args.prefix, chunk=args.chunk)
    rows = []
    for (name, cfg), r in zip(cands.items(), out["results"]):
        if "unavailable" in r:
            raise SystemExit(f"{name}: {r['unavailable']}")
        rows.append({"name": name, "config": cfg.to_dict(), "describe": cfg.describe(),
                     "bits_planner_fp16_32k": bits_per_element(spec, cfg, 32768),
                     "bits_planner_fp16_fill": bits_per_element(spec, cfg, args.nbytes_tokens),
                     "bits_nbytes_fp16_fill": synthetic_bits(
                         model, dataclasses.replace(cfg, attention_backend="reference"), args.nbytes_tokens,
                         dtype=torch.float16),
                     "bits_nbytes_eval": r.get("bits_per_element"), "ppl": r["ppl"],
                     "delta_ppl_pct": r["delta_ppl_pct"], "kl": r["kl"], "top1_agreement": r["top1_agreement"]})
    res = {"protocol": out["protocol"], "fp_ppl": out["fp"]["ppl"], "profile_seconds": t_prof,
           "profile_windows": args.profile_windows, "max_bits": args.max_bits, "rows": rows, "profile": prof}
    Path(args.output + ".json").write_text(json.dumps(res, indent=1) + "\n")
    lines = [f"FP ppl {res['fp_ppl']:.4f}; {args.windows} windows x {args.context} (prefix {args.prefix}, chunk "
             f"{args.chunk}); profile {args.profile_windows} other windows, {t_prof:.0f} s",
             f"{'config':16s} {'bits(plan,32K)':>14s} {'plan,fill':>10s} {'nbytes,fill':>11s} {'dppl%':>8s} "
             f"{'KL':>9s} {'top1%':>7s}   (fill: one float16 prefill of {args.nbytes_tokens} tokens)"]
    for r in rows:
        lines.append(f"{r['name']:16s} {r['bits_planner_fp16_32k']:14.4f} {r['bits_planner_fp16_fill']:10.4f} "
                     f"{r['bits_nbytes_fp16_fill']:11.4f} "
                     f"{r['delta_ppl_pct']:+8.2f} {r['kl']:9.5f} {100 * r['top1_agreement']:7.2f}")
    for r in rows[1:]:
        lines.append(f"{r['name']}: head_bits={r['config']['head_bits']} layer_specific_config="
                     f"{r['config']['layer_specific_config']}")
    Path(args.output + ".txt").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
