"""The cache's schedule: where a layer's tokens are after ``seen`` tokens, as integer arithmetic.

One side (keys or values) of a :class:`~kivi.cache.layer.KiviLayer` holds the tokens ``[0, seen)`` as

* **sink** ``[0, s)`` — the first ``s <= sink_tokens`` tokens to leave the window, full precision;
* **store** ``[s, s + stored)`` — quantized, in blocks (:class:`~kivi.cache.store.BlockStore`);
* **window** ``[s + stored, seen)`` — the most recent tokens, full precision.

A flush (after every append) moves tokens out of the front of the window -- only once the side holds
more than ``quantize_after`` tokens (:func:`quantizing`; until then every token stays in the window, full
precision, and the first flush past it moves everything due at once) -- the first ones fill the sink, then keys move
in whole groups of ``G`` (aligned on ``s, s + G, ...``) once at least ``R``
newer keys remain, values as soon as more than ``R`` newer values exist. These rules make the state
depend on ``seen`` alone, not on how the tokens arrived (:func:`side_tokens`). A forward of several
tokens gives each of its queries the state one-token decoding would have at that query's step
(:func:`query_boundaries`; a prefill into an empty layer is exact: :func:`prefill_exact_queries`).

:class:`~kivi.cache.layer.KiviLayer` moves tensors by these functions and the planner
(:mod:`kivi.memory`) counts bytes with them; neither restates them. Pure functions of ints: no torch.
"""

from __future__ import annotations

from ..quant.side_format import KEY_AXIS, VALUE_AXIS


def _check_axis(axis: str) -> None:
    if axis not in (KEY_AXIS, VALUE_AXIS):
        raise ValueError(f"axis={axis!r}: expected {KEY_AXIS!r} (keys) or {VALUE_AXIS!r} (values)")


def layer_sink_tokens(sink_tokens: int, sliding_window: int | None) -> int:
    """Sink capacity of a layer: ``sink_tokens``, but 0 on sliding-window layers.

    A sliding layer's first tokens leave its attention window anyway, so it keeps no sink.
    """
    return 0 if sliding_window is not None else sink_tokens


def sink_take(pending: int, residual_length: int, sink_len: int, sink_tokens: int) -> int:
    """How many of the first ``pending`` tokens (old window + new tokens) a flush turns into sink tokens.

    Only tokens with at least ``residual_length`` newer ones leave the window; the first of them
    fill the sink (already ``sink_len`` of ``sink_tokens``) before anything is stored.
    """
    return max(0, min(sink_tokens - sink_len, pending - residual_length))


def flush_count(axis: str, pending: int, residual_length: int, group_size: int) -> int:
    """How many of the first ``pending`` tokens (after the sink took its share) a flush stores.

    Keys (``"channel"``): whole groups of ``group_size``, leaving at least ``residual_length`` newer
    keys (so ``R`` to ``R + G - 1`` stay); values (``"token"``): everything but the ``residual_length``
    most recent. ``pending`` starts at a group boundary (the store holds whole groups after the sink).
    """
    _check_axis(axis)
    excess = pending - residual_length
    if excess <= 0:
        return 0
    return excess // group_size * group_size if axis == KEY_AXIS else excess


def window_capacity(residual_length: int, group_size: int) -> int:
    """The most tokens a side's window holds between forwards once it quantizes (``quantize_after = 0``):
    ``R + G - 1`` (keys keep ``R`` to ``R + G - 1`` after a flush, values ``R``; while the sink fills, ``R``)."""
    return residual_length + group_size - 1


def window_ring_slots(residual_length: int, group_size: int) -> int:
    """Slots of a window kept as a ring in place (token ``t`` in ring slot ``t % slots``) when a step writes
    its new token into the ring before the step's attention reads it: the window's capacity
    (:func:`window_capacity`) and that token, ``R + G``, so the new token never lands on a token the step
    still reads. A step writes only its tokens that stay in the window; tokens that leave are not moved."""
    return window_capacity(residual_length, group_size) + 1


