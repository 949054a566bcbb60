"""`KiviPagedCache`: transformers' ``PagedAttentionCache`` whose blocks hold KIVI pages.

What changes against the float paged cache (everything else — scheduling, block tables, the ledger of
shared blocks, the batch's attention mask — is transformers' own):

* **prefix hashes** are kivi's (:meth:`KiviPageAllocator.page_hashes`: with sink tokens a page's
  content depends on ``S`` tokens past transformers' block), and sharing counts the sink;
* **size**: the number of blocks is ``cache_memory // layout.block_bytes`` (the packed block size),
  and no trash sectors are reserved (nothing reads or writes through indices);
* **update** (one call per layer and forward): for every request of the batch, what attention sees
  is its sink, its pages dequantized (all requests' pages of this layer in one gather and one
  dequantization), its window and its new tokens, in full precision, concatenated in the batch's
  order (transformers' SDPA / eager attention then runs over it with its varlen mask: at most one
  layer of the batch's context is dequantized at a time; a chunk's queries all see the cache as it was
  before the chunk: tensors cannot carry a per-query boundary). In the packed mode it hands attention
  each request's :class:`~kivi.cache.view.AttentionView` instead, with :class:`KiviLayer`'s per-query
  boundary for a chunk into a request that holds tokens (:func:`kivi.paged.step.request_view`).
  Then, as in :class:`kivi.cache.KiviLayer`,
  tokens leave the window (keys in whole groups of ``G`` once ``R`` newer remain, values beyond
  ``R``), are quantized (one :func:`kivi.paged.step.quantize_leaving` per side for the whole batch) and
  written to their pages (:func:`kivi.paged.step.commit`).

The batch's requests reach ``update`` through the one side channel transformers leaves:
``extend_read_and_write_indices`` is called once per request, in batch order, while the batch is
prepared; the cache records ``(request_id, past_length, query_length)`` there (:attr:`_next_batch`)
and the first layer's ``update`` takes that list for the whole forward. Synchronous batching only
(``use_async_batching`` prepares the next batch during a forward; it is refused).
"""

from __future__ import annotations

import dataclasses
from functools import partial
from typing import Any

import torch
from transformers.generation.continuous_batching.cache import PagedAttentionCache
from transformers.generation.continuous_batching.cache_allocators import FULL_ATTENTION, CachePool
from transformers.generation.continuous_batching.requests import RequestState as HFRequestState
from transformers.generation.continuous_batching.requests import RequestStatus

