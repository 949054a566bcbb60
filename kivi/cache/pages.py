"""Reading and writing quantized tokens in KIVI pages (pure functions over the page views), for every paged
cache (transformers' continuous batching in kivi.batching, the vLLM plugin in kivi.vllm).

A side's page views (``kivi.batching.layout.field_views``, ``kivi.paged.geometry.block_field_views``) are
``{field: [NB, H, rows, C]}``.
:func:`gather_pages` reads whole pages of many requests at once into one :class:`PackedKV`
(``[1, H, n_pages * P, ...]``, pages concatenated along tokens: key groups stay aligned because a page
is a whole number of groups); :func:`scatter_tokens` writes a :class:`PackedKV` of quantized tokens to
their store positions. Both index the cache with tensors (one gather / one index_put per field).
"""

from __future__ import annotations

import torch

from ..quant.kv import PackedKV
from ..quant.side_format import SideFormat
from .store import BlockStore


def gather_pages(views: dict[str, torch.Tensor], blocks: torch.Tensor, *, fmt: SideFormat, head_dim: int) -> PackedKV:
    """The pages ``blocks`` (long ``[N]``) of one side as one ``PackedKV`` of ``N * P`` tokens (copies)."""
    tensors = {}
    for name, view in views.items():
        pages = view.index_select(0, blocks)  # [N, H, rows, C]
        n, h, rows, c = pages.shape
        tensors[name] = pages.transpose(0, 1).reshape(1, h, n * rows, c)  # [1, H, N * rows, C]
    return PackedKV(packed=tensors["packed"], scale=tensors["scale"], offset=tensors.get("offset"),
                    comp=tensors.get("comp"), format=fmt, head_dim=head_dim)


def page_store(views: dict[str, torch.Tensor], blocks: list[int], first: int, stored: int, page_size: int, *,
               fmt: SideFormat, head_dim: int, evicted: int = 0) -> BlockStore:
    """A :class:`BlockStore` of tokens ``[first, first + stored)`` whose blocks are the pages ``blocks``
    themselves (views into the cache, no copy): what kivi's attention backends read. ``first`` is the
    first stored token (the sink length). ``evicted`` (a multiple of ``page_size``; sliding layers, no
    sink): the first ``evicted`` tokens' pages are gone, ``blocks`` starts with the page of token ``evicted``."""
    if evicted:
        store = BlockStore(page_size, start=first + evicted, length=first + stored)
        first, stored = first + evicted, stored - evicted
    else:
        store = BlockStore(page_size, start=first, length=first + stored)
    if stored == 0:
        return store
    page0 = {name: v[blocks[0]].unsqueeze(0) for name, v in views.items()}
    store.template = PackedKV(packed=page0["packed"][:, :, :0], scale=page0["scale"][:, :, :0],
                              offset=None if "offset" not in page0 else page0["offset"][:, :, :0],
                              comp=None if "comp" not in page0 else page0["comp"][:, :, :0], format=fmt,
                              head_dim=head_dim)
    store.blocks = [page0] + [{name: v[b].unsqueeze(0) for name, v in views.items()} for b in blocks[1:]]
    store.starts = [first + i * page_size for i in range(len(blocks))]
    store.caps = [page_size] * len(blocks)
    return store


def store_rows(block_table: list[int], start: int, count: int, page_size: int,
               tokens_per_row: int) -> tuple[list[int], list[int]]:
    """``(blocks, rows)`` of the page rows that hold store positions ``[start, start + count)``.

    ``tokens_per_row`` is 1 for per-token fields, ``G`` for the keys' per-group fields (``start`` and
    ``count`` are then multiples of ``G``).
    """
    blocks, rows = [], []
    for u in range(start, start + count, tokens_per_row):
        blocks.append(block_table[u // page_size])
        rows.append((u % page_size) // tokens_per_row)
    return blocks, rows


def scatter_tokens(views: dict[str, torch.Tensor], seg: PackedKV, index: dict[int, tuple[torch.Tensor, torch.Tensor]],
                   tokens_per_row: dict[str, int]) -> None:
    """Write ``seg`` (``[1, H, M, ...]``) into the pages: field rows go to ``index[tokens_per_row[field]]``
    = ``(blocks [rows], rows [rows])`` (long tensors, one entry per row of the field)."""
    for name, src in seg.tensors().items():
        blocks, rows = index[tokens_per_row[name]]
        views[name][blocks, :, rows] = src[0].transpose(0, 1)  # [rows, H, C]


__all__ = ["gather_pages", "page_store", "store_rows", "scatter_tokens"]
