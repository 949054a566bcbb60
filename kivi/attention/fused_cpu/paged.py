"""Paged decode attention: one query token for each of ``N`` requests whose KIVI pages sit in a block pool.

One kernel call per layer for a whole batch, the way vLLM's paged attention reads its cache: the caller
gives the pool (flat uint8 memory, ``num_blocks x block_bytes``), a block table ``int32 [N, max_pages]``
(request ``i``'s store positions ``[jP, (j+1)P)`` are in block ``block_table[i, j]``), per-request counts
and the full-precision rows. No request ids, no transformers: kivi's continuous batching
(:mod:`kivi.batching`) and a vLLM plugin (``seq_lens`` / ``block_table_tensor`` of its metadata) build the
same inputs, one :class:`kivi.paged.decode.PagedDecode` that :func:`kivi.paged.decode.run_paged_decode` runs.

Kv positions of request ``i`` (per side, ``counts[i] = [k sink, k stored, k window, v sink, v stored,
v window]``; both sides cover the same ``sink + stored + window`` positions):

* ``[0, sink)``: full-precision rows ``fp[i, 0:sink]`` (:class:`PagedLayout`'s sinks);
* ``[sink, sink + stored)``: quantized, store position ``u = t - sink`` in page ``u // P`` of the block
  table, row ``u % P`` (keys in groups of ``G`` tokens per channel, values in groups of ``G`` channels);
* ``[sink + stored, sink + stored + window)``: full-precision rows ``fp[i, w0 : w0 + window]`` (the
  window, and the step's new token last).

The full-precision rows come in one of two forms, the same for both sides:

* **gathered**: ``fp`` is ``[N, slots, H, D]`` float32 per side; the slot of the window's first row ``w0``
  is one argument (the new token is the window's last row);
* **in place** (:class:`RingRows`): the rows stay where the cache keeps them, a rows pool
  ``[blocks, rows_per_block, H, D]`` (float32 / bfloat16 / float16), read through a per-request slot table
  ``int32 [N, w0 + ring]`` of row ids ``block * rows_per_block + row``: columns ``[0, w0)`` hold the sink
  (sink token ``t`` in column ``t``), and the window is a **ring**: the window token at position ``t``
  (``t`` counts the request's tokens from 0) is in column :func:`kivi.paged.ring.ring_slot` ``(t, ring, w0)``
  (``t`` below ``w0``, else ``w0 + t % ring``): a column is a slot of the one ring rule. The step's new token comes
  separately (``new [N, H, D]``), so a caller may write it into its ring after the call (a ring of
  ``R + G - 1`` slots) or before (its ring then needs a slot more than the window: kivi's window blocks,
  :func:`kivi.cache.schedule.window_ring_slots`). No gather copy of the rows is made on the host; each
  task converts the rows its chunk covers, of its kv head, to float32.

  kivi's window blocks: ``rows`` is :func:`kivi.batching.layout.window_view` of the cache pool, ``w0`` the
  layer's sink slots. kivi's vLLM plugin: ``rows`` is its ``k`` window rings ``[NBw, H, Pw, 2D]`` seen as one
  pool over vLLM's shared allocation (:func:`kivi.paged.geometry.ring_pool`, keys in channels ``[0, D)``,
  values in ``[D, 2D)``), ``w0`` the sink slots, the slot table per request the row ids of its slots
  (:meth:`kivi.paged.geometry.RingPool.slot_ids`), the step's keys / values as ``new``, the rings written after
  the call.

:func:`paged_decode_attention` checks the inputs and runs the numba kernel (:mod:`.kernel`,
``paged_decode_*``: split-K over ``(request, kv head, chunk)`` tasks on numba's pool, each task running
the single-sequence kernel's inner loops on its request's pieces, then one merge).
:func:`torch_paged_decode` is the plain torch reference beside it: it dequantizes each request's pages
and attends.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass

import numpy as np
import torch

from ...capabilities import kernel_reasons
from ...paged.ring import ring_slot
from ...quant.kv import PackedKV, dequantize_kv
from ...quant.page import field_view
from ...quant.side_format import AXIS, SideFormat

#: dtype codes of the pages' scales / offsets in the layout vector (the kernel converts 16-bit ones)
PARAM_DTYPES = {torch.float32: 0, torch.bfloat16: 1, torch.float16: 2}


@dataclass(frozen=True)
class PagedLayout:
    """Where one layer's quantized fields sit inside a block of the pool (byte offsets, one home:
    :meth:`of_page` derives this from a page's fields, for every paged cache).

    Per kv head the fields are contiguous: key codes ``[H, P, k_row_bytes]``, key scale / offset
    ``[H, P // G, D]``; value codes ``[H, P, v_row_bytes]``, value scale / offset ``[H, P, D // G]``, all
    parameters in ``param_dtype``. ``k_offset`` / ``v_offset`` ``None``: symmetric codes (base
    ``-(2**(bits-1) - 1) * scale``). No compensation codes.
    """

    block_bytes: int
    page_size: int
    group_size: int
    num_kv_heads: int
    head_dim: int
    k_bits: int
    v_bits: int
    param_dtype: torch.dtype
    k_row_bytes: int
    v_row_bytes: int
    k_packed: int
    k_scale: int
    k_offset: int | None
    v_packed: int
    v_scale: int
    v_offset: int | None

    def vector(self) -> np.ndarray:
        """The kernel's layout vector (columns ``kernel._PL_*``)."""
        return np.array([self.block_bytes, self.page_size, self.group_size, self.k_bits, self.v_bits,
                         self.k_row_bytes, self.v_row_bytes, self.k_packed, self.k_scale,
                         -1 if self.k_offset is None else self.k_offset, self.v_packed, self.v_scale,
                         -1 if self.v_offset is None else self.v_offset, PARAM_DTYPES[self.param_dtype]],
                        dtype=np.int64)

    @classmethod
    def of_page(cls, fields, cfg, *, block_bytes: int, base: int = 0) -> PagedLayout:
        """The layout of one layer's page ``fields`` (:class:`kivi.quant.page.SideField` of both sides, as
        :func:`kivi.quant.page.page_fields` gives them; heads, page size and head_dim read off their shapes) of
        the layer config ``cfg`` (group size, widths), the page ``base`` bytes into blocks ``block_bytes`` apart.
        The one translation of a page's fields into the kernel's layout, for every paged cache. Whether the kernel
        reads them is :func:`kivi.capabilities.kernel_reasons`' answer, asked first; ``ValueError`` on compensation
        codes (the layout has no place for them)."""
        k = {f.name: f for f in fields if f.side == "k"}
        v = {f.name: f for f in fields if f.side == "v"}
        if "comp" in k or "comp" in v:
            raise ValueError("the paged decode kernels read no compensation codes (residual_bits > 0)")
        k_off, v_off = (None if "offset" not in f else base + f["offset"].offset for f in (k, v))
        heads, page_size, _ = k["packed"].shape
        return cls(block_bytes=block_bytes, page_size=page_size, group_size=cfg.group_size, num_kv_heads=heads,
                   head_dim=k["scale"].shape[-1], k_bits=cfg.k_bits, v_bits=cfg.v_bits, param_dtype=k["scale"].dtype,
                   k_row_bytes=k["packed"].shape[-1], v_row_bytes=v["packed"].shape[-1],
                   k_packed=base + k["packed"].offset, k_scale=base + k["scale"].offset, k_offset=k_off,
                   v_packed=base + v["packed"].offset, v_scale=base + v["scale"].offset, v_offset=v_off)

    def formats(self) -> list[SideFormat]:
        """The two side formats the layout's pages hold (as far as the layout says: widths, group, symmetry)."""
        return [SideFormat(AXIS[side], bits, self.group_size, symmetric=off is None)
                for side, bits, off in (("k", self.k_bits, self.k_offset), ("v", self.v_bits, self.v_offset))]

    def unsupported(self) -> str | None:
        """Why the paged kernels cannot read this layout, or ``None``: the ``"torch"`` cells of the paged kernels in
        :data:`kivi.capabilities.TABLE` (``"vllm"``'s; ``"batching"`` reads pages with the same kernel)."""
        if (self.k_offset is None) != (self.v_offset is None):
            return "one side symmetric and the other not"
        why = kernel_reasons(None, "vllm", "cpu", formats=self.formats(), param_dtype=self.param_dtype)
        return why[0].detail if why else None

    def field(self, pool: torch.Tensor, side: str, name: str) -> torch.Tensor:
        """``[num_blocks, H, rows, C]`` view of field ``name`` (``packed``, ``scale``, ``offset``) of ``side``."""
        H, P, G, D = self.num_kv_heads, self.page_size, self.group_size, self.head_dim
        if name == "packed":
            off, dtype = (self.k_packed, self.k_row_bytes) if side == "k" else (self.v_packed, self.v_row_bytes)
            shape, dtype = (H, P, dtype), torch.uint8
        else:
            off = getattr(self, f"{side}_{name}")
            shape, dtype = ((H, P // G, D) if side == "k" else (H, P, D // G)), self.param_dtype
        return field_view(pool, shape, dtype, off, self.block_bytes)


#: dtype codes of the rows pool of :class:`RingRows` (the kernel converts 16-bit rows)
ROW_DTYPES = {torch.float32: 0, torch.bfloat16: 1, torch.float16: 2}


@dataclass(frozen=True)
class RingRows:
    """One side's full-precision rows of ``N`` requests read in place (the module docstring's second form).

    ``rows``: the rows pool ``[blocks, rows_per_block, H, D]``, float32 / bfloat16 / float16, channels
    contiguous (any other strides: a view of a larger buffer). ``slots``: ``int32 [N, w0 + ring]`` row ids
    (``block * rows_per_block + row``) of the slots of :func:`kivi.paged.ring.ring_slot`: sink columns first,
    then the ring (window position ``t`` in column ``ring_slot(t, ring, w0)``). ``new``: ``[N, H, D]`` the
    step's token of each request, the window's last.
    """

    rows: torch.Tensor
    slots: torch.Tensor
    new: torch.Tensor

    def vector(self) -> np.ndarray:
        """The kernel's rows layout row (columns ``kernel._RL_*``): address, block / row / head strides in
        bytes, rows per block, dtype code."""
        item = self.rows.element_size()
        sb, sr, sh, _ = self.rows.stride()
        return np.array([self.rows.data_ptr(), sb * item, sr * item, sh * item, self.rows.shape[1],
                         ROW_DTYPES[self.rows.dtype]], dtype=np.int64)


def _check_ring(name: str, rr: RingRows, N: int, H: int, D: int, w0: int) -> None:
    rows, slots, new = rr.rows, rr.slots, rr.new
    if rows.dtype not in ROW_DTYPES or rows.dim() != 4 or tuple(rows.shape[2:]) != (H, D) or rows.stride(-1) != 1:
        raise ValueError(f"{name}.rows must be [blocks, rows, {H}, {D}] of {sorted(map(str, ROW_DTYPES))} with "
                         f"contiguous channels, got {rows.dtype} {tuple(rows.shape)} strides {rows.stride()}")
    if slots.dtype != torch.int32 or slots.dim() != 2 or slots.shape[0] != N or slots.shape[1] <= w0:
        raise ValueError(f"{name}.slots must be int32 [{N}, w0 + ring] with w0={w0} and a ring of at least one slot, "
                         f"got {slots.dtype} {tuple(slots.shape)}")
    if not new.is_floating_point() or tuple(new.shape) != (N, H, D):
        raise ValueError(f"{name}.new must be floating [{N}, {H}, {D}], got {new.dtype} {tuple(new.shape)}")


def on_host(fp: torch.Tensor | RingRows) -> torch.Tensor | RingRows:
    """``fp`` with what :func:`check_paged_inputs` reads by value (a :class:`RingRows`' slot table) on the host."""
    if isinstance(fp, RingRows) and fp.slots.device.type != "cpu":
        return RingRows(rows=fp.rows, slots=fp.slots.cpu(), new=fp.new)
    return fp


def check_paged_inputs(q, pool, layout, block_table, counts, k_fp, v_fp, w0) -> None:
    """Every check of the inputs of a paged decode kernel (this module's numba one, and the Triton one of
    :mod:`kivi.kernels.triton_paged`): their shapes and dtypes, then the per-request values (numpy: ``block_table``,
    ``counts`` and the :class:`RingRows` slot tables on the host); ``ValueError`` naming what does not fit."""
    check_paged_shapes(q, pool, layout, block_table, counts, k_fp, v_fp, w0)
    _check_values(pool, layout, block_table, counts, k_fp, v_fp, w0)


def _check_fast(q, pool, layout, block_table, counts, k_fp, v_fp, w0) -> None:
    """:func:`check_paged_inputs` with the per-request values checked in one compiled call
    (:func:`.paged_checks.values_ok`, a few microseconds where numpy takes ~100-150); only a refused input runs
    the numpy checks, for their message."""
    from .paged_checks import values_ok

    check_paged_shapes(q, pool, layout, block_table, counts, k_fp, v_fp, w0)
    ring = isinstance(k_fp, RingRows)
    if ring:
        fp = [(f.slots.numpy(), f.rows.shape[0] * f.rows.shape[1]) for f in (k_fp, v_fp)]
        fp_slots = 0
    else:
        empty = np.zeros((0, 0), dtype=np.int32)
        fp, fp_slots = [(empty, 0), (empty, 0)], min(k_fp.shape[1], v_fp.shape[1])
    if not values_ok(counts.numpy(), block_table.numpy(), fp[0][0], fp[1][0], fp[0][1], fp[1][1], ring, fp_slots,
                     int(w0), layout.page_size, layout.group_size, pool.numel() // layout.block_bytes):
        _check_values(pool, layout, block_table, counts, k_fp, v_fp, w0)
        raise AssertionError("paged decode: the compiled input checks refused what the numpy checks accept")


def check_paged_shapes(q, pool, layout, block_table, counts, k_fp, v_fp, w0) -> None:
    """The checks of a paged decode call's inputs that read no tensor's values: layout, shapes, dtypes."""
    why = layout.unsupported()
    if why is not None:
        raise ValueError(f"paged decode: unsupported layout: {why}")
    N, hq, D = q.shape
    H = layout.num_kv_heads
    if D != layout.head_dim or hq % H:
        raise ValueError(f"q of shape {tuple(q.shape)} does not fit {H} kv heads of head_dim {layout.head_dim}")
    if pool.dtype != torch.uint8 or pool.dim() != 1 or pool.numel() % layout.block_bytes:
        raise ValueError(f"pool must be flat uint8 of whole blocks of {layout.block_bytes} bytes, got "
                         f"{pool.dtype} {tuple(pool.shape)}")
    if block_table.dtype != torch.int32 or block_table.dim() != 2 or block_table.shape[0] != N:
        raise ValueError(
            f"block_table must be int32 [{N}, max_pages], got {block_table.dtype} {tuple(block_table.shape)}"
        )
    if counts.dtype != torch.int64 or tuple(counts.shape) != (N, 6):
        raise ValueError(f"counts must be int64 [{N}, 6], got {counts.dtype} {tuple(counts.shape)}")
    ring = isinstance(k_fp, RingRows)
    if ring != isinstance(v_fp, RingRows):
        raise ValueError("k_fp and v_fp must both be gathered tensors or both RingRows")
    for name, fp in (("k_fp", k_fp), ("v_fp", v_fp)):
        if ring:
            _check_ring(name, fp, N, H, D, w0)
        elif fp.dtype != torch.float32 or fp.dim() != 4 or fp.shape[0] != N or tuple(fp.shape[2:]) != (H, D):
            raise ValueError(f"{name} must be float32 [{N}, slots, {H}, {D}], got {fp.dtype} {tuple(fp.shape)}")


def _check_values(pool, layout, block_table, counts, k_fp, v_fp, w0) -> None:
    """The per-request checks on numpy views, after :func:`check_paged_shapes` (the reference of
    :func:`.paged_checks.values_ok`): the counts (:func:`check_paged_counts`), then the ids the tables name."""
    ring = isinstance(k_fp, RingRows)
    if ring:
        for name, fp in (("k_fp", k_fp), ("v_fp", v_fp)):
            ids = fp.slots.numpy()
            nrows = fp.rows.shape[0] * fp.rows.shape[1]
            if ids.size and (ids.min() < 0 or ids.max() >= nrows):
                raise ValueError(f"{name}.slots names rows outside the rows pool's {nrows}")
    c, table = counts.numpy(), block_table.numpy()
    pages = check_paged_counts(layout, table.shape[1], c, k_fp, v_fp, w0)
    ids = table[np.arange(table.shape[1])[None, :] < pages[:, None]]
    nb = pool.numel() // layout.block_bytes
    if ids.size and (ids.min() < 0 or ids.max() >= nb):
        raise ValueError(f"block_table names blocks outside the pool's {nb}")


def check_paged_counts(layout: PagedLayout, table_columns: int, c: np.ndarray, k_fp, v_fp, w0: int) -> np.ndarray:
    """The checks of the per-request ``counts`` (numpy int64 ``[N, 6]``) of a paged decode call that need no id
    table's values (those need only ``block_table``'s width and the fp rows' shapes); the pages each request
    reads. A caller that vouches for its block and slot ids (vLLM's block tables) checks this much on the host
    copy of counts it made (:func:`kivi.kernels.triton_paged.triton_paged_decode`'s ``host_counts``)."""
    ring = isinstance(k_fp, RingRows)
    if (c < 0).any():
        raise ValueError("counts must be non-negative")
    total = c[:, :3].sum(1)
    if (total != c[:, 3:].sum(1)).any() or (total == 0).any():
        raise ValueError(f"every request needs as many key as value positions, at least one: {c.tolist()}")
    pages = (np.maximum(c[:, 1], c[:, 4]) + layout.page_size - 1) // layout.page_size
    if (pages > table_columns).any():
        raise ValueError(f"stored tokens need more pages than block_table's {table_columns} columns")
    if ring:
        slots = k_fp.slots.shape[1]
        if v_fp.slots.shape[1] != slots:
            raise ValueError(f"k_fp.slots and v_fp.slots must have as many columns: {slots} vs {v_fp.slots.shape[1]}")
        if (c[:, [0, 3]] > w0).any() or (c[:, [2, 5]] < 1).any() or (c[:, [2, 5]] - 1 > slots - w0).any():
            raise ValueError(f"sink / window rows do not fit the slot table (w0={w0}, ring={slots - w0}; every "
                             f"window holds the new token and at most ring older tokens): {c.tolist()}")
    elif (c[:, [0, 3]] > w0).any() or (w0 + c[:, [2, 5]] > min(k_fp.shape[1], v_fp.shape[1])).any():
        raise ValueError(f"sink / window rows do not fit the fp slots (w0={w0}, slots={k_fp.shape[1]})")
    if (c[:, 1] % layout.group_size).any():
        raise ValueError(f"stored keys must be whole groups of {layout.group_size}: {c[:, 1].tolist()}")
    return pages


def paged_decode_attention(q: torch.Tensor, pool: torch.Tensor, layout: PagedLayout, block_table: torch.Tensor,
                           counts: torch.Tensor, k_fp: torch.Tensor | RingRows, v_fp: torch.Tensor | RingRows,
                           w0: int, *, scaling: float | None = None, threaded: bool | None = None) -> torch.Tensor:
    """Decode attention of ``q [N, Hq, D]`` (one token per request) over the requests' pages; ``[N, Hq, D]``
    in ``q.dtype``. Inputs as in the module docstring (``k_fp`` / ``v_fp``: gathered float32 rows, or
    :class:`RingRows` read in place); ``ValueError`` naming an input that does not fit.
    ``threaded``: numba's pool or the calling thread (``None``: by size, :data:`.dispatch.SERIAL_BELOW`)."""
    from .dispatch import _chunk_tokens, _kernel, _run_threaded, _use_threads

    _check_fast(q, pool, layout, block_table, counts, k_fp, v_fp, w0)
    N, hq, D = q.shape
    H = layout.num_kv_heads
    scaling = D**-0.5 if scaling is None else scaling
    lens = counts.numpy()[:, :3].sum(1)
    total = int(lens.sum())
    if threaded is None:
        threaded = _use_threads(1, H, total)
    ring = isinstance(k_fp, RingRows)
    name = f"paged{'_ring' if ring else ''}_decode_{'threaded' if threaded else 'serial'}"
    kernel = _kernel(name)  # loads this entry only
    out = torch.empty(N, hq, D)
    if threaded:
        import numba  # loaded with the kernel

        chunk = _chunk_tokens(int(lens.max()), N * H, numba.get_num_threads(), kernel.SUB)
    else:
        chunk = int(lens.max())
    head = (q.float().contiguous().numpy(), pool.numpy(), layout.vector(), block_table.contiguous().numpy(),
            counts.contiguous().numpy())
    tail = (np.float32(scaling), H, chunk, out.numpy())
    if ring:
        news = [fp.new.float().contiguous() for fp in (k_fp, v_fp)]  # kept alive through the call
        scratch = _row_scratch((N * H, 2, k_fp.slots.shape[1] + 1, D))
        args = (*head, k_fp.slots.contiguous().numpy(), v_fp.slots.contiguous().numpy(),
                np.stack([k_fp.vector(), v_fp.vector()]), news[0].numpy(), news[1].numpy(), int(w0), *tail[:3],
                scratch, tail[3])
    else:
        args = (*head, k_fp.contiguous().numpy(), v_fp.contiguous().numpy(), int(w0), *tail)
    entry = getattr(kernel, name)
    if threaded:
        _run_threaded(entry, args)
    else:
        entry(*args)
    return out if q.dtype == torch.float32 else out.to(q.dtype)


_scratch = threading.local()


def _row_scratch(shape: tuple[int, ...]) -> np.ndarray:
    """Float32 room for the rows the in-place entries stage, kept per calling thread between calls (a fresh
    array of that size in every call costs its page faults, about the kernel's own time at small batches)."""
    n = int(np.prod(shape))
    buf = getattr(_scratch, "buf", None)
    if buf is None or buf.size < n:
        buf = _scratch.buf = np.empty(n, dtype=np.float32)
    return buf[:n].reshape(shape)


def _fp_rows(fp: torch.Tensor | RingRows, i: int, sink: int, first: int, window: int, w0: int
             ) -> tuple[torch.Tensor, torch.Tensor]:
    """Request ``i``'s sink ``[H, sink, D]`` and window ``[H, window, D]`` rows in float32 (window positions
    ``[first, first + window)``), read from either form."""
    if not isinstance(fp, RingRows):
        return fp[i, :sink].transpose(0, 1), fp[i, w0: w0 + window].transpose(0, 1)
    ring = fp.slots.shape[1] - w0
    per_block = fp.rows.shape[1]

    def read(cols: torch.Tensor) -> torch.Tensor:
        ids = fp.slots[i, cols].long()
        return fp.rows[ids // per_block, ids % per_block].float().transpose(0, 1)  # [H, n, D]

    dev = fp.slots.device
    old = read(ring_slot(torch.arange(first, first + window - 1, device=dev), ring, w0))
    return read(torch.arange(sink, device=dev)), torch.cat([old, fp.new[i].float().unsqueeze(1)], dim=1)


def torch_paged_decode(q: torch.Tensor, pool: torch.Tensor, layout: PagedLayout, block_table: torch.Tensor,
                       counts: torch.Tensor, k_fp: torch.Tensor | RingRows, v_fp: torch.Tensor | RingRows, w0: int,
                       *, scaling: float | None = None) -> torch.Tensor:
    """Plain torch reference of :func:`paged_decode_attention` (both forms of rows; any device, the tables
    checked on host copies): each request's pages dequantized (:func:`kivi.quant.kv.dequantize_kv`), sink +
    pages + window concatenated, softmax attention in float32."""
    check_paged_inputs(q, pool, layout, block_table.cpu(), counts.cpu(), on_host(k_fp), on_host(v_fp), w0)
    N, hq, D = q.shape
    H, P = layout.num_kv_heads, layout.page_size
    g = hq // H
    scaling = D**-0.5 if scaling is None else scaling
    out = torch.empty(N, hq, D, device=q.device)
    for i in range(N):
        sides = []
        for s, (side, fp) in enumerate((("k", k_fp), ("v", v_fp))):
            sink, stored, window = counts[i, 3 * s: 3 * s + 3].tolist()
            sink_rows, window_rows = _fp_rows(fp, i, sink, sink + stored, window, w0)
            parts = [sink_rows]  # [H, sink, D]
            if stored:
                blocks = block_table[i, : -(-stored // P)].long().to(pool.device)
                fields = {}
                for name in ("packed", "scale", "offset"):
                    if name == "offset" and getattr(layout, f"{side}_offset") is None:
                        continue
                    t = layout.field(pool, side, name).index_select(0, blocks)  # [n, H, rows, C]
                    fields[name] = t.transpose(0, 1).reshape(1, H, -1, t.shape[-1])
                seg = PackedKV(packed=fields["packed"], scale=fields["scale"], offset=fields.get("offset"), comp=None,
                               format=layout.formats()[0 if side == "k" else 1], head_dim=D)
                parts.append(dequantize_kv(seg, torch.float32)[0, :, :stored])
            parts.append(window_rows)
            sides.append(torch.cat(parts, dim=1))  # [H, T, D]
        k, v = sides
        qi = q[i].float().view(H, g, D)
        p = torch.softmax(torch.einsum("hgd,htd->hgt", qi, k) * scaling, dim=-1)
        out[i] = torch.einsum("hgt,htd->hgd", p, v).reshape(hq, D)
    return out if q.dtype == torch.float32 else out.to(q.dtype)


__all__ = ["PagedLayout", "RingRows", "PARAM_DTYPES", "ROW_DTYPES", "check_paged_inputs", "check_paged_shapes",
           "check_paged_counts", "on_host", "paged_decode_attention", "torch_paged_decode"]
