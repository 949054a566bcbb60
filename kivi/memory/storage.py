"""Bytes of one layer's KIVI cache after a prefill of ``P`` tokens and decode steps up to ``T``.

With ``quantize_after = N`` nothing is stored until the layer holds more than ``N`` tokens; the first
append of the stores is then the flush that passes ``N`` (the prefill, or the decode step to ``N + 1``:
:func:`kivi.cache.schedule.first_store_seen`).

Where the tokens are (sink, store, window), which blocks are allocated and which a sliding layer has
freed all come from :mod:`kivi.cache.schedule`, the functions :class:`~kivi.cache.KiviLayer` runs;
the bytes per stored token from :meth:`kivi.quant.side_format.SideFormat.token_bytes`, the format's own
accounting (each side's :meth:`~kivi.config.KiviConfig.side_format`).
"""

from __future__ import annotations

import dataclasses

import torch

from ..cache.heads import head_groups
from ..cache.schedule import (
    KEY_AXIS,
    allocated_tokens,
    first_store_seen,
    freed_tokens,
    layer_sink_tokens,
    side_tokens,
    sliding_cut,
    tier_keeps,
    tier_passed,
    tier_tokens,
)
from ..config import KiviConfig
from ..quant.side_format import SIDES

#: Fields of a KIVI estimate's breakdown (bytes).
FIELDS = ("codes", "scales_zero_points", "compensation", "fp_window", "fp_sink", "fp_unquantized", "block_reserve")


def held_tokens(cfg: KiviConfig, axis: str, quantized: bool, T: int, P: int, window: int | None,
                sink: int) -> tuple[int, int]:
    """(allocated tokens still held, written tokens in them) of one side's block store.

    One prefill of ``P`` tokens (one append: its own block), then one-token decode steps up to ``T``.
    A sliding layer (``window``) evicts at the start of every decode step; the last one ran with
    ``T - 1`` tokens cached. After a single prefill nothing is evicted yet.
    """
    R, G, bs, Q = cfg.residual_length, cfg.group_size, cfg.block_size, cfg.quantize_after
    stored = side_tokens(axis, T, R, G, sink, quantized, Q)[1]
    if stored == 0:
        return 0, 0
    # the first append: the prefill's flush, or (quantize_after) the step that passes Q
    first = side_tokens(axis, first_store_seen(P, T, Q) if quantized else P, R, G, sink, quantized, Q)[1]
    allocated = allocated_tokens(stored, first, bs)
    freed = 0
    if window is not None and T > P:
        seen_before = T - 1
        stored_before = side_tokens(axis, seen_before, R, G, sink, quantized, Q)[1]
        # BlockStore.evict(cut) exposes from min(cut, length); sliding layers keep no sink, so store
        # positions are absolute positions.
        start = min(sliding_cut(seen_before, window, R, G, bs), stored_before)
        freed = freed_tokens(start, first, bs)
    return allocated - freed, stored - freed