from ..attention.fused_cpu.paged import RingRows
from ..cache.pages import gather_pages, page_store
from ..cache.view import AttentionView
from ..capabilities import kernel_reasons
from ..optional import numba_problem
from ..paged.counts import side_counts
from ..paged.decode import PagedDecode
from ..paged.step import Leaving, Pages, Pending, commit, exits, kept_rows, request_side
from ..quant.kv import dequantize_kv
from .allocator import KiviPageAllocator
from .decode import DecodeStep, decode_counts, decode_step
from .layout import SIDES, PageLayout, field_views, window_view
from .paged_attention import PagedBatchViews

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
        #: ``None``: update returns the batch's keys / values dequantized (transformers' SDPA reads them);
        #: a backend (``"cpu"`` / ``"reference"``: a :class:`kivi.backends.Backend` or its name): it returns
        #: :class:`PagedBatchViews` that kivi's backend reads packed
        self.packed_backend = packed_backend
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
        self._views = field_views(self.cache_tensor, layout)
        self._rows = window_view(self.cache_tensor, layout)
        #: per layer, the paged decode kernel's view of its fields (``None``: that layer's decoding requests are
        #: read one by one — materialized or reference mode, numba absent, a sliding window, compensation codes)
        backend, numba = getattr(packed_backend, "name", packed_backend) or "reference", numba_problem() or ""
        scales = [layout.layer_fields(i, "k")["scale"].dtype for i in range(layout.num_layers)]
        self._kernel_layouts = [
            None if kernel_reasons(cfg, "batching", backend, numba=numba, sliding=w is not None, param_dtype=scales[i])
            else layout.kernel_layout(i)
            for i, (cfg, w) in enumerate(zip(layout.layer_configs, layout.sliding_windows))]
        self._decode: DecodeStep | None = None  # the running forward's decoding requests
        self._next_batch: list[tuple[str, int, int]] = []  # filled while a batch is prepared
        self._batch: list[tuple[str, int, int]] = []  # the batch of the running forward
        #: largest keys + values (bytes) one update handed to attention: the dequantized transient of one layer
        self.max_dequantized_bytes = 0
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
               kwargs: dict[str, Any]) -> tuple[torch.Tensor, torch.Tensor]:
        """``[1, H, n, D]`` new keys / values of the batch -> ``[1, H, sum(past + q), D]`` for attention."""
        alloc = self.allocator
        kwargs["cu_seq_lens_k"] = kwargs["cu_seq_lens_k"][alloc.layer_type].to(torch.int32)
        kwargs["max_length_k"] = kwargs["max_length_k"][alloc.layer_type]
        if kwargs.get("block_table") is not None:
            raise NotImplementedError("KIVI pages cannot be read by a block-table (flash) kernel")
        if layer_idx == 0:
            self._batch, self._next_batch = self._next_batch, []
            for rid, past, q in self._batch:
                self.allocator.state(rid).tokens = past + q
            if self.layout.evicting_window is not None:  # before the views: as KiviLayer, at a forward's start
                for rid, past, _ in self._batch:
                    self.allocator.evict_pages(rid, past)
            self._decode = None
            if any(lay is not None for lay in self._kernel_layouts):
                alloc = self.allocator
                self._decode = decode_step(self._batch, [alloc.state(rid) for rid, _, _ in self._batch],
                                           alloc.block_table, self.layout)
        n = key_states.shape[-2]
        if sum(q for _, _, q in self._batch) != n:
            raise RuntimeError(
                f"KiviPagedCache.update got {n} new tokens but the prepared batch has "
                f"{sum(q for _, _, q in self._batch)}; was the batch prepared by transformers' continuous batching?")
        keys, values = self.layer_forward(layer_idx, key_states[0], value_states[0], self._batch)
        if isinstance(keys, PagedBatchViews):
            return keys, values
        self.max_dequantized_bytes = max(self.max_dequantized_bytes,
                                         keys.numel() * keys.element_size() * 2)
        return keys.unsqueeze(0), values.unsqueeze(0)

    def layer_forward(self, layer: int, keys: torch.Tensor, values: torch.Tensor,
                      batch: list[tuple[str, int, int]]) -> tuple[Any, Any]:
        """One layer of one forward: ``keys`` / ``values`` ``[H, n, D]`` (the batch's new tokens, in batch
        order) -> what attention sees: ``[H, sum(past + q), D]`` tensors (materialized mode) or a
        :class:`PagedBatchViews` per side (packed mode); then moves tokens out of the windows."""
        alloc, lay = self.allocator, self.layout
        cfg = lay.layer_configs[layer]
        states = [alloc.state(rid) for rid, _, _ in batch]
        for (rid, past, q), st in zip(batch, states):
            if not st.window_blocks:
                raise RuntimeError(f"request {rid} has no KIVI window blocks (its cache was never allocated)")
            if st.shared > past:
                raise RuntimeError(f"request {rid}: it shares {st.shared} prompt tokens, more than its past ({past})")
            if st.window_index.shape[2] < lay.window_slots(past + q):
                raise RuntimeError(f"request {rid}: its window blocks hold {st.window_index.shape[2]} row slots, "
                                   f"{past + q} tokens need {lay.window_slots(past + q)} (allocated for fewer tokens?)")
        qs = [q for _, _, q in batch]
        # (sink, stored) of each request's sides before the forward: the schedule's, a function of its token
        # count (kivi.paged.counts; no stateful copy)
        counts = [[side_counts(cfg, side, past, st.shared)[:2] for side in SIDES]
                  for (_, past, _), st in zip(batch, states)]
        dec = self._decode_rows(layer, counts)
        # Both sides are read before either is written; commit quantizes both before writing anything: a refused
        # value (NaN) leaves the layer's pages and windows exactly as they were.
        sides = [self._side_forward(layer, s, side, cfg, new.split(qs, dim=1), batch, states,
                                    [c[s] for c in counts], dec)
                 for s, (side, new) in enumerate((("k", keys), ("v", values)))]
        seen = [side[0] for side in sides]
        if dec:
            rows = [batch[j] for j, _ in dec]
            picked = [k for _, k in dec]
            table = self._decode.table if len(picked) == len(self._decode.rows) else self._decode.table[picked]
            decode = PagedDecode(self.cache_tensor, self._kernel_layouts[layer], table,
                                 decode_counts(cfg, [p for _, p, _ in rows], [states[j].shared for j, _ in dec]),
                                 sides[0][2], sides[1][2], cfg.sink_tokens,
                                 getattr(self.packed_backend, "name", self.packed_backend))
            seen = [dataclasses.replace(v, decode=decode, decode_rows=tuple(j for j, _ in dec)) for v in seen]
        commit([side[1][:2] for side in sides], *(side[1][2] for side in sides))
        return seen[0], seen[1]

    def _decode_rows(self, layer: int, counts: list) -> list[tuple[int, int]]:
        """``(batch position, row of the DecodeStep)`` of the requests one paged decode kernel call reads at
        ``layer``: one query token and something quantized or in the sink (a request holding only its
        window attends with SDPA, as one-request generate() does)."""
        if self._decode is None or self._kernel_layouts[layer] is None:
            return []
        return [(j, k) for k, j in enumerate(self._decode.rows)
                if any(sink or stored for sink, stored in counts[j])]

    def _side_forward(self, layer: int, s: int, side: str, cfg: Any, news: tuple[torch.Tensor, ...],
                      batch: list[tuple[str, int, int]], states: list, counts: list[tuple[int, int]],
                      dec: list[tuple[int, int]]) -> tuple[Any, tuple[Leaving, Pages, Any], RingRows | None]:
        """What attention sees of one side ``[H, sum(past + q), D]``, the side's writes for
        :func:`kivi.paged.step.commit` (its leaving tokens, their pages, and the function that writes the new
        tokens below the sink slots or staying in the window to their slots: :func:`kivi.paged.step.kept_rows`),
        and the full-precision rows of the requests in ``dec`` as the paged decode kernel reads them in place
        (:class:`RingRows`; they get no view).

        The window is a ring in its slots (:meth:`PageLayout.window_slot`): tokens that leave it are read
        (those that go to the sink or the pages) and never moved, the ones that stay are never rewritten."""
        alloc, lay = self.allocator, self.layout
        P = lay.page_size
        dtype = news[0].dtype
        views = self._views[(layer, side)]
        S, ring = cfg.sink_tokens, lay.ring_slots(layer)
        # what leaves each request's window in this forward: kivi.paged.step's one rule
        moves = [exits(cfg, side, past, q, sink, stored) for (_, past, q), (sink, stored) in zip(batch, counts)]
        # 1. every request's pages of this layer and side: one gather, one dequantization (materialized mode)
        blocks: list[int] = []
        starts: list[int] = []
        for (rid, _, _), (_, stored) in zip(batch, counts):
            starts.append(len(blocks) * P)
            blocks.extend(alloc.block_table[rid][: lay.token_blocks(stored)])
        meta = dict(fmt=cfg.side_format(side), head_dim=lay.head_dim)
        deq = None
        if blocks and self.packed_backend is None:
            seg = gather_pages(views, torch.tensor(blocks, dtype=torch.long, device=self.cache_tensor.device), **meta)
            deq = dequantize_kv(seg, dtype)[0]  # [H, N * P, D]
        # 2. the decoding requests of ``dec``: their rows stay in place (one kernel call reads them); only the
        # rows that leave their windows are read, all in one gather, and the slots this step writes found
        rows_in, dec_writes, leaving = None, [], {}
        if dec:
            table = self._decode.slots[layer, s]  # int32 [N_all, window_rows]
            picked = [k for _, k in dec]
            reads, writes, spans = ([], []), ([], []), []
            for j, k in dec:
                (_, past, _), (sink, stored) = batch[j], counts[j]
                take, move = moves[j]
                lo, out = sink + stored, min(sink + stored + take + move, past)
                for t in range(lo, out):
                    reads[0].append(k)
                    reads[1].append(lay.window_slot(layer, t))
                spans.append((j, out - lo, lo + take + move - out))
                if kept_rows(past, 1, S, lo + take + move):  # the new token: its sink slot, or its ring slot
                    writes[0].append(k)
                    writes[1].append(lay.window_slot(layer, past))
            per_block = lay.rows_per_block
            ids = table[torch.tensor(reads[0] + writes[0], dtype=torch.long),
                        torch.tensor(reads[1] + writes[1], dtype=torch.long)].long()
            rid_ = ids[: len(reads[0])]
            got = self._rows[rid_ // per_block, rid_ % per_block]  # [n, H, D] (a copy: read before any write)
            at = 0
            for j, n_ring, n_new in spans:
                parts = [got[at: at + n_ring].transpose(0, 1)] if n_ring else []
                at += n_ring
                if n_new:  # leaves in its own step (R = 0)
                    parts.append(news[j][:, :n_new])
                if parts:
                    leaving[j] = parts[0] if len(parts) == 1 else torch.cat(parts, dim=1)
            wid = ids[len(reads[0]):]
            dec_writes = [wid // per_block, wid % per_block]
            slots = table[:, : S + ring] if len(picked) == table.shape[0] else table[picked, : S + ring]
            rows_in = RingRows(self._rows, slots, torch.cat([news[j] for j, _ in dec], dim=1).transpose(0, 1))
        # 3. what attention sees of the other requests, request by request: sink, pages, window, new tokens
        parts: list[torch.Tensor] = []
        pendings: dict[int, Pending] = {}
        attn_views: list[AttentionView | None] = []
        decoding = {j for j, _ in dec}
        for j, ((rid, past, _q), st, new, start) in enumerate(zip(batch, states, news, starts)):
            if j in decoding:
                attn_views.append(None)
                continue
            sink, stored = counts[j]
            evicted, store = min(st.evicted, stored), None  # sliding-window models: pages freed (no sink there)
            if self.packed_backend is not None:
                table = alloc.block_table[rid][evicted // P: lay.token_blocks(stored)]
                store = page_store(views, table, sink, stored, P, **meta, evicted=evicted)
            read = partial(self._read_rows, st.window_index[layer, s], layer)
            pendings[j], sink_t, view = request_side(cfg, side, new, past, counts[j], read, store, start=evicted)
            if view is not None:
                attn_views.append(view)
                continue
            if sink_t is not None:
                parts.append(sink_t)
            if stored:
                parts.append(deq[:, start: start + stored])
            parts.append(pendings[j].rows)
        if self.packed_backend is not None:
            seen = PagedBatchViews(tuple(attn_views), tuple(q for _, _, q in batch), self.packed_backend)
        else:
            seen = torch.cat(parts, dim=1)
        del deq
        # 4. what is due out of the windows (quantized by commit, once for the batch), the slots to write
        out, tables = Leaving(cfg, side), []
        row_slots, row_values, dec_values = [], [], []  # (block, row) and rows of the other requests; decoding's
        for j, ((rid, past, _q), st, new, (take, move)) in enumerate(zip(batch, states, news, moves)):
            sink, stored = counts[j]
            values = dec_values if j in decoding else row_values  # in the order of their slots' lists
            if move:  # store positions [stored, stored + move): the request's pages from stored // P on
                first = stored // P
                tables.append(alloc.block_table[rid][first: lay.token_blocks(stored + move)])
                part = pendings[j] if j in pendings else leaving[j][:, take: take + move]
                out.add(part, [(len(tables) - 1, stored - first * P, move)])
            for first, end in kept_rows(past, new.shape[1], S, sink + stored + take + move):
                values.append(new[:, first - past: end - past])
                if j in pendings:
                    row_slots.append(st.window_index[layer, s][lay.window_slot(layer, torch.arange(first, end))])
        width = max((len(t) for t in tables), default=0)
        table = torch.tensor([t + [0] * (width - len(t)) for t in tables], dtype=torch.long,
                             device=self.cache_tensor.device).reshape(len(tables), width)
        per_row = {f.name: f.tokens_per_row for f in self.layout.layer_fields(layer, side).values()}

        def write_rows() -> None:
            blocks_at, rows_at = [], []
            if row_values:
                ridx = torch.cat(row_slots, dim=0)  # [n, 2]: (block, row)
                blocks_at.append(ridx[:, 0])
                rows_at.append(ridx[:, 1])
            if dec_values:
                blocks_at.append(dec_writes[0])
                rows_at.append(dec_writes[1])
            if blocks_at:
                self._rows[torch.cat(blocks_at), torch.cat(rows_at)] = torch.cat(
                    [r.transpose(0, 1) for r in row_values + dec_values], dim=0).to(self._rows.dtype)  # [n, H, D]

        return seen, (out, Pages(views, per_row, table, P), write_rows), rows_in

    def _read_rows(self, index: torch.Tensor, layer: int, lo: int, hi: int) -> torch.Tensor:
        """Full-precision rows ``[H, hi - lo, D]`` of positions ``[lo, hi)`` of one request's side (a copy, in token
        order): ``index`` its ``[slots, 2]`` (block, row) of :attr:`RequestState.window_index`, the ring's slots
        :meth:`PageLayout.window_slot`."""
        w = index[self.layout.window_slot(layer, torch.arange(lo, hi))]
        return self._rows[w[:, 0], w[:, 1]].transpose(0, 1)


__all__ = ["KiviPagedCache"]
