"""Triton kernels of a decode step's writes over KIVI pages in a block pool (imported lazily: imports triton).

The GPU form of :func:`kivi.paged.write_kernel.decode_write` (same tables, same order), in four launches:

* :func:`gather_rows_kernel` (grid ``(M, H)``): each leaving row, from the window rings (row ``slot % Pw`` of pool
  block ``rbase[r] + ring_table[req, r] * rstep[r]``, ``r = slot // Pw``) or the step's input, to a float32 scratch;
  a row that is not finite sets the step's flag (``flag``, one int64, zero before the launch), and the three
  launches after it write nothing when it is set (every store masked by it: all or nothing, on the device, with
  no host read in between);
* :func:`write_key_groups_kernel` (grid ``(groups, H)``): a group of ``G`` leaving keys of one request, per
  channel, to its page rows;
* :func:`write_values_kernel` (grid ``(M, H)``): one leaving value, per ``G`` channels, to its page row;
* :func:`write_rings_kernel` (grid ``(W, H)``): the step's tokens to their ring slots (bits copied: the input is
  in the rings' dtype).

Quantization is :mod:`._quant_kernels`' (``_params`` / ``_encode``: IEEE division, round half to even, parameters
rounded to their dtype as torch rounds them), so codes and parameters are :func:`kivi.quant.kv.quantize_side`'s.
Codes are packed ``8 // BITS`` per byte (1 / 2 / 4 / 8 bits), every byte of a row written.
"""

from __future__ import annotations

import triton
import triton.language as tl

from ._quant_kernels import _encode, _params, pack_rows


@triton.jit
def _store_packed(codes, row_ptrs, row_mask, ROW_BYTES: tl.constexpr, ROWS: tl.constexpr, BLOCK_D: tl.constexpr,
                  BITS: tl.constexpr):
    """Pack int32 ``codes [ROWS, BLOCK_D]`` along axis 1 (:func:`pack_rows`) and store each row's ``ROW_BYTES``
    bytes at ``row_ptrs [ROWS]`` (uint8 pointers)."""
    NB: tl.constexpr = BLOCK_D // (8 // BITS)
    packed = pack_rows(codes, ROWS, BLOCK_D, BITS)
    nb = tl.arange(0, NB)
    tl.store(row_ptrs[:, None] + nb[None, :], packed.to(tl.uint8), mask=row_mask[:, None] & (nb[None, :] < ROW_BYTES))


@triton.jit
def _ring_row(rt_ptr, rt_s0, rbase_ptr, rstep_ptr, req, slot, PW):
    """Row ``(pool block, row)`` of request ``req``'s ring slot ``slot`` (:func:`kivi.paged.ring.slot_place`,
    restated)."""
    r = slot // PW
    blk = tl.load(rbase_ptr + r) + tl.load(rt_ptr + req * rt_s0 + r).to(tl.int64) * tl.load(rstep_ptr + r)
    return blk, slot % PW


@triton.jit
def gather_rows_kernel(leave_ptr, out_ptr, rows_ptr, r_sb, r_sr, r_sh, new_ptr, n_s0, n_s1, rt_ptr, rt_s0,
                       rbase_ptr, rstep_ptr, PW, H, flag_ptr, D: tl.constexpr, BLOCK_D: tl.constexpr):
    """``out[m, h] = leaving row m`` (float32), ``leave [M, 4]``: ``(request, ring slot or -1, input row or -1,
    store position)``; ``flag`` raised to 1 when the row holds a NaN or an infinity."""
    m = tl.program_id(0).to(tl.int64)
    h = tl.program_id(1).to(tl.int64)
    req = tl.load(leave_ptr + m * 4)
    slot = tl.load(leave_ptr + m * 4 + 1)
    src = tl.load(leave_ptr + m * 4 + 2)
    d = tl.arange(0, BLOCK_D)
    dm = d < D
    if slot >= 0:
        blk, row = _ring_row(rt_ptr, rt_s0, rbase_ptr, rstep_ptr, req, slot, PW)
        x = tl.load(rows_ptr + blk * r_sb + row * r_sr + h * r_sh + d, mask=dm, other=0.0).to(tl.float32)
    else:
        x = tl.load(new_ptr + src * n_s0 + h * n_s1 + d, mask=dm, other=0.0).to(tl.float32)
    tl.store(out_ptr + (m * H + h) * D + d, x, mask=dm)
    bad = tl.max(((x != x) | (tl.abs(x) == float("inf"))).to(tl.int64), axis=0)
    tl.atomic_max(flag_ptr, bad)


