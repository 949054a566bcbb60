"""Triton split-K decode attention over KIVI pages in a block pool (imported lazily: imports triton).

The GPU form of :func:`kivi.attention.fused_cpu.paged.paged_decode_attention`, with the same inputs (its module
docstring has them): one query token for each of ``N`` requests, each request's quantized tokens in pages found
through a block table, its sink and window rows read in place from a rows pool through a per-request slot table
(the ring), the step's new token last. Pass 1 (grid ``(N * HKV, NUM_SPLITS)``): a program owns one request, one kv
head with its ``QG = HQ // HKV`` query heads (padded to ``QG_P2 >= 16`` rows for ``tl.dot``) and one token range
of that request; it walks the range in ``BLOCK_N`` tiles, each token read from where it lives:

* ``t < sink``: the rows pool, row id ``slots[n, t]``;
* ``sink <= t < sink + stored``: store position ``u = t - sink`` in block ``block_table[n, u // P]``, row
  ``u % P``; its packed row read by the single-sequence kernel's readers (whole bytes unpacked, 3-bit runs as
  24-bit integers); keys' parameters one row per ``G`` tokens, values'
  one per token and ``G`` channels; ``code * scale + offset`` (or ``(code - qmax) * scale`` without offsets);
* ``sink + stored <= t < T - 1``: the rows pool, row id ``slots[n, c]``, ``c`` the slot of
  :func:`kivi.paged.ring.ring_slot` (``t`` below ``w0``, else ``w0 + t % ring``);
* ``t = T - 1``: ``new[n]``;

and updates an online softmax (base 2). Pass 2 is :func:`kivi.kernels._attention_kernels.decode_reduce_kernel`.
"""

from __future__ import annotations

import triton
import triton.language as tl

from ._attention_kernels import _load_codes3, _unpack, online_softmax, store_partials


@triton.jit
def _codes(row_ptrs, rmask, BITS: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr, D: tl.constexpr):
    """float32 codes ``[BLOCK_N, BLOCK_D]`` of the packed rows at ``row_ptrs [BLOCK_N, 1]`` (``rmask``: the rows to
    read): whole bytes unpacked (1/2/4/8 bits) or each run's 24-bit integer split (3 bits), the single-sequence
    kernel's readers, so a row's bytes load as vectors."""
    if BITS == 3:
        return _load_codes3(row_ptrs, rmask[:, None], BLOCK_N, BLOCK_D, D)
    else:
        PB: tl.constexpr = 8 // BITS
        NB: tl.constexpr = BLOCK_D // PB
        NB_REAL: tl.constexpr = (D * BITS + 7) // 8
        cb = tl.arange(0, NB)
        raw = tl.load(row_ptrs + cb[None, :], mask=rmask[:, None] & (cb[None, :] < NB_REAL), other=0)
        return _unpack(raw, BLOCK_N, BLOCK_D, BITS)


