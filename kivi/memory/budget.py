"""Precision chosen from a byte budget: the best-quality KIVI config whose cache fits.

:func:`config_for_budget` walks a list of candidate configs from the highest measured quality down
and returns the first whose cache, planned by :func:`~kivi.memory.estimate.estimate_kv_memory` (byte
for byte ``KiviCache.nbytes``), fits the budget at the requested context and batch. Nothing is
measured here: the order of the candidates is the quality ranking, and the default ranking,
:data:`QUALITY_LADDER`, is the one measured on the 20-window protocol (SmolLM2-135M, WikiText-2,
``docs/results.md``, "Evaluation results in full", table "The grid at full size", ``results/quality/grid_20w.csv``).

The need of a candidate is the cache's *peak* while it grows to ``context``: the largest
``kivi_total_bytes`` over the last ``group_size`` token counts up to ``context`` (keys leave the
full-precision window a group at a time, so the cache is not largest exactly at ``context`` when a
group has just been quantized; before that last group, every length needs at most as much). That is
the rule the planner's "largest context that fits" uses (``kivi estimate --device-memory``).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any, Sequence

from ..config import PRESETS, KiviConfig
from .estimate import estimate_kv_memory, float_cache_bytes, peak_lengths
from .sources import model_spec
from .units import format_bytes, parse_bytes, parse_context

#: ``(name, KiviConfig fields, measured Δppl % on the 20-window protocol)``, best quality first; the
#: presets' fields are read from :data:`kivi.config.PRESETS` (the rungs between them extend them).
#: Source: docs/results.md "The grid at full size" (results/quality/grid_20w.csv): high +0.22 %, balanced
#: +1.45 %, K2V2 + 4 sinks +12.39 %, extreme (KIVI-2) +22.87 %, K2V2 G64 +36.13 %. Each step down
#: stores fewer bytes per token (sinks cost 4 full-precision tokens; G64 halves the scales). Configs
#: the grid measured that are worse *and* larger than one above (K4V4 without sinks, K4V2 without
#: sinks, the spec's compensation) are left out: a budget that fits them fits a better one.
QUALITY_LADDER: tuple[tuple[str, dict[str, Any], float], ...] = (
    ("high", PRESETS["high"], 0.22),
    ("balanced", PRESETS["balanced"], 1.45),
    ("K2V2+4 sinks", {**PRESETS["extreme"], "sink_tokens": 4}, 12.39),
    ("extreme", PRESETS["extreme"], 22.87),
    ("K2V2 G64", {**PRESETS["extreme"], "group_size": 64}, 36.13),
)


def default_candidates() -> list[tuple[str, KiviConfig]]:
    """:data:`QUALITY_LADDER` as ``(name, KiviConfig)``, best quality first."""
    return [(name, KiviConfig(**fields)) for name, fields, _ in QUALITY_LADDER]


@dataclass
class BudgetPick:
    """What :func:`config_for_budget` chose (bytes unless named otherwise). ``to_dict()`` for JSON.

    ``considered``: per candidate, in quality order, ``{"name", "config", "need_bytes", "fits"}``
    (``"invalid"``: why the candidate cannot serve this model, instead of the bytes); ``fp_bytes``:
    the full-precision cache at ``context`` (when it fits, KIVI is not needed for memory).
    """

    name: str
    config: KiviConfig
    need_bytes: int
    budget_bytes: int
    context: int
    batch: int
    model: str
    fp_bytes: int
    considered: list[dict[str, Any]] = field(default_factory=list)

    @property
    def fp_fits(self) -> bool:
        return self.fp_bytes <= self.budget_bytes

    def to_dict(self) -> dict[str, Any]:
        return {"name": self.name, "config": self.config.to_dict(), "config_description": self.config.describe(),
                "need_bytes": self.need_bytes, "budget_bytes": self.budget_bytes, "context": self.context,
                "batch": self.batch, "model": self.model, "fp_bytes": self.fp_bytes, "fp_fits": self.fp_fits,
                "considered": self.considered}


class BudgetError(ValueError):
    """No candidate's cache fits the budget; the message (one line) names the budget and the smallest need."""

    user_facing = True


def cache_need(spec: Any, config: KiviConfig, context: int, batch: int = 1, *, prefill: int | None = None) -> int:
    """Peak bytes of ``config``'s cache while it grows to ``context`` tokens (see the module doc):
    the largest ``estimate_kv_memory(...).kivi_total_bytes`` over the last ``group_size`` lengths.

    With ``quantize_after = N < context`` the cache also peaks just before it quantizes: at ``N`` tokens it
    is a full-precision cache of ``N`` tokens, and it shrinks at ``N + 1``; so the ``group_size`` lengths
    up to each layer's ``N`` count too (each layer only grows between those drops and its key groups')."""
    layers = [config.for_layer(i) for i in range(spec.num_layers)]
    lengths = peak_lengths(context, max(c.group_size for c in layers), {c.quantize_after for c in layers})
    return max(estimate_kv_memory(spec, t, batch=batch, config=config,
                                  prefill=None if prefill is None else min(prefill, t)).kivi_total_bytes
               for t in lengths)