@triton.jit
def write_key_groups_kernel(x_ptr, leave_ptr, pt_ptr, pt_s0, pool_ptr, par_ptr, H, flag_ptr,
                            D: tl.constexpr, BLOCK_D: tl.constexpr, G: tl.constexpr, G_P2: tl.constexpr,
                            BITS: tl.constexpr, PARAM_KIND: tl.constexpr, P: tl.constexpr,
                            BLOCK_BYTES: tl.constexpr, CODES: tl.constexpr, SCALE: tl.constexpr,
                            OFFSET: tl.constexpr, ROW_BYTES: tl.constexpr, PAR_ITEM: tl.constexpr):
    """Keys ``x [Mk, H, D]`` (float32) leaving in groups of ``G`` consecutive entries of one request, aligned in a
    page: per channel min/max, codes ``[H, P, ROW_BYTES]``, parameters ``[H, P // G, D]``; nothing when ``flag``."""
    LEVELS: tl.constexpr = (1 << BITS) - 1
    j = tl.program_id(0).to(tl.int64)
    h = tl.program_id(1).to(tl.int64)
    m0 = j * G
    req = tl.load(leave_ptr + m0 * 4)
    u0 = tl.load(leave_ptr + m0 * 4 + 3)
    base = tl.load(pt_ptr + req * pt_s0 + u0 // P).to(tl.int64) * BLOCK_BYTES
    r0 = u0 % P
    t = tl.arange(0, G_P2)
    d = tl.arange(0, BLOCK_D)
    rmask = t < G
    dmask = d < D
    m2 = rmask[:, None] & dmask[None, :]
    ok_t = tl.load(flag_ptr + 0 * t) == 0  # the flag as a vector: the interpreter cannot mask with a scalar
    ok_d = tl.load(flag_ptr + 0 * d) == 0
    x = tl.load(x_ptr + ((m0 + t)[:, None] * H + h) * D + d[None, :], mask=m2, other=0.0)
    lo = tl.min(tl.where(m2, x, float("inf")), axis=0)
    hi = tl.max(tl.where(m2, x, float("-inf")), axis=0)
    lo = tl.where(dmask, lo, 0.0)
    hi = tl.where(dmask, hi, 0.0)
    sc, off = _params(lo, hi, LEVELS, PARAM_KIND)
    q = tl.where(m2, _encode(x, sc[None, :], off[None, :], LEVELS), 0)
    _store_packed(q, pool_ptr + base + CODES + (h * P + r0 + t) * ROW_BYTES, rmask & ok_t, ROW_BYTES, G_P2, BLOCK_D,
                  BITS)
    pidx = (h * (P // G) + r0 // G) * D + d
    tl.store(par_ptr + (base + SCALE) // PAR_ITEM + pidx, sc.to(par_ptr.dtype.element_ty), mask=dmask & ok_d)
    tl.store(par_ptr + (base + OFFSET) // PAR_ITEM + pidx, off.to(par_ptr.dtype.element_ty), mask=dmask & ok_d)


@triton.jit
def write_values_kernel(x_ptr, leave_ptr, pt_ptr, pt_s0, pool_ptr, par_ptr, H, flag_ptr,
                        D: tl.constexpr, BLOCK_D: tl.constexpr, G: tl.constexpr, NG: tl.constexpr,
                        BITS: tl.constexpr, PARAM_KIND: tl.constexpr, P: tl.constexpr,
                        BLOCK_BYTES: tl.constexpr, CODES: tl.constexpr, SCALE: tl.constexpr,
                        OFFSET: tl.constexpr, ROW_BYTES: tl.constexpr, PAR_ITEM: tl.constexpr):
    """One leaving value ``x [Mv, H, D]`` (float32): per token, groups of ``G`` channels; codes
    ``[H, P, ROW_BYTES]``, parameters ``[H, P, D // G]``; nothing when ``flag``."""
    LEVELS: tl.constexpr = (1 << BITS) - 1
    m = tl.program_id(0).to(tl.int64)
    h = tl.program_id(1).to(tl.int64)
    req = tl.load(leave_ptr + m * 4)
    u = tl.load(leave_ptr + m * 4 + 3)
    base = tl.load(pt_ptr + req * pt_s0 + u // P).to(tl.int64) * BLOCK_BYTES
    r = u % P
    one = tl.arange(0, 1)
    ok = tl.load(flag_ptr + 0 * one) == 0
    d = tl.arange(0, BLOCK_D)
    dmask = d < D
    x = tl.load(x_ptr + (m * H + h) * D + d[None, :] + 0 * one[:, None], mask=dmask[None, :], other=0.0)
    sc_full = tl.zeros((1, BLOCK_D), dtype=tl.float32)
    off_full = tl.zeros((1, BLOCK_D), dtype=tl.float32)
    grp = d // G
    prow = (base + SCALE) // PAR_ITEM + (h * P + r) * NG
    orow = (base + OFFSET) // PAR_ITEM + (h * P + r) * NG
    for g in tl.static_range(NG):
        in_g = ((grp == g) & dmask)[None, :]
        lo = tl.min(tl.where(in_g, x, float("inf")), axis=1)
        hi = tl.max(tl.where(in_g, x, float("-inf")), axis=1)
        sc, off = _params(lo, hi, LEVELS, PARAM_KIND)
        tl.store(par_ptr + prow + g + one, sc.to(par_ptr.dtype.element_ty), mask=ok)
        tl.store(par_ptr + orow + g + one, off.to(par_ptr.dtype.element_ty), mask=ok)
        sc_full = tl.where(in_g, sc[:, None], sc_full)
        off_full = tl.where(in_g, off[:, None], off_full)
    q = tl.where(dmask[None, :], _encode(x, sc_full, off_full, LEVELS), 0)
    _store_packed(q, pool_ptr + base + CODES + (h * P + r) * ROW_BYTES + one, ok, ROW_BYTES, 1, BLOCK_D, BITS)


@triton.jit
def write_rings_kernel(writes_ptr, krows_ptr, vrows_ptr, r_sb, r_sr, r_sh, knew_ptr, vnew_ptr, n_s0, n_s1,
                       rt_ptr, rt_s0, rbase_ptr, rstep_ptr, PW, flag_ptr, D: tl.constexpr, BLOCK_D: tl.constexpr):
    """The step's tokens ``writes [W, 3]`` (``(request, ring slot, input row)``) to their ring rows, both sides;
    nothing when ``flag``."""
    w = tl.program_id(0).to(tl.int64)
    h = tl.program_id(1).to(tl.int64)
    req = tl.load(writes_ptr + w * 3)
    slot = tl.load(writes_ptr + w * 3 + 1)
    src = tl.load(writes_ptr + w * 3 + 2)
    blk, row = _ring_row(rt_ptr, rt_s0, rbase_ptr, rstep_ptr, req, slot, PW)
    d = tl.arange(0, BLOCK_D)
    dm = (d < D) & (tl.load(flag_ptr + 0 * d) == 0)
    at = blk * r_sb + row * r_sr + h * r_sh + d
    src_at = src * n_s0 + h * n_s1 + d
    tl.store(krows_ptr + at, tl.load(knew_ptr + src_at, mask=dm), mask=dm)
    tl.store(vrows_ptr + at, tl.load(vnew_ptr + src_at, mask=dm), mask=dm)
