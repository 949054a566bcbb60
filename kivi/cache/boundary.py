"""The per-query precision of a forward's views: one home for the layer and both paged caches.

A forward of ``n > 1`` tokens into a side that already holds tokens: one-token decoding would have
moved some pending tokens (the window and the new ones) out of the window before the later queries
run (:func:`~kivi.cache.schedule.query_boundaries`). :func:`set_boundary` gives the forward's
:class:`~kivi.cache.view.AttentionView` its :class:`~kivi.cache.view.QueryRegion`: two versions of the
tokens concerned, ``fp`` and the tokens as they are once out of the window (sink tokens exact, stored
tokens quantized and dequantized, bit-identical to what storage then holds); a side with position tiers
gets one version per tier instead (every stored token at the tier one-token decoding gives it at each
query's step, :func:`~kivi.cache.schedule.query_tier_ranges`). Inputs are plain: the side's counts, the
pending tensor, and a function that quantizes pending tokens as storage will.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import torch

from ..quant.demote import demote_kv
from ..quant.kv import PackedKV, dequantize_kv
from .schedule import query_boundaries, query_tier_ranges, tier_ranges, window_exits
from .store import token_slice
from .view import AttentionView, QueryRegion


@dataclass(frozen=True)
class SideCounts:
    """What the schedule needs to know of one side before a forward (all token counts)."""

    axis: str
    residual_length: int
    group_size: int
    sink_len: int  # sink tokens held
    sink_tokens: int  # the sink's capacity
    before: int = 0  # tokens that already left the window (sink + stored), read by quantize_after
    quantize_after: int = 0

    def exits(self, pending: int) -> tuple[int, int]:
        """``(to_sink, to_store)`` of a flush of ``pending`` tokens (:func:`~kivi.cache.schedule.window_exits`)."""
        return window_exits(self.axis, pending, self.residual_length, self.group_size, self.sink_len,
                            self.sink_tokens, self.before, self.quantize_after)


@dataclass(frozen=True)
class TierLayout:
    """A tiered side's quantized tiers, newest first: token counts (all but the oldest) and widths."""

    keeps: tuple[int, ...]
    bits: tuple[int, ...]


def set_boundary(view: AttentionView, counts: SideCounts, pending: torch.Tensor, n: int, exact: int,
                 quantize: Callable[[int, int], PackedKV], tiers: TierLayout | None = None) -> None:
    """Set ``view.region``, the per-query precision of a forward of ``n`` tokens (left ``None`` when every
    query reads the view as it is). The one function every producer of views calls (the layer's sides,
    kivi/batching/paged_cache.py, kivi/paged/forward.py).

    ``pending [B, H, window + n, D]``: the side's window then the new tokens; ``exact``: the forward's
    first queries that read every token at full precision (:func:`~kivi.cache.schedule.prefill_exact_queries`);
    ``quantize(lo, hi)``: pending tokens ``[lo, hi)`` quantized exactly as storage will hold them.
    """
    c = counts
    window = pending.shape[-2] - n
    args = (c.residual_length, c.group_size, c.sink_len, c.sink_tokens)
    held = dict(before=c.before, quantize_after=c.quantize_after)
    bounds = query_boundaries(c.axis, window, n, *args, exact=exact, **held)
    if bounds is None:
        return
    leading = next((i for i, b in enumerate(bounds) if b), n)  # queries before the window's first exit
    # The last query's exits: its first `take` pending tokens went to the sink (exact), the next
    # `stored` into quantized storage, quantized here exactly as the flush will quantize them.
    take, stored = c.exits(window + n - 1)
    seg = quantize(take, take + stored) if stored else None
    region = None
    if tiers is not None:
        region = _tier_region(view, c, tiers, pending, seg, take, window, n, exact, leading)
    if region is None:
        parts = [pending[:, :, :take]] if take else []
        if seg is not None:
            parts.append(dequantize_kv(seg, pending.dtype))
        left = torch.cat(parts, dim=-2) if len(parts) > 1 else parts[0]  # [B, H, M, D], M = bounds[-1]
        m = left.shape[-2]
        dev = view.fp.device
        reads_left = torch.arange(m, device=dev)[None, :] < torch.tensor(bounds, device=dev)[:, None]  # [n, M]
        region = QueryRegion(view.split, (view.fp[:, :, :m], left), reads_left.to(torch.uint8), leading)
    view.region = region


