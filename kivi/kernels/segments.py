"""What the Triton decode kernel reads of one side (keys or values): a sink, stored blocks, a tail.

A side covers the kv positions ``[0, T)`` (relative to ``origin``, the first position attention
sees) in three pieces, read in place:

* ``sink [B, H, S, D]``: tokens ``[0, S)`` at full precision (or ``None``);
* stored blocks: tokens ``[S, split)``, each block a whole storage block (a
  :class:`~kivi.quant.kv.PackedKV` or a full-precision ``[B, H, cap, D]`` tensor) described by one
  row of a small int64 device table (:class:`BlockTable`): its first and end positions, and the
  element offsets and batch / head strides of its codes, scales and offsets;
* ``fp [B, H, T - split, D]``: tokens ``[split, T)`` at full precision.

Blocks of one side live in separate allocations; the kernel receives one typed pointer per kind
of tensor (the first block's codes / data and its scale: the *witnesses*) and reaches the others by
element offsets from them (a flat address space; offsets may be negative). Offsets and batch / head
strides are stored in units of ``unit`` elements (the largest power of two, at most 16 bytes, that
divides all of them) and the kernel multiplies by that constant, so the compiler still knows the
alignment it needs to vectorise loads. Row strides (per token, or per key group) are one number per
side: every block of a store has the same row layout.

A table describes whole blocks: how far a block is filled is the side's ``split``, passed per call,
so a table stays valid while the last block fills and can be memoised until blocks are added,
dropped or replaced (:attr:`kivi.cache.store.BlockStore.derived`). Plain Python, no triton import.
"""

from __future__ import annotations

import bisect
from dataclasses import dataclass
from typing import Sequence

import torch

from ..quant.kv import PackedKV

# Columns of a block row (int64). Positions are absolute; offsets and strides in units of ``unit``.
LO, HI, DATA, DATA_SB, DATA_SH, SCALE, OFFSET, PAR_SB, PAR_SH = range(9)
NCOL = 9
_MAX_ALIGN_BYTES = 16


