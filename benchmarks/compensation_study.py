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

Issue 12 item 4 (``--rows beyond``): techniques beyond KIVI as composable ``Spec``/``Recipe`` rows, each
with its real storage cost: MSE clipping, KVQuant dense-and-sparse outliers, a Hadamard rotation of
head_dim (values; keys per token QuaRot-style), NF / Lloyd-Max levels, pre-RoPE keys (llama's rotary
function wrapped in this script), and combined recipes; ``--only`` picks rows, ``--merge`` combines runs
into one table with the wider-codes frontier (results/quality12_screen.md):

    python benchmarks/compensation_study.py --windows 4 --threads 1 --rows beyond --only R3b --out r.json
"""

from __future__ import annotations

import argparse
import json
import math
import shlex
import sys
import time
from dataclasses import dataclass
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


# --------------------------------------------------------------------------------------------------
# Beyond KIVI (issue 12, item 4): one composable quantizer so that techniques combine, each with its
# real storage cost. A ``Spec`` describes how ONE tensor (keys or values) is stored.

_NF_CACHE: dict = {}


def lloyd_levels(samples: torch.Tensor, n: int, iters: int = 25) -> torch.Tensor:
    """Lloyd-Max: ``n`` reconstruction levels minimising the squared error on 1-D ``samples``."""
    s = samples.flatten().float()
    lv = torch.quantile(s, (torch.arange(n, dtype=torch.float32) + 0.5) / n)
    for _ in range(iters):
        idx = torch.bucketize(s, (lv[1:] + lv[:-1]) / 2)
        sums = torch.zeros(n).index_add_(0, idx, s)
        cnt = torch.zeros(n).index_add_(0, idx, torch.ones_like(s))
        lv = torch.where(cnt > 0, sums / cnt.clamp_min(1), lv)
        lv = lv.sort().values
    return lv


def normal_levels(bits: int) -> torch.Tensor:
    """Lloyd-Max levels of a standard normal (NF-style, ±0.453/±1.510 for 2 bits)."""
    if bits not in _NF_CACHE:
        g = torch.Generator().manual_seed(0)
        _NF_CACHE[bits] = lloyd_levels(torch.randn(100_000, generator=g), 2**bits, iters=40)
    return _NF_CACHE[bits]


def hadamard(n: int) -> torch.Tensor:
    """Orthonormal Sylvester-Hadamard matrix of size ``n`` (a power of two); H = H^T = H^-1."""
    if n & (n - 1):
        raise ValueError(f"head_dim={n} is not a power of two; the Hadamard rotation needs one")
    h = torch.ones(1, 1)
    while h.shape[0] < n:
        h = torch.cat([torch.cat([h, h], 1), torch.cat([h, -h], 1)], 0)
    return h / math.sqrt(n)


@dataclass(frozen=True)
class Spec:
    """How one tensor ([B, H, T, D]) is stored. ``per``: "channel" (groups of G tokens, KIVI keys) or
    "token" (groups of G channels, KIVI values). ``rotate``: Hadamard on head_dim first (attention folds
    H: q·k = (qH)·(kH), softmax·V = (softmax·VH)H^T). ``clip``: MSE-optimal shrink of each group's range.
    ``outliers``: int k ≥ 1 = the k entries farthest from the group median kept exact (fp16 + uint8
    index); a fraction < 1 = that share of each 32-token × D block (fp16 + uint16 index, fixed count).
    ``levels``: "uniform" (KIVI), "nf" (normal Lloyd-Max levels on mean/std of the group, fp16 mean and
    std), "lloyd" (levels fitted per layer on the min-max normalised data of this layer and window).
    ``pre_rope`` (keys only): quantized before RoPE (patched rotary; the kernel would rotate at read).
    Parameters are kept in fp32 like the other rows (bits still count them as fp16); ``fp16_params``
    rounds them to fp16 as a float16 cache would store them."""

    bits: int = 2
    per: str = "channel"
    rotate: bool = False
    clip: bool = False
    outliers: float = 0
    levels: str = "uniform"
    pre_rope: bool = False
    fp16_params: bool = False  # round offset/range to fp16 as stored (the other rows keep them fp32)

    def bits_per_element(self, T: int, D: int, H: int = 3) -> float:
        b = self.bits + PARAM_BITS  # codes + two fp16 per group (scale/zero, or std/mean for nf)
        if self.levels == "lloyd":
            b += 2**self.bits * 16 / (H * T * D)  # one fp16 codebook per layer and tensor
        if self.outliers >= 1:
            b += self.outliers * (16 + 8) / G
        elif self.outliers > 0:
            n = round(self.outliers * G * D)
            b += n * (16 + 16) / (G * D)
        return b


_SHRINK = (1.0, 0.95, 0.9, 0.85, 0.8, 0.75, 0.7)
_NF_MULT = (0.7, 0.8, 0.9, 1.0, 1.1, 1.25, 1.4)


def _exact_mask(x: torch.Tensor, spec: Spec, sinks: int, axis: int) -> torch.Tensor:
    """Entries stored exactly: sink tokens plus outliers (by distance to the group median)."""
    exact = torch.zeros(x.shape, dtype=torch.bool)
    exact[:, :, :sinks] = True
    if spec.outliers:
        xg, red = _grouped(x, axis)
        score = (xg - xg.median(red, keepdim=True).values).abs()
        if spec.outliers >= 1:
            k = int(spec.outliers)
            top = score.topk(k, dim=red).indices
            m = torch.zeros_like(score, dtype=torch.bool).scatter_(red, top, True)
            exact |= m.reshape(x.shape)
        else:
            B, Hh, T, D = x.shape
            sc = score.reshape(x.shape).reshape(B, Hh, T // G, G * D)
            n = round(spec.outliers * G * D)
            top = sc.topk(n, dim=-1).indices
            m = torch.zeros_like(sc, dtype=torch.bool).scatter_(-1, top, True)
            exact |= m.reshape(x.shape)
    return exact


def quantize_spec(x: torch.Tensor, spec: Spec, sinks: int = 0) -> torch.Tensor:
    """Fake-quantize ``x`` [B, H, T, D] (T a multiple of G) as ``spec`` stores it; returns x_hat."""
    D = x.shape[-1]
    if spec.rotate:
        x = x @ hadamard(D)
    axis = -2 if spec.per == "channel" else -1
    exact = _exact_mask(x, spec, sinks, axis)
    xg, red = _grouped(x, axis)
    eg, _ = _grouped(exact, axis)
    keep = ~eg
    L = 2**spec.bits
    rp = (lambda t: t.half().float()) if spec.fp16_params else (lambda t: t)
    if spec.levels == "nf":
        cnt = keep.sum(red, keepdim=True).clamp_min(1)
        a = rp(torch.where(keep, xg, 0).sum(red, keepdim=True) / cnt)
        var = (torch.where(keep, (xg - a) ** 2, 0).sum(red, keepdim=True) / cnt)
        sd = var.sqrt()
        book = normal_levels(spec.bits)
        tries = [(a, rp(sd * m).clamp_min(1e-12)) for m in (_NF_MULT if spec.clip else (1.0,))]
    else:
        lo = torch.where(keep, xg, math.inf).amin(red, keepdim=True)
        hi = torch.where(keep, xg, -math.inf).amax(red, keepdim=True)
        lo, hi = torch.where(torch.isfinite(lo), lo, 0), torch.where(torch.isfinite(hi), hi, 0)
        if spec.levels == "lloyd":
            t = ((xg - lo) / (hi - lo).clamp_min(1e-12))[keep]
            t = t[torch.randperm(t.numel(), generator=torch.Generator().manual_seed(0))[:200_000]]
            book = rp(lloyd_levels(t, L))
        else:
            book = torch.linspace(0, 1, L)
        tries = []
        for r in (_SHRINK if spec.clip else (1.0,)):
            mid, half = (lo + hi) / 2, (hi - lo) / 2 * r
            tries.append((rp(mid - half), rp(2 * half).clamp_min(1e-12)))
    mids = (book[1:] + book[:-1]) / 2
    best = best_err = None
    for a, b in tries:
        q = book[torch.bucketize((xg - a) / b, mids)] * b + a
        err = torch.where(keep, (q - xg) ** 2, 0).sum(red, keepdim=True)
        if best is None:
            best, best_err = q, err
        else:
            better = err < best_err
            best, best_err = torch.where(better, q, best), torch.where(better, err, best_err)
    out = torch.where(keep, best, xg.half().float()).reshape(x.shape)
    if spec.rotate:
        out = out @ hadamard(D).T
    return out


@dataclass(frozen=True)
class Recipe:
    """Keys and values each stored by a ``Spec``; ``sinks`` first tokens kept exact (fp16)."""

    k: Spec = Spec(2, "channel")
    v: Spec = Spec(2, "token")
    sinks: int = 0

    def bits(self, T: int, D: int, H: int = 3) -> float:
        sink = self.sinks * 16 / T  # same convention as the sink rows above
        return (self.k.bits_per_element(T, D, H) + self.v.bits_per_element(T, D, H)) / 2 + sink

    def __call__(self, k, v):
        kq = k if self.k.pre_rope else quantize_spec(k, self.k, self.sinks)
        return kq, quantize_spec(v, self.v, self.sinks)

    def pre_rope_keys(self, k):
        return quantize_spec(k, self.k, self.sinks)


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


def beyond_kivi() -> list[tuple[str, Recipe]]:
    """Issue 12 item 4: techniques beyond KIVI, alone (on clipped K2V2) and combined into recipes."""
    K, V = Spec(2, "channel", clip=True), Spec(2, "token", clip=True)
    K16, V16 = Spec(2, "channel", clip=True, fp16_params=True), Spec(2, "token", clip=True, fp16_params=True)
    kout = Spec(2, "channel", clip=True, outliers=0.01)
    vh = Spec(2, "token", rotate=True, clip=True)
    return [
        ("B K2V2 clip (= 'K2V2 + MSE clipping' above)", Recipe(K, V)),
        ("B16 K2V2 clip, offset/range rounded to fp16", Recipe(K16, V16)),
        ("B16 + NF levels K,V, mean/std rounded to fp16", Recipe(Spec(2, "channel", clip=True, levels="nf", fp16_params=True),
                                                              Spec(2, "token", clip=True, levels="nf", fp16_params=True))),
        ("B + K outliers 1/group", Recipe(Spec(2, "channel", clip=True, outliers=1), V)),
        ("B + K outliers 1%", Recipe(kout, V)),
        ("B + K,V outliers 1%", Recipe(kout, Spec(2, "token", clip=True, outliers=0.01))),
        ("B + V Hadamard", Recipe(K, vh)),
        ("B + K,V Hadamard, K per token (QuaRot)", Recipe(Spec(2, "token", rotate=True, clip=True), vh)),
        ("B + NF levels K,V", Recipe(Spec(2, "channel", clip=True, levels="nf"), Spec(2, "token", clip=True, levels="nf"))),
        ("B + Lloyd levels K,V (per layer)", Recipe(Spec(2, "channel", clip=True, levels="lloyd"), Spec(2, "token", clip=True, levels="lloyd"))),
        ("B + K pre-RoPE", Recipe(Spec(2, "channel", clip=True, pre_rope=True), V)),
        ("W K4V3 (wider codes, frontier above 4 bits)", Recipe(Spec(4, "channel"), Spec(3, "token"))),
        ("W K4V4 (wider codes, frontier above 4 bits)", Recipe(Spec(4, "channel"), Spec(4, "token"))),
        ("R3a K2 out1% + V2 Had + clip + 4 sinks", Recipe(kout, vh, sinks=4)),
        ("R3b K2 pre-RoPE out1% + V2 Had + clip + 4 sinks", Recipe(Spec(2, "channel", clip=True, outliers=0.01, pre_rope=True), vh, sinks=4)),
        ("R4a K3 out1% + V3 Had + clip + 4 sinks", Recipe(Spec(3, "channel", clip=True, outliers=0.01), Spec(3, "token", rotate=True, clip=True), sinks=4)),
        ("R4b K4 out1% + V2 Had + clip + 4 sinks", Recipe(Spec(4, "channel", clip=True, outliers=0.01), vh, sinks=4)),
        ("R4c K3V3 + V Had + clip + 4 sinks", Recipe(Spec(3, "channel", clip=True), Spec(3, "token", rotate=True, clip=True), sinks=4)),
    ]


_ACTIVE: dict = {"fn": None, "R": 128}


def _probe_attention(module, query, key, value, attention_mask, **kw):
    fn = _ACTIVE["fn"]
    if isinstance(fn, Recipe) and fn.k.pre_rope and not _ACTIVE.get("pre_rope_calls"):
        raise RuntimeError("pre-RoPE keys requested but the rotary hook never ran (model is not llama-like)")
    if fn is not None:
        n = (key.shape[2] - _ACTIVE["R"]) // G * G
        if n > 0:
            kq, vq = fn(key[:, :, :n].float(), value[:, :, :n].float())
            key = torch.cat([kq.to(key.dtype), key[:, :, n:]], dim=2)
            value = torch.cat([vq.to(value.dtype), value[:, :, n:]], dim=2)
    return sdpa_attention_forward(module, query, key, value, attention_mask, **kw)


def _install_pre_rope_hook() -> None:
    """Quantize keys before RoPE for recipes with ``k.pre_rope`` by wrapping llama's rotary function
    (the attention hook then leaves the keys alone); no library code is touched."""
    import transformers.models.llama.modeling_llama as llama

    if getattr(llama.apply_rotary_pos_emb, "_kivi_screen", False):
        return
    orig = llama.apply_rotary_pos_emb

    def wrapped(q, k, cos, sin, *args, **kwargs):
        fn = _ACTIVE["fn"]
        if isinstance(fn, Recipe) and fn.k.pre_rope:
            n = (k.shape[2] - _ACTIVE["R"]) // G * G
            if n > 0:
                k = torch.cat([fn.pre_rope_keys(k[:, :, :n].float()).to(k.dtype), k[:, :, n:]], dim=2)
            _ACTIVE["pre_rope_calls"] = _ACTIVE.get("pre_rope_calls", 0) + 1
        return orig(q, k, cos, sin, *args, **kwargs)

    wrapped._kivi_screen = True
    llama.apply_rotary_pos_emb = wrapped


WIDER = ("K2V2 (KIVI)", "K3V2", "K3V3", "K4V2", "W K4V3", "W K4V4")


def frontier(rows: list[dict]) -> list[tuple[float, float]]:
    """(bits, Δppl %) of spending bits on wider codes: the best plain-code row at each width."""
    best: dict[float, float] = {}
    for r in rows:
        if r["name"].split(" (")[0] in {w.split(" (")[0] for w in WIDER}:
            best[r["bits"]] = min(best.get(r["bits"], math.inf), r["dppl"])
    return sorted(best.items())


def at_bits(front: list[tuple[float, float]], bits: float) -> float | None:
    """Δppl % of wider codes at ``bits``, log-linear between frontier points; None outside them."""
    for (b0, d0), (b1, d1) in zip(front, front[1:]):
        if b0 <= bits <= b1:
            t = (bits - b0) / (b1 - b0)
            return math.exp((1 - t) * math.log(d0) + t * math.log(d1))
    return None


def merge(paths: list[str], md: str | None) -> dict:
    """Combine screen runs (same protocol, same fp reference) into one table with the frontier."""
    runs = [json.loads(Path(p).read_text()) for p in paths]
    fp = runs[0]["rows"][0]["ppl"]
    for p, r in zip(paths, runs):
        if abs(r["rows"][0]["ppl"] - fp) > 1e-4 * fp or r["windows"] != runs[0]["windows"]:
            raise ValueError(f"--merge: {p} is not the same protocol (fp ppl {r['rows'][0]['ppl']} vs {fp})")
    rows, seen = [], set()
    for p, r in zip(paths, runs):
        for row in r["rows"]:
            if row["name"] in seen:
                continue
            seen.add(row["name"])
            own_fp = r["rows"][0]["ppl"]  # each run against its own reference (equal up to 1e-4)
            rows.append({**row, "dppl": 100 * (row["ppl"] / own_fp - 1), "source": p,
                         "command": r.get("command", "")})
    front = frontier(rows)
    for row in rows:
        w = at_bits(front, row["bits"])
        row["wider_codes_dppl_at_same_bits"] = None if w is None else round(w, 2)
    out = {**{k: runs[0][k] for k in ("protocol", "model", "windows", "context", "residual_length", "group_size",
                                      "tokens_scored")}, "sources": paths, "rows": rows}
    if md:
        lines = ["| method | bits | ppl | Δppl % | KL | wider codes at same bits, Δppl % |", "|---|---|---|---|---|---|"]
        for row in rows:
            w = row["wider_codes_dppl_at_same_bits"]
            lines.append(f"| {row['name']} | {row['bits']:.3f} | {row['ppl']:.2f} | {row['dppl']:+.1f} | "
                         f"{row['kl']:.3f} | {'' if w is None or row['name'] == 'fp' else f'{w:+.1f}'} |")
        cmds = sorted({r.get("command", "") for r in runs})
        Path(md).write_text("Commands:\n\n" + "\n".join(f"    python {c}" for c in cmds) + "\n\n" + "\n".join(lines) + "\n")
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="smollm2")
    ap.add_argument("--text", default=None, help="text file (default: shipped WikiText-2 test)")
    ap.add_argument("--windows", type=int, default=4)
    ap.add_argument("--context", type=int, default=1024)
    ap.add_argument("--residual-length", type=int, default=128)
    ap.add_argument("--threads", type=int, default=None)
    ap.add_argument("--out", default=None, help="JSON output")
    ap.add_argument("--rows", choices=("compensation", "beyond", "all"), default="compensation",
                    help="compensation: the original study; beyond: issue-12 techniques and recipes")
    ap.add_argument("--only", action="append", default=None,
                    help="keep only rows whose name contains this (repeatable)")
    ap.add_argument("--merge", nargs="+", default=None, metavar="JSON",
                    help="no model: combine earlier runs' JSON into --out (and --md) with the wider-codes frontier")
    ap.add_argument("--md", default=None, help="with --merge: markdown table output")
    a = ap.parse_args()
    if a.merge:
        result = merge(a.merge, a.md)
        text = json.dumps(result, indent=2) + "\n"
        Path(a.out).write_text(text) if a.out else print(text)
        return 0
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
    print(f"{'method':48s} {'bits':>6s} {'ppl':>9s} {'KL':>8s}", file=sys.stderr)
    print(f"{'fp':48s} {16.0:6.2f} {rows[0]['ppl']:9.3f} {0.0:8.4f}", file=sys.stderr)
    H = model.config.num_key_value_heads
    todo = []
    if a.rows in ("compensation", "all"):
        todo += candidates(T, D)
    if a.rows in ("beyond", "all"):
        _install_pre_rope_hook()
        todo += [(name, r.bits(T, D, H), r) for name, r in beyond_kivi()]
    if a.only:  # in the order given
        todo = [t for o in a.only for t in todo if o in t[0]]
        todo = [t for i, t in enumerate(todo) if t[0] not in {u[0] for u in todo[:i]}]
    for name, bits, fn in todo:
        t0 = time.time()
        lp = logprobs(fn)
        ppl = math.exp(-lp.gather(1, targets[:, None]).mean().item())
        kl = (ref.exp() * (ref - lp)).sum(-1).mean().item()
        rows.append({"name": name, "bits": round(bits, 4), "ppl": ppl, "kl": kl, "seconds": round(time.time() - t0, 1)})
        print(f"{name:48s} {bits:6.2f} {ppl:9.3f} {kl:8.4f}", file=sys.stderr, flush=True)
        if a.out:  # after every row, so that a long run leaves what it measured
            _write(a, rows, targets)
    _write(a, rows, targets)
    return 0


def _write(a, rows, targets) -> None:
    result = {"protocol": "one-shot screening (see module docstring), second half of each window scored",
              "model": a.model, "windows": a.windows, "context": a.context, "residual_length": a.residual_length,
              "group_size": G, "tokens_scored": int(targets.numel()), "torch_threads": torch.get_num_threads(),
              "command": shlex.join(sys.argv), "rows": rows}
    if a.out:
        Path(a.out).parent.mkdir(parents=True, exist_ok=True)
        Path(a.out).write_text(json.dumps(result, indent=2) + "\n")
    else:
        print(json.dumps(result, indent=2))


if __name__ == "__main__":
    sys.exit(main())