def full_precision_tokens(spec: Any, budget_bytes: int, batch: int = 1) -> int:
    """The most tokens per sequence a full-precision cache of ``batch`` sequences holds within ``budget_bytes``
    (what ``quantize_after`` may be so that the cache's full-precision phase fits the budget)."""
    return budget_bytes // float_cache_bytes(spec, 1, batch)


def config_for_budget(
    model_or_spec: Any,
    budget_bytes: int | str,
    context: int | str,
    batch: int = 1,
    candidates: Sequence[KiviConfig | tuple[str, KiviConfig]] | None = None,
    *,
    dtype: Any = None,
    prefill: int | None = None,
    full_precision_first: bool = False,
) -> BudgetPick:
    """The highest-quality candidate whose KV cache fits ``budget_bytes`` at ``context`` x ``batch``.

    Args:
        model_or_spec: what :func:`~kivi.memory.estimate_kv_memory` takes (an alias, a ``.gguf``, a
            loaded model, a :class:`~kivi.memory.ModelSpec`...).
        budget_bytes: bytes for the cache alone (``"2GiB"``, ``"512MB"`` or an int); weights and
            activations are not in it.
        context: tokens per sequence (``32768``, ``"32k"``).
        batch: sequences.
        candidates: configs (or ``(name, config)``) in order of decreasing quality; default
            :data:`QUALITY_LADDER`. A candidate this model cannot use (group size vs head_dim) is
            skipped and listed with the reason.
        dtype: the cache dtype (default: the model's).
        prefill: tokens of the first forward (default: the whole context), as in the planner.
        full_precision_first: also give the pick ``quantize_after`` = the most tokens a full-precision
            cache of ``batch`` sequences holds within the budget (:func:`full_precision_tokens`): a request
            shorter than that is never quantized, a longer one switches to the pick at that length. Kept
            only when the peak with it (:func:`cache_need`) still fits; otherwise the plain pick.

    Returns:
        a :class:`BudgetPick`; ``need_bytes`` is the chosen cache's peak (module doc).

    Raises:
        BudgetError: nothing fits; one line naming the budget and the smallest need.
        ValueError: bad arguments (one line naming the parameter).
    """
    budget = parse_bytes(budget_bytes)
    T = parse_context(context)
    if isinstance(batch, bool) or not isinstance(batch, int) or batch < 1:
        raise ValueError(f"batch={batch!r} must be a positive integer")
    spec = model_spec(model_or_spec, dtype=dtype)
    named = default_candidates() if candidates is None else [_named(c) for c in candidates]
    if not named:
        raise ValueError("candidates is empty; give at least one KiviConfig (or None for the default ladder)")
    fp = float_cache_bytes(spec, T, batch)
    considered: list[dict[str, Any]] = []
    chosen: tuple[str, KiviConfig, int] | None = None
    for name, cfg in named:
        try:
            need = cache_need(spec, cfg, T, batch, prefill=prefill)
        except ValueError as e:  # e.g. group_size does not divide head_dim
            considered.append({"name": name, "config": cfg.to_dict(), "invalid": str(e)})
            continue
        fits = need <= budget
        considered.append({"name": name, "config": cfg.to_dict(), "need_bytes": need, "fits": fits})
        if fits and chosen is None:
            chosen = (name, cfg, need)
    if chosen is None:
        needs = [c for c in considered if "need_bytes" in c]
        if not needs:
            raise BudgetError(f"no candidate config can serve {spec.name}: {considered[0]['invalid']}")
        low = min(needs, key=lambda c: c["need_bytes"])
        raise BudgetError(
            f"budget {format_bytes(budget)} ({budget:,} B) is too small for a {T:,}-token cache x batch {batch} of "
            f"{spec.name}: the smallest candidate, {low['name']}, needs {format_bytes(low['need_bytes'])} "
            f"({low['need_bytes']:,} B)"
        )
    name, cfg, need = chosen
    if full_precision_first:
        if "sliding_attention" in (spec.layer_types or []):
            raise ValueError(f"full_precision_first needs a model without sliding-window layers ({spec.name} has "
                             "them; quantize_after is not supported there)")
        n = full_precision_tokens(spec, budget, batch)
        if n:
            gated = dataclasses.replace(cfg, quantize_after=n)
            gated_need = cache_need(spec, gated, T, batch, prefill=prefill)
            if gated_need <= budget:
                cfg, need = gated, gated_need
    return BudgetPick(name=name, config=cfg, need_bytes=need, budget_bytes=budget, context=T, batch=batch,
                      model=spec.name, fp_bytes=fp, considered=considered)


def _named(c: Any) -> tuple[str, KiviConfig]:
    if isinstance(c, KiviConfig):
        return c.describe(), c
    if isinstance(c, tuple) and len(c) == 2 and isinstance(c[0], str) and isinstance(c[1], KiviConfig):
        return c
    raise ValueError(f"a candidate must be a KiviConfig or (name, KiviConfig), got {type(c).__name__}")


__all__ = ["QUALITY_LADDER", "BudgetPick", "BudgetError", "default_candidates", "cache_need", "config_for_budget",
           "full_precision_tokens"]
