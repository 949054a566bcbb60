"""The kernel's inputs built on the host: piece descriptor tables of a layer's views, and the mask row.

A side (keys or values) of an :class:`~kivi.cache.view.AttentionView` is a table of *pieces*
(:func:`side_table`): the sink tokens, the store blocks (quantized or not) and the fp tail, one
int64 row each with the piece's kv positions and the addresses and strides of its tensors — no
copies when the store holds float32 parameters — so one kernel call covers the whole view whatever
the number of blocks. A block's row is memoised in its store (``BlockStore.derived["fused_cpu"]``,
dropped whenever a block is added, dropped or replaced) while it points at the block's own float32
tensors, so a decode step only adds the fp tail's row.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import numpy as np
import torch

from ...quant.kv import PackedKV, compensation_values, token_divisor
from .columns import NCOL  # a piece descriptor's columns (one int64 row per piece of a side, see side_table)

if TYPE_CHECKING:
    from ...cache.view import AttentionView


def _base(seg: PackedKV) -> torch.Tensor:
    """float32 additive term per group (``scale``'s shape): offset (+ compensation), or symmetric."""
    if seg.offset is None:
        base = seg.scale.float() * -(2 ** (seg.bits - 1) - 1)
    else:
        base = seg.offset.float()
    comp = compensation_values(seg)
    return base if comp is None else base + comp


def _rows_f32(t: torch.Tensor) -> torch.Tensor:
    """float32 with a unit-stride last axis (the kernel reads rows with pointer arithmetic)."""
    if t.dtype != torch.float32:
        t = t.float()
    return t if t.stride(-1) == 1 else t.contiguous()


def _addr(t: torch.Tensor, keep: list) -> tuple[int, int, int, int]:
    """``(address, stride_b, stride_h, stride_t)`` of a ``[B, H, T, ...]`` tensor; ``keep`` holds it alive."""
    keep.append(t)
    return (t.data_ptr(), *t.stride()[:3])


def _block_entry(store, blk: dict, quantized: bool) -> tuple[bool, tuple, tuple]:
    """``(direct, descriptor columns _QUANT.., tensors referenced)`` of one store block.

    ``direct``: the columns point at the block's own tensors (float32, unit-stride rows), so they
    stay valid whatever is appended to the block later. Otherwise (bf16 / fp16 data or
    parameters, symmetric, compensation) they point at float32 copies of the block made now.
    """
    keep: list = []
    if not quantized:
        data = blk["data"]
        direct = data.dtype == torch.float32 and data.stride(-1) == 1
        cols = (0, *_addr(_rows_f32(data), keep)) + (0,) * 9
    else:
        seg = store.template.with_tensors(**blk)
        packed = seg.packed if seg.packed.stride(-1) == 1 else seg.packed.contiguous()
        direct = (packed is seg.packed and seg.scale.dtype == torch.float32 and seg.scale.stride(-1) == 1
                  and seg.offset is not None and seg.offset.dtype == torch.float32 and seg.offset.stride(-1) == 1
                  and seg.comp is None)
        cols = (1, *_addr(packed, keep), *_addr(_rows_f32(seg.scale), keep), *_addr(_rows_f32(_base(seg)), keep),
                seg.bits)
    return direct, cols, tuple(keep)


def _store_rows(store, split: int, quantized: bool, start: int, keep: list) -> list[tuple]:
    """Descriptor rows of the blocks of ``store`` holding tokens ``[store.start, split)``, in token order.

    Each row describes a whole block (``lo`` = its first token relative to ``start``, possibly
    negative after an eviction: the kernel only visits positions ``>= 0``) up to ``view.split``.
    Columns that point at the blocks' own tensors are memoised in ``store.derived`` (cleared
    whenever blocks are added, dropped or replaced), so a decode step does not rebuild them.
    float32 copies (bf16 / fp16 parameters, ...) are made per call and not kept: memoising them
    would hold a float32 copy of every scale and offset, as many bytes again as the 2-bit codes.
    """
    memo = store.derived.setdefault("fused_cpu", {})
    rows = []
    for i, (blk, b0, cap) in enumerate(zip(store.blocks, store.starts, store.caps)):
        if blk is None or b0 + cap <= store.start:
            continue
        if b0 >= split:
            break
        hi = min(split, b0 + cap)
        ent = memo.get(i)
        if ent is None:
            ent = _block_entry(store, blk, quantized)
            if ent[0]:
                memo[i] = ent
        keep.append(ent[2])
        cols = ent[1]
        if b0 < store.start and store.start > start:
            # A position tier's store whose first block was partly demoted into the next tier: those
            # tokens are read from that tier's rows, so this row starts at the store's first token.
            cols = _skip_rows(cols, store, store.start - b0, quantized)
            b0 = store.start
        rows.append((b0 - start, hi - start, *cols))
    return rows


def _skip_rows(cols: tuple, store, skip: int, quantized: bool) -> tuple:
    """Descriptor columns ``_QUANT..`` of a block advanced by ``skip`` tokens (addresses are bytes, strides
    elements: codes uint8, parameters and full-precision data float32)."""
    cols = list(cols)
    fields = ((1, "packed", 1), (5, "scale", 4), (9, "offset", 4)) if quantized else ((1, "data", 4),)
    for at, name, size in fields:
        div = token_divisor(store.template.axis, store.template.group_size, name)
        if skip % div:
            raise ValueError(f"cannot start a descriptor {skip} tokens into a block of groups of {div}")
        cols[at] += skip // div * cols[at + 3] * size
    return tuple(cols)


def side_table(view: AttentionView, start: int, keep: list) -> tuple[np.ndarray, int, int]:
    """``(descriptors [P, NCOL] int64, bits, group_size)`` of one side's pieces, in token order.

    Every row names the kv heads ``[0, H)`` of the view (:func:`_side_rows`; :func:`heads_table` stacks the
    rows of several head groups, each with its own range).

    ``bits`` is the widest code of the side's pieces (each quantized row holds its own width in
    ``_BITS``: a side with position tiers has pieces of several widths, a ``TierChain`` of stores).

    Pieces are the sink (if any), the store blocks (quantized or full precision) and the fp tail. Each descriptor
    row holds the piece's kv positions (relative to ``start``) and the address and strides of its
    codes / data, scale and base (float32; converted here when stored in another dtype). Nothing
    is copied when the store holds float32 parameters; everything referenced is appended to
    ``keep`` so it outlives the kernel call. ``bits`` / ``group_size`` are 8 / 1 when the side is
    not quantized.
    """
    rows, widths, group = _side_rows(view, start, keep, 0, view.fp.shape[1])
    return np.array(rows, dtype=np.int64).reshape(len(rows), NCOL), max(widths, default=8), group


def _side_rows(view: AttentionView, start: int, keep: list, h0: int, h1: int) -> tuple[list[tuple], list[int], int]:
    """:func:`side_table`'s rows (tuples of ``NCOL`` ints), the widths of its quantized stores, its group size.

    The view holds the layer's kv heads ``[h0, h1)`` (all of them, or a head group of a layer with per-head
    widths, :class:`~kivi.cache.heads.HeadViews`); every row carries that range. The kernel reads kv head
    ``h`` of the layer from the pieces whose range holds it, at local head ``h - h0``, so the rows of several
    groups stacked (:func:`heads_table`) describe one layer.
    """
    rows = []
    widths, group = [], 1
    tail = (0,) * 9 + (h0, h1)  # a full-precision piece: no scale / base / width
    if view.sink is not None:  # full-precision sink tokens [0, S)
        lo = 0 - start
        rows.append((lo, lo + view.sink.shape[-2], 0, *_addr(_rows_f32(view.sink), keep)) + tail)
    for store in (view.store.stores if view.tiered else (view.store,)):
        split = min(view.split, store.length)
        if store.template is not None and split > store.start:
            rows += [row + (h0, h1) for row in _store_rows(store, split, view.quantized, start, keep)]
            if view.quantized:
                widths.append(store.template.bits)
                group = store.template.group_size
    nfp = view.fp.shape[-2]
    if nfp:
        lo = view.split - start
        rows.append((lo, lo + nfp, 0, *_addr(_rows_f32(view.fp), keep)) + tail)
    return rows, widths, group


def heads_table(views, groups, start: int, keep: list) -> tuple[np.ndarray, int, int]:
    """:func:`side_table` of a layer with per-head widths: every group's pieces (with their kv head
    range) stacked into one table; the widest code and the group size (shared by the groups)."""
    rows, widths, sizes = [], [], set()
    for grp, view in zip(groups, views):
        r, w, group = _side_rows(view, start, keep, grp.start, grp.stop)
        rows += r
        widths.append(max(w, default=8))
        sizes.add(group)
    quantized = {g for g in sizes if g != 1}  # 1: a side held at full precision in that group
    if len(quantized) > 1:
        raise ValueError(f"head groups of one layer with different group sizes {sorted(quantized)}")
    table = np.array(rows, dtype=np.int64).reshape(len(rows), NCOL)
    return table, max(widths), quantized.pop() if quantized else 1


def valid_row(attention_mask: torch.Tensor | None, batch: int, kv_len: int) -> torch.Tensor | None:
    """``[B, kv_len]`` bool from the last query row of a 4-D mask, ``None`` if all valid.

    Raises ``ValueError`` for a mask the kernel cannot express (callers check first).
    """
    if attention_mask is None:
        return None
    if attention_mask.dim() != 4 or attention_mask.shape[1] != 1 or attention_mask.shape[-1] < kv_len:
        raise ValueError(f"mask of shape {tuple(attention_mask.shape)} is not a per-kv-position validity")
    row = attention_mask[:, 0, -1, :kv_len]
    if row.dtype != torch.bool:
        lowest = torch.finfo(row.dtype).min / 2
        keep = row > lowest
        if bool((row[keep] != 0).any()):
            raise ValueError("additive mask with values other than 0 and -inf/min")
        row = keep
    row = row.expand(batch, kv_len)
    if bool(row.all()):
        return None
    return row.contiguous()