def quantizing(held: int, quantize_after: int) -> bool:
    """Whether a side that holds ``held`` tokens (sink + stored + window) quantizes anything at all:
    only once it holds more than ``quantize_after`` (``KiviConfig.quantize_after``; 0 = from the start).

    Until then a flush moves nothing (every token stays in the full-precision window, attention is
    exact); the first flush past it moves everything the plain rules make due, so from then on the
    side is where it would be with ``quantize_after = 0`` (a function of the token count alone).
    """
    return held > quantize_after


def window_exits(axis: str, pending: int, residual_length: int, group_size: int, sink_len: int,
                 sink_tokens: int, before: int = 0, quantize_after: int = 0) -> tuple[int, int]:
    """``(to_sink, to_store)``: how many of the first ``pending`` tokens a flush moves into the sink,
    then into the store (the sink, already ``sink_len`` of ``sink_tokens``, fills first).

    ``before`` tokens of the side already left the window (sink + stored: the absolute position of the
    first pending token); nothing moves while ``before + pending <= quantize_after`` (:func:`quantizing`).
    What :meth:`~kivi.cache.layer.KiviLayer.append` moves after each forward, and what
    :func:`query_boundaries` counts for each query of a forward.
    """
    if not quantizing(before + pending, quantize_after):
        return 0, 0
    take = sink_take(pending, residual_length, sink_len, sink_tokens)
    return take, flush_count(axis, pending - take, residual_length, group_size)


def query_boundaries(axis: str, window: int, n: int, residual_length: int, group_size: int, sink_len: int,
                     sink_tokens: int, exact: int = 0, before: int = 0,
                     quantize_after: int = 0) -> tuple[int, ...] | None:
    """The per-query precision boundary of a forward of ``n`` tokens, or ``None`` when it is trivial.

    The side's full-precision window holds ``window`` tokens; the forward's ``pending`` tokens are
    that window followed by the ``n`` new ones. One-token decoding would run query ``i`` after
    flushing the first ``window + i`` pending tokens, so query ``i`` must read the first ``e_i``
    pending tokens as they are once they left the window (sink tokens exact, stored tokens
    quantized) and the rest at full precision: ``e_i = sum(window_exits(..., window + i, ...))``.
    The first ``exact`` queries are a prefill's prompt queries: they read every token at full
    precision (``e_i = 0``; the caller passes ``exact > 0`` only for a forward into an empty side).
    ``before`` / ``quantize_after``: as in :func:`window_exits` (query ``i`` follows a side holding
    ``before + window + i`` tokens, so a forward that crosses ``quantize_after`` quantizes for its later
    queries only).
    Returns ``(e_0, ..., e_{n-1})`` (non-decreasing after the first ``exact``), or ``None`` when
    every ``e_i`` is 0 -- always for ``n == 1``: a flush leaves nothing due, so decode steps never
    carry a boundary.
    """
    if n <= 1 or exact >= n:
        return None
    bounds = tuple(0 if i < exact else sum(window_exits(axis, window + i, residual_length, group_size, sink_len,
                                                        sink_tokens, before, quantize_after))
                   for i in range(n))
    return bounds if bounds[-1] else None


def prefill_exact_queries(seen: int, n: int, prompt_length: int | None) -> int:
    """How many of a forward's ``n`` queries read every token at full precision (KIVI's exact prefill).

    Only a forward into an empty layer (``seen == 0``) is a prefill: all its queries by default, or
    the first ``prompt_length`` when the prompt is known to be shorter than the forward (transformers'
    assisted / prompt-lookup decoding runs the prompt and the first candidates in one forward; the
    candidates' queries must see what one-token decoding after the prompt would). Every later forward
    follows the one-token rule, so the chunks after the first of a chunked prefill equal one-token
    decoding of those tokens.
    """
    if seen:
        return 0
    return n if prompt_length is None else min(n, prompt_length)


