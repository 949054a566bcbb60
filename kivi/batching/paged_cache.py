"""`KiviPagedCache`: transformers' ``PagedAttentionCache`` whose blocks hold KIVI pages.

What changes against the float paged cache (everything else — scheduling, block tables, the ledger of
shared blocks — is transformers' own; no batch attention mask is built):

* **prefix hashes** are kivi's (:meth:`KiviPageAllocator.page_hashes`: with sink tokens a page's
  content depends on ``S`` tokens past transformers' block), and sharing counts the sink;
* **size**: the number of blocks is ``cache_memory // layout.block_bytes`` (the packed block size),
  and no trash sectors are reserved (nothing reads or writes through indices);
* **the step** (one per layer and forward): ``update`` hands the ``"kivi_paged"`` attention the batch's new keys
  and values (:class:`~kivi.batching.paged_attention.StepInput`), which hands them back with the queries to
  :meth:`KiviPagedCache.attend`: the paged core's step (:func:`kivi.paged.forward.paged_step`, the vLLM plugin's)
  over this cache's block tables and window blocks — each request reads its sink, pages, window and new tokens
  with :class:`kivi.cache.KiviLayer`'s per-query boundary (decode rows in one paged decode kernel call), then what
  leaves the windows is quantized and written to the pages and the new rows to the rings, all or nothing.
  A block is every layer's unit of the core's geometry (:mod:`kivi.batching.layout`), so one step serves both hosts.

The batch's requests reach ``update`` through the one side channel transformers leaves:
``extend_read_and_write_indices`` is called once per request, in batch order, while the batch is
prepared; the cache records ``(request_id, past_length, query_length)`` there (:attr:`_next_batch`)
and the first layer's ``update`` takes that list for the whole forward. Synchronous batching only
(``use_async_batching`` prepares the next batch during a forward; it is refused).
"""

from __future__ import annotations

import dataclasses
from typing import Any

import torch
from transformers.generation.continuous_batching.cache import PagedAttentionCache
from transformers.generation.continuous_batching.cache_allocators import FULL_ATTENTION, CachePool
from transformers.generation.continuous_batching.requests import RequestState as HFRequestState
from transformers.generation.continuous_batching.requests import RequestStatus

from ..paged.decode_call import decode_kernel
from ..paged.forward import StepBatch, paged_step
from ..paged.plan import step_plan
from .allocator import KiviPageAllocator
from .layout import PageLayout
from .paged_attention import StepInput

TRANSFORMERS_MAX_BATCH_TOKENS = 8192  # transformers' default where a config gives none (PagedAttentionMemoryHandler)