def tier_held_tokens(cfg: KiviConfig, axis: str, T: int, P: int, sink: int) -> list[tuple[int, int, int]]:
    """``[(bits, allocated tokens held, written tokens in them)]`` of each position-tier store of one side
    (``cfg.tiers``), newest tier first; one prefill of ``P`` tokens then one-token decode steps up to ``T``.

    At the prefill each tier keeps its share (one exact-size block) and what ages out of it at once
    goes straight on (:meth:`BlockStore.skip`); every later append (one token, or a key group) enters
    the newest tier, which passes its oldest tokens on, evicting them (blocks freed once wholly passed).
    """
    R, G, bs, Q = cfg.residual_length, cfg.group_size, cfg.block_size, cfg.quantize_after
    j = 0 if axis == KEY_AXIS else 1
    keeps = tier_keeps(cfg.tiers)
    stored_T = side_tokens(axis, T, R, G, sink, quantize_after=Q)[1]
    # the first append (one exact-size block per tier): the prefill, or the step that passes quantize_after
    stored_P = side_tokens(axis, first_store_seen(P, T, Q), R, G, sink, quantize_after=Q)[1]
    held_T, held_P = tier_tokens(axis, stored_T, keeps, G), tier_tokens(axis, stored_P, keeps, G)
    in_T, in_P = tier_passed(axis, stored_T, keeps, G), tier_passed(axis, stored_P, keeps, G)
    out = []
    for i, (_, widths) in enumerate(cfg.tiers[1:]):
        passed_T, passed_P = in_T[i] - held_T[i], in_P[i] - held_P[i]
        appended = in_T[i] - passed_P  # everything after what bypassed the tier at the prefill
        if appended <= 0:
            out.append((widths[j], 0, 0))
            continue
        allocated = allocated_tokens(appended, held_P[i], bs)
        freed = freed_tokens(passed_T - passed_P, held_P[i], bs)
        out.append((widths[j], allocated - freed, appended - freed))
    return out


def layer_bytes(cfg: KiviConfig, head_dim: int, heads: int, dtype: torch.dtype, T: int, P: int,
                window: int | None) -> dict[str, float]:
    """Bytes of one layer (config ``cfg``, ``heads`` = KV heads x batch, cached tensors of ``dtype``), by field
    of :data:`FIELDS`."""
    D, dtype_bytes = head_dim, dtype.itemsize
    sink = layer_sink_tokens(cfg.sink_tokens, window)
    out = dict.fromkeys(FIELDS, 0.0)
    for side, quant in zip(SIDES, (cfg.quantize_key, cfg.quantize_value)):
        fmt = cfg.side_format(side)
        axis = fmt.axis
        if quant:
            stores = (tier_held_tokens(cfg, axis, T, P, sink) if cfg.tiers
                      else [(fmt.bits, *held_tokens(cfg, axis, quant, T, P, window, sink))])
            for store_bits, held, used in stores:
                per = dataclasses.replace(fmt, bits=store_bits).token_bytes(D, dtype)
                for k, v in per.items():
                    out[k] += heads * used * v
                out["block_reserve"] += heads * (held - used) * sum(per.values())
            s, _, in_window = side_tokens(axis, T, cfg.residual_length, cfg.group_size, sink,
                                          quantize_after=cfg.quantize_after)
            out["fp_sink"] += heads * s * D * dtype_bytes
            out["fp_window"] += heads * in_window * D * dtype_bytes
        else:
            held, used = held_tokens(cfg, axis, quant, T, P, window, sink)
            out["fp_unquantized"] += heads * used * D * dtype_bytes
            out["block_reserve"] += heads * (held - used) * D * dtype_bytes
    return out


def head_layer_bytes(cfg: KiviConfig, widths: tuple[list[int], list[int]] | None, head_dim: int, kv_heads: int,
                     batch: int, dtype: torch.dtype, T: int, P: int, window: int | None) -> dict[str, float]:
    """Bytes of one layer with per-head widths (``widths`` = ``(k_bits, v_bits)`` per kv head, as
    :meth:`KiviConfig.layer_head_bits` gives them; ``None``: the layer's own widths on all ``kv_heads``):
    the sum over its head groups (:func:`kivi.cache.heads.head_groups`, each a layer of its own)."""
    if widths is None:
        return layer_bytes(cfg, head_dim, kv_heads * batch, dtype, T, P, window)
    out = dict.fromkeys(FIELDS, 0.0)
    for g in head_groups(*widths):
        gcfg = dataclasses.replace(cfg, k_bits=g.k_bits, v_bits=g.v_bits)
        for k, v in layer_bytes(gcfg, head_dim, g.heads * batch, dtype, T, P, window).items():
            out[k] += v
    return out


__all__ = ["FIELDS", "held_tokens", "tier_held_tokens", "layer_bytes", "head_layer_bytes"]
