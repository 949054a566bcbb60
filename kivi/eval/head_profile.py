"""Per-head sensitivity: what does quantizing ONE kv head's keys (or values) cost, and which heads pay
for wider codes?

One full-precision pass over the windows records, in every attention layer, the queries, keys and
values the model computes (after RoPE). For each (layer, kv head, side) and each candidate width,
that head's keys (or values) are quantized as a KiviLayer stores them (key groups of ``G`` tokens
per channel from the sink on, values per token; the last ``residual_length`` tokens and the sink stay
exact), attention of the head's query heads is recomputed for the scored queries (positions
``[prefix, context)``), and the error is pushed through the layer's output projection:

    score = sum_t || W_o[:, heads of h] (o~_t - o_t) ||^2  /  sum_t || W_o o_t ||^2

the share of the layer's attention output that quantizing this one head-side perturbs. It costs one
forward per window (no forward per candidate: a (layer x head) KL profile of SmolLM2 would need 90
evaluation passes); it is a proxy, ranked per head within and across layers, and the choices it makes
are then measured end to end (``studies/per_head_study.py`` in the git tag studies-archive, docs/python.md,
"Per-head widths").

:func:`recommend_head_bits` turns a profile into a config within a bit budget: starting from ``base``,
it widens the head-sides (or, ``granularity="layer"``, whole layer-sides: the per-layer mix at the
same budget) with the largest error reduction per byte, as long as the planner
(:func:`kivi.memory.estimate.estimate_kv_memory` for a float16 model at ``context`` tokens) keeps bits
per element within ``max_bits``.
"""

from __future__ import annotations

import dataclasses
from contextlib import contextmanager
from typing import Any, Iterator, Sequence

import torch

from ..config import KiviConfig
from ..quant.kv import dequantize_kv, quantize_side
from ..quant.side_format import KEY_AXIS, VALUE_AXIS, SideFormat

RECORDING = "kivi_head_profile"  # the attention implementation registered while a profile runs
SIDES = ("k", "v")


@dataclasses.dataclass
class _Scores:
    """Running sums of one profile: error per (layer, head, side, bits) and the layer output energy."""

    num: dict[tuple[int, int, str, int], float] = dataclasses.field(default_factory=dict)
    den: dict[int, float] = dataclasses.field(default_factory=dict)


def _quantized(x: torch.Tensor, axis: str, bits: int, cfg: KiviConfig) -> torch.Tensor:
    """``x [T, D]`` (one head) as a KiviLayer would hold it after ``T`` tokens: sink and window exact."""
    T = x.shape[0]
    S, R, G = min(cfg.sink_tokens, T), cfg.residual_length, cfg.group_size
    end = S + max(0, T - R - S) // G * G if axis == KEY_AXIS else max(S, T - R)
    if end <= S:
        return x
    seg = quantize_side(x[None, None, S:end], SideFormat(axis, bits, G, check_finite=False))  # plain KIVI RTN
    return torch.cat([x[:S], dequantize_kv(seg, x.dtype)[0, 0], x[end:]], dim=0)


def _probs(q: torch.Tensor, k: torch.Tensor, first: int, scaling: float) -> torch.Tensor:
    """Causal attention weights ``[g, n, T]`` of queries ``q [g, n, D]`` (positions ``[first, first + n)``)."""
    s = (q.float() @ k.float().T) * scaling  # [g, n, T]
    n, T = q.shape[1], k.shape[0]
    pos = torch.arange(first, first + n, device=q.device)
    s = s.masked_fill(torch.arange(T, device=q.device)[None, :] > pos[:, None], float("-inf"))
    return torch.softmax(s, dim=-1)


def _score_layer(acc: _Scores, module: Any, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scaling: float,
                 base: KiviConfig, bits: Sequence[int], prefix: int) -> None:
    """Add one forward's errors of layer ``module.layer_idx`` (``q [B, Hq, T, D]``, ``k/v [B, Hkv, T, D]``)."""
    layer = int(module.layer_idx)
    B, hq, T, D = q.shape
    hkv = k.shape[1]
    g = hq // hkv
    w_o = getattr(getattr(module, "o_proj", None), "weight", None)  # [hidden, Hq * D]
    for b in range(B):
        qs = q[b, :, prefix:]  # [Hq, n, D]
        probs = [_probs(qs[h * g:(h + 1) * g], k[b, h], prefix, scaling) for h in range(hkv)]
        exact = [p @ v[b, h].float() for p, h in zip(probs, range(hkv))]
        o = torch.cat(exact, dim=0)  # [Hq, n, D]
        full = o.permute(1, 0, 2).reshape(o.shape[1], hq * D)
        out = full @ w_o.float().T if w_o is not None else full
        acc.den[layer] = acc.den.get(layer, 0.0) + float(out.pow(2).sum())
        for h in range(hkv):
            cols = slice(h * g * D, (h + 1) * g * D)
            for side in SIDES:
                for nb in bits:
                    if side == "k":  # new weights over exact values
                        kk = _quantized(k[b, h], KEY_AXIS, nb, base)
                        d = _probs(qs[h * g:(h + 1) * g], kk, prefix, scaling) @ v[b, h].float() - exact[h]
                    else:  # same weights over the value error
                        d = probs[h] @ (_quantized(v[b, h], VALUE_AXIS, nb, base) - v[b, h]).float()  # [g, n, D]
                    d = d.permute(1, 0, 2).reshape(d.shape[1], g * D)
                    e = d @ w_o.float()[:, cols].T if w_o is not None else d
                    key = (layer, h, side, int(nb))
                    acc.num[key] = acc.num.get(key, 0.0) + float(e.pow(2).sum())


