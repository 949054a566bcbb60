"""The byte layout of KIVI pages: what one block of the paged cache holds, and how many fit a budget.

transformers' paged cache (``PagedAttentionCache``) cuts one flat byte tensor into **blocks**; a block
holds ``page_size`` consecutive tokens of one request for every layer (one **page** per layer). A KIVI
block holds, per layer, one KIVI page of ``page_size`` tokens: the fields of kivi's own
:class:`~kivi.quant.kv.PackedKV` per side, laid out by :func:`kivi.quant.page.page_fields` (the one
home of the page format, shared with the vLLM plugin).

Each request also keeps full-precision rows (model dtype, ``[H, D]`` per token): its sink tokens (sink
token ``t`` in slot ``t``) and its window of recent tokens kept as a **ring** from slot ``S``: window token
at position ``t`` in slot :func:`kivi.paged.ring.ring_slot` ``(t, R + G, S)`` (``t`` below ``S``, else
``S + t % (R + G)``, :func:`kivi.cache.schedule.window_ring_slots`: a step writes the rows of its new tokens
below ``S`` or staying in the window, and moves nothing), ``S + R + G`` rows per layer and side at most, and
never more than ``S + t`` once it holds ``t`` tokens (:meth:`PageLayout.window_slots`). They live in **window
blocks**
taken from the same pool (so the budget counts them and the scheduler sees them), as many as the
request's slots need (:meth:`PageLayout.request_window_blocks`; a short request takes fewer than the
``window_blocks`` of a full window). Rows are numbered slot-major,
``r = slot * (2 * layers) + layer * 2 + side``, and cut into blocks of ``rows_per_block`` rows
(:func:`kivi.paged.ring.slot_rows` with ``2 * layers`` lanes), so the slots a request uses are a prefix of its
window blocks: it grows by taking more blocks, no row moves.

Store positions: a side's quantized tokens are numbered from the end of its sink (``u = t - S``), and
store position ``u`` lives in the request's ``u // P``-th block, row ``u % P``. Key groups start at
``u = 0, G, 2G, ...`` as in :class:`kivi.cache.KiviLayer`, so they never straddle pages.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any

import torch

from ..attention.fused_cpu.paged import PagedLayout
from ..cache.schedule import layer_sink_tokens, sliding_cut, window_ring_slots
from ..cache.support import check_head_dim, model_head_dim, plan_layers, text_config
from ..capabilities import host_reasons
from ..config import KiviConfig
from ..paged.ring import ring_slot, slot_rows
from ..quant.page import AXIS, SIDES, SideField, field_view, page_fields
from ..quant.page import round_up as _round_up

BLOCK_ALIGN = 128  # bytes: transformers aligns its sectors on 128 bytes


@dataclass(frozen=True)
class PageLayout:
    """Geometry of a KIVI paged cache for one model, config, dtype and ``page_size``.

    Attributes:
        page_size: tokens per page (``P``), a multiple of every layer's ``group_size``.
        num_layers, num_kv_heads (``H``), head_dim (``D``), dtype: the model's.
        layer_configs: the KIVI config of each layer (``layer_specific_config`` applied; no sink on sliding layers).
        sliding_windows: each layer's sliding window (``None``: full attention).
        fields: per layer, its page fields (:class:`kivi.quant.page.SideField`, the one page format) with their
            byte offsets inside a block.
        page_bytes: bytes the fields take in one block (all layers).
        bytes_per_page: what transformers' allocator calls a page (``block_bytes // num_layers``).
        block_bytes: bytes of one block (``page_bytes`` rounded up; a multiple of 128 bytes).
        window_rows: full-precision rows per layer and side (``S`` sink slots and the window's ring of
            :func:`kivi.cache.schedule.window_ring_slots` ``= R + G`` slots, max over layers).
        rows_per_block: full-precision rows of ``[H, D]`` one block holds.
        window_blocks: window blocks of a request with a full window (all layers, both sides); a shorter
            request takes :meth:`request_window_blocks`.
    """

    page_size: int
    num_layers: int
    num_kv_heads: int
    head_dim: int
    dtype: torch.dtype
    layer_configs: tuple[KiviConfig, ...]
    sliding_windows: tuple[int | None, ...]
    fields: tuple[tuple[SideField, ...], ...]
    page_bytes: int
    bytes_per_page: int
    block_bytes: int
    window_rows: int
    rows_per_block: int
    window_blocks: int

    @property
    def evicting_window(self) -> int | None:
        """The sliding window when every layer has the same one (a block then holds only sliding pages, and
        pages older than the window can be freed: :meth:`evicted_tokens`); ``None`` otherwise."""
        windows = set(self.sliding_windows)
        return windows.pop() if len(windows) == 1 and None not in windows else None

    def evicted_tokens(self, past: int) -> int:
        """Leading tokens of a request no query can reach any more once it holds ``past`` tokens (whole pages;
        0 unless :attr:`evicting_window`): :func:`kivi.cache.schedule.sliding_cut`, the rule KiviLayer evicts
        by, with pages as its blocks. Every sliding layer shares ``R`` and ``G`` (``plan_layers``)."""
        window = self.evicting_window
        if window is None:
            return 0
        cfg = self.layer_configs[0]
        return sliding_cut(past, window, cfg.residual_length, cfg.group_size, self.page_size)

    @property
    def row_bytes(self) -> int:
        return self.num_kv_heads * self.head_dim * self.dtype.itemsize

    def layer_fields(self, layer: int, side: str) -> dict[str, SideField]:
        return {f.name: f for f in self.fields[layer] if f.side == side}

    def token_blocks(self, tokens: int) -> int:
        """Blocks that hold the pages of ``tokens`` tokens of one request."""
        return -(-tokens // self.page_size)

    def window_slots(self, tokens: int) -> int:
        """Full-precision row slots per layer and side a request holding ``tokens`` tokens can use: its sink
        slots ``[0, S)`` and its window from slot ``S`` on (at most all its tokens), capped at ``window_rows``."""
        sink = max(cfg.sink_tokens for cfg in self.layer_configs)
        return min(self.window_rows, sink + max(0, tokens))

    def ring_slots(self, layer: int) -> int:
        """Slots of layer ``layer``'s window ring (:func:`kivi.cache.schedule.window_ring_slots`, ``R + G``)."""
        cfg = self.layer_configs[layer]
        return window_ring_slots(cfg.residual_length, cfg.group_size)

    def window_slot(self, layer: int, position):
        """The slot of layer ``layer``'s token at ``position`` (an int or a long tensor, counted from the request's
        first token): :func:`kivi.paged.ring.ring_slot` with ring :meth:`ring_slots`. A short request's
        positions stay below its slots (``t < tokens``)."""
        return ring_slot(position, self.ring_slots(layer), self.layer_configs[layer].sink_tokens)

    def request_window_blocks(self, tokens: int) -> int:
        """Window blocks a request holding ``tokens`` tokens needs (``window_blocks`` once its window is full)."""
        return -(-(self.window_slots(tokens) * self.num_layers * 2) // self.rows_per_block)

    def request_blocks(self, tokens: int) -> int:
        """Blocks one request of ``tokens`` tokens takes: its pages plus its window blocks."""
        return self.token_blocks(tokens) + self.request_window_blocks(tokens)

    def window_ids(self, window_blocks: list[int]) -> torch.Tensor:
        """Long ``[layers, 2, slots]``: the row id (``block * rows_per_block + row`` of :func:`window_view`) of
        every full-precision row slot that a request whose window blocks are ``window_blocks`` holds (``slots``:
        as many as the blocks cover, at most ``window_rows``). Row ``(layer, side, slot)`` is number
        ``r = slot * (2 * layers) + layer * 2 + side`` (:func:`kivi.paged.ring.slot_rows`, ``2 * layers``
        lanes): more blocks add slots and move no row."""
        lanes = self.num_layers * 2
        slots = min(self.window_rows, len(window_blocks) * self.rows_per_block // lanes)
        lane = torch.arange(lanes).view(self.num_layers, 2, 1)
        return slot_rows(torch.tensor(window_blocks, dtype=torch.long), torch.arange(slots).expand(
            self.num_layers, 2, slots), self.rows_per_block, lanes, lane)

    def window_index(self, window_blocks: list[int]) -> torch.Tensor:
        """Long ``[layers, 2, slots, 2]``: :meth:`window_ids` as (block id, row)."""
        ids = self.window_ids(window_blocks)
        return torch.stack([ids // self.rows_per_block, ids % self.rows_per_block], dim=-1)

    def kernel_layout(self, layer: int) -> PagedLayout:
        """Where layer ``layer``'s fields sit in a block, for the paged decode kernel
        (:meth:`kivi.attention.fused_cpu.paged.PagedLayout.of_page`; whether it reads them:
        :mod:`kivi.capabilities`)."""
        return PagedLayout.of_page(list(self.fields[layer]), self.layer_configs[layer], block_bytes=self.block_bytes)

    def requests_that_fit(self, cache_memory: int, tokens: int) -> int:
        """Requests of ``tokens`` tokens each that ``cache_memory`` bytes of blocks hold at once."""
        return (cache_memory // self.block_bytes) // self.request_blocks(tokens)


def fp_block_bytes(model_config: Any, dtype: torch.dtype, page_size: int) -> int:
    """Bytes of one block of transformers' float paged cache (keys + values of ``page_size`` tokens, all layers)."""
    text = text_config(model_config)
    heads = getattr(text, "num_key_value_heads", None) or text.num_attention_heads
    return text.num_hidden_layers * 2 * heads * model_head_dim(model_config) * dtype.itemsize * page_size


def build_layout(model_config: Any, config: KiviConfig, page_size: int, dtype: torch.dtype) -> PageLayout:
    """The :class:`PageLayout` of ``config`` on a model; ``ValueError`` naming what the paged cache cannot hold."""
    if isinstance(page_size, bool) or not isinstance(page_size, int) or page_size < 1:
        raise ValueError(f"page_size={page_size!r} must be a positive integer")
    refusals = host_reasons(config, "batching")
    if refusals:
        raise ValueError(f"{'; '.join(map(str, refusals))}: not supported by KIVI pages in continuous batching "
                         "(use kivi's generate())")
    # Sliding-window layers keep no sink (kivi.cache.schedule.layer_sink_tokens, as KiviLayer); their window
    # is applied by the "kivi_paged" attention (the pages keep every token: no eviction yet).
    plan = [(dataclasses.replace(cfg, sink_tokens=layer_sink_tokens(cfg.sink_tokens, window)), window)
            for cfg, window in plan_layers(model_config, config)]
    text = text_config(model_config)
    heads = getattr(text, "num_key_value_heads", None) or text.num_attention_heads
    head_dim = model_head_dim(model_config)
    check_head_dim(config, head_dim, len(plan))
    fields: list[tuple[SideField, ...]] = []
    offset = 0
    window_rows = 0
    for layer, (cfg, _) in enumerate(plan):
        where = f"layer_specific_config[{layer}]." if layer in config.layer_specific_config else ""
        window_rows = max(window_rows, cfg.sink_tokens + window_ring_slots(cfg.residual_length, cfg.group_size))
        side_fields, offset = page_fields(cfg, heads, head_dim, page_size, dtype, offset=offset, where=where)
        fields.append(tuple(side_fields))
    page_bytes = offset
    num_layers = len(plan)
    bytes_per_page = _round_up(-(-page_bytes // num_layers), BLOCK_ALIGN)
    block_bytes = bytes_per_page * num_layers
    row_bytes = heads * head_dim * dtype.itemsize
    rows_per_block = block_bytes // row_bytes
    if rows_per_block < 1:
        raise ValueError(f"page_size={page_size} is too small: one block ({block_bytes} bytes) cannot hold one "
                         f"full-precision token row ({row_bytes} bytes)")
    window_blocks = -(-(num_layers * 2 * window_rows) // rows_per_block)
    return PageLayout(page_size, num_layers, heads, head_dim, dtype, tuple(c for c, _ in plan),
                      tuple(w for _, w in plan), tuple(fields),
                      page_bytes, bytes_per_page, block_bytes, window_rows, rows_per_block, window_blocks)


def field_views(cache_tensor: torch.Tensor, layout: PageLayout) -> dict[tuple[int, str], dict[str, torch.Tensor]]:
    """Views of ``cache_tensor`` (flat uint8, a whole number of blocks): ``{(layer, side): {field: [NB, *shape]}}``.

    Element ``[b]`` of a view is that field of block ``b``; the views alias the cache (no copy).
    """
    out: dict[tuple[int, str], dict[str, torch.Tensor]] = {}
    for layer, layer_fields in enumerate(layout.fields):
        for f in layer_fields:
            out.setdefault((layer, f.side), {})[f.name] = field_view(cache_tensor, f.shape, f.dtype, f.offset,
                                                                     layout.block_bytes)
    return out


def window_view(cache_tensor: torch.Tensor, layout: PageLayout) -> torch.Tensor:
    """``[NB, rows_per_block, H, D]`` view of ``cache_tensor`` in the model dtype: the full-precision rows."""
    nb = cache_tensor.numel() // layout.block_bytes
    item = layout.dtype.itemsize
    h, d = layout.num_kv_heads, layout.head_dim
    return cache_tensor.view(layout.dtype).as_strided(
        (nb, layout.rows_per_block, h, d), (layout.block_bytes // item, h * d, d, 1), 0
    )


__all__ = ["PageLayout", "build_layout", "fp_block_bytes", "field_views", "window_view",
           "SIDES", "AXIS"]
