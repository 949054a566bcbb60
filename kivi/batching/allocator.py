"""`KiviPageAllocator`: transformers' block bookkeeping for KIVI pages, plus each request's KIVI state.

It subclasses transformers' ``FullAttentionCacheAllocator`` (block tables, reference counts, prefix
hashes and the free pool stay transformers' own) and changes what a block is and what a request needs:

* a block is ``layout.block_bytes`` bytes of KIVI pages (:mod:`kivi.batching.layout`);
* a request also holds window blocks (its full-precision sinks and windows, every layer's ring blocks): as many
  as its length needs (``layout.request_window_blocks``, at most ``layout.window_blocks``), taken with its pages
  when it gets cache (so the scheduler's free-block arithmetic counts them, and what is held is what is
  reported) and given back when it is freed;
* each request has a :class:`RequestState`: its window blocks, its token count and the prompt tokens it took
  from other requests' pages; how many of its tokens are in the sink, in pages and in the window follows from
  them (:func:`kivi.paged.counts.side_counts`, the schedule's one rule: no per-layer copy);
* prefix matching only shares pages that are fully quantized in the source and that the new request's
  own schedule would have quantized too (:func:`shareable_tokens`), and a block is only hashed for
  sharing once every layer has quantized all its tokens (:meth:`quantized_blocks`).

Prefix hashes with sink tokens (``S``): page ``i`` holds the tokens ``[S + iP, S + (i+1)P)`` (store
positions count from the end of the sink), so its content depends on the prompt up to ``S + (i+1)P``,
not ``(i+1)P`` as transformers' hash of block ``i`` assumes. The allocator therefore hashes page ``i``
as the chain *sink tokens, page 0's tokens, ..., page i's tokens* (:meth:`page_hashes`; with ``S = 0``
exactly transformers' chain), and keeps the sink's full-precision rows of every hashed first page
(:attr:`prefix_sinks`): a request that shares ``k`` pages starts with ``S + kP`` tokens, its sink copied
into its own window blocks.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
from transformers.generation.continuous_batching.cache_allocators import FullAttentionCacheAllocator
from transformers.generation.continuous_batching.cache_allocators.cache_allocator import compute_block_hash

from ..cache.schedule import KEY_AXIS, VALUE_AXIS, side_tokens
from ..paged.counts import side_counts
from ..paged.ring import slot_place
from .layout import PageLayout


@dataclass
class RequestState:
    """One request's KIVI bookkeeping.

    ``tokens``: the tokens its cache holds once the running forward is done; ``shared``: prompt tokens taken
    quantized from other requests' pages (the sink and whole pages; 0: none), so its sink / stored / window counts
    are :func:`kivi.paged.counts.side_counts` of them. ``window_blocks``: its window block ids (ring block ``j``
    of every layer is unit ``layer`` of ``window_blocks[j]``: :meth:`kivi.batching.layout.PageLayout.rings`).
    """

    tokens: int = 0
    shared: int = 0
    window_blocks: list[int] = field(default_factory=list)
    #: ``[layers, S, H, 2D]`` sink rows of a shared prefix, written to the window blocks when they are taken
    shared_sink: torch.Tensor | None = None
    #: leading tokens whose pages were freed (sliding-window models: out of every query's reach)
    evicted: int = 0


#: block-table entry of a page freed because it left the sliding window (the table keeps its length:
#: transformers counts a request's allocated blocks by it)
EVICTED = -1


def prefix_sink_tokens(layout: PageLayout) -> int | None:
    """The sink length every layer shares (``None`` when layers differ: prefix sharing is then off, a
    prefix of ``n`` tokens would need different page boundaries per layer)."""
    sinks = {cfg.sink_tokens for cfg in layout.layer_configs}
    return sinks.pop() if len(sinks) == 1 else None


def shareable_tokens(layout: PageLayout, prompt_len: int) -> int:
    """Prompt tokens another request's pages may give a new request of ``prompt_len`` prompt tokens.

    The sink (``S`` tokens, the same in every layer) plus the whole pages of tokens the new request's own
    schedule quantizes during its prefill (keys leave the window in whole groups once ``R`` newer remain;
    the window part is recomputed at full precision), and at least one prompt token left to compute (its
    logits give the first new token). 0 when nothing can be shared (or layers have different sinks).
    """
    sink = prefix_sink_tokens(layout)
    if sink is None:
        return 0
    n = prompt_len
    for cfg in layout.layer_configs:
        n = min(n, side_tokens(KEY_AXIS, prompt_len, cfg.residual_length, cfg.group_size, sink)[1],
                side_tokens(VALUE_AXIS, prompt_len, cfg.residual_length, cfg.group_size, sink)[1])
    pages = min(n // layout.page_size, max(0, prompt_len - 1 - sink) // layout.page_size)
    return sink + pages * layout.page_size if pages else 0


class KiviPageAllocator(FullAttentionCacheAllocator):
    """Allocator of KIVI blocks for the full-attention layers of a model (see the module docstring)."""

    def __init__(self, index: int, layer_indices: list[int], layout: PageLayout, allow_block_sharing: bool) -> None:
        self.layout = layout
        self.head_dim = layout.head_dim
        self.num_key_value_heads = layout.num_kv_heads
        self.cache_dtype = layout.dtype
        self.requests: dict[str, RequestState] = {}
        #: sink tokens of every layer (prefix hashes start after them); ``None``: layers differ, no sharing
        self.sink_tokens = prefix_sink_tokens(layout)
        #: first page's block id -> (its hash, the sink rows ``[layers, S, H, 2D]`` of the request that
        #: hashed it); an entry is valid while the ledger still maps the block to that hash
        self.prefix_sinks: dict[int, tuple[int, torch.Tensor]] = {}
        self._before_cache_tensor_init(index=index, layer_indices=layer_indices, tokens_per_page=layout.page_size,
                                       bytes_per_page=layout.bytes_per_page, allow_block_sharing=allow_block_sharing)

    def register_cache_tensor(self, bytes_per_sector: int, non_trash_bytes: int, cache_tensor: torch.Tensor,
                              pool) -> None:
        self._copy_view = cache_tensor.view(-1, self.bytes_per_block)
        self._rings = [self.layout.rings(cache_tensor, i) for i in range(self.layout.num_layers)]  # sinks travel here
        self._after_cache_tensor_init(non_trash_bytes, bytes_per_sector, cache_tensor, pool)

    # ------------------------------------------------------------------ per-request state
    def state(self, request_id: str) -> RequestState:
        st = self.requests.get(request_id)
        if st is None:
            st = self.requests[request_id] = RequestState()
        return st

    def _missing_window_blocks(self, request_id: str, tokens: int) -> int:
        st = self.requests.get(request_id)
        held = len(st.window_blocks) if st is not None else 0
        return max(0, self.layout.request_window_blocks(tokens) - held)

    def _grow_window_blocks(self, request_id: str, tokens: int) -> None:
        """Give the request the window blocks a length of ``tokens`` needs (more blocks move no row)."""
        missing = self._missing_window_blocks(request_id, tokens)
        st = self.state(request_id)
        if not missing:
            return
        st.window_blocks = st.window_blocks + self.pool.get_free_blocks(self.index, missing)
        if st.shared_sink is not None:  # a shared prefix's sink: the request's own full-precision rows
            block, row = self._sink_slots(st.window_blocks)
            for rings, rows in zip(self._rings, st.shared_sink):
                rings[block, :, row] = rows
            st.shared_sink = None

    def _sink_slots(self, window_blocks: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
        """(block id, row) of the sink slots ``[0, S)`` in every layer's rings (:mod:`kivi.paged.ring`)."""
        index, row = slot_place(torch.arange(self.sink_tokens or 0), self.layout.window_tokens)
        return torch.tensor(window_blocks, dtype=torch.long)[index], row

    def quantized_blocks(self, request_id: str) -> int:
        """Leading blocks of the request whose tokens are quantized in every layer, on both sides."""
        st = self.requests.get(request_id)
        if st is None:
            return 0
        return min(side_counts(cfg, side, st.tokens, st.shared)[1] for cfg in self.layout.layer_configs
                   for side in ("k", "v")) // self.tokens_per_page

    # ------------------------------------------------------------------ block level (transformers API)
    def needs_new_blocks(self, request_id: str, past_length: int, query_length: int) -> int:
        return (super().needs_new_blocks(request_id, past_length, query_length)
                + self._missing_window_blocks(request_id, past_length + query_length))

    def allocate_cache_to_request(self, request_id: str, past_length: int, query_length: int) -> None:
        self._grow_window_blocks(request_id, past_length + query_length)
        super().allocate_cache_to_request(request_id, past_length, query_length)

    def free_blocks(self, request_id: str, no_cache: bool = False) -> None:
        st = self.requests.pop(request_id, None)
        if st is not None and st.window_blocks:
            self.pool.free_blocks(self.index, st.window_blocks)
        if request_id in self.block_table:
            self.block_table[request_id] = [b for b in self.block_table[request_id] if b != EVICTED]
        super().free_blocks(request_id, no_cache)

    def evict_pages(self, request_id: str, past: int) -> None:
        """Free the request's pages that left the sliding window (``layout.evicted_tokens(past)``)."""
        cut = self.layout.evicted_tokens(past)
        st = self.requests.get(request_id)
        if st is None or cut <= st.evicted:
            return
        table = self.block_table.get(request_id, [])
        freed = []
        for i in range(st.evicted // self.tokens_per_page, min(cut // self.tokens_per_page, len(table))):
            if table[i] != EVICTED and self.ledger.release(table[i], True):
                freed.append(table[i])
            table[i] = EVICTED
        self.pool.free_blocks(self.index, freed)
        st.evicted = cut

    def free_all_requests(self) -> None:
        for request_id in list(set(self.block_table) | set(self.requests)):
            self.free_blocks(request_id)

    # ------------------------------------------------------------------ prefix hashes (see the module docstring)
    def page_hashes(self, token_ids: list[int], pages: int):
        """The hash of each of the first ``pages`` pages of a request of tokens ``token_ids``: page ``i``
        chains the sink tokens and the tokens of pages ``0..i`` (``[0, S + (i+1)P)``, what its content
        depends on). Yields fewer when ``token_ids`` ends before a page does."""
        S, P = self.sink_tokens or 0, self.tokens_per_page
        parent = compute_block_hash(None, token_ids[:S]) if S else None
        for i in range(pages):
            tokens = token_ids[S + i * P: S + (i + 1) * P]
            if len(tokens) < P:
                return
            parent = compute_block_hash(parent, tokens)
            yield parent

    def match_prefix_blocks(self, prompt_ids: list[int]) -> list[int]:
        """Pages of other requests the prompt can take: matching hashes, as many as :func:`shareable_tokens`
        allows, and with sinks only while the first page's sink rows are kept."""
        if self.sink_tokens is None:
            return []
        limit = max(0, shareable_tokens(self.layout, len(prompt_ids)) - self.sink_tokens) // self.tokens_per_page
        blocks = []
        for h in self.page_hashes(prompt_ids, limit):
            block = self.ledger.hash_to_block.get(h)
            if block is None:
                break
            blocks.append(block)
        if blocks and self.sink_tokens and self._prefix_sink(blocks[0]) is None:
            return []
        return blocks

    def _prefix_sink(self, block: int) -> torch.Tensor | None:
        entry = self.prefix_sinks.get(block)
        if entry is None or self.ledger.block_to_hash.get(block) != entry[0]:
            return None
        return entry[1]

    def shared_prefix_tokens(self, pages: int) -> int:
        """Prompt tokens a request taking ``pages`` shared pages starts with: the sink and the pages."""
        return (self.sink_tokens or 0) + pages * self.tokens_per_page if pages else 0

    def acquire_prefix_blocks(self, request_id: str, prefix_len: int, block_ids: list[int]) -> None:
        S = self.sink_tokens or 0
        pages = (prefix_len - S) // self.tokens_per_page
        if prefix_len != self.shared_prefix_tokens(pages) or pages > len(block_ids):
            raise RuntimeError(f"prefix of {prefix_len} tokens is not the sink ({S}) plus whole shared pages")
        self.block_table[request_id] = list(block_ids[:pages])
        for block_id in block_ids[:pages]:
            self.ledger.acquire(block_id)
        st = self.state(request_id)
        st.shared = st.tokens = prefix_len  # the shared pages hold the prefix, quantized
        if S:
            st.shared_sink = self._prefix_sink(block_ids[0]).clone()

    def mark_complete_blocks(self, request_id: str, token_ids: list[int], new_new_blocks: int) -> None:
        """transformers' hashing of completed blocks (with de-duplication), page hashes as :meth:`page_hashes`;
        with sinks, keeps the sink rows of a newly hashed first page."""
        table = self.block_table[request_id]
        for i, block_hash in enumerate(self.page_hashes(token_ids, len(table))):
            block_id = table[i]
            if block_id in self.ledger.block_to_hash:
                continue
            if new_new_blocks == 0:
                break
            new_new_blocks -= 1
            identical = self.ledger.register_new_hash(block_id, block_hash)
            if identical is not None:  # the same content is already hashed: adopt it, free the duplicate
                self.ledger.acquire(identical)
                table[i] = identical
                if self.ledger.release(block_id):
                    self.pool.free_blocks(self.index, [block_id])
            elif i == 0 and self.sink_tokens:
                self._keep_prefix_sink(request_id, block_id, block_hash)

    def _keep_prefix_sink(self, request_id: str, block: int, block_hash: int) -> None:
        for b in [b for b in self.prefix_sinks if self._prefix_sink(b) is None]:  # drop stale entries
            del self.prefix_sinks[b]
        at, row = self._sink_slots(self.requests[request_id].window_blocks)
        self.prefix_sinks[block] = (block_hash, torch.stack([rings[at, :, row] for rings in self._rings]))

    def fork_blocks(self, source_request_id: str, dest_request_id: str, past_length: int):
        raise NotImplementedError("KIVI pages do not support forking requests (num_return_sequences > 1)")

    # ------------------------------------------------------------------ input preparation: KIVI reads no index
    def get_read_indices(self, request_id: str, past_length: int, query_length: int) -> list[int]:
        return []

    def get_write_indices(self, request_id: str, past_length: int, query_length: int) -> list[int]:
        return []

    def fill_block_table(self, request_id: str, past_length: int, query_length: int, block_table: torch.Tensor) -> None:
        raise NotImplementedError("KIVI pages cannot be read by a block-table (flash) kernel")

    def get_cache_for_block_table(self, layer_idx: int):
        raise NotImplementedError("KIVI pages cannot be read by a block-table (flash) kernel")

    def update(self, *args, **kwargs):  # the cache itself (KiviPagedCache.update) reads and writes KIVI pages
        raise NotImplementedError("KiviPageAllocator.update is not used: KiviPagedCache.update reads the pages")


__all__ = ["KiviPageAllocator", "RequestState", "shareable_tokens", "prefix_sink_tokens", "EVICTED"]
