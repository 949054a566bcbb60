"""The byte layout of one KIVI page: the :class:`~kivi.quant.kv.PackedKV` fields of ``P`` tokens of one layer.

A page holds, per side, the fields kivi's own cache stores for those tokens:

* keys (per channel, groups of ``G`` tokens): codes ``[H, P, packed(D)]``, scale / offset
  ``[H, P // G, D]`` (+ compensation codes) -- a page is a whole number of key groups (``G | P``);
* values (per token, groups of ``G`` channels): codes ``[H, P, packed(D)]``, scale / offset ``[H, P, D // G]``.

Field shapes and dtypes are read off :func:`kivi.quant.kv.quantize_side` itself (one quantization of a
zero page in each side's :meth:`~kivi.config.KiviConfig.side_format`), so the page format is the format
of kivi's own cache, never restated here. Every paged
cache (transformers' continuous batching in :mod:`kivi.batching`, vLLM in :mod:`kivi.vllm`) lays its
pages out with :func:`page_fields` and reads a field of every block through :func:`field_view`.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ..config import KiviConfig
from .kv import quantize_side, token_divisor
from .side_format import AXIS, SIDES

ALIGN = 16  # bytes: every field starts on a multiple (any dtype can view it)


def round_up(n: int, m: int) -> int:
    return -(-n // m) * m


@dataclass(frozen=True)
class SideField:
    """One tensor of one side of a page: ``shape`` per page (``[H, rows, C]``, rows = ``P`` or ``P // G``),
    ``offset`` in bytes from where the caller started the page, ``tokens_per_row`` = tokens one row
    covers (``G`` for the keys' scale / offset / compensation, else 1)."""

    side: str
    name: str
    shape: tuple[int, ...]
    dtype: torch.dtype
    offset: int
    tokens_per_row: int

    @property
    def nbytes(self) -> int:
        n = self.dtype.itemsize
        for s in self.shape:
            n *= s
        return n


def page_fields(cfg: KiviConfig, heads: int, head_dim: int, page_size: int, dtype: torch.dtype, *,
                offset: int = 0, where: str = "") -> tuple[tuple[SideField, ...], int]:
    """The fields of one layer's page of ``page_size`` tokens (keys, then values), laid out from byte
    ``offset`` with every field aligned on :data:`ALIGN` bytes, and the byte offset after the last one.

    ``ValueError`` (naming ``where`` + ``group_size``) when ``page_size`` is not a whole number of key groups.
    """
    if page_size % cfg.group_size:
        raise ValueError(f"page_size={page_size} must be a multiple of {where}group_size={cfg.group_size} (a page "
                         "holds whole key groups)")
    zero = torch.zeros(1, heads, page_size, head_dim, dtype=dtype)
    fields = []
    for side in SIDES:
        fmt = cfg.side_format(side)
        seg = quantize_side(zero, fmt)
        for name, t in seg.tensors().items():
            offset = round_up(offset, ALIGN)
            rows = token_divisor(fmt.axis, fmt.group_size, name)
            f = SideField(side, name, tuple(t.shape[1:]), t.dtype, offset, rows)
            fields.append(f)
            offset += f.nbytes
    return tuple(fields), offset


def field_view(memory: torch.Tensor, shape: tuple[int, ...], dtype: torch.dtype, offset: int, block_stride: int,
               num_blocks: int | None = None) -> torch.Tensor:
    """``[num_blocks, *shape]`` view (no copy) of one page field in every block of ``memory``: ``dtype``
    elements, dense in ``shape`` order, starting ``offset`` bytes into each block; block ``b`` starts
    ``b * block_stride`` bytes after ``memory``'s first byte (any dtype, any storage offset: the view aliases
    its storage). ``num_blocks`` defaults to the whole blocks ``memory`` holds. The one rule every paged
    cache reads its fields by (:func:`page_fields` gives ``shape``, ``dtype`` and ``offset``)."""
    item = dtype.itemsize
    start = memory.storage_offset() * memory.element_size() + offset
    if start % item or block_stride % item:
        raise ValueError(f"a {dtype} field must start on a multiple of {item} bytes: byte {start}, blocks "
                         f"{block_stride} bytes apart")
    if num_blocks is None:
        num_blocks = memory.numel() * memory.element_size() // block_stride
    inner = [1]
    for n in reversed(shape[1:]):
        inner.insert(0, inner[0] * n)
    typed = torch.empty(0, dtype=dtype, device=memory.device).set_(memory.untyped_storage())
    return typed.as_strided((num_blocks, *shape), (block_stride // item, *inner), start // item)


__all__ = ["SIDES", "AXIS", "ALIGN", "SideField", "field_view", "page_fields", "round_up"]
