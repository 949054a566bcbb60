"""Position tiers as a storage layout: :class:`TieredStore` (written) and :class:`TierChain` (read).

With ``KiviConfig.tiers`` a side keeps one :class:`~kivi.cache.store.BlockStore` per quantized tier;
tier ``i`` (oldest first) holds tokens ``[stores[i].start, stores[i].length)`` and the next (newer)
tier starts where it ends. What leaves the window enters the newest tier; each tier passes on, demoted
to the next narrower width, what ages out of it by the window's own rule
(:func:`~kivi.cache.schedule.flush_count` with the tier's token count). A :class:`TieredStore` is a
:class:`~kivi.cache.store.Storage` like a ``BlockStore``, so the layer's side never asks which it holds.

An :class:`~kivi.cache.view.AttentionView` of a tiered side carries a ``TierChain`` of snapshots
(:meth:`BlockStore.frozen`, taken when the view is made: what a decode step reads; each query of a
multi-token forward also gets the tokens that forward's earlier steps demote, through the view's
``region``, :mod:`kivi.cache.boundary`) as its ``store``: ``iter_blocks`` walks every
tier's blocks in token order, each segment with its own ``bits``, so every reader that dequantizes
segment by segment reads tiers as is; the fused numba kernel's tables list every tier store's blocks,
each row with its own width. Triton reads one width per side: :func:`kivi.attention.interface.run_backend`
sends tiered views (``AttentionView.tiered``) to the blocked path explicitly.
"""

from __future__ import annotations

from typing import Any, Callable, Iterator

import torch

from ..quant.demote import demote_kv
from ..quant.side_format import KEY_AXIS
from .schedule import flush_count, tier_keeps
from .store import BlockStore, Segment, token_slice


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


class TieredStore:
    """The quantized tiers of one side, oldest first; what leaves the window enters the newest."""

    writes_in_place = False  # a new token may go straight on to an older tier: written through append()

    def __init__(self, block_size: int, axis: str, tiers: tuple, group_size: int):
        j = 0 if axis == KEY_AXIS else 1
        self.axis, self.group_size = axis, group_size
        self.stores: list[BlockStore] = [BlockStore(block_size) for _ in tiers[1:]]  # oldest tier first
        #: widths of the tiers older than the newest, oldest first (what a demotion into tier i writes)
        self.bits: list[int] = [b[j] for _, b in reversed(tiers[2:])]
        #: token count of every tier but the oldest, oldest first (``keeps[i]`` for ``stores[i + 1]``)
        self.keeps: tuple[int, ...] = tuple(reversed(tier_keeps(tiers)))

    # ------------------------------------------------------------------ reading
    @property
    def start(self) -> int:
        return self.stores[0].start

    @property
    def length(self) -> int:
        return self.stores[-1].length

    @property
    def newest(self) -> BlockStore:
        return self.stores[-1]

    def tier_stores(self) -> tuple[BlockStore, ...]:
        return tuple(self.stores)

    def iter_blocks(self, end: int | None = None) -> Iterator[tuple[int, Segment]]:
        return TierChain(tuple(self.stores)).iter_blocks(end)

    def snapshot(self) -> TierChain:
        """Snapshots of the chain as it is now (this forward's demotions come after the view)."""
        return TierChain(tuple(s.frozen() for s in self.stores))

    def read_range(self, a: int, b: int) -> Segment:
        """Tokens ``[a, b)``, which must lie in one tier (one width)."""
        for store in self.stores:
            if store.start <= a and b <= store.length:
                return store.read_range(a, b)
        raise ValueError(f"tokens [{a}, {b}) span several position tiers: read them with iter_blocks()")

    # ------------------------------------------------------------------ writing
    def append(self, seg: Segment) -> None:
        self._push(len(self.stores) - 1, seg)

    def _push(self, i: int, seg: Segment) -> None:
        """Append ``seg`` (the next tokens in age order) to tier ``stores[i]``, first demoting into tier
        ``i - 1`` what ages out of tier ``i`` (:func:`~kivi.cache.schedule.flush_count` with the tier's
        token count: the window's own rule). Tokens of ``seg`` that would age out at once go straight on,
        demoted, and never occupy tier ``i``."""
        store = self.stores[i]
        if i > 0:
            held = store.length - store.start
            due = flush_count(self.axis, held + seg.num_tokens, self.keeps[i - 1], self.group_size)
            from_store = min(due, held)
            from_seg = due - from_store
            to_bits = self.bits[i - 1]
            if from_store:
                self._push(i - 1, demote_kv(store.read(store.start + from_store), to_bits))
                store.evict(store.start + from_store)
            if from_seg:
                self._push(i - 1, demote_kv(token_slice(seg, 0, from_seg), to_bits))
                store.skip(from_seg)
            seg = token_slice(seg, from_seg, seg.num_tokens)
        if seg.num_tokens:
            store.append(seg)

    # ------------------------------------------------------------------ editing
    def truncate(self, new_length: int) -> None:
        """Forget tokens ``[new_length, length)``; only within the newest tier (:meth:`check_truncate`)."""
        self.check_truncate(new_length)
        self.newest.truncate(new_length)

    def check_truncate(self, new_length: int) -> None:
        """Older tiers hold demoted codes, which cannot give back the wider ones: a truncation stays in the newest."""
        if new_length < self.newest.start:
            raise ValueError(f"cannot crop to {new_length} tokens: tokens before {self.newest.start} were demoted to a "
                             "narrower position tier, which cannot restore their wider codes")

    def evict(self, before: int) -> None:
        for store in self.stores:
            store.evict(before)

    def restart(self, position: int) -> None:
        for store in self.stores:
            store.restart(position)

    def checkpoint(self) -> tuple:
        return tuple(s.checkpoint() for s in self.stores)

    def rollback(self, checkpoint: tuple) -> None:
        for s, cp in zip(self.stores, checkpoint):
            s.rollback(cp)

    def map_tensors(self, fn: Callable[[torch.Tensor], torch.Tensor]) -> None:
        for s in self.stores:
            s.map_tensors(fn)

    def nbytes_by_field(self) -> dict[str, int]:
        out: dict[str, int] = {}
        for s in self.stores:
            for k, v in s.nbytes_by_field().items():
                out[k] = out.get(k, 0) + v
        return out

    def state_dict(self) -> dict[str, Any]:
        return {"tiers": [s.state_dict() for s in self.stores]}

    def load_state_dict(self, state: dict[str, Any], device: str | torch.device = "cpu") -> None:
        tiers = state.get("tiers")
        if not isinstance(tiers, list) or len(tiers) != len(self.stores):
            raise ValueError(f"{len(tiers) if isinstance(tiers, list) else 'no'} tier stores saved; the config's "
                             f"tiers give {len(self.stores)}")
        for s, sd in zip(self.stores, tiers):
            s.load_state_dict(sd, device)


def new_storage(block_size: int, axis: str, tiers: tuple | None, group_size: int) -> BlockStore | TieredStore:
    """The storage of one side: a :class:`TieredStore` for a config with position tiers, else a ``BlockStore``."""
    return TieredStore(block_size, axis, tiers, group_size) if tiers else BlockStore(block_size)


__all__ = ["TierChain", "TieredStore", "new_storage"]
