"""How many of a paged request's tokens are in its sink, in its pages and in its window: one function of its token
count (:func:`kivi.cache.schedule.side_tokens`), for every paged host and the paged decode kernel's ``counts``.

A request that took ``shared`` prompt tokens from other requests' pages (transformers' prefix sharing,
:mod:`kivi.batching.allocator`: the sink ``S`` and whole pages, quantized in the source) holds them as sink and
pages from the start; its own schedule catches up with them once it has seen enough tokens (keys leave the window
in whole groups, and shared pages end on a group boundary), so its counts are the schedule's with at least those.
"""

from __future__ import annotations

from ..cache.schedule import side_tokens
from ..quant.page import AXIS, SIDES


def side_counts(cfg, side: str, seen: int, shared: int = 0) -> tuple[int, int, int]:
    """``(sink, stored, window)`` of side ``side`` (``"k"`` / ``"v"``) of a layer of config ``cfg`` (its
    ``sink_tokens`` the layer's) once a request holds ``seen`` tokens, ``shared`` of them taken from other requests'
    pages (0: none; else at least the sink)."""
    S = cfg.sink_tokens
    sink, stored, _ = side_tokens(AXIS[side], seen, cfg.residual_length, cfg.group_size, S,
                                  quantize_after=cfg.quantize_after)
    if shared:
        sink, stored = S, max(stored, shared - S)
    return sink, stored, seen - sink - stored


def kernel_counts(cfg, past: int, shared: int = 0) -> list[int]:
    """The paged decode kernel's counts of a decode row whose request holds ``past`` tokens before its new one:
    ``[k sink, k stored, k window + 1, v sink, v stored, v window + 1]`` (the window and the new token)."""
    out = []
    for side in SIDES:
        sink, stored, window = side_counts(cfg, side, past, shared)
        out += [sink, stored, window + 1]
    return out


__all__ = ["side_counts", "kernel_counts"]
