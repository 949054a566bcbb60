#!/usr/bin/env python
"""Screen error-compensation ideas for 2-bit KIVI against simply spending the bits on wider codes.

Issue: the spec's §2.3 "residual compensation" (per group, the mean quantization error on a few
bits) barely helps, because round-to-nearest errors have near-zero means by construction. This
script measures alternatives side by side so the choice rests on numbers:

* ``K2V2`` (plain KIVI) and wider codes at the same extra cost (``K3V2``, ``K3V3``);
* the spec's group mean (stored exactly: an upper bound for any ``residual_bits``);
* a 1-bit sign correction of the residual per element with a per-group magnitude (``signres``);
* a low-rank (SVD) correction of the residual per head, rank 1..8, factors in fp16 (GEAR-like);
* a per-channel mean correction for values over blocks of tokens;
* zero-storage changes: full-precision sink tokens (out of the statistics), MSE-optimal clipping.

**This is a screening protocol, not the streaming perplexity of ``kivi eval``**: each window of
``--context`` tokens goes through the model in one forward; in every layer the keys/values of all
but the last ``R`` tokens (rounded down to whole groups) are replaced by their fake-quantized
versions before attention, so every query sees a quantized history (harsher than generation,
where a query sees its own recent window in full precision). Perplexity and KL vs full precision
are measured on the second half of each window. Winners are then confirmed with real caches
(``benchmarks/run_eval_suite.py``); see results/README.md.

``bits`` = average stored bits per quantized element (keys and values averaged), counting codes,
fp16 scale + zero-point per group of 32, and each method's extra storage.

    python benchmarks/compensation_study.py --windows 4 --out results/compensation_study.json
"""

from __future__ import annotations

import argparse
import json
import math
import sys
import time
from pathlib import Path

import torch
from transformers import AttentionInterface, AttentionMaskInterface
from transformers.integrations.sdpa_attention import sdpa_attention_forward
from transformers.masking_utils import sdpa_mask

from kivi.data import load_text, token_windows
from kivi.models import load_model
from kivi.quant.primitives import dequantize_groups, quantize_groups

G = 32
PARAM_BITS = 2 * 16 / G  # fp16 scale + zero-point per group, per element


def fq(x: torch.Tensor, bits: int, axis: int, valid: torch.Tensor | None = None) -> torch.Tensor:
    """KIVI fake quantization (keys: axis=-2 per channel, values: axis=-1 per token)."""
    c, s, o = quantize_groups(x, bits, G, axis, valid=valid)
    return dequantize_groups(c, s, o, bits, G, axis)