@triton.jit
def _side_tile(
    t, tmask, d, dmask, n64, h64, sink, stored, total,
    pool_ptr, par_ptr, bt_ptr, bt_sn, BLOCK_BYTES: tl.constexpr,
    rows_ptr, r_sb, r_sr, r_sh, rows_per_block, slots_ptr, sl_sn, w0, ring,
    new_ptr, nw_sn, nw_sh,
    CODES: tl.constexpr, SCALE: tl.constexpr, OFFSET: tl.constexpr, HAS_OFFSET: tl.constexpr,
    ROW_BYTES: tl.constexpr, BITS: tl.constexpr, G: tl.constexpr, CHANNEL: tl.constexpr,
    P: tl.constexpr, D: tl.constexpr, PAR_ITEM: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr,
):
    """float32 ``[BLOCK_N, BLOCK_D]`` of one side's tokens ``t`` of request ``n``, kv head ``h``."""
    dm = dmask[None, :]
    # full-precision rows of the pool: column = slot = kivi.paged.ring.ring_slot(t, ring, w0) (position t below
    # w0, else w0 + t % ring), the one ring rule
    is_sink = tmask & (t < sink)
    is_win = tmask & (t >= sink + stored) & (t < total - 1)
    col = tl.where(t < w0, t, w0 + t % ring)
    fp_rows = is_sink | is_win
    rid = tl.load(slots_ptr + n64 * sl_sn + col, mask=fp_rows, other=0).to(tl.int64)
    rptr = rows_ptr + (rid // rows_per_block) * r_sb + (rid % rows_per_block) * r_sr + h64 * r_sh
    x = tl.load(rptr[:, None] + d[None, :], mask=fp_rows[:, None] & dm, other=0.0).to(tl.float32)
    # the step's new token, the window's last row
    is_new = tmask & (t == total - 1)
    nv = tl.load(new_ptr + n64 * nw_sn + h64 * nw_sh + d[None, :] + 0 * t[:, None], mask=is_new[:, None] & dm,
                 other=0.0).to(tl.float32)
    x = tl.where(is_new[:, None], nv, x)
    # quantized tokens in the pages
    is_st = tmask & (t >= sink) & (t < sink + stored)
    u = tl.where(is_st, t - sink, 0)
    blk = tl.load(bt_ptr + n64 * bt_sn + u // P, mask=is_st, other=0).to(tl.int64)
    row = (u % P).to(tl.int64)
    base = blk * BLOCK_BYTES  # a multiple of 128 (PageLayout / KiviGeometry): rows load as vectors
    m2 = is_st[:, None] & dm
    codes = _codes(pool_ptr + (base + CODES + (h64 * P + row) * ROW_BYTES)[:, None], is_st, BITS, BLOCK_N, BLOCK_D, D)
    if CHANNEL:  # keys: a parameter row per G tokens, one per channel
        pidx = (h64 * (P // G) + row // G)[:, None] * D + d[None, :]
    else:  # values: a parameter row per token, one per G channels
        pidx = (h64 * P + row)[:, None] * (D // G) + (d // G)[None, :]
    pbase = (base // PAR_ITEM)[:, None]
    sc = tl.load(par_ptr + pbase + SCALE // PAR_ITEM + pidx, mask=m2, other=0.0).to(tl.float32)
    if HAS_OFFSET:
        of = tl.load(par_ptr + pbase + OFFSET // PAR_ITEM + pidx, mask=m2, other=0.0).to(tl.float32)
        val = codes * sc + of
    else:
        QMAX: tl.constexpr = (1 << (BITS - 1)) - 1
        val = (codes - QMAX) * sc
    return tl.where(is_st[:, None], val, x)


@triton.jit
def paged_split_kernel(
    q_ptr, sq_n, sq_h,
    pool_ptr, par_ptr, bt_ptr, bt_sn, counts_ptr,
    krows_ptr, kr_sb, kr_sr, kr_sh, k_rpb, kslots_ptr, ksl_sn, knew_ptr, kn_sn, kn_sh,
    vrows_ptr, vr_sb, vr_sr, vr_sh, v_rpb, vslots_ptr, vsl_sn, vnew_ptr, vn_sn, vn_sh,
    w0, ring,
    m_ptr, l_ptr, acc_ptr,
    qk_scale, TOK_PER_SPLIT, NUM_SPLITS,
    HKV: tl.constexpr, QG: tl.constexpr, QG_P2: tl.constexpr, D: tl.constexpr, BLOCK_D: tl.constexpr,
    BLOCK_N: tl.constexpr, P: tl.constexpr, G: tl.constexpr, PAR_ITEM: tl.constexpr, HAS_OFFSET: tl.constexpr,
    BLOCK_BYTES: tl.constexpr,
    K_CODES: tl.constexpr, K_SCALE: tl.constexpr, K_OFFSET: tl.constexpr, K_ROW_BYTES: tl.constexpr,
    K_BITS: tl.constexpr,
    V_CODES: tl.constexpr, V_SCALE: tl.constexpr, V_OFFSET: tl.constexpr, V_ROW_BYTES: tl.constexpr,
    V_BITS: tl.constexpr,
    dot_t: tl.constexpr, PRECISION: tl.constexpr,
):
    pid_nh = tl.program_id(0)
    pid_s = tl.program_id(1)
    n64 = (pid_nh // HKV).to(tl.int64)
    h64 = (pid_nh % HKV).to(tl.int64)

    cbase = counts_ptr + n64 * 6
    k_sink = tl.load(cbase + 0)
    k_stored = tl.load(cbase + 1)
    total = k_sink + k_stored + tl.load(cbase + 2)
    v_sink = tl.load(cbase + 3)
    v_stored = tl.load(cbase + 4)

    qi = tl.arange(0, QG_P2)
    d = tl.arange(0, BLOCK_D)
    qmask = qi < QG
    dmask = d < D
    q = tl.load(q_ptr + n64 * sq_n + (h64 * QG + qi)[:, None] * sq_h + d[None, :],
                mask=qmask[:, None] & dmask[None, :], other=0.0).to(tl.float32)
    q = (q * qk_scale).to(dot_t)  # softmax scale and log2(e) folded in: scores in base 2

    m_i = tl.full((QG_P2,), float("-inf"), dtype=tl.float32)
    l_i = tl.zeros((QG_P2,), dtype=tl.float32)
    acc = tl.zeros((QG_P2, BLOCK_D), dtype=tl.float32)

    start = pid_s * TOK_PER_SPLIT
    end = tl.minimum(start + TOK_PER_SPLIT, total)
    for n0 in range(start, end, BLOCK_N):
        t = n0 + tl.arange(0, BLOCK_N)
        tmask = t < end
        k = _side_tile(t, tmask, d, dmask, n64, h64, k_sink, k_stored, total,
                       pool_ptr, par_ptr, bt_ptr, bt_sn, BLOCK_BYTES,
                       krows_ptr, kr_sb, kr_sr, kr_sh, k_rpb, kslots_ptr, ksl_sn, w0, ring,
                       knew_ptr, kn_sn, kn_sh,
                       K_CODES, K_SCALE, K_OFFSET, HAS_OFFSET, K_ROW_BYTES, K_BITS, G, True, P, D, PAR_ITEM,
                       BLOCK_N, BLOCK_D)
        s = tl.dot(q, tl.trans(k.to(dot_t)), input_precision=PRECISION)  # [QG_P2, BLOCK_N], float32
        s = tl.where(tmask[None, :], s, float("-inf"))
        m_new, p, alpha, l_i = online_softmax(s, m_i, l_i)
        v = _side_tile(t, tmask, d, dmask, n64, h64, v_sink, v_stored, total,
                       pool_ptr, par_ptr, bt_ptr, bt_sn, BLOCK_BYTES,
                       vrows_ptr, vr_sb, vr_sr, vr_sh, v_rpb, vslots_ptr, vsl_sn, w0, ring,
                       vnew_ptr, vn_sn, vn_sh,
                       V_CODES, V_SCALE, V_OFFSET, HAS_OFFSET, V_ROW_BYTES, V_BITS, G, False, P, D, PAR_ITEM,
                       BLOCK_N, BLOCK_D)
        acc = acc * alpha[:, None] + tl.dot(p.to(dot_t), v.to(dot_t), input_precision=PRECISION)
        m_i = m_new

    store_partials(m_ptr, l_ptr, acc_ptr, pid_nh * NUM_SPLITS + pid_s, qi, d, m_i, l_i, acc, QG_P2, BLOCK_D)
