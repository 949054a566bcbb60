"""What a paged cache's blocks are doing now: held by requests (pages, KIVI window blocks), kept for
prefix sharing, free. Read by ``kivi serve``'s ``GET /health``; works for :class:`KiviPagedCache` and
transformers' float ``PagedAttentionCache``.

The counts are read while the generation thread may change them: every table is copied first (a dict
or list copy is atomic under the GIL), so each count is consistent with itself, not necessarily with
the others.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class BlockUsage:
    """Blocks of a paged cache by what holds them.

    ``total``: blocks the budget holds. ``pages``: distinct page blocks in the requests' block tables (a
    page shared by several requests counts once; pages freed by a sliding window do not count).
    ``window``: KIVI window blocks the requests hold (their full-precision sinks and windows; 0 for float
    pages). ``cached``: blocks no request holds, kept for prefix sharing (the scheduler evicts them when it
    needs room). ``requests``: requests holding at least one block. ``free_fraction``: the fraction of the
    budget in the free pool, what transformers' scheduler compares with its safety margin (held and
    cached blocks are not free).
    """

    total: int
    pages: int
    window: int
    cached: int
    requests: int
    free_fraction: float

    @property
    def held(self) -> int:
        """Blocks requests hold: pages and window blocks."""
        return self.pages + self.window


def block_usage(cache: Any) -> BlockUsage:
    """The :class:`BlockUsage` of ``cache`` (a ``KiviPagedCache`` or transformers' ``PagedAttentionCache``)."""
    pages: set[tuple[int, int]] = set()
    holders: set[str] = set()
    window = cached = 0
    for allocator in list(cache.cache_allocators.values()):
        for request_id, blocks in dict(allocator.block_table).items():
            ids = {(allocator.index, b) for b in list(blocks) if b >= 0}  # EVICTED (-1): freed by a sliding window
            pages |= ids
            if ids:
                holders.add(request_id)
        for request_id, state in dict(getattr(allocator, "requests", {})).items():  # KIVI window blocks
            if state.window_blocks:
                window += len(state.window_blocks)
                holders.add(request_id)
        cached += len(dict(allocator.ledger.cached_blocks))
    return BlockUsage(total=int(cache.num_blocks), pages=len(pages), window=window, cached=cached,
                      requests=len(holders), free_fraction=float(cache.compute_free_capacity()))


__all__ = ["BlockUsage", "block_usage"]
