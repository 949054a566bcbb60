"""The numba side of :mod:`kivi.paged.write`: a decode step's writes of one layer in one compiled call.

Importing this module imports numba (and the paged decode kernel's layout columns); :mod:`kivi.paged.write`
imports it on first use. The quantization is :mod:`kivi.quant.numba_quant_kernel`'s (the one compiled rule,
bit-identical to :func:`kivi.quant.kv.quantize_side`); this module only says where the rows come from and
where the codes and parameters go. numba's on-disk cache of :func:`decode_write` is keyed on this file only, and
the quantizer's helpers are compiled into it: after an edit of :mod:`kivi.quant.numba_quant_kernel`, touch this
file (or drop ``kivi/vllm/__pycache__/write_kernel*.nb*``), or a stale cache keeps the old quantizer (an
installed kivi's files change together).

Arguments of :func:`decode_write` (``n`` input rows, ``H`` kv heads, ``D`` head size, ``Pw`` rows per ring
block):

* ``pool`` uint8 ``[bytes]``, ``lay`` int64: the layer's pages and where their fields sit
  (:meth:`kivi.attention.fused_cpu.paged.PagedLayout.vector`; parameters float32 or bfloat16);
* ``krows`` / ``vrows`` ``[blocks, Pw, H, D]``: the layer's window rings as one rows pool per side
  (:class:`kivi.paged.geometry.RingPool`; float32, or int16 holding bfloat16 bits), pool block
  ``rbase[r] + ring_table[i, r] * rstep[r]`` is request ``i``'s block of ring ``r``;
* ``page_table`` int32 ``[N, pages]``: request ``i``'s store position ``u`` is in block ``page_table[i, u // P]``,
  row ``u % P``;
* ``knew`` / ``vnew`` ``[n, H, D]``: the step's input rows, the rings' dtype;
* ``kleave`` / ``vleave`` int64 ``[M, 4]``: the tokens leaving the windows for the pages, in token order, as
  ``(request, ring slot or -1, input row or -1, store position)`` (a slot: the token is in the rings; else
  it is the step's own, input row); keys in whole aligned groups of ``G`` consecutive entries;
* ``writes`` int64 ``[W, 3]``: ``(request, ring slot, input row)`` of the step's tokens for the rings;
* ``kshrinks`` / ``vshrinks``: the clipping grids (``[1.0]``: min/max).

Order: parameters that are neither float32 nor bfloat16 are refused (3, nothing written: float16 parameters take
the torch writes, :func:`kivi.paged.write.decode_writer`), the key groups are checked whole and aligned (2, nothing
written: a caller's error), every leaving row
is read (and converted to float32) and checked finite (1, nothing written: a NaN / Inf); then values and keys go
to their page rows; then the rings are written (a ring slot is reused only once its token has left: read before
written). Returns 0.
"""

from __future__ import annotations

import numba
import numpy as np

from ..attention.fused_cpu.kernel import (
    _PL_BLOCK,
    _PL_G,
    _PL_KBITS,
    _PL_KOFF,
    _PL_KPACK,
    _PL_KROW,
    _PL_KSC,
    _PL_P,
    _PL_PDT,
    _PL_VBITS,
    _PL_VOFF,
    _PL_VPACK,
    _PL_VROW,
    _PL_VSC,
)
from ..quant.numba_bits import f32_bits
from ..quant.numba_quant_kernel import all_finite, as_f32, group_code, group_params, put_code

inline = numba.njit(inline="always", cache=True)


@inline
def _put_param(pool, at, v, bf16):
    """Store the parameter ``v`` (already :func:`~kivi.quant.numba_quant_kernel.stored`) at byte ``at``: 4 bytes of
    float32, or (``bf16``) the 2 high bytes, little-endian."""
    w = f32_bits(v)
    if bf16:
        w >>= np.uint32(16)
        pool[at] = np.uint8(w & np.uint32(0xFF))
        pool[at + 1] = np.uint8(w >> np.uint32(8))
        return
    for j in range(4):
        pool[at + j] = np.uint8((w >> np.uint32(8 * j)) & np.uint32(0xFF))


@inline
def _ring_block(rbase, rstep, ring_table, req, slot, pw):
    """The rows pool block of request ``req``'s ring slot ``slot`` (its row: ``slot % pw``):
    :func:`kivi.paged.ring.slot_place`, restated (compiled code cannot call it)."""
    r = slot // pw
    return rbase[r] + np.int64(ring_table[req, r]) * rstep[r]


