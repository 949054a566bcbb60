"""Triton split-K decode attention over a packed KIVI cache read in place (imported lazily: imports triton).

Each side (keys, values) covers the kv positions ``[0, T)`` in three pieces
(:mod:`kivi.kernels.segments`): a full-precision sink ``[0, S)``, stored blocks ``[S, SPLIT)`` walked
through a small int64 descriptor table (one row per block: first / end position, element offsets and
batch / head strides of its codes, scales and offsets, from the side's witness pointers), and the
full-precision tail ``[SPLIT, T)``. Keys and values have their own pieces (their splits differ).

Pass 1 (grid ``(B * HKV, NUM_SPLITS)``): a program owns one kv head, its ``QG = HQ // HKV`` query heads
(padded to ``QG_P2 >= 16`` rows for ``tl.dot``) and one contiguous token range; it finds the first
block of its range in each side's table, then walks the range in ``BLOCK_N`` tiles: a tile takes its
tokens from the sink, from every block it overlaps (a cursor moves along the table) and from the
tail, dequantizes (``code * scale + offset`` in float32; 1/2/4/8-bit codes are unpacked from whole
bytes, 3-bit codes from each run's 24-bit integer) and updates an online softmax (base 2). It
writes partial ``m``, ``l`` and the unnormalised accumulator. Pass 2 (grid ``(B * HQ,)``) merges the
splits.
"""

from __future__ import annotations

import triton
import triton.language as tl

#: Columns of a block row (kivi.kernels.segments: LO, HI, DATA, DATA_SB, DATA_SH, SCALE, OFFSET, PAR_SB, PAR_SH).
NCOL: tl.constexpr = tl.constexpr(9)


@triton.jit
def _unpack(bytes_, ROWS: tl.constexpr, BLOCK_D: tl.constexpr, BITS: tl.constexpr):
    """uint8 ``[ROWS, BLOCK_D // (8 // BITS)]`` -> float32 codes ``[ROWS, BLOCK_D]`` (1, 2, 4, 8 bits: whole
    codes per byte; 3 bits go through :func:`_load_codes3`)."""
    PB: tl.constexpr = 8 // BITS
    b = bytes_.to(tl.int32)
    if PB == 1:
        return b.to(tl.float32)
    else:
        shifts = tl.arange(0, PB) * BITS
        c = (b[:, :, None] >> shifts[None, None, :]) & ((1 << BITS) - 1)
        return tl.reshape(c, (ROWS, BLOCK_D)).to(tl.float32)


@triton.jit
def _load_codes3(row_ptrs, mask, ROWS: tl.constexpr, BLOCK_D: tl.constexpr, D: tl.constexpr):
    """float32 codes ``[ROWS, BLOCK_D]`` of 3-bit rows (``row_ptrs [ROWS, 1]``: each row's first byte;
    ``mask [ROWS, 1]``: the rows to read).

    Layout (kivi.quant.packing): runs of 8 codes are a little-endian 24-bit integer in 3 bytes, code
    ``j`` of a run at bits ``[3j, 3j + 3)`` (a code may straddle two bytes); a row of ``D`` channels
    takes ``ceil(D / 8) * 3`` bytes. Each run's 3 bytes are loaded (``[ROWS, BLOCK_D // 8, 4]``, the
    fourth lane masked off), assembled into its 24-bit integer and split into 8 codes.
    """
    NR: tl.constexpr = BLOCK_D // 8
    NB_REAL: tl.constexpr = (D + 7) // 8 * 3
    run = tl.arange(0, NR)
    k = tl.arange(0, 4)
    boff = run[:, None] * 3 + k[None, :]  # [NR, 4]
    ok = (k[None, :] < 3) & (boff < NB_REAL)
    b = tl.load(row_ptrs[:, :, None] + boff[None, :, :], mask=mask[:, :, None] & ok[None, :, :], other=0)
    word = tl.sum(b.to(tl.int32) << (k * 8)[None, None, :], axis=2)  # [ROWS, NR]: the runs' 24-bit integers
    shifts = tl.arange(0, 8) * 3
    c = (word[:, :, None] >> shifts[None, None, :]) & 7
    return tl.reshape(c, (ROWS, BLOCK_D)).to(tl.float32)


