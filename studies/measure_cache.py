"""Measure what KiviCache really stores, and what padding costs, on the embedded SmolLM2.

    python studies/measure_cache.py [--tokens 4096] [--json out.json]

1. Memory: prefill ``--tokens`` WikiText-2 tokens into a KiviCache (2/2, G=32, R=128) and into a
   DynamicCache of the same dtype; compare ``cache.nbytes`` with the DynamicCache tensors and with
   the analytic expectation (packed codes + one scale and one zero-point per group + the
   full-precision window).
2. Padding: a left-padded row of a batch vs the same prompt alone, after prefill and 64 tokens fed
   through the quantized cache in chunks of 16: max |Δlogit| and mean KL.
"""

from __future__ import annotations

import argparse
import json
import platform

import torch
import torch.nn.functional as F

from kivi import KiviConfig, quantize_model
from kivi.data import load_text
from kivi.eval import cache_nbytes, make_cache
from kivi.models import load_model
from kivi.quant.packing import packed_size


def analytic_bytes(cfg: KiviConfig, layers: int, kv_heads: int, head_dim: int, tokens: int, elem: int, batch: int = 1):
    R, G = cfg.residual_length, cfg.group_size
    nk = max(0, (tokens - R) // G * G)  # quantized keys: whole groups only
    nv = max(0, tokens - R)
    per_head = (
        nk * packed_size(head_dim, cfg.k_bits) + 2 * elem * (nk // G) * head_dim  # key codes + scale/zero per group
        + nv * packed_size(head_dim, cfg.v_bits) + 2 * elem * nv * (head_dim // G)  # value codes + scale/zero
        + (tokens - nk) * head_dim * elem + (tokens - nv) * head_dim * elem  # full-precision windows
    )
    return per_head * layers * kv_heads * batch


def memory(model, ids, cfg):
    c = model.config
    kv_heads, head_dim = c.num_key_value_heads, c.hidden_size // c.num_attention_heads
    with torch.no_grad():
        kc = make_cache(model, cfg)
        model(ids, cache=kc)
        dyn = make_cache(model, None)
        model(ids, cache=dyn)
    dyn_bytes = cache_nbytes(dyn)
    elem = model.dtype.itemsize
    expect = analytic_bytes(cfg, c.num_hidden_layers, kv_heads, head_dim, ids.shape[1], elem)
    return {
        "tokens": ids.shape[1],
        "dtype": str(model.dtype),
        "config": cfg.describe(),
        "kivi_nbytes": kc.nbytes,
        "breakdown": kc.memory_breakdown(),
        "dynamic_cache_bytes": dyn_bytes,
        "analytic_bytes": expect,
        "ratio_vs_dynamic": dyn_bytes / kc.nbytes,
        "measured_over_analytic": kc.nbytes / expect,
    }


def padding(model, all_ids, cfg, prompt_len=300, short_len=237, steps=64, chunk=16):
    a = all_ids[:prompt_len + steps]
    b = all_ids[5000:5000 + short_len + steps]
    pad = prompt_len - short_len
    ids = torch.stack([a, torch.cat([torch.zeros(pad, dtype=torch.long), b])])
    mask = torch.ones_like(ids)
    mask[1, :pad] = 0
    quantize_model(model, cfg)
    with torch.no_grad():
        cb = make_cache(model, cfg)
        ca = make_cache(model, cfg)
        lb = [model(ids[:, :prompt_len], attention_mask=mask[:, :prompt_len], cache=cb).logits[1, pad:]]
        la = [model(b[None, :short_len], cache=ca).logits[0]]
        for s in range(prompt_len, prompt_len + steps, chunk):
            lb.append(model(ids[:, s:s + chunk], attention_mask=mask[:, :s + chunk], cache=cb).logits[1])
            la.append(model(b[None, s - pad:s - pad + chunk], cache=ca).logits[0])
    lb, la = torch.cat(lb), torch.cat(la)
    dec_b, dec_a = lb[short_len:], la[short_len:]
    kl = F.kl_div(F.log_softmax(dec_b, -1), F.log_softmax(dec_a, -1), log_target=True, reduction="batchmean")
    return {
        "prefill_max_abs_logit_diff": (lb[:short_len] - la[:short_len]).abs().max().item(),
        "decode_max_abs_logit_diff": (dec_b - dec_a).abs().max().item(),
        "decode_mean_kl": kl.item(),
        "decode_top1_agreement": (dec_b.argmax(-1) == dec_a.argmax(-1)).float().mean().item(),
        "note": "padding shifts the row's absolute group boundaries, so its quantized history differs slightly",
    }


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--tokens", type=int, default=4096)
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    model, tok = load_model("smollm2")
    ids = tok(load_text()[:400_000], return_tensors="pt", add_special_tokens=False).input_ids[0]
    cfg = KiviConfig(k_bits=2, v_bits=2, group_size=32, residual_length=128)
    out = {"machine": f"{platform.machine()} {torch.get_num_threads()} threads",
           "memory": memory(model, ids[None, : args.tokens], cfg)}
    out["padding"] = padding(model, ids, cfg)
    print(json.dumps(out, indent=2))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(out, f, indent=2)


if __name__ == "__main__":
    main()
