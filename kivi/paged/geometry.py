"""What one block holds under KIVI, in bytes: the packed page and the full-precision window page (vLLM's blocks;
pure torch).

Each attention layer has two KV cache groups in vLLM's hybrid allocator (docs/vllm.md):

* **pages** (the layer's own full-attention group): block ``b`` holds tokens ``[b*P, (b+1)*P)`` of one
  request as one KIVI page (:func:`kivi.quant.page.page_fields`: keys per channel in groups of ``G``
  tokens, values per token), ``P`` = vLLM's block size, a multiple of ``G``;
* **window** (``k`` companion layers, each a vLLM circular-buffer group: one block per request for its
  whole life): together ``k * Pw`` slots holding, in the model dtype ``[H, Pw, 2D]`` (keys in ``[..., :D]``,
  values in ``[..., D:]``), the request's full-precision rows: with ``S = sink_tokens``, slots ``[0, S)``
  hold positions ``[0, S)`` (sink tokens, and first tokens not yet in the sink: a position below ``S`` is
  never stored, :func:`kivi.cache.schedule.sink_take` fills the sink first), and the slots from ``S`` on
  are a ring for the at most ``R + G - 1`` tokens after them that have not left KIVI's full-precision
  window (:func:`kivi.paged.ring.ring_slot` with a ring of ``k * Pw - S`` slots). A token's row is written once,
  when it arrives, and never moves.

With sinks the pages hold a side's stored tokens counted from the end of the sink (store position
``u = p - S``), so key groups (aligned on ``S + k*G``, :func:`kivi.cache.schedule.key_group_start`) stay
whole inside pages of ``P`` tokens (``G | P``), as in kivi's own cache and :mod:`kivi.batching.layout`.

vLLM needs one page size for every group: ``Pw`` is the number of full-precision tokens that fit in one
packed page, and the window page is padded to the packed page's bytes. Pure torch (no vLLM import).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ..attention.fused_cpu.paged import PagedLayout
from ..cache.schedule import window_capacity
from ..config import KiviConfig
from ..quant.page import SideField, field_view, page_fields
from .ring import slot_rows


@dataclass(frozen=True)
class KiviGeometry:
    """The byte geometry of one layer (the same for every layer: the plugin refuses per-layer settings)."""

    page_size: int  # P: tokens per block (vLLM's block size)
    num_kv_heads: int  # H on this rank
    head_dim: int  # D
    dtype: torch.dtype  # the model's (the window's rows)
    fields: tuple[SideField, ...]  # one page's fields, offsets from the block's first byte
    page_bytes: int  # bytes the fields take
    state_bytes: int  # vLLM's state_content_bytes: bytes per (kv head, token) so that H * P * it >= page_bytes
    window_tokens: int  # Pw: full-precision tokens one window block holds
    sliding_window: int  # R + G: the full-precision tokens after a step are at most R + G - 1
    sink_tokens: int = 0  # S: sink slots [0, S) before the ring

    @property
    def fp_slots(self) -> int:
        """Full-precision rows a request keeps at most: ``S`` sink slots and the ring's ``R + G - 1``
        (:func:`kivi.cache.schedule.window_capacity`)."""
        return self.sink_tokens + self.sliding_window - 1

    @property
    def window_rings(self) -> int:
        """k: window rings (one vLLM block each per request) that hold :attr:`fp_slots` rows."""
        return -(-self.fp_slots // self.window_tokens)

    @property
    def block_bytes(self) -> int:
        """Bytes of one block of either group (vLLM's ``page_size_bytes``)."""
        return self.num_kv_heads * self.page_size * self.state_bytes

    @property
    def fp_token_bytes(self) -> int:
        """Bytes of one token's keys and values in the model dtype (one layer)."""
        return self.num_kv_heads * 2 * self.head_dim * self.dtype.itemsize

    def side_fields(self, side: str) -> dict[str, SideField]:
        return {f.name: f for f in self.fields if f.side == side}

    def kernel_layout(self, cfg: KiviConfig, block_bytes: int, page_at: int = 0) -> PagedLayout:
        """Where this page's fields sit in blocks ``block_bytes`` apart, the page ``page_at`` bytes into its
        block, for the paged decode kernel (:meth:`kivi.attention.fused_cpu.paged.PagedLayout.of_page`;
        whether it reads them: :mod:`kivi.capabilities`)."""
        return PagedLayout.of_page(self.fields, cfg, block_bytes=block_bytes, base=page_at)


def build_geometry(cfg: KiviConfig, *, page_size: int, num_kv_heads: int, head_dim: int,
                   dtype: torch.dtype, where: str = "vLLM block_size / ") -> KiviGeometry:
    """The :class:`KiviGeometry` of ``cfg`` for vLLM blocks of ``page_size`` tokens; ``ValueError`` naming
    the field (after ``where``) when a block cannot hold whole key groups or head_dim is not whole value groups."""
    if head_dim % cfg.group_size:
        raise ValueError(
            f"group_size={cfg.group_size} must divide head_dim={head_dim} (value groups run over channels)"
        )
    fields, end = page_fields(cfg, num_kv_heads, head_dim, page_size, dtype, where=where)
    state_bytes = -(-end // (num_kv_heads * page_size))
    block_bytes = num_kv_heads * page_size * state_bytes
    fp_token = num_kv_heads * 2 * head_dim * dtype.itemsize
    window_tokens = block_bytes // fp_token
    if window_tokens < 1:
        raise ValueError(f"block_size={page_size} is too small: one KIVI block ({block_bytes} bytes) cannot hold one "
                         f"full-precision token ({fp_token} bytes) of the window")
    return KiviGeometry(page_size, num_kv_heads, head_dim, dtype, fields, end, state_bytes, window_tokens,
                        window_capacity(cfg.residual_length, cfg.group_size) + 1, cfg.sink_tokens)


def _block_bytes(cache: torch.Tensor, geo: KiviGeometry) -> tuple[int, int]:
    """``(block stride, first byte)`` of one layer's vLLM cache in bytes; ``ValueError`` unless each block's
    bytes are dense and hold a page."""
    item = cache.element_size()
    span = 1 + sum((n - 1) * st for n, st in zip(cache.shape[1:], cache.stride()[1:]))  # elements a block covers
    if span != cache[0].numel() or span * item < geo.page_bytes:  # any order of [H, N, C] inside, but dense
        raise ValueError(
            f"a KIVI layer's cache must be blocks of at least {geo.page_bytes} contiguous bytes, got shape "
            f"{tuple(cache.shape)} strides {cache.stride()} of {cache.dtype}"
        )
    return cache.stride(0) * item, cache.storage_offset() * item


def block_pool(cache: torch.Tensor, geo: KiviGeometry) -> tuple[torch.Tensor, int, int] | None:
    """One layer's vLLM cache as the paged decode kernel's pool: ``(flat uint8 view, bytes between blocks,
    byte of block 0's page inside the pool's first block)`` aliasing the cache (no copy). vLLM may put other
    layers' pages between this layer's blocks (block ``b`` of layer ``l`` at ``offset + l * layer_stride +
    b * block_stride``): the pool is then ``num_blocks`` whole strides of the shared storage ending no later
    than its end, and the page sits that many bytes into each. ``None`` when the storage holds fewer bytes
    than ``num_blocks`` strides."""
    stride, first = _block_bytes(cache, geo)
    nbytes = cache.shape[0] * stride
    storage = cache.untyped_storage()
    start = min(first, storage.nbytes() - nbytes)
    if start < 0:
        return None
    pool = torch.empty(0, dtype=torch.uint8, device=cache.device).set_(storage, start, (nbytes,))
    return pool, stride, first - start


@dataclass(frozen=True)
class RingPool:
    """A layer's ``k`` window rings as one rows pool per side over their shared storage (vLLM puts every
    layer of every group in one allocation): ``rows[side]`` ``[blocks, Pw, H, D]`` (keys: channels ``[0, D)`` of
    each ring row, values ``[D, 2D)``), pool block ``base[r] + b * step[r]`` is block ``b`` of ring ``r`` (long
    ``[k]`` each). Row id ``block * Pw + row`` (:meth:`slot_ids`) names a row of either side."""

    rows: dict[str, torch.Tensor]
    base: torch.Tensor
    step: torch.Tensor

    def slot_ids(self, ring_table: torch.Tensor, slots: torch.Tensor) -> torch.Tensor:
        """Row ids (long, the shape of ``slots``) of slots ``slots [N, m]`` (:func:`kivi.paged.ring.ring_slot` values,
        ring ``k * Pw - S``) of the
        requests whose ring blocks are ``ring_table [N, k]``: :func:`kivi.paged.ring.slot_rows` over their pool
        blocks (a ring block holds one layer's rows)."""
        return slot_rows(self.base + ring_table.long() * self.step, slots, self.rows["k"].shape[1])


def ring_pool(rings: list[torch.Tensor], geo: KiviGeometry) -> RingPool | None:
    """The rings ``[NBw, H, Pw, 2D]`` of one layer as one :class:`RingPool` aliasing their storage (no copy), or
    ``None`` when they do not share one: a different storage or dtype, other strides inside a block, or a ring
    whose first block or block stride is not a whole number of :attr:`KiviGeometry.block_bytes` from the
    storage's start (the one unit every ring block then sits on)."""
    first = rings[0]
    storage, item, unit = first.untyped_storage(), first.element_size(), geo.block_bytes
    inner = first.stride()[1:]
    base, step = [], []
    for r in rings:
        if (r.untyped_storage().data_ptr() != storage.data_ptr() or r.dtype != first.dtype or r.stride()[1:] != inner
                or r.shape[1:] != first.shape[1:] or (r.storage_offset() * item) % unit
                or (r.stride(0) * item) % unit or inner[-1] != 1):
            return None
        base.append(r.storage_offset() * item // unit)
        step.append(r.stride(0) * item // unit)
    _, h, pw, c = first.shape
    blocks = storage.nbytes() // unit  # every ring block lies inside (each is at most one unit of bytes)
    typed = torch.empty(0, dtype=first.dtype, device=first.device).set_(storage)
    d = c // 2
    rows = {side: typed.as_strided((blocks, pw, h, d), (unit // item, inner[1], inner[0], 1), at)
            for side, at in (("k", 0), ("v", d))}
    return RingPool(rows, torch.tensor(base, dtype=torch.long, device=first.device),
                    torch.tensor(step, dtype=torch.long, device=first.device))


def block_field_views(cache: torch.Tensor, geo: KiviGeometry, side: str) -> dict[str, torch.Tensor]:
    """``{field: [NB, *shape]}`` views of one layer's vLLM cache (``[NB, ...]``: each block's bytes dense, in
    whatever order vLLM's layout puts its logical ``[H, N, C]``; blocks ``cache.stride(0)`` apart): element ``[b]`` is
    that field of block ``b``. The views alias the
    cache's storage (no copy), whatever dtype vLLM gave the cache tensor."""
    block_stride, _ = _block_bytes(cache, geo)
    return {name: field_view(cache, f.shape, f.dtype, f.offset, block_stride, cache.shape[0])
            for name, f in geo.side_fields(side).items()}


__all__ = ["KiviGeometry", "RingPool", "build_geometry", "block_field_views", "block_pool", "ring_pool"]
