"""Triton kernels for KIVI quantize + pack (imported lazily: this module imports triton).

Both kernels reproduce :func:`kivi.quant.primitives.quantize_groups` (asymmetric) exactly:

    lo, hi = min/max over the group (float32)     offset = lo rounded to the param dtype
    scale  = div_rn(hi - offset, levels) rounded to the param dtype
    code   = clamp(round_half_even(div_rn(x - offset, scale)), 0, levels)   (0 where scale == 0)

``div_rn`` is IEEE division (Triton's plain ``/`` may be approximate on GPUs); the bf16 rounding
is done by hand (round-to-nearest-even on the bits) because the interpreter truncates fp32->bf16.
Codes are packed ``8 // BITS`` per byte, code j of a byte at bits ``[j*BITS, (j+1)*BITS)``.
"""

from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def _round_param(x, PARAM_KIND: tl.constexpr):
    """float32 -> nearest value of the parameter dtype (0 fp32, 1 fp16, 2 bf16), kept as float32."""
    if PARAM_KIND == 1:
        return x.to(tl.float16).to(tl.float32)
    elif PARAM_KIND == 2:
        b = x.to(tl.uint32, bitcast=True)
        b = b + 0x7FFF + ((b >> 16) & 1)
        b = (b >> 16) << 16
        return b.to(tl.float32, bitcast=True)
    else:
        return x


@triton.jit
def _round_half_even(y):
    f = tl.floor(y)
    r = y - f
    odd = (f - 2.0 * tl.floor(f * 0.5)) != 0.0
    up = (r > 0.5) | ((r == 0.5) & odd)
    return tl.where(up, f + 1.0, f)


@triton.jit
def _params(lo, hi, LEVELS: tl.constexpr, PARAM_KIND: tl.constexpr):
    """Group min/max (float32) -> (scale, offset) as stored in the param dtype, kept as float32."""
    off = _round_param(lo, PARAM_KIND)
    sc = _round_param(tl.math.div_rn(hi - off, tl.zeros_like(hi) + LEVELS), PARAM_KIND)
    return sc, off


@triton.jit
def _encode(x, sc, off, LEVELS: tl.constexpr):
    pos = sc > 0.0
    safe = tl.where(pos, sc, 1.0)
    q = _round_half_even(tl.math.div_rn(x - off, safe))
    q = tl.minimum(tl.maximum(q, 0.0), LEVELS * 1.0)
    q = tl.where(pos, q, 0.0)
    return q.to(tl.int32)


@triton.jit
def pack_rows(codes, ROWS: tl.constexpr, BLOCK_D: tl.constexpr, BITS: tl.constexpr):
    """int32 ``codes [ROWS, BLOCK_D]`` packed ``8 // BITS`` per byte along axis 1: ``[ROWS, BLOCK_D * BITS // 8]``,
    code ``j`` of a byte at bits ``[j * BITS, (j + 1) * BITS)``."""
    PB: tl.constexpr = 8 // BITS
    NB: tl.constexpr = BLOCK_D // PB
    if PB == 1:
        return codes
    c3 = tl.reshape(codes, (ROWS, NB, PB))
    shifts = tl.arange(0, PB) * BITS
    return tl.sum(c3 << shifts[None, None, :], axis=2)


@triton.jit
def _pack_store(codes, out_ptr, rows, row_mask, row_stride, NBYTES, ROWS: tl.constexpr,
                BLOCK_D: tl.constexpr, BITS: tl.constexpr):
    """Pack int32 ``codes [ROWS, BLOCK_D]`` along axis 1 and store the bytes of each row."""
    NB: tl.constexpr = BLOCK_D // (8 // BITS)
    packed = pack_rows(codes, ROWS, BLOCK_D, BITS)
    nb = tl.arange(0, NB)
    ptrs = out_ptr + rows[:, None] * row_stride + nb[None, :]
    tl.store(ptrs, packed.to(tl.uint8), mask=row_mask[:, None] & (nb[None, :] < NBYTES))