@contextmanager
def _recording(model: Any, acc: _Scores, base: KiviConfig, bits: Sequence[int], prefix: int) -> Iterator[None]:
    """Run ``model`` with an attention that scores every layer's heads into ``acc`` (SDPA computes the output).

    The one side channel of the profile: transformers hands q/k/v only to the attention function.
    """
    from transformers import AttentionInterface
    from transformers.integrations.sdpa_attention import sdpa_attention_forward
    from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

    def attention(module, query, key, value, attention_mask, scaling=None, **kwargs):
        sc = query.shape[-1] ** -0.5 if scaling is None else scaling
        _score_layer(acc, module, query, key, value, sc, base, bits, prefix)
        return sdpa_attention_forward(module, query, key, value, attention_mask, scaling=scaling, **kwargs)

    AttentionInterface.register(RECORDING, attention)
    AttentionMaskInterface.register(RECORDING, sdpa_mask)
    current = model.config._attn_implementation
    model.set_attn_implementation(RECORDING)
    try:
        yield
    finally:
        model.set_attn_implementation(current)


def head_profile(model: Any, windows: torch.Tensor, base: KiviConfig | None = None, *, bits: Sequence[int] = (2, 4),
                 prefix: int = 512, progress: bool = True) -> dict[str, Any]:
    """Sensitivity of every (layer, kv head, side) to ``bits`` (default 2 and 4), ``base``'s G, R and sink.

    ``windows [N, context]`` token ids, one full-precision forward each; queries ``[prefix, context)`` are
    scored. Returns ``{"metric", "base", "bits", "protocol", "heads": [{"layer", "head", "side",
    "score": {bits: share}}], "num_layers", "num_kv_heads"}``.
    """
    base = base if base is not None else KiviConfig.preset("extreme", sink_tokens=4)
    bits = sorted({int(b) for b in bits})
    if windows.dim() != 2 or not 0 <= prefix < windows.shape[1]:
        raise ValueError(f"windows of shape {tuple(windows.shape)} with prefix={prefix}: need [N, context] with "
                         "prefix < context")
    acc = _Scores()
    it = range(windows.shape[0])
    if progress:
        from tqdm.auto import tqdm

        it = tqdm(it, desc="head profile (FP pass, scoring every head)", unit="window")
    device = next(model.parameters()).device
    with torch.no_grad(), _recording(model, acc, base, bits, prefix):
        for i in it:
            model(windows[i : i + 1].to(device), use_cache=False)
    layers = sorted(acc.den)
    hkv = 1 + max(h for _, h, _, _ in acc.num)
    rows = [{"layer": layer, "head": h, "side": side,
             "score": {str(b): acc.num[(layer, h, side, b)] / max(acc.den[layer], 1e-30) for b in bits}}
            for layer in layers for h in range(hkv) for side in SIDES]
    return {"metric": "attention output error share (through o_proj)", "base": base.to_dict(),
            "base_name": base.describe(), "bits": bits, "num_layers": len(layers), "num_kv_heads": hkv,
            "protocol": {"windows": int(windows.shape[0]), "context": int(windows.shape[1]), "prefix": prefix},
            "heads": rows}