def _tier_region(view: AttentionView, c: SideCounts, tiers: TierLayout, pending: torch.Tensor,
                 seg: PackedKV | None, take: int, window: int, n: int, exact: int, leading: int) -> QueryRegion | None:
    """A tiered side's per-query region (one version per tier): each query reads every stored token
    at the tier one-token decoding would give it at that query's step (:func:`query_tier_ranges`),
    including tokens the forward's earlier steps demote and tokens leaving the window that are demoted
    within the same forward. ``seg``: the tokens leaving the window by the last query's step (after
    ``take`` sink tokens), quantized at the newest tier's widths. Positions below are relative to ``split``.
    ``None`` when no query reads a stored token differently from the view's base: only sink tokens left
    the window, which the plain two-version region says.
    """
    stored, keeps, bits = view.split - c.sink_len, tiers.keeps, tiers.bits
    ranges = query_tier_ranges(c.axis, window, n, c.residual_length, c.group_size, c.sink_len, c.sink_tokens,
                               stored, keeps, exact=exact, before=c.before, quantize_after=c.quantize_after)
    pre = tier_ranges(c.axis, stored, keeps, c.group_size)  # the tiers before the forward
    stores = list(reversed(view.store.stores))  # the view's snapshots, newest tier first
    # Per query and tier: the tokens that query reads at that tier but the view's base does not.
    moved = [[(max(lo, pre[j][1]), hi) for j, (lo, hi) in enumerate(r)] for r in ranges]
    spans = [(a, b) for r in moved for a, b in r if a < b]
    if not spans:
        return None
    first, end = min(0, *(a for a, _ in spans)), max(b for _, b in spans)  # from `split` on at least: readers
    # walk the store up to the region, the region, then `fp` after it
    L = end - first
    choice = torch.zeros(n, L, dtype=torch.uint8, device=pending.device)
    for i, r in enumerate(moved):
        for j, (a, b) in enumerate(r):
            if a < b:
                choice[i, a - first : b - first] = j + 1
    dtype = pending.dtype

    def tier_codes(j: int, a: int, b: int) -> torch.Tensor:
        """Tokens [a, b) (relative) at tier j, dequantized: stored codes or `seg`, demoted tier by tier."""
        parts = []
        for s, (lo, hi) in enumerate(pre[:j + 1]):  # stored before the forward, at a newer tier s <= j
            lo, hi = max(a, lo), min(b, hi, 0)
            if lo < hi:
                parts.append((s, stores[s].read_range(view.split + lo, view.split + hi)))
        if b > max(a, 0):
            lo = max(a, 0)
            parts.append((0, token_slice(seg, lo - take, b - take)))
        out = []
        for s, p in parts:
            for t in range(s + 1, j + 1):
                p = demote_kv(p, bits[t])
            out.append(dequantize_kv(p, dtype))
        return torch.cat(out, dim=-2) if len(out) > 1 else out[0]

    base = []
    if first < 0:  # stored tokens the forward demotes, at their tier before it
        base = [tier_codes(j, max(first, lo), hi) for j, (lo, hi) in enumerate(pre) if max(first, lo) < min(hi, 0)]
        base.reverse()  # oldest tier first: token order
    base.append(pending[:, :, max(first, 0):end])
    versions = [torch.cat(base, dim=-2) if len(base) > 1 else base[0]]
    for j in range(len(stores)):
        x = torch.zeros_like(versions[0])
        tj = [(a, b) for r in moved for a, b in [r[j]] if a < b]
        if tj:
            a, b = min(a for a, _ in tj), max(b for _, b in tj)
            x[:, :, a - first : b - first] = tier_codes(j, a, b)
        versions.append(x)
    return QueryRegion(view.split + first, tuple(versions), choice, leading)


__all__ = ["SideCounts", "TierLayout", "set_boundary"]
