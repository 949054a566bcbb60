"""The search space of `kivi tune`: which configs it measures.

* **uniform widths** ``UNIFORM_WIDTHS`` x group sizes ``GROUP_SIZES`` x sinks ``SINKS`` (0 and 4 sink
  tokens: the sinks cost 4 full-precision tokens per layer, nothing at long context, and helped
  every config measured, docs/results.md, "Evaluation results in full"; 0 is there so that tune measures rather
  than assumes it);
* **per-layer key upgrades** (given a ``kivi profile --json`` layer profile): 2/2 with the 2/4/8 most
  sensitive layers' keys at 4 bits;
* **per-head widths** (given a head profile, :func:`kivi.eval.head_profile.head_profile`): from each
  base of ``HEAD_BASES`` (K2V2, K3V2, K3V3 and K4V2, 4 sink tokens; K3V2 / K3V3 + widened heads were the
  best mixes near 4.3 bits in studies-archive:results/quality/pareto12_screen43_w24_4w.json and
  studies-archive:results/quality/pareto12b_20w.json),
  the head-sides that pay most widened to 4 bits
  at budgets ``HEAD_STEPS`` bits per element above the base (and at any extra budget asked for, e.g.
  ``--max-bits``), counted by the planner for a float16 model (:func:`recommend_head_bits`);
* **position tiers** ``tier_candidates``: 128 FP / 256 at 4 bits / the rest at 2 bits (K4V4 and K4V2
  first tiers). A tiered config holds a mix of widths that depends on the length: on a 1K evaluation
  window most tokens are still in its wide tiers, at 32K almost all are in the last one. Its quality is
  therefore only comparable with its bits when both are counted at the same length, so tune searches
  tiers only when bits are counted at a length no longer than the evaluation windows
  (:func:`tiers_comparable`); docs/evaluation.md.

The spec's per-group error compensation is not a candidate: measured, it does not pay for its bits.
"""

from __future__ import annotations

from typing import Any, Sequence

from ..config import KiviConfig

UNIFORM_WIDTHS = ((4, 4), (4, 2), (2, 4), (3, 3), (2, 2))
GROUP_SIZES = (32, 64, 128)
SINKS = (4, 0)
HEAD_BASES = ((2, 2), (3, 2), (3, 3), (4, 2))
HEAD_GROUP_SIZES = (32, 64)
HEAD_STEPS = (0.125, 0.25, 0.5, 0.75)
HEAD_UPGRADE = 4
TIER_MIDDLE = 256
PLANNER_TOKENS = 32768  # bits per element as the planner counts them: float16 model, 32K tokens


def uniform_candidates(group_sizes: Sequence[int] = GROUP_SIZES, sinks: Sequence[int] = SINKS) -> list[KiviConfig]:
    """Every width pair of ``UNIFORM_WIDTHS`` at each group size and sink count (R = 128)."""
    return [KiviConfig(k_bits=kb, v_bits=vb, group_size=g, residual_length=128, sink_tokens=s)
            for s in sinks for g in group_sizes for kb, vb in UNIFORM_WIDTHS]


def layer_candidates(profile: dict[str, Any]) -> list[KiviConfig]:
    """From a layer profile: 2/2 + 4 sinks with the 2/4/8 most sensitive layers' keys at 4 bits (G 32, 64)."""
    from .profile import recommend_layer_config  # noqa: PLC0415

    c = []
    for n in (2, 4, 8):
        if n <= len(profile["ranking"]):
            for g in (32, 64):
                c.append(recommend_layer_config(profile, KiviConfig(group_size=g, sink_tokens=4), num_layers=n))
    return c


def tier_candidates(group_sizes: Sequence[int] = (32, 64), middle: int = TIER_MIDDLE) -> list[KiviConfig]:
    """128 FP, then ``middle`` tokens at K4V4 (or K4V2), every older token at K2V2; 4 sink tokens."""
    return [KiviConfig(k_bits=4, v_bits=vb, group_size=g, sink_tokens=4,
                       tiers=[(128, None), (middle, (4, vb)), (None, (2, 2))])
            for g in group_sizes for vb in (4, 2)]


def tiers_comparable(bits_at: int | None, context: int) -> bool:
    """Whether a tiered candidate's bits and its measured quality describe the same cache: bits counted
    at the evaluation windows' length (``bits_at`` ``None``) or at a length no longer than them."""
    return bits_at is None or bits_at <= context


def has_tiers(cfg: KiviConfig) -> bool:
    """Whether any layer of ``cfg`` has position tiers."""
    return cfg.tiers is not None or any(lc.get("tiers") for lc in cfg.layer_specific_config.values())