def head_profile_prompts(model: Any, prompts: Sequence[tuple[Sequence[int], int]], base: KiviConfig | None = None, *,
                         bits: Sequence[int] = (2, 4), progress: bool = True) -> dict[str, Any]:
    """:func:`head_profile` over prompts of any lengths, each ``(ids, scored_from)``: the queries at positions
    ``[scored_from, len(ids))`` are scored (e.g. a suite prompt's question and answer,
    :func:`kivi.eval.longctx.calibration.calibration_prompts`). Each prompt's shares are computed on their own
    and averaged, so every prompt weighs the same whatever its number of scored queries. The result has
    :func:`head_profile`'s fields; ``protocol`` is ``{"prompts", "tokens", "scored"}`` (prompt count, total
    tokens, total scored queries)."""
    prompts = [(list(ids), int(first)) for ids, first in prompts]
    if not prompts:
        raise ValueError("prompts is empty: give at least one (ids, scored_from) prompt")
    for n, (ids, first) in enumerate(prompts):
        if not 0 <= first < len(ids):
            raise ValueError(f"prompts[{n}]: scored_from={first} must be in [0, {len(ids)}) for its {len(ids)} tokens "
                             "(at least one query scored)")
    it = prompts
    if progress:
        from tqdm.auto import tqdm

        it = tqdm(prompts, desc="head profile (FP pass per prompt)", unit="prompt")
    total: dict[str, Any] | None = None
    for ids, first in it:
        prof = head_profile(model, torch.tensor([ids]), base, bits=bits, prefix=first, progress=False)
        if total is None:
            total = prof
            continue
        for a, b in zip(total["heads"], prof["heads"]):
            for w in a["score"]:
                a["score"][w] += b["score"][w]
    for r in total["heads"]:
        r["score"] = {w: v / len(prompts) for w, v in r["score"].items()}
    total["protocol"] = {"prompts": len(prompts), "tokens": sum(len(ids) for ids, _ in prompts),
                         "scored": sum(len(ids) - first for ids, first in prompts)}
    total["metric"] += ", mean over prompts"
    return total


def bits_per_element(spec: Any, cfg: KiviConfig, context: int | str = 32768) -> float:
    """Bits per element as the planner counts them: its cache bytes for a float16 model at ``context`` tokens,
    over 2 x layers x kv heads x head_dim x tokens."""
    from ..memory.estimate import estimate_kv_memory

    e = estimate_kv_memory(spec, context, config=cfg, dtype="float16")
    return 8 * e.kivi_total_bytes / (2 * e.num_layers * e.num_kv_heads * e.head_dim * e.context)


def _with_units(base: KiviConfig, units: list[tuple[int, int | None, str]], upgrade: int, hkv: int) -> KiviConfig:
    """``base`` with each unit ``(layer, head or None = every head, side)`` widened to ``upgrade`` bits."""
    lsc = {int(k): dict(v) for k, v in base.layer_specific_config.items()}
    heads: dict[int, dict[str, list[int]]] = {}
    for layer, head, side in units:
        name = f"{side}_bits"
        if head is None:
            lsc[layer] = {**lsc.get(layer, {}), name: upgrade}
        else:
            lcfg = base.for_layer(layer)
            entry = heads.setdefault(layer, {})
            widths = entry.setdefault(name, [getattr(lcfg, name)] * hkv)
            widths[head] = upgrade
    return dataclasses.replace(base, layer_specific_config=lsc, head_bits=heads)


def recommend_head_bits(profile: dict[str, Any], spec: Any, max_bits: float, *, base: KiviConfig | None = None,
                        upgrade: int | None = None, granularity: str = "head",
                        context: int | str = 32768) -> tuple[KiviConfig, float]:
    """``(config, bits per element)``: ``base`` with the head-sides (``granularity="head"``) or layer-sides
    (``"layer"``) whose widening to ``upgrade`` bits (default: the profile's widest) removes the most error
    per byte, greedily, while :func:`bits_per_element` stays ``<= max_bits``. ``spec``: the model or its
    planner spec (:func:`kivi.memory.sources.model_spec`)."""
    if granularity not in ("head", "layer"):
        raise ValueError(f"granularity={granularity!r} is not allowed; choose 'head' or 'layer'")
    base = base if base is not None else KiviConfig.from_dict(profile["base"])
    bits = [int(b) for b in profile["bits"]]
    upgrade = max(bits) if upgrade is None else int(upgrade)
    if upgrade not in bits:
        raise ValueError(f"upgrade={upgrade} is not a width the profile measured; allowed: {bits}")
    hkv = int(profile["num_kv_heads"])
    gains: dict[tuple[int, int | None, str], float] = {}
    for r in profile["heads"]:
        lcfg = base.for_layer(r["layer"])
        now = getattr(lcfg, f"{r['side']}_bits")
        if str(now) not in r["score"] or now >= upgrade:
            continue
        unit = (r["layer"], r["head"] if granularity == "head" else None, r["side"])
        gains[unit] = gains.get(unit, 0.0) + r["score"][str(now)] - r["score"][str(upgrade)]
    order = sorted(gains, key=lambda u: -gains[u])  # every unit of a granularity costs the same bytes
    have = bits_per_element(spec, base, context)
    if have > max_bits:
        raise ValueError(
            f"max_bits={max_bits}: the base config {base.describe()} already needs {have:.4f} bits/element"
        )
    chosen: list[tuple[int, int | None, str]] = []
    for unit in order:
        cand = _with_units(base, chosen + [unit], upgrade, hkv)
        b = bits_per_element(spec, cand, context)
        if b > max_bits:
            break
        chosen.append(unit)
        have = b
    return _with_units(base, chosen, upgrade, hkv), have


__all__ = ["head_profile", "head_profile_prompts", "recommend_head_bits", "bits_per_element"]