class KiviPagedCache(PagedAttentionCache):
    """A ``PagedAttentionCache`` of KIVI pages holding at most ``cache_memory`` bytes (see the module docstring)."""

    def __init__(self, config: Any, continuous_batching_config: Any, device: torch.device | str, *,
                 layout: PageLayout, cache_memory: int, packed_backend: Any = None) -> None:
        if isinstance(cache_memory, bool) or not isinstance(cache_memory, int) or cache_memory < 1:
            raise ValueError(f"cache_memory={cache_memory!r} must be a positive number of bytes")
        self.config = config
        self.dtype = layout.dtype
        self.device = device
        self.layout = layout
        #: the attention backend of the step (``"cpu"`` / ``"reference"``: a :class:`kivi.backends.Backend` or its
        #: name; ``None``: ``"reference"``)
        self.packed_backend = packed_backend
        self._backend = getattr(packed_backend, "name", packed_backend) or "reference"
        self.max_blocks_per_request = 0  # no decode fast path: no kernel reads KIVI pages by block table
        allocator = KiviPageAllocator(0, list(range(layout.num_layers)), layout,
                                      continuous_batching_config.allow_block_sharing)
        self.cache_allocators = {FULL_ATTENTION: allocator}
        self.layer_to_allocator = dict.fromkeys(range(layout.num_layers), allocator)
        self.bytes_per_sector = layout.block_bytes  # one block per sector
        self.tokens_per_sector = layout.page_size * layout.num_layers
        self.max_batch_tokens = continuous_batching_config.max_batch_tokens or TRANSFORMERS_MAX_BATCH_TOKENS
        self.num_sectors = cache_memory // layout.block_bytes
        if self.num_sectors < layout.request_blocks(1):
            raise ValueError(
                f"cache_memory={cache_memory} bytes holds {self.num_sectors} KIVI blocks "
                f"of {layout.block_bytes} bytes; "
                f"one request needs at least {layout.request_blocks(1)} (its full-precision rows and one page)"
            )
        self.cache_tensor = torch.zeros(self.num_sectors * self.bytes_per_sector, dtype=torch.uint8, device=device)
        self.pool = CachePool(self.num_sectors, 1, num_reserved_sectors=0)
        allocator.register_cache_tensor(self.bytes_per_sector, self.cache_tensor.numel(), self.cache_tensor, self.pool)
        self.allow_block_sharing = continuous_batching_config.allow_block_sharing
        # layers with different sink lengths would need different page boundaries for one shared prefix
        # pages freed by a sliding window cannot be shared
        self.use_prefix_sharing = (self.allow_block_sharing and allocator.sink_tokens is not None
                                   and layout.evicting_window is None)
        self.num_blocks = self.num_sectors
        self.read_cache_limit = None
        self.max_decode_fast_path_length = 0
        self.max_tokens_read = layout.page_size * self.num_blocks
        # per layer: its units of the pool as the core's step reads them, its k window rings (all in the same
        # blocks), and the batched paged decode kernel over them (None: decode rows go request by request)
        self._pages = [layout.pages(self.cache_tensor, i) for i in range(layout.num_layers)]
        self._rings = [[layout.rings(self.cache_tensor, i)] * geo.window_rings
                       for i, geo in enumerate(layout.geometries)]
        self._kernels = [
            None if w is not None else decode_kernel(cfg, geo, self._backend, pages, rings, host="batching")
            for cfg, geo, w, pages, rings in zip(layout.layer_configs, layout.geometries, layout.sliding_windows,
                                                 self._pages, self._rings)]
        self._next_batch: list[tuple[str, int, int]] = []  # filled while a batch is prepared
        self._batch: list[tuple[str, int, int]] = []  # the batch of the running forward
        self._step: StepBatch | None = None  # its tables, the same for every layer
        self._plans: dict[int, Any] = {}  # its schedule (kivi.paged.plan.step_plan) by the first layer of each config
        pairs = list(zip(layout.layer_configs, layout.geometries))
        self._plan_of = [pairs.index(pair) for pair in pairs]  # layers of equal config and geometry share a plan
        #: prompt tokens requests took from other requests' pages instead of computing them
        self.shared_tokens = 0

    @property
    def allocator(self) -> KiviPageAllocator:
        return self.cache_allocators[FULL_ATTENTION]

    # ------------------------------------------------------------------ accounting
    def free_block_count(self) -> int:
        self.pool.try_to_free_sectors()
        return self.pool.num_free_sectors + self.pool.count_free_blocks(0)

    # ------------------------------------------------------------------ batch plan (the side channel)
    def extend_read_and_write_indices(self, request_id: str, past_length: int, query_length: int,
                                      read_index: list[list[int]] | None, write_index: list[list[int]]) -> None:
        """transformers calls this once per request, in batch order, while it prepares a batch."""
        self._next_batch.append((request_id, past_length, query_length))

    # ------------------------------------------------------------------ prefix sharing
    def search_prefix_match(self, request_id: str, prompt_ids: list[int]) -> int:
        """transformers' prefix match (limited to pages the request's own schedule quantizes, see
        :func:`kivi.batching.allocator.shareable_tokens`); counts the tokens shared in :attr:`shared_tokens`."""
        if not self.use_prefix_sharing:
            return 0
        alloc = self.allocator
        blocks = alloc.match_prefix_blocks(prompt_ids)
        n = alloc.shared_prefix_tokens(len(blocks))
        if n:
            alloc.acquire_prefix_blocks(request_id, n, blocks)
        self.shared_tokens += n
        return n

    def count_new_complete_blocks(self, state: HFRequestState, request_len: int) -> dict[str, int]:
        return {FULL_ATTENTION: 1} if self.use_prefix_sharing else {}

    def mark_complete_blocks(self, state: HFRequestState, complete_blocks: dict[str, int]) -> None:
        """Hash (offer for sharing) the request's blocks whose tokens every layer has quantized."""
        if not self.use_prefix_sharing or state.status == RequestStatus.FINISHED:
            return
        alloc = self.allocator
        table = alloc.block_table.get(state.request_id, [])
        hashed = 0
        while hashed < len(table) and table[hashed] in alloc.ledger.block_to_hash:
            hashed += 1
        new = min(alloc.quantized_blocks(state.request_id), len(table)) - hashed
        if new > 0:
            alloc.mark_complete_blocks(state.request_id, state.initial_tokens + state.generated_tokens, new)

    def prepare_fork_request(self, src_state, dst_req_ids, copy_src_and_dst):
        raise NotImplementedError("KIVI pages do not support forking requests (num_return_sequences > 1)")

    # ------------------------------------------------------------------ the forward
    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, layer_idx: int,
               kwargs: dict[str, Any]) -> tuple[StepInput, StepInput]:
        """``[1, H, n, D]`` new keys / values of the batch -> the layer's :class:`StepInput` (both sides), which the
        ``"kivi_paged"`` attention hands back to :meth:`attend` with the queries."""
        if kwargs.get("block_table") is not None:
            raise NotImplementedError("KIVI pages cannot be read by a block-table (flash) kernel")
        if layer_idx == 0:
            self._start_forward()
        n = key_states.shape[-2]
        if self._step is None or self._step.query_start[-1] != n:
            raise RuntimeError(
                f"KiviPagedCache.update got {n} new tokens but the prepared batch has "
                f"{sum(q for _, _, q in self._batch)}; was the batch prepared by transformers' continuous batching?")
        step = StepInput(self, layer_idx, key_states[0].transpose(0, 1), value_states[0].transpose(0, 1))
        return step, step

    def _start_forward(self) -> None:
        """At a forward's first layer: the batch transformers prepared, each request's token count, evictions, and
        the step's tables (the same for every layer; a layer's ring table is its first ``k`` columns)."""
        alloc, lay = self.allocator, self.layout
        self._batch, self._next_batch = self._next_batch, []
        states = []
        for rid, past, q in self._batch:
            st = alloc.state(rid)
            st.tokens = past + q
            if lay.evicting_window is not None:  # before the reads: as KiviLayer, at a forward's start
                alloc.evict_pages(rid, past)
            if not st.window_blocks or len(st.window_blocks) < lay.request_window_blocks(past + q):
                raise RuntimeError(f"request {rid} holds {len(st.window_blocks)} KIVI window blocks, {past + q} tokens "
                                   f"need {lay.request_window_blocks(past + q)} (its cache was not allocated)")
            if st.shared > past:
                raise RuntimeError(f"request {rid}: it shares {st.shared} prompt tokens, more than its past ({past})")
            states.append(st)
        qs, starts = [q for _, _, q in self._batch], [0]
        for q in qs:
            starts.append(starts[-1] + q)
        # page tables (EVICTED pages, freed by a sliding window, are never read: any block id stands in)
        tables = [[max(b, 0) for b in alloc.block_table.get(rid, [])] for rid, _, _ in self._batch]
        width = max([1] + [len(t) for t in tables])
        device = self.cache_tensor.device
        page_table = torch.tensor([t + [0] * (width - len(t)) for t in tables], dtype=torch.int32,
                                  device=device).reshape(len(tables), width)
        k = lay.window_blocks
        ring_table = torch.tensor([(st.window_blocks + [0] * k)[:k] for st in states], dtype=torch.int32,
                                  device=device).reshape(len(states), k)
        shared = [st.shared for st in states]
        self._step = StepBatch(starts, [p + q for _, p, q in self._batch], page_table, ring_table, None,
                               shared if any(shared) else None,
                               [st.evicted for st in states] if lay.evicting_window is not None else None)
        self._plans = {}

    def attend(self, layer: int, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
               scale: float) -> torch.Tensor:
        """Layer ``layer``'s step (:func:`kivi.paged.forward.paged_step`): ``query [n, Hq, D]``, ``key / value
        [n, H, D]`` (the batch's new tokens) -> attention ``[n, Hq, D]``; reads the pages and rings, quantizes what
        leaves the windows and writes it, writes the new rows (all or nothing: a refused value writes nothing). A
        sliding layer's window is the layout's (the model config's, as transformers passes it to attention)."""
        lay, step = self.layout, self._step
        cfg, geo = lay.layer_configs[layer], lay.geometries[layer]
        window = lay.sliding_windows[layer]
        plan = self._plans.get(self._plan_of[layer])
        if plan is None:
            plan = self._plans[self._plan_of[layer]] = step_plan(cfg, geo, step.query_start, step.seq_lens,
                                                                step.shared)
        batch = dataclasses.replace(step, ring_table=step.ring_table[:, : geo.window_rings], plan=plan)
        out = torch.empty_like(query)
        kernel = self._kernels[layer]
        return paged_step(cfg, geo, self._backend, query, key, value, self._pages[layer], self._rings[layer], batch,
                          scale, out, batched_decode=kernel is not None, kernel=kernel, sliding_window=window)


__all__ = ["KiviPagedCache"]
