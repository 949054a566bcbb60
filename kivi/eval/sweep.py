"""Sweeps over cache configs (:func:`sweep`, :func:`default_grid`); budgeted selection lives in :mod:`.tuning`,
the CSV rows and Pareto plot in :mod:`.report` (both importable from here)."""

from __future__ import annotations

from typing import Any, Sequence

import torch

from ..config import KiviConfig
from .caches import CacheSpec, check_spec, spec_kind
from .candidates import candidate_grid
from .comparison import compare
from .report import ROW_FIELDS, pareto_plot, write_rows
from .tuning import NoCandidateFits, parse_percent, select_config, tune


def default_grid(include_baselines: bool = True) -> list[CacheSpec]:
    """Presets, 2-bit variants (group size, keys-only, values-only, symmetric) and quanto baselines."""
    P = KiviConfig.preset
    grid: list[CacheSpec] = [P("high"), P("balanced"), P("extreme"),
                             KiviConfig(group_size=64), KiviConfig(group_size=128),
                             KiviConfig(quantize_value=False), KiviConfig(quantize_key=False),
                             KiviConfig(symmetric=True), KiviConfig(k_bits=4, v_bits=2), KiviConfig(k_bits=2, v_bits=4),
                             KiviConfig(sink_tokens=4), KiviConfig(residual_bits=4)]
    if include_baselines:
        grid += ["quanto-int4", "quanto-int2", "quanto-int2-perchannel"]
    return grid


def sweep(
    model: Any,
    tokenizer: Any,
    windows: torch.Tensor,
    specs: Sequence[CacheSpec] | None = None,
    *,
    prefix: int = 512,
    chunk: int = 16,
    batch_size: int = 1,
    passkey_lengths: Sequence[int] = (),
    passkey_seeds: int = 2,
    progress: bool = True,
    on_window: Any = None,
    fast: bool = True,
) -> list[dict[str, Any]]:
    """One row per spec (plus the ``fp`` row first): bits/element from the real cache, bytes, ppl,
    Δppl %, KL, top-1 agreement; passkey accuracy when ``passkey_lengths`` is given."""
    specs = list(default_grid() if specs is None else specs)
    specs = [check_spec(s) for s in specs]
    specs = [s for s in specs if s is not None]  # fp is the reference row anyway
    out = compare(model, windows, specs, prefix=prefix, chunk=chunk, batch_size=batch_size, progress=progress,
                  on_window=on_window, fast=fast)
    fp = dict(out["fp"])
    fp.update(kind="fp", delta_ppl_pct=0.0, kl=0.0, top1_agreement=1.0)
    rows = [fp] + [{**r, "kind": spec_kind(s)} for s, r in zip(specs, out["results"])]
    if passkey_lengths:
        from .passkey import passkey  # noqa: PLC0415

        pk = passkey(model, tokenizer, [None] + specs, lengths=passkey_lengths, depths=(0.5,), seeds=passkey_seeds,
                     progress=progress)
        for row, r in zip(rows, pk["results"]):
            row["passkey_accuracy"] = r.get("accuracy")
    for row in rows:
        row["protocol"] = out["protocol"]
    return rows



__all__ = ["default_grid", "sweep", "ROW_FIELDS", "write_rows", "pareto_plot", "NoCandidateFits", "parse_percent",
           "select_config", "tune", "candidate_grid"]