def candidate_name(cfg: KiviConfig) -> str:
    """``cfg.describe()``, with the number of head-sides a per-head mix sets off its layer's width."""
    name = cfg.describe()
    if not cfg.head_bits:
        return name
    n = 0
    for layer, sides in cfg.head_bits.items():
        lcfg = cfg.for_layer(int(layer))
        for side, widths in sides.items():
            n += sum(1 for w in widths if w != getattr(lcfg, side))
    return f"{name} ({n} head-sides widened)"


def head_bases(group_size: int, bases: Sequence[tuple[int, int]] = HEAD_BASES) -> list[KiviConfig]:
    """The configs per-head candidates start from: each width pair of ``bases``, 4 sink tokens, R = 128."""
    return [KiviConfig(k_bits=kb, v_bits=vb, group_size=group_size, sink_tokens=4) for kb, vb in bases]


def head_candidates(head_prof: dict[str, Any], spec: Any, bases: Sequence[KiviConfig], *,
                    steps: Sequence[float] = HEAD_STEPS, budgets: Sequence[float] = (), context: int = 32768,
                    upgrade: int = HEAD_UPGRADE) -> list[KiviConfig]:
    """Per-head mixes from ``head_prof`` (whose ``base`` has the group size, window and sinks of ``bases``).

    For each base: the greedy choice of :func:`~kivi.eval.head_profile.recommend_head_bits` at the base's
    bits + each of ``steps``, and at each of ``budgets`` above the base (planner bits per element, float16
    model, ``context`` tokens). Budgets whose choice widens nothing, or repeats another's, add nothing."""
    from .head_profile import bits_per_element, recommend_head_bits  # noqa: PLC0415

    out: list[KiviConfig] = []
    seen: set[str] = set()
    for base in bases:
        have = bits_per_element(spec, base, context)
        for budget in sorted({have + s for s in steps} | {b for b in budgets if b > have}):
            cfg, _ = recommend_head_bits(head_prof, spec, budget, base=base, upgrade=upgrade, context=context)
            key = repr(cfg.to_dict())
            if not cfg.head_bits or key in seen:
                continue
            seen.add(key)
            out.append(cfg)
    return out


def profiled_head_candidates(model: Any, windows: Any, spec: Any, *, bases: Sequence[KiviConfig] | None = None,
                             steps: Sequence[float] = HEAD_STEPS, budgets: Sequence[float] = (),
                             context: int = PLANNER_TOKENS, prefix: int = 512,
                             progress: bool = True) -> tuple[list[KiviConfig], list[dict[str, str]]]:
    """``(per-head candidates, skipped)``: one :func:`~kivi.eval.head_profile.head_profile` pass over ``windows``
    per (group size, window, sinks) of ``bases`` (default: :func:`head_bases` at each of ``HEAD_GROUP_SIZES``),
    scoring the bases' widths and ``HEAD_UPGRADE``, then :func:`head_candidates`. A family whose group size does
    not fit the model (head_dim) is skipped with the reason, before its profile pass."""
    from .head_profile import bits_per_element, head_profile  # noqa: PLC0415

    bases = list(bases) if bases is not None else [b for g in HEAD_GROUP_SIZES for b in head_bases(g)]
    families: dict[tuple[int, int, int], list[KiviConfig]] = {}
    for b in bases:
        families.setdefault((b.group_size, b.residual_length, b.sink_tokens), []).append(b)
    out: list[KiviConfig] = []
    skipped: list[dict[str, str]] = []
    for (g, res, sinks), fam in families.items():
        try:
            bits_per_element(spec, fam[0], context)
        except ValueError as e:
            skipped.append({"name": f"per-head mixes G{g} R{res} sink{sinks}", "reason": str(e)})
            continue
        widths = sorted({HEAD_UPGRADE} | {w for b in fam for w in (b.k_bits, b.v_bits)})
        prof = head_profile(model, windows, fam[0], bits=widths, prefix=prefix, progress=progress)
        out += head_candidates(prof, spec, fam, steps=steps, budgets=budgets, context=context)
    return out, skipped


def candidate_grid(profile: dict[str, Any] | None = None, num_layers: int | None = None, *,
                   sinks: Sequence[int] = SINKS, tiers: bool = False) -> list[KiviConfig]:
    """The static part of tune's search space: :func:`uniform_candidates`, :func:`layer_candidates` of a
    layer ``profile`` and, with ``tiers``, :func:`tier_candidates` (per-head candidates need a head
    profile of the model: :func:`kivi.eval.sweep.tune` makes one). ``num_layers`` is unused (kept for
    callers of the old signature)."""
    c = uniform_candidates(sinks=sinks)
    if profile is not None:
        c += layer_candidates(profile)
    if tiers:
        c += tier_candidates()
    return c


__all__ = ["candidate_grid", "candidate_name", "has_tiers", "head_bases", "head_candidates", "layer_candidates",
           "profiled_head_candidates", "tier_candidates", "tiers_comparable", "uniform_candidates"]