@triton.jit
def _first_block(tab_ptr, nblk, origin, start, SCAN: tl.constexpr):
    """Index of the first table row whose block ends after relative position ``start``."""
    idx0 = tl.arange(0, SCAN)
    cur = tl.sum(tl.zeros((SCAN,), dtype=tl.int32), axis=0)
    for c in range(0, nblk, SCAN):
        idx = c + idx0
        ok = idx < nblk
        hi = tl.load(tab_ptr + idx.to(tl.int64) * NCOL + 1, mask=ok, other=0) - origin
        cur += tl.sum((ok & (hi <= start)).to(tl.int32), axis=0)
    return cur


@triton.jit
def _side_tile(
    t, tmask, n0, cur, d, dmask, b64, h64,
    sink_ptr, s_sb, s_sh, s_st, S,
    tab_ptr, nblk, origin, split, data_ptr, data_st, par_ptr, par_st,
    fp_ptr, f_sb, f_sh, f_st,
    HAS_SINK: tl.constexpr, QUANT: tl.constexpr, BITS: tl.constexpr, G: tl.constexpr, CHANNEL: tl.constexpr,
    DATA_UNIT: tl.constexpr, PAR_UNIT: tl.constexpr,
    BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr, D: tl.constexpr,
):
    """float32 ``[BLOCK_N, BLOCK_D]`` of the side's tokens ``t`` (tile ``[n0, n0 + BLOCK_N)``), and the
    table cursor for the next tile (the block holding position ``n0 + BLOCK_N``)."""
    dm = dmask[None, :]
    x = tl.zeros((BLOCK_N, BLOCK_D), dtype=tl.float32)
    if HAS_SINK:
        if n0 < S:
            sm = tmask & (t < S)
            x = tl.load(sink_ptr + b64 * s_sb + h64 * s_sh + t[:, None] * s_st + d[None, :],
                        mask=sm[:, None] & dm, other=0.0).to(tl.float32)
    tile_end = n0 + BLOCK_N
    go = (cur < nblk) & (n0 < split)
    while go:
        row = tab_ptr + cur.to(tl.int64) * NCOL
        lo = tl.load(row + 0) - origin
        hi = tl.load(row + 1) - origin
        m = tmask & (t >= tl.maximum(lo, S)) & (t < tl.minimum(hi, split))
        r = t - lo  # row of each token in the block
        doff = (tl.load(row + 2) + b64 * tl.load(row + 3) + h64 * tl.load(row + 4)) * DATA_UNIT
        if QUANT:
            if BITS == 3:
                codes = _load_codes3(data_ptr + doff + r[:, None] * data_st, m[:, None], BLOCK_N, BLOCK_D, D)
            else:
                PB: tl.constexpr = 8 // BITS
                NB: tl.constexpr = BLOCK_D // PB
                NB_REAL: tl.constexpr = (D * BITS + 7) // 8
                cb = tl.arange(0, NB)
                raw = tl.load(data_ptr + doff + r[:, None] * data_st + cb[None, :],
                              mask=m[:, None] & (cb[None, :] < NB_REAL), other=0)
                codes = _unpack(raw, BLOCK_N, BLOCK_D, BITS)
            pbh = b64 * tl.load(row + 7) + h64 * tl.load(row + 8)
            soff = (tl.load(row + 5) + pbh) * PAR_UNIT
            ooff = (tl.load(row + 6) + pbh) * PAR_UNIT
            if CHANNEL:  # keys: one parameter row per G tokens (blocks start on a group boundary)
                pidx = (r // G)[:, None] * par_st + d[None, :]
            else:  # values: one row per token, one parameter per G channels
                pidx = r[:, None] * par_st + (d // G)[None, :]
            pm = m[:, None] & dm
            sc = tl.load(par_ptr + soff + pidx, mask=pm, other=0.0).to(tl.float32)
            of = tl.load(par_ptr + ooff + pidx, mask=pm, other=0.0).to(tl.float32)
            val = codes * sc + of
        else:
            val = tl.load(data_ptr + doff + r[:, None] * data_st + d[None, :],
                          mask=m[:, None] & dm, other=0.0).to(tl.float32)
        x = tl.where(m[:, None], val, x)
        adv = hi <= tile_end  # the block ends inside this tile: the next one may start in it too
        cur = cur + adv.to(tl.int32)
        go = adv & (cur < nblk)
    if tile_end > split:
        fm = tmask & (t >= split)
        f = tl.load(fp_ptr + b64 * f_sb + h64 * f_sh + (t - split)[:, None] * f_st + d[None, :],
                    mask=fm[:, None] & dm, other=0.0).to(tl.float32)
        x = tl.where(fm[:, None], f, x)
    return x, cur


@triton.jit
def online_softmax(s, m_i, l_i):
    """One tile's scores ``s [QG_P2, BLOCK_N]`` (base 2, ``-inf`` where masked) into the running max ``m_i`` and
    sum ``l_i``: ``(m_new, p, alpha, l_new)``; the caller rescales its accumulator by ``alpha`` and adds
    ``p @ v``. A row with nothing seen yet keeps ``-inf`` / 0 (no NaN from ``-inf - -inf``)."""
    m_new = tl.maximum(m_i, tl.max(s, axis=1))
    m_use = tl.where(m_new == float("-inf"), 0.0, m_new)
    alpha = tl.exp2(m_i - m_use)
    p = tl.exp2(s - m_use[:, None])
    return m_new, p, alpha, l_i * alpha + tl.sum(p, axis=1)


@triton.jit
def store_partials(m_ptr, l_ptr, acc_ptr, program, qi, d, m_i, l_i, acc, QG_P2: tl.constexpr,
                   BLOCK_D: tl.constexpr):
    """Write a split's partial ``m``, ``l`` and unnormalised accumulator at rows ``program * QG_P2 + qi``, where
    :func:`decode_reduce_kernel` reads them (``program``: kv head row times the splits, plus the split)."""
    row = program.to(tl.int64) * QG_P2 + qi
    tl.store(m_ptr + row, m_i)
    tl.store(l_ptr + row, l_i)
    tl.store(acc_ptr + row[:, None] * BLOCK_D + d[None, :], acc)


@triton.jit
def decode_split_kernel(
    q_ptr, sq_b, sq_h,
    ksink_ptr, ksk_b, ksk_h, ksk_t, k_S,
    ktab_ptr, k_nblk, k_split, kdata_ptr, kdata_st, kpar_ptr, kpar_st,
    kf_ptr, skf_b, skf_h, skf_t,
    vsink_ptr, vsk_b, vsk_h, vsk_t, v_S,
    vtab_ptr, v_nblk, v_split, vdata_ptr, vdata_st, vpar_ptr, vpar_st,
    vf_ptr, svf_b, svf_h, svf_t,
    valid_ptr, sval_b,
    m_ptr, l_ptr, acc_ptr,
    qk_scale, T, origin, TOK_PER_SPLIT, NUM_SPLITS,
    HKV: tl.constexpr, QG: tl.constexpr, QG_P2: tl.constexpr, D: tl.constexpr, BLOCK_D: tl.constexpr,
    BLOCK_N: tl.constexpr,
    K_SINK: tl.constexpr, K_QUANT: tl.constexpr, K_BITS: tl.constexpr, K_G: tl.constexpr,
    K_DATA_UNIT: tl.constexpr, K_PAR_UNIT: tl.constexpr,
    V_SINK: tl.constexpr, V_QUANT: tl.constexpr, V_BITS: tl.constexpr, V_G: tl.constexpr,
    V_DATA_UNIT: tl.constexpr, V_PAR_UNIT: tl.constexpr,
    HAS_VALID: tl.constexpr, dot_t: tl.constexpr, PRECISION: tl.constexpr, SCAN: tl.constexpr,
):
    pid_bh = tl.program_id(0)
    pid_s = tl.program_id(1)
    b = pid_bh // HKV
    h = pid_bh % HKV
    b64 = b.to(tl.int64)
    h64 = h.to(tl.int64)

    qi = tl.arange(0, QG_P2)
    d = tl.arange(0, BLOCK_D)
    qmask = qi < QG
    dmask = d < D
    q = tl.load(q_ptr + b64 * sq_b + (h * QG + qi)[:, None] * sq_h + d[None, :],
                mask=qmask[:, None] & dmask[None, :], other=0.0).to(tl.float32)
    # fold softmax scale and log2(e) into q (scores are then in base 2)
    q = (q * qk_scale).to(dot_t)

    m_i = tl.full((QG_P2,), float("-inf"), dtype=tl.float32)
    l_i = tl.zeros((QG_P2,), dtype=tl.float32)
    acc = tl.zeros((QG_P2, BLOCK_D), dtype=tl.float32)

    start = pid_s * TOK_PER_SPLIT
    end = tl.minimum(start + TOK_PER_SPLIT, T)
    kcur = _first_block(ktab_ptr, k_nblk, origin, start, SCAN)
    vcur = _first_block(vtab_ptr, v_nblk, origin, start, SCAN)

    for n0 in range(start, end, BLOCK_N):
        t = n0 + tl.arange(0, BLOCK_N)
        tmask = t < end
        k, kcur = _side_tile(
            t, tmask, n0, kcur, d, dmask, b64, h64,
            ksink_ptr, ksk_b, ksk_h, ksk_t, k_S,
            ktab_ptr, k_nblk, origin, k_split, kdata_ptr, kdata_st, kpar_ptr, kpar_st,
            kf_ptr, skf_b, skf_h, skf_t,
            K_SINK, K_QUANT, K_BITS, K_G, True, K_DATA_UNIT, K_PAR_UNIT, BLOCK_N, BLOCK_D, D,
        )
        s = tl.dot(q, tl.trans(k.to(dot_t)), input_precision=PRECISION)  # [QG_P2, BLOCK_N], float32
        ok = tmask
        if HAS_VALID:
            vt = tl.load(valid_ptr + b64 * sval_b + t, mask=tmask, other=0)
            ok = ok & (vt != 0)
        s = tl.where(ok[None, :], s, float("-inf"))

        m_new, p, alpha, l_i = online_softmax(s, m_i, l_i)

        v, vcur = _side_tile(
            t, tmask, n0, vcur, d, dmask, b64, h64,
            vsink_ptr, vsk_b, vsk_h, vsk_t, v_S,
            vtab_ptr, v_nblk, origin, v_split, vdata_ptr, vdata_st, vpar_ptr, vpar_st,
            vf_ptr, svf_b, svf_h, svf_t,
            V_SINK, V_QUANT, V_BITS, V_G, False, V_DATA_UNIT, V_PAR_UNIT, BLOCK_N, BLOCK_D, D,
        )
        acc = acc * alpha[:, None] + tl.dot(p.to(dot_t), v.to(dot_t), input_precision=PRECISION)
        m_i = m_new

    store_partials(m_ptr, l_ptr, acc_ptr, pid_bh * NUM_SPLITS + pid_s, qi, d, m_i, l_i, acc, QG_P2, BLOCK_D)


@triton.jit
def decode_reduce_kernel(
    m_ptr, l_ptr, acc_ptr, out_ptr, so_b, so_h,
    NUM_SPLITS, HQ: tl.constexpr, QG: tl.constexpr, QG_P2: tl.constexpr, D: tl.constexpr,
    BLOCK_D: tl.constexpr, S_P2: tl.constexpr,
):
    """Merge the splits of one query head. Grid (B * HQ,)."""
    pid = tl.program_id(0)
    b = pid // HQ
    hq = pid % HQ
    hkv = hq // QG
    qi = hq % QG
    HKV: tl.constexpr = HQ // QG
    sp = tl.arange(0, S_P2)
    d = tl.arange(0, BLOCK_D)
    smask = sp < NUM_SPLITS
    row = ((b * HKV + hkv).to(tl.int64) * NUM_SPLITS + sp) * QG_P2 + qi
    m = tl.load(m_ptr + row, mask=smask, other=float("-inf"))
    l = tl.load(l_ptr + row, mask=smask, other=0.0)
    acc = tl.load(acc_ptr + row[:, None] * BLOCK_D + d[None, :], mask=smask[:, None], other=0.0)
    mx = tl.max(m, axis=0)
    mx = tl.where(mx == float("-inf"), 0.0, mx)
    w = tl.exp2(m - mx)
    lsum = tl.sum(l * w, axis=0)
    o = tl.sum(acc * w[:, None], axis=0)
    o = tl.where(lsum > 0.0, o / tl.where(lsum > 0.0, lsum, 1.0), 0.0)
    tl.store(out_ptr + b.to(tl.int64) * so_b + hq * so_h + d, o.to(out_ptr.dtype.element_ty), mask=d < D)