@triton.jit
def quant_keys_kernel(
    x_ptr, valid_ptr, packed_ptr, scale_ptr, offset_ptr,
    H, T, D, NBYTES,
    G: tl.constexpr, G_P2: tl.constexpr, BLOCK_D: tl.constexpr, BITS: tl.constexpr,
    PARAM_KIND: tl.constexpr, HAS_VALID: tl.constexpr,
):
    """Keys: per channel, groups of G tokens. Grid (B*H, T // G). x, packed, scale contiguous."""
    pid_bh = tl.program_id(0)
    pid_g = tl.program_id(1)
    LEVELS: tl.constexpr = (1 << BITS) - 1
    r = tl.arange(0, G_P2)
    d = tl.arange(0, BLOCK_D)
    t = pid_g * G + r
    rmask = r < G
    dmask = d < D
    stat_rows = rmask
    if HAS_VALID:
        b = pid_bh // H
        vt = tl.load(valid_ptr + b * T + t, mask=rmask, other=0)
        stat_rows = rmask & (vt != 0)
    base = pid_bh.to(tl.int64) * T * D
    m2 = rmask[:, None] & dmask[None, :]
    x = tl.load(x_ptr + base + t[:, None] * D + d[None, :], mask=m2, other=0.0).to(tl.float32)
    sm = stat_rows[:, None] & dmask[None, :]
    lo = tl.min(tl.where(sm, x, float("inf")), axis=0)
    hi = tl.max(tl.where(sm, x, float("-inf")), axis=0)
    empty = lo == float("inf")
    lo = tl.where(empty, 0.0, lo)
    hi = tl.where(empty, 0.0, hi)
    sc, off = _params(lo, hi, LEVELS, PARAM_KIND)
    q = _encode(x, sc[None, :], off[None, :], LEVELS)
    q = tl.where(m2, q, 0)
    pbase = pid_bh.to(tl.int64) * T * NBYTES
    _pack_store(q, packed_ptr + pbase, t, rmask, NBYTES, NBYTES, G_P2, BLOCK_D, BITS)
    n_groups = T // G
    sbase = (pid_bh.to(tl.int64) * n_groups + pid_g) * D
    tl.store(scale_ptr + sbase + d, sc.to(scale_ptr.dtype.element_ty), mask=dmask)
    tl.store(offset_ptr + sbase + d, off.to(offset_ptr.dtype.element_ty), mask=dmask)


@triton.jit
def quant_values_kernel(
    x_ptr, valid_ptr, packed_ptr, scale_ptr, offset_ptr,
    H, T, D, NBYTES,
    G: tl.constexpr, NG: tl.constexpr, BLOCK_T: tl.constexpr, BLOCK_D: tl.constexpr, BITS: tl.constexpr,
    PARAM_KIND: tl.constexpr, HAS_VALID: tl.constexpr,
):
    """Values: per token, groups of G channels (NG = D // G groups). Grid (B*H, cdiv(T, BLOCK_T))."""
    pid_bh = tl.program_id(0)
    pid_t = tl.program_id(1)
    LEVELS: tl.constexpr = (1 << BITS) - 1
    t = pid_t * BLOCK_T + tl.arange(0, BLOCK_T)
    d = tl.arange(0, BLOCK_D)
    tmask = t < T
    dmask = d < D
    stat_rows = tmask
    if HAS_VALID:
        b = pid_bh // H
        vt = tl.load(valid_ptr + b * T + t, mask=tmask, other=0)
        stat_rows = tmask & (vt != 0)
    base = pid_bh.to(tl.int64) * T * D
    m2 = tmask[:, None] & dmask[None, :]
    x = tl.load(x_ptr + base + t[:, None] * D + d[None, :], mask=m2, other=0.0).to(tl.float32)
    sc_full = tl.zeros((BLOCK_T, BLOCK_D), dtype=tl.float32)
    off_full = tl.zeros((BLOCK_T, BLOCK_D), dtype=tl.float32)
    grp = d // G
    sbase = pid_bh.to(tl.int64) * T * NG
    for g in tl.static_range(NG):
        in_g = (grp == g) & dmask
        sm = stat_rows[:, None] & in_g[None, :]
        lo = tl.min(tl.where(sm, x, float("inf")), axis=1)
        hi = tl.max(tl.where(sm, x, float("-inf")), axis=1)
        empty = lo == float("inf")
        lo = tl.where(empty, 0.0, lo)
        hi = tl.where(empty, 0.0, hi)
        sc, off = _params(lo, hi, LEVELS, PARAM_KIND)
        tl.store(scale_ptr + sbase + t * NG + g, sc.to(scale_ptr.dtype.element_ty), mask=tmask)
        tl.store(offset_ptr + sbase + t * NG + g, off.to(offset_ptr.dtype.element_ty), mask=tmask)
        sc_full = tl.where(in_g[None, :], sc[:, None], sc_full)
        off_full = tl.where(in_g[None, :], off[:, None], off_full)
    q = _encode(x, sc_full, off_full, LEVELS)
    q = tl.where(m2, q, 0)
    pbase = pid_bh.to(tl.int64) * T * NBYTES
    _pack_store(q, packed_ptr + pbase, t, tmask, NBYTES, NBYTES, BLOCK_T, BLOCK_D, BITS)