def side_tokens(axis: str, seen: int, residual_length: int, group_size: int, sink_tokens: int = 0,
                quantized: bool = True, quantize_after: int = 0) -> tuple[int, int, int]:
    """``(sink, stored, window)`` token counts of one side after ``seen`` tokens.

    The same whatever the chunking of the appends, so it is one flush of ``seen`` tokens into an empty
    side (``(0, 0, seen)`` while ``seen <= quantize_after``). An unquantized side stores every token
    (no sink, no window).
    """
    _check_axis(axis)
    if not quantized:
        return 0, seen, 0
    sink, stored = window_exits(axis, seen, residual_length, group_size, 0, sink_tokens, 0, quantize_after)
    return sink, stored, seen - sink - stored


def key_group_start(position: int, sink_len: int, group_size: int) -> int:
    """Start of the key group holding ``position`` (groups are aligned on ``sink_len + k * G``)."""
    return sink_len + (position - sink_len) // group_size * group_size


def sliding_cut(seen: int, sliding_window: int, residual_length: int, group_size: int, block_size: int) -> int:
    """First token a sliding-window layer must still expose when ``seen`` tokens are cached.

    Tokens older than ``window + R + G`` are out of reach of every future query; the cut is floored to
    a multiple of ``block_size`` (so it depends on ``seen, W, R, G, block_size`` only and every sliding
    layer with those reports the same mask offset). The layer evicts at the start of each forward,
    with ``seen`` = the tokens before it.
    """
    return max(0, (seen - sliding_window - residual_length - group_size) // block_size * block_size)


# --------------------------------------------------------------------------- position tiers
# With ``KiviConfig.tiers`` a side's store is a chain of stores, oldest (narrowest) tier first. A tier
# with a token count ``keep`` passes tokens on to the next older tier by the window's own rule
# (flush_count with ``residual_length = keep``): keys in whole groups once ``keep`` newer ones remain,
# values beyond the ``keep`` most recent. So every tier's count depends on the stored count alone.


def tier_keeps(tiers) -> tuple[int, ...]:
    """Token counts of the quantized tiers that have one (all but the last), newest first."""
    return tuple(n for n, _ in tiers[1:-1])


def tier_tokens(axis: str, stored: int, keeps: tuple[int, ...], group_size: int) -> tuple[int, ...]:
    """Tokens each quantized tier holds when ``stored`` tokens left the window, newest tier first
    (``len(keeps) + 1`` counts; the last, oldest tier holds the rest)."""
    out = []
    for keep in keeps:
        passed = flush_count(axis, stored, keep, group_size)
        out.append(stored - passed)
        stored = passed
    return (*out, stored)


def tier_passed(axis: str, stored: int, keeps: tuple[int, ...], group_size: int) -> tuple[int, ...]:
    """Tokens that entered each quantized tier (newest first) when ``stored`` tokens left the window:
    ``stored`` for the newest, then what each tier passed on."""
    held = tier_tokens(axis, stored, keeps, group_size)
    out, entered = [], stored
    for h in held:
        out.append(entered)
        entered -= h
    return tuple(out)


def query_tier_ranges(axis: str, window: int, n: int, residual_length: int, group_size: int, sink_len: int,
                      sink_tokens: int, stored: int, keeps: tuple[int, ...], exact: int = 0, before: int = 0,
                      quantize_after: int = 0) -> tuple[tuple[tuple[int, int], ...], ...]:
    """Which tokens each query of a forward of ``n`` reads at each quantized tier: the tier state one-token
    decoding would have at that query's step (the one rule for it; :func:`query_boundaries` is its window part).

    Positions count from the first token of the window (``0`` = the side's ``split``: the first token not
    stored before the forward, ``stored`` tokens being stored then, after ``sink_len`` sink tokens). Query
    ``i``'s step has moved ``e_i`` pending tokens out of the window (``e_i`` as in :func:`query_boundaries`,
    of which the first ``to_sink`` filled the sink), so ``stored + s_i`` tokens are stored and the tiers
    hold :func:`tier_tokens` of that, newest at the end. Returns, per query, ``(lo, hi)`` per quantized
    tier, newest first, relative to ``split`` (negative: tokens stored before the forward); the oldest
    tier ends at the first stored token. The first ``exact`` queries (a prefill's prompt) see the tiers
    as they were before the forward. ``before`` / ``quantize_after``: as in :func:`query_boundaries`.
    """
    out = []
    for i in range(n):
        take, moved = (0, 0) if i < exact else window_exits(axis, window + i, residual_length, group_size,
                                                            sink_len, sink_tokens, before, quantize_after)
        out.append(tier_ranges(axis, stored + moved, keeps, group_size, end=take + moved))
    return tuple(out)


def tier_ranges(axis: str, stored: int, keeps: tuple[int, ...], group_size: int, end: int = 0
                ) -> tuple[tuple[int, int], ...]:
    """``(lo, hi)`` of each quantized tier, newest first, when ``stored`` tokens left the window and the
    newest stored token ends at ``end`` (:func:`tier_tokens` laid out backwards from ``end``)."""
    ranges, hi = [], end
    for count in tier_tokens(axis, stored, keeps, group_size):
        ranges.append((hi - count, hi))
        hi -= count
    return tuple(ranges)


# --------------------------------------------------------------------------- block allocation
# BlockStore allocates each new block with new_block_tokens: a long first append
# (a prefill) is one exact-size block, later (short) appends go into blocks of block_size tokens.


def new_block_tokens(remaining: int, block_size: int) -> int:
    """Tokens a new storage block holds: ``block_size``, or all ``remaining`` tokens of the append
    that opens it when that is more (a long prefill becomes one exact-size block)."""
    return max(block_size, remaining)


def saved_capacity(filled: int, block_size: int) -> int:
    """Capacity a saved block holding ``filled`` tokens gets back on load: what a fresh append of them opens
    (:func:`new_block_tokens`), whatever a crop left; a loader derives it, never reads it."""
    return new_block_tokens(filled, block_size)


def first_block_tokens(first_append: int, block_size: int) -> int:
    """Capacity of the first block when the first append writes ``first_append`` tokens."""
    return new_block_tokens(first_append, block_size)


def first_store_seen(prefill: int, seen: int, quantize_after: int) -> int:
    """Tokens held at the first flush that may store anything, for one prefill of ``prefill`` tokens and
    one-token steps up to ``seen``: the prefill itself, or the step that passes ``quantize_after``
    (capped at ``seen``). What that flush stores is the first append of the block store
    (:func:`allocated_tokens`' ``first_append``)."""
    return min(seen, max(prefill, quantize_after + 1))


def allocated_tokens(stored: int, first_append: int, block_size: int) -> int:
    """Token capacity allocated for ``stored`` tokens: a first append of ``first_append`` tokens,
    then appends of at most ``block_size`` tokens (decode)."""
    if stored <= 0:
        return 0
    first = first_block_tokens(first_append, block_size)
    return first + -(-max(0, stored - first) // block_size) * block_size


def freed_tokens(start: int, first_append: int, block_size: int) -> int:
    """Capacity of the leading blocks that end at or before store position ``start`` (freed by eviction);
    positions count from the store's first token. Same allocation as :func:`allocated_tokens`."""
    first = first_block_tokens(first_append, block_size)
    if start < first:
        return 0
    return first + (start - first) // block_size * block_size


__all__ = [
    "KEY_AXIS", "VALUE_AXIS", "layer_sink_tokens", "sink_take", "flush_count", "window_exits", "query_boundaries",
    "window_capacity", "window_ring_slots",
    "prefill_exact_queries", "side_tokens", "quantizing",
    "first_store_seen", "key_group_start",
    "sliding_cut", "first_block_tokens", "tier_keeps", "tier_tokens", "tier_passed", "query_tier_ranges", "tier_ranges",
    "allocated_tokens", "freed_tokens",
]
