"""The byte layout of KIVI pages in transformers' paged cache: what one block holds, and how many fit a budget.

transformers' paged cache (``PagedAttentionCache``) cuts one flat byte tensor into **blocks**; a block holds
``page_size`` consecutive tokens of one request for every layer. Here a block is ``num_layers`` **units** of
``unit`` bytes, unit ``l`` being one block of layer ``l`` in the paged core's geometry
(:class:`kivi.paged.geometry.KiviGeometry`, the vLLM plugin's): so layer ``l``'s blocks are a strided view of the
pool (:meth:`PageLayout.pages`, :meth:`PageLayout.rings`) and the core's step (:func:`kivi.paged.forward.paged_step`)
reads and writes them as it reads vLLM's. A block serves a request either as a **page** (in every layer, the KIVI
page of ``page_size`` tokens: :func:`kivi.quant.page.page_fields`) or as a **window block** (in every layer, one
ring block of ``Pw`` full-precision rows ``[H, Pw, 2D]``, keys then values). A request's full-precision rows (sink
and window, :mod:`kivi.paged.ring`: slot ``S + (pos - S) % (k * Pw - S)``) live in its first ``k`` window blocks,
``k`` = :attr:`ring_blocks` of the layer; a short request takes only the window blocks its tokens reach
(:meth:`PageLayout.request_window_blocks`), and more blocks move no row. Window blocks come from the same pool, so
the budget counts them and the scheduler sees them.

Store positions: a side's quantized tokens are numbered from the end of its sink (``u = t - S``), and store
position ``u`` lives in the request's ``u // P``-th page, so key groups never straddle pages.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass
from typing import Any

import torch

from ..cache.schedule import layer_sink_tokens, sliding_cut
from ..cache.support import check_head_dim, model_head_dim, plan_layers, text_config
from ..capabilities import host_reasons
from ..config import KiviConfig
from ..paged.geometry import KiviGeometry, build_geometry
from ..quant.page import AXIS, SIDES
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
        geometries: each layer's :class:`~kivi.paged.geometry.KiviGeometry`, every one ``unit`` bytes a block.
        unit: bytes of one layer's part of a block (what transformers' allocator calls a page).
        window_tokens: ``Pw``, full-precision tokens of one layer one window block holds.
    """

    page_size: int
    num_layers: int
    num_kv_heads: int
    head_dim: int
    dtype: torch.dtype
    layer_configs: tuple[KiviConfig, ...]
    sliding_windows: tuple[int | None, ...]
    geometries: tuple[KiviGeometry, ...]
    unit: int
    window_tokens: int

    @property
    def block_bytes(self) -> int:
        """Bytes of one block (every layer's unit)."""
        return self.unit * self.num_layers

    @property
    def bytes_per_page(self) -> int:
        """What transformers' allocator calls a page: one layer's part of a block."""
        return self.unit

    @property
    def ring_blocks(self) -> tuple[int, ...]:
        """``k`` per layer: the window blocks holding its ``S + R + G - 1`` full-precision rows."""
        return tuple(g.window_rings for g in self.geometries)

    @property
    def window_blocks(self) -> int:
        """Window blocks of a request with a full window (the most any layer needs)."""
        return max(self.ring_blocks)

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

    def token_blocks(self, tokens: int) -> int:
        """Blocks that hold the pages of ``tokens`` tokens of one request."""
        return -(-tokens // self.page_size)

    def request_window_blocks(self, tokens: int) -> int:
        """Window blocks a request holding ``tokens`` tokens needs: position ``t`` is in slot ``t`` below the sink
        and in a slot ``<= S + t`` after it (:func:`kivi.paged.ring.ring_slot`), so the blocks holding slots
        ``[0, S + tokens)`` (``S``: the largest sink of any layer), at most :attr:`window_blocks`."""
        if tokens <= 0:
            return 0
        sink = max(cfg.sink_tokens for cfg in self.layer_configs)
        return min(self.window_blocks, -(-(sink + tokens) // self.window_tokens))

    def request_blocks(self, tokens: int) -> int:
        """Blocks one request of ``tokens`` tokens takes: its pages plus its window blocks."""
        return self.token_blocks(tokens) + self.request_window_blocks(tokens)

    def requests_that_fit(self, cache_memory: int, tokens: int) -> int:
        """Requests of ``tokens`` tokens each that ``cache_memory`` bytes of blocks hold at once."""
        return (cache_memory // self.block_bytes) // self.request_blocks(tokens)

    def pages(self, pool: torch.Tensor, layer: int) -> torch.Tensor:
        """Layer ``layer``'s units of ``pool`` (flat uint8, whole blocks) as ``[NB, unit]`` (a view): the layer's
        cache as :func:`kivi.paged.forward.paged_step` takes it."""
        return pool.view(-1, self.block_bytes)[:, layer * self.unit: (layer + 1) * self.unit]

    def rings(self, pool: torch.Tensor, layer: int) -> torch.Tensor:
        """Layer ``layer``'s units of ``pool`` as window rows ``[NB, H, Pw, 2D]`` in the model dtype (a view)."""
        item, h, d, pw = self.dtype.itemsize, self.num_kv_heads, self.head_dim, self.window_tokens
        return pool.view(self.dtype).as_strided((pool.numel() // self.block_bytes, h, pw, 2 * d),
                                                (self.block_bytes // item, pw * 2 * d, 2 * d, 1),
                                                pool.storage_offset() // item + layer * self.unit // item)


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
    # Sliding-window layers keep no sink (kivi.cache.schedule.layer_sink_tokens, as KiviLayer)
    plan = [(dataclasses.replace(cfg, sink_tokens=layer_sink_tokens(cfg.sink_tokens, window)), window)
            for cfg, window in plan_layers(model_config, config)]
    text = text_config(model_config)
    heads = getattr(text, "num_key_value_heads", None) or text.num_attention_heads
    head_dim = model_head_dim(model_config)
    check_head_dim(config, head_dim, len(plan))
    natural = []
    for layer, (cfg, _) in enumerate(plan):
        where = f"layer_specific_config[{layer}]." if layer in config.layer_specific_config else ""
        natural.append(build_geometry(cfg, page_size=page_size, num_kv_heads=heads, head_dim=head_dim, dtype=dtype,
                                      where=where))
    # one unit for every layer, a multiple of heads * page_size (the geometry's state bytes) and of 128 bytes
    step = math.lcm(heads * page_size, BLOCK_ALIGN)
    unit = _round_up(max(g.block_bytes for g in natural), step)
    fp_token = heads * 2 * head_dim * dtype.itemsize
    window_tokens = unit // fp_token
    if window_tokens < 1:
        raise ValueError(f"page_size={page_size} is too small: one block's layer part ({unit} bytes) cannot hold one "
                         f"full-precision token ({fp_token} bytes)")
    geos = tuple(dataclasses.replace(g, state_bytes=unit // (heads * page_size), window_tokens=window_tokens)
                 for g in natural)
    return PageLayout(page_size, len(plan), heads, head_dim, dtype, tuple(c for c, _ in plan),
                      tuple(w for _, w in plan), geos, unit, window_tokens)


__all__ = ["PageLayout", "build_layout", "fp_block_bytes", "SIDES", "AXIS"]
