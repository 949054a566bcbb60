"""`KiviPageAllocator`: transformers' block bookkeeping for KIVI pages, plus each request's KIVI state.

It subclasses transformers' ``FullAttentionCacheAllocator`` (block tables, reference counts, prefix
hashes and the free pool stay transformers' own) and changes what a block is and what a request needs:

* a block is ``layout.block_bytes`` bytes of KIVI pages (:mod:`kivi.batching.layout`);
* a request also holds ``layout.window_blocks`` window blocks (its full-precision sinks and windows),
  taken when it first gets cache and given back when it is freed, so the scheduler's free-block
  arithmetic counts them;
* each request has a :class:`RequestState`: per layer and side, how many tokens are in the sink and
  how many are quantized in pages (the window holds the rest);
* prefix matching only shares pages that are fully quantized in the source and that the new request's
  own schedule would have quantized too (:func:`shareable_tokens`), and a block is only hashed for
  sharing once every layer has quantized all its tokens (:meth:`quantized_blocks`).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
from transformers.generation.continuous_batching.cache_allocators import FullAttentionCacheAllocator

from ..cache.schedule import KEY_AXIS, VALUE_AXIS, side_tokens
from .layout import PageLayout


@dataclass
class RequestState:
    """One request's KIVI bookkeeping.

    ``sink[layer][s]`` / ``stored[layer][s]`` (``s`` = 0 keys, 1 values): tokens in the full-precision
    sink / quantized in pages. ``window_blocks``: its window block ids; ``window_index``: long
    ``[layers, 2, window_rows, 2]`` = (block id, row) of every full-precision row slot.
    """

    sink: list[list[int]]
    stored: list[list[int]]
    window_blocks: list[int] = field(default_factory=list)
    window_index: torch.Tensor | None = None


def shareable_tokens(layout: PageLayout, prompt_len: int) -> int:
    """Prompt tokens another request's pages may give a new request of ``prompt_len`` prompt tokens.

    Only tokens the new request's own schedule quantizes during its prefill (keys leave the window in
    whole groups once ``R`` newer remain; so the window part is recomputed at full precision) and no
    sink (a sink lives in the source's window blocks, which are not shared); floored to whole pages.
    """
    n = prompt_len
    for cfg in layout.layer_configs:
        if cfg.sink_tokens:
            return 0
        n = min(n, side_tokens(KEY_AXIS, prompt_len, cfg.residual_length, cfg.group_size)[1],
                side_tokens(VALUE_AXIS, prompt_len, cfg.residual_length, cfg.group_size)[1])
    return n // layout.page_size * layout.page_size


class KiviPageAllocator(FullAttentionCacheAllocator):
    """Allocator of KIVI blocks for the full-attention layers of a model (see the module docstring)."""

    def __init__(self, index: int, layer_indices: list[int], layout: PageLayout, allow_block_sharing: bool) -> None:
        self.layout = layout
        self.head_dim = layout.head_dim
        self.num_key_value_heads = layout.num_kv_heads
        self.cache_dtype = layout.dtype
        self.requests: dict[str, RequestState] = {}
        self._before_cache_tensor_init(index=index, layer_indices=layer_indices, tokens_per_page=layout.page_size,
                                       bytes_per_page=layout.bytes_per_page, allow_block_sharing=allow_block_sharing)

    def register_cache_tensor(self, bytes_per_sector: int, non_trash_bytes: int, cache_tensor: torch.Tensor,
                              pool) -> None:
        self._copy_view = cache_tensor.view(-1, self.bytes_per_block)
        self._after_cache_tensor_init(non_trash_bytes, bytes_per_sector, cache_tensor, pool)

    # ------------------------------------------------------------------ per-request state
    def state(self, request_id: str) -> RequestState:
        st = self.requests.get(request_id)
        if st is None:
            n = self.layout.num_layers
            st = self.requests[request_id] = RequestState([[0, 0] for _ in range(n)], [[0, 0] for _ in range(n)])
        return st

    def _take_window_blocks(self, request_id: str) -> None:
        st = self.state(request_id)
        if st.window_blocks:
            return
        lay = self.layout
        st.window_blocks = self.pool.get_free_blocks(self.index, lay.window_blocks)
        st.window_index = lay.window_index(st.window_blocks)

    def quantized_blocks(self, request_id: str) -> int:
        """Leading blocks of the request whose tokens are quantized in every layer, on both sides."""
        st = self.requests.get(request_id)
        if st is None:
            return 0
        return min(min(s) for s in st.stored) // self.tokens_per_page

    # ------------------------------------------------------------------ block level (transformers API)
    def needs_new_blocks(self, request_id: str, past_length: int, query_length: int) -> int:
        has_window = request_id in self.requests and bool(self.requests[request_id].window_blocks)
        return super().needs_new_blocks(request_id, past_length, query_length) + (
            0 if has_window else self.layout.window_blocks)

    def allocate_cache_to_request(self, request_id: str, past_length: int, query_length: int) -> None:
        self._take_window_blocks(request_id)
        super().allocate_cache_to_request(request_id, past_length, query_length)

    def free_blocks(self, request_id: str, no_cache: bool = False) -> None:
        st = self.requests.pop(request_id, None)
        if st is not None and st.window_blocks:
            self.pool.free_blocks(self.index, st.window_blocks)
        super().free_blocks(request_id, no_cache)

    def free_all_requests(self) -> None:
        for request_id in list(set(self.block_table) | set(self.requests)):
            self.free_blocks(request_id)

    def match_prefix_blocks(self, prompt_ids: list[int]) -> list[int]:
        blocks = super().match_prefix_blocks(prompt_ids)
        return blocks[: shareable_tokens(self.layout, len(prompt_ids)) // self.tokens_per_page]

    def acquire_prefix_blocks(self, request_id: str, prefix_len: int, block_ids: list[int]) -> None:
        super().acquire_prefix_blocks(request_id, prefix_len, block_ids)
        st = self.state(request_id)
        for layer in range(self.layout.num_layers):
            st.stored[layer] = [prefix_len, prefix_len]  # the shared pages hold the prefix, quantized

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


__all__ = ["KiviPageAllocator", "RequestState", "shareable_tokens"]