def _grouped(x: torch.Tensor, axis: int) -> tuple[torch.Tensor, int]:
    a = axis % x.dim()
    shape = list(x.shape)
    shape[a : a + 1] = [shape[a] // G, G]
    return x.reshape(shape), a + 1


def plain(kb: int, vb: int):
    return lambda k, v: (fq(k, kb, -2), fq(v, vb, -1))


def group_mean(k, v):
    def one(x, axis):
        xh = fq(x, 2, axis)
        eg, red = _grouped(x - xh, axis)
        xg, _ = _grouped(xh, axis)
        return (xg + eg.mean(red, keepdim=True)).reshape(x.shape)
    return one(k, -2), one(v, -1)


def sign_residual(on_v: bool):
    def one(x, axis):
        xh = fq(x, 2, axis)
        eg, red = _grouped(x - xh, axis)
        xg, _ = _grouped(xh, axis)
        mag = eg.abs().mean(red, keepdim=True).half().float()
        return (xg + torch.sign(eg) * mag).reshape(x.shape)
    return lambda k, v: (one(k, -2), one(v, -1) if on_v else fq(v, 2, -1))


def low_rank(rk: int, rv: int):
    def one(x, axis, r):
        xh = fq(x, 2, axis)
        if r == 0:
            return xh
        u, s, vh = torch.linalg.svd(x - xh, full_matrices=False)
        a = (u[..., :r] * s[..., None, :r]).half().float()
        return xh + a @ vh[..., :r, :].half().float()
    return lambda k, v: (one(k, -2, rk), one(v, -1, rv))


def value_channel_mean(block: int):
    def f(k, v):
        vh = fq(v, 2, -1)
        B, H, T, D = v.shape
        if T % block:
            return fq(k, 2, -2), vh
        e = (v - vh).reshape(B, H, T // block, block, D).mean(3, keepdim=True).half().float()
        return fq(k, 2, -2), (vh.reshape(B, H, T // block, block, D) + e).reshape(v.shape)
    return f


def sinks(n: int):
    def one(x, axis):
        valid = torch.ones(x.shape, dtype=torch.bool)
        valid[:, :, :n] = False
        xh = fq(x, 2, axis, valid=valid)
        xh[:, :, :n] = x[:, :, :n]
        return xh
    return lambda k, v: (one(k, -2), one(v, -1))


def clipped(ratios=(1.0, 0.95, 0.9, 0.85, 0.8, 0.75, 0.7)):
    def one(x, axis, bits=2):
        xg, red = _grouped(x, axis)
        lo, hi = xg.amin(red, keepdim=True), xg.amax(red, keepdim=True)
        levels = 2**bits - 1
        best = best_err = None
        for r in ratios:  # shrink the range around its middle, keep the lowest squared error
            mid, half = (lo + hi) / 2, (hi - lo) / 2 * r
            s = (2 * half / levels).clamp_min(1e-12)
            q = torch.round((xg - (mid - half)) / s).clamp(0, levels) * s + (mid - half)
            err = ((q - xg) ** 2).sum(red, keepdim=True)
            if best is None:
                best, best_err = q, err
            else:
                better = err < best_err
                best, best_err = torch.where(better, q, best), torch.where(better, err, best_err)
        return best.reshape(x.shape)
    return lambda k, v: (one(k, -2), one(v, -1))


def candidates(T: int, D: int) -> list[tuple[str, float, object]]:
    """(name, average stored bits per quantized element, transform) — T quantized tokens, head_dim D."""
    base = 2 + PARAM_BITS
    lr = lambda r: r * (T + D) * 16 / (T * D)  # noqa: E731  fp16 factors of a rank-r correction
    return [
        ("K2V2 (KIVI)", base, plain(2, 2)),
        ("K3V2", base + 0.5, plain(3, 2)),
        ("K3V3", base + 1, plain(3, 3)),
        ("K4V2", base + 1, plain(4, 2)),
        ("K2V2 + group mean (spec, exact)", base + 4 / G, group_mean),  # as if stored on 4 bits
        ("K2V2 + 1-bit sign residual K", base + 0.5 * (1 + 16 / G), sign_residual(False)),
        ("K2V2 + 1-bit sign residual KV", base + 1 + 16 / G, sign_residual(True)),
        ("K2V2 + low-rank K r1", base + 0.5 * lr(1), low_rank(1, 0)),
        ("K2V2 + low-rank K r2", base + 0.5 * lr(2), low_rank(2, 0)),
        ("K2V2 + low-rank K r4", base + 0.5 * lr(4), low_rank(4, 0)),
        ("K2V2 + low-rank V r4", base + 0.5 * lr(4), low_rank(0, 4)),
        ("K2V2 + low-rank K r8 V r8", base + lr(8), low_rank(8, 8)),
        ("K2V2 + value channel mean /128", base + 0.5 * 16 / 128, value_channel_mean(128)),
        ("K2V2 + 1 sink token", base + 2 * 16 / T / 2, sinks(1)),
        ("K2V2 + 4 sink tokens", base + 2 * 4 * 16 / T / 2, sinks(4)),
        ("K2V2 + MSE clipping", base, clipped()),
    ]


_ACTIVE: dict = {"fn": None, "R": 128}


def _probe_attention(module, query, key, value, attention_mask, **kw):
    fn = _ACTIVE["fn"]
    if fn is not None:
        n = (key.shape[2] - _ACTIVE["R"]) // G * G
        if n > 0:
            kq, vq = fn(key[:, :, :n].float(), value[:, :, :n].float())
            key = torch.cat([kq.to(key.dtype), key[:, :, n:]], dim=2)
            value = torch.cat([vq.to(value.dtype), value[:, :, n:]], dim=2)
    return sdpa_attention_forward(module, query, key, value, attention_mask, **kw)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="smollm2")
    ap.add_argument("--text", default=None, help="text file (default: shipped WikiText-2 test)")
    ap.add_argument("--windows", type=int, default=4)
    ap.add_argument("--context", type=int, default=1024)
    ap.add_argument("--residual-length", type=int, default=128)
    ap.add_argument("--threads", type=int, default=None)
    ap.add_argument("--out", default=None, help="JSON output")
    a = ap.parse_args()
    if a.threads:
        torch.set_num_threads(a.threads)
    AttentionInterface.register("kivi_screen", _probe_attention)
    AttentionMaskInterface.register("kivi_screen", sdpa_mask)
    model, tok = load_model(a.model)
    model.set_attn_implementation("kivi_screen")
    _ACTIVE["R"] = a.residual_length
    windows = token_windows(tok, load_text(a.text), a.context, a.windows)
    half = a.context // 2
    targets = windows[:, half:].reshape(-1)

    @torch.no_grad()
    def logprobs(fn):
        _ACTIVE["fn"] = fn
        out = [model(w[None]).logits[0, half - 1 : -1].float().log_softmax(-1) for w in windows]
        return torch.cat(out)

    ref = logprobs(None)
    T = (a.context - a.residual_length) // G * G
    D = model.config.head_dim if getattr(model.config, "head_dim", None) else model.config.hidden_size // model.config.num_attention_heads
    rows = [{"name": "fp", "bits": 16.0, "ppl": math.exp(-ref.gather(1, targets[:, None]).mean().item()), "kl": 0.0}]
    print(f"{'method':34s} {'bits':>6s} {'ppl':>9s} {'KL':>8s}", file=sys.stderr)
    print(f"{'fp':34s} {16.0:6.2f} {rows[0]['ppl']:9.3f} {0.0:8.4f}", file=sys.stderr)
    for name, bits, fn in candidates(T, D):
        t0 = time.time()
        lp = logprobs(fn)
        ppl = math.exp(-lp.gather(1, targets[:, None]).mean().item())
        kl = (ref.exp() * (ref - lp)).sum(-1).mean().item()
        rows.append({"name": name, "bits": round(bits, 4), "ppl": ppl, "kl": kl, "seconds": round(time.time() - t0, 1)})
        print(f"{name:34s} {bits:6.2f} {ppl:9.3f} {kl:8.4f}", file=sys.stderr, flush=True)
    result = {"protocol": "one-shot screening (see module docstring), second half of each window scored",
              "model": a.model, "windows": a.windows, "context": a.context, "residual_length": a.residual_length,
              "group_size": G, "tokens_scored": int(targets.numel()), "torch_threads": torch.get_num_threads(),
              "command": " ".join(sys.argv), "rows": rows}
    if a.out:
        Path(a.out).parent.mkdir(parents=True, exist_ok=True)
        Path(a.out).write_text(json.dumps(result, indent=2) + "\n")
    else:
        print(json.dumps(result, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
