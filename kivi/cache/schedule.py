"""The cache's schedule: where a layer's tokens are after ``seen`` tokens, as integer arithmetic.

One side (keys or values) of a :class:`~kivi.cache.layer.KiviLayer` holds the tokens ``[0, seen)`` as

* **sink** ``[0, s)`` — the first ``s <= sink_tokens`` tokens to leave the window, full precision;
* **store** ``[s, s + stored)`` — quantized, in blocks (:class:`~kivi.cache.store.BlockStore`);
* **window** ``[s + stored, seen)`` — the most recent tokens, full precision.

A flush (after every append) moves tokens out of the front of the window: the first ones fill the
sink, then keys move in whole groups of ``G`` (aligned on ``s, s + G, ...``) once at least ``R``
newer keys remain, values as soon as more than ``R`` newer values exist. These rules make the state
depend on ``seen`` alone, not on how the tokens arrived (:func:`side_tokens`).

:class:`~kivi.cache.layer.KiviLayer` moves tensors by these functions and the planner
(:mod:`kivi.memory`) counts bytes with them; neither restates them. Pure functions of ints: no torch.
"""

from __future__ import annotations

KEY_AXIS = "channel"  # keys: quantized per channel, groups of G tokens
VALUE_AXIS = "token"  # values: quantized per token, groups of G channels


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


def side_tokens(axis: str, seen: int, residual_length: int, group_size: int, sink_tokens: int = 0,
                quantized: bool = True) -> tuple[int, int, int]:
    """``(sink, stored, window)`` token counts of one side after ``seen`` tokens.

    The same whatever the chunking of the appends, so it is one flush of ``seen`` tokens into an empty
    side. An unquantized side stores every token (no sink, no window).
    """
    _check_axis(axis)
    if not quantized:
        return 0, seen, 0
    sink = sink_take(seen, residual_length, 0, sink_tokens)
    stored = flush_count(axis, seen - sink, residual_length, group_size)
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


# --------------------------------------------------------------------------- block allocation
# BlockStore allocates each new block with new_block_tokens: a long first append
# (a prefill) is one exact-size block, later (short) appends go into blocks of block_size tokens.


def new_block_tokens(remaining: int, block_size: int) -> int:
    """Tokens a new storage block holds: ``block_size``, or all ``remaining`` tokens of the append
    that opens it when that is more (a long prefill becomes one exact-size block)."""
    return max(block_size, remaining)


def first_block_tokens(first_append: int, block_size: int) -> int:
    """Capacity of the first block when the first append writes ``first_append`` tokens."""
    return new_block_tokens(first_append, block_size)


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
    "KEY_AXIS", "VALUE_AXIS", "layer_sink_tokens", "sink_take", "flush_count", "side_tokens", "key_group_start",
    "sliding_cut", "first_block_tokens", "allocated_tokens", "freed_tokens",
]