def _unit(values: Sequence[int], element_size: int) -> int:
    """Largest power of two ``u <= 16 // element_size`` (elements) dividing every value."""
    u = max(1, _MAX_ALIGN_BYTES // element_size)
    while u > 1 and any(v % u for v in values):
        u //= 2
    return u


def _offset(t: torch.Tensor, witness: torch.Tensor) -> int:
    diff = t.data_ptr() - witness.data_ptr()
    if diff % t.element_size():
        raise ValueError("block tensors must be aligned to their element size")
    return diff // t.element_size()


@dataclass(frozen=True)
class BlockTable:
    """Stored blocks of one side, as the kernel reads them (see the module docstring).

    ``rows``: int64 ``[R, NCOL]`` on the kernel's device; ``firsts`` / ``ends``: each block's token
    positions (host copy of columns LO / HI); ``segments``: the blocks themselves (whole, views of
    the storage; they keep the memory the rows point at alive, and the torch reference reads them).
    ``data`` / ``params``: the witnesses (first block's codes or full-precision data; its scale).
    """

    rows: torch.Tensor
    firsts: tuple[int, ...]
    ends: tuple[int, ...]
    segments: tuple
    quantized: bool
    bits: int
    group_size: int
    head_dim: int
    data: torch.Tensor
    params: torch.Tensor | None
    data_row_stride: int
    param_row_stride: int
    data_unit: int
    param_unit: int

    def blocks_before(self, split: int) -> int:
        """Rows holding tokens before absolute position ``split`` (blocks are in token order)."""
        return bisect.bisect_left(self.firsts, split)


def build_block_table(blocks: Sequence[tuple[int, PackedKV | torch.Tensor]], axis: str,
                      device: torch.device) -> BlockTable:
    """Descriptor table of ``blocks`` = ``[(first_position, block), ...]`` in token order.

    Each block is a :class:`PackedKV` of ``axis`` (asymmetric, no compensation codes, 1/2/3/4/8 bits;
    all with the same bits, group size and dtypes) or a full-precision ``[B, H, cap, D]`` tensor (a
    side stored unquantized). Every tensor needs a unit-stride last axis and the same row stride
    as the others of its kind. Raises ``ValueError`` / ``NotImplementedError`` naming what does not fit.
    """
    if not blocks:
        raise ValueError("build_block_table needs at least one block")
    firsts = [int(f) for f, _ in blocks]
    if any(b <= a for a, b in zip(firsts, firsts[1:])):
        raise ValueError(f"block first positions must increase, got {firsts}")
    segs = [s for _, s in blocks]
    quantized = isinstance(segs[0], PackedKV)
    if any(isinstance(s, PackedKV) != quantized for s in segs):
        raise ValueError("a side's blocks are all quantized (PackedKV) or all full precision (tensors)")
    ends = []
    if quantized:
        ref = segs[0]
        if ref.axis != axis:
            raise ValueError(f"blocks of axis {ref.axis!r} given for axis {axis!r}")
        for s in segs:
            if s.offset is None:
                raise NotImplementedError("symmetric quantization (offset None) is not supported by the Triton kernel")
            if s.comp is not None:
                raise NotImplementedError("compensation codes (residual_bits) are not supported by the Triton kernel")
            if (s.bits, s.group_size, s.axis, s.head_dim) != (ref.bits, ref.group_size, ref.axis, ref.head_dim):
                raise ValueError("the blocks of one side must share bits, group size and head_dim")
            if s.packed.dtype != torch.uint8 or s.scale.dtype != ref.scale.dtype or s.offset.dtype != ref.scale.dtype:
                raise ValueError("the blocks of one side must share dtypes (uint8 codes; scale and offset alike)")
            if s.scale.stride() != s.offset.stride():
                raise ValueError("a block's scale and offset must have the same strides")
        datas = [s.packed for s in segs]
        pars = [s.scale for s in segs]
        ends = [f + s.num_tokens for f, s in zip(firsts, segs)]
    else:
        datas = list(segs)
        if any(t.dtype != datas[0].dtype for t in datas):
            raise ValueError("the full-precision blocks of one side must share a dtype")
        pars = []
        ends = [f + t.shape[-2] for f, t in zip(firsts, datas)]
    if any(e > f2 for e, f2 in zip(ends, firsts[1:])):
        raise ValueError(f"blocks overlap: firsts {firsts}, ends {ends}")
    kinds = [("codes/data", datas)] + ([("scale/offset", pars + [s.offset for s in segs])] if quantized else [])
    for name, ts in kinds:
        for t in ts:
            if t.dim() != 4 or t.stride(-1) != 1:
                raise ValueError(f"block {name} must be [B, H, rows, cols] with a unit-stride last axis, "
                                 f"got shape {tuple(t.shape)} strides {t.stride()}")
            if t.device != datas[0].device:
                raise ValueError(f"block {name} on {t.device}, others on {datas[0].device}")
        if len({t.stride(2) for t in ts}) > 1:
            raise ValueError(f"the blocks' {name} must share one row stride, got {sorted({t.stride(2) for t in ts})}")
    data_w = datas[0]
    par_w = pars[0] if quantized else None
    d_off = [_offset(t, data_w) for t in datas]
    d_sb = [t.stride(0) for t in datas]
    d_sh = [t.stride(1) for t in datas]
    du = _unit(d_off + d_sb + d_sh, data_w.element_size())
    if quantized:
        s_off = [_offset(s.scale, par_w) for s in segs]
        o_off = [_offset(s.offset, par_w) for s in segs]
        p_sb = [s.scale.stride(0) for s in segs]
        p_sh = [s.scale.stride(1) for s in segs]
        pu = _unit(s_off + o_off + p_sb + p_sh, par_w.element_size())
    else:
        s_off = o_off = p_sb = p_sh = [0] * len(segs)
        pu = 1
    rows = [
        (f, e, d_off[i] // du, d_sb[i] // du, d_sh[i] // du,
         s_off[i] // pu, o_off[i] // pu, p_sb[i] // pu, p_sh[i] // pu)
        for i, (f, e) in enumerate(zip(firsts, ends))
    ]
    table = torch.tensor(rows, dtype=torch.int64).to(device)
    first = segs[0]
    return BlockTable(
        rows=table, firsts=tuple(firsts), ends=tuple(ends), segments=tuple(segs), quantized=quantized,
        bits=first.bits if quantized else 16, group_size=first.group_size if quantized else 1,
        head_dim=first.head_dim if quantized else data_w.shape[-1], data=data_w, params=par_w,
        data_row_stride=data_w.stride(2), param_row_stride=par_w.stride(2) if quantized else 0,
        data_unit=du, param_unit=pu,
    )


@dataclass(frozen=True)
class KernelSide:
    """One side of a decode step: ``sink`` tokens ``[0, S)``, ``blocks`` tokens ``[S, split)``, ``fp``
    tokens ``[split, T)``; positions relative to ``origin`` (absolute position = ``origin + t``).

    ``sink``: ``[B, H, S, D]`` or ``None``; ``blocks``: a :class:`BlockTable` (its blocks may extend
    before ``S`` or past ``split``, e.g. a sliding layer's partly evicted first block or the block
    being filled: only ``[S, split)`` is read) or ``None``; ``fp``: ``[B, H, T - split, D]`` or
    ``None``. Build with :func:`kernel_side`, which checks that the pieces meet.
    """

    sink: torch.Tensor | None
    blocks: BlockTable | None
    split: int
    fp: torch.Tensor | None
    origin: int = 0

    @property
    def sink_tokens(self) -> int:
        return 0 if self.sink is None else self.sink.shape[-2]

    @property
    def num_tokens(self) -> int:
        return self.split + (0 if self.fp is None else self.fp.shape[-2])

    @property
    def n_blocks(self) -> int:
        """Rows of the block table the kernel walks (the blocks starting before ``split``)."""
        if self.blocks is None or self.split <= self.sink_tokens:
            return 0
        return self.blocks.blocks_before(self.origin + self.split)

    def pieces(self) -> list[tuple[str, object, int, int]]:
        """``(kind, obj, a, e)``: what the side reads for the tokens ``[a, e)`` (relative), in order.

        kind ``"fp"``: obj is ``[B, H, e - a, D]``; kind ``"block"``: obj is ``(block, row)``, the
        whole block and the row of token ``a`` in it. Blocks that hold nothing of ``[S, split)`` are
        left out.
        """
        out = []
        S = self.sink_tokens
        if S:
            out.append(("fp", self.sink, 0, S))
        for i in range(self.n_blocks):
            lo = self.blocks.firsts[i] - self.origin
            a = max(lo, S)
            e = min(self.blocks.ends[i] - self.origin, self.split)
            if e > a:
                out.append(("block", (self.blocks.segments[i], a - lo), a, e))
        if self.fp is not None and self.fp.shape[-2]:
            out.append(("fp", self.fp, self.split, self.num_tokens))
        return out


def kernel_side(sink: torch.Tensor | None, blocks: BlockTable | None, split: int, fp: torch.Tensor | None,
                origin: int = 0) -> KernelSide:
    """A :class:`KernelSide`, checked: the blocks cover ``[S, split)`` without a gap (``S`` = sink
    tokens), so that sink, blocks and tail tile ``[0, T)``. Raises ``ValueError`` otherwise."""
    S = 0 if sink is None else sink.shape[-2]
    if split < S:
        raise ValueError(f"split={split} falls inside the sink tokens [0, {S})")
    side = KernelSide(sink, blocks, split, fp, origin)
    covered = S
    for kind, _obj, a, e in side.pieces():
        if kind == "block":
            if a != covered:
                raise ValueError(f"the stored blocks leave tokens [{covered}, {a}) uncovered")
            covered = e
    if covered != split:
        raise ValueError(f"the stored blocks cover tokens [{S}, {covered}) but the store ends at split={split}")
    return side


__all__ = ["BlockTable", "KernelSide", "build_block_table", "kernel_side", "NCOL"]
