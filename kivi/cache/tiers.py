"""`TierChain`: the stores of a side with position tiers, read as one store (oldest tier first).

With ``KiviConfig.tiers`` a side keeps one :class:`~kivi.cache.store.BlockStore` per quantized tier;
tier ``i`` holds tokens ``[stores[i].start, stores[i].length)`` and the next (newer) tier starts
where it ends. An :class:`~kivi.cache.view.AttentionView` of such a side carries a ``TierChain`` of
snapshots (:meth:`BlockStore.frozen`, taken when the view is made: what a decode step reads; each
query of a multi-token forward also gets the tokens that forward's earlier steps demote, through the
view's ``variants`` / ``choice``, :func:`kivi.cache.schedule.query_tier_ranges`) as its ``store``: ``iter_blocks`` walks every tier's blocks in token order,
each segment with its own ``bits``, so every reader that dequantizes segment by segment (the
reference :func:`~kivi.cache.view.materialize`, :mod:`kivi.attention.blocked`) reads tiers as is;
the fused numba kernel's tables list every tier store's blocks, each row with its own width. Triton
reads one width per side: :func:`kivi.attention.interface.run_backend` sends tiered views
(``AttentionView.tiered``) to the blocked path explicitly.
"""

from __future__ import annotations

from typing import Iterator

from .store import BlockStore


class TierChain:
    """Read-only chain of tier stores, oldest first, exposing tokens ``[start, length)``."""

    def __init__(self, stores: tuple[BlockStore, ...]):
        self.stores = stores

    @property
    def start(self) -> int:
        return self.stores[0].start

    @property
    def length(self) -> int:
        return self.stores[-1].length

    @property
    def template(self):
        raise TypeError("a TierChain holds segments of several widths: read it with iter_blocks()")

    def iter_blocks(self, end: int | None = None) -> Iterator[tuple[int, object]]:
        """``(first_token, segment)`` of the tokens ``[start, end)``, tier after tier (views, no copy)."""
        end = self.length if end is None else end
        for store in self.stores:
            yield from store.iter_blocks(min(end, store.length))

    def read(self, end: int | None = None):
        raise TypeError("a TierChain holds segments of several widths and cannot be read as one segment; "
                        "use iter_blocks()")


__all__ = ["TierChain"]