@inline
def _gather(leave, rows, new, rbase, rstep, ring_table, pw, out):
    """The leaving rows ``out [M, H, D]`` (float32): from the rings, or the step's input."""
    M, H, D = out.shape
    for m in range(M):
        req, slot, src = leave[m, 0], leave[m, 1], leave[m, 2]
        if slot >= 0:
            blk = _ring_block(rbase, rstep, ring_table, req, slot, pw)
            row = slot % pw
            for h in range(H):
                for c in range(D):
                    out[m, h, c] = as_f32(rows[blk, row, h, c])
        else:
            for h in range(H):
                for c in range(D):
                    out[m, h, c] = as_f32(new[src, h, c])


@numba.njit(cache=True)
def decode_write(pool, lay, krows, vrows, rbase, rstep, ring_table, page_table, knew, vnew, kleave, vleave, writes,
                 kshrinks, vshrinks):
    """One layer's writes of a decode step (the module docstring); 1 (nothing written) on a non-finite leaving
    value, 2 on key groups that are not whole, 3 on parameters neither float32 nor bfloat16, else 0."""
    H, D = knew.shape[1], knew.shape[2]
    pw = krows.shape[1]
    BB, P, G = lay[_PL_BLOCK], lay[_PL_P], lay[_PL_G]
    if lay[_PL_PDT] != 0 and lay[_PL_PDT] != 1:  # float16 parameters: the torch writes' (decode_writer's rule)
        return 3
    bf16 = lay[_PL_PDT] == 1
    item = 2 if bf16 else 4
    for g0 in range(0, kleave.shape[0], G):  # keys leave in whole aligned groups of one request
        if g0 + G > kleave.shape[0] or kleave[g0, 3] % G:
            return 2
        for t in range(1, G):
            if kleave[g0 + t, 0] != kleave[g0, 0] or kleave[g0 + t, 3] != kleave[g0, 3] + t:
                return 2
    kx = np.empty((kleave.shape[0], H, D), dtype=np.float32)
    vx = np.empty((vleave.shape[0], H, D), dtype=np.float32)
    _gather(kleave, krows, knew, rbase, rstep, ring_table, pw, kx)
    _gather(vleave, vrows, vnew, rbase, rstep, ring_table, pw, vx)
    if not (all_finite(kx) and all_finite(vx)):
        return 1
    # values: per token, groups of G channels; codes [H, P, vrow] bytes, parameters [H, P, D // G]
    bits, rowb = lay[_PL_VBITS], lay[_PL_VROW]
    levels = (1 << bits) - 1
    flevels = np.float32(levels)
    nvg = D // G
    for m in range(vx.shape[0]):
        req, u = vleave[m, 0], vleave[m, 3]
        base = np.int64(page_table[req, u // P]) * BB
        r = u % P
        for h in range(H):
            at = base + lay[_PL_VPACK] + (h * P + r) * rowb
            out = pool[at : at + rowb]
            out[:] = 0
            x = vx[m, h]
            for gi in range(nvg):
                c0 = gi * G
                sc, lo = group_params(x[c0 : c0 + G], levels, vshrinks, bf16)
                p = ((h * P + r) * nvg + gi) * item
                _put_param(pool, base + lay[_PL_VSC] + p, sc, bf16)
                _put_param(pool, base + lay[_PL_VOFF] + p, lo, bf16)
                for c in range(c0, c0 + G):
                    put_code(out, c, bits, group_code(x[c], lo, sc, flevels))
    # keys: per channel, groups of G tokens (G consecutive entries, one request, an aligned group of a page);
    # codes [H, P, krow] bytes, parameters [H, P // G, D]
    bits, rowb = lay[_PL_KBITS], lay[_PL_KROW]
    levels = (1 << bits) - 1
    flevels = np.float32(levels)
    for g0 in range(0, kx.shape[0], G):
        req, u = kleave[g0, 0], kleave[g0, 3]
        base = np.int64(page_table[req, u // P]) * BB
        r = u % P
        for h in range(H):
            at = base + lay[_PL_KPACK] + (h * P + r) * rowb
            pool[at : at + G * rowb] = 0
            for c in range(D):
                g = kx[g0 : g0 + G, h, c]
                sc, lo = group_params(g, levels, kshrinks, bf16)
                p = ((h * (P // G) + r // G) * D + c) * item
                _put_param(pool, base + lay[_PL_KSC] + p, sc, bf16)
                _put_param(pool, base + lay[_PL_KOFF] + p, lo, bf16)
                for t in range(G):
                    put_code(pool[at + t * rowb : at + (t + 1) * rowb], c, bits, group_code(g[t], lo, sc, flevels))
    # the rings: every read of the step is done
    for w in range(writes.shape[0]):
        req, slot, src = writes[w, 0], writes[w, 1], writes[w, 2]
        blk = _ring_block(rbase, rstep, ring_table, req, slot, pw)
        row = slot % pw
        for h in range(H):
            for c in range(D):
                krows[blk, row, h, c] = knew[src, h, c]
                vrows[blk, row, h, c] = vnew[src, h, c]
    return 0


__all__ = ["decode_write"]
