"""Triton split-K decode attention over a packed KIVI cache (imported lazily: imports triton).

Token axis (length T) = quantized segment ++ full-precision tail, separately per side:
keys ``[0, TQK)`` packed, ``[TQK, T)`` from ``k_fp``; values ``[0, TQV)`` packed, ``[TQV, T)`` from ``v_fp``.

Pass 1 (grid ``(B * HKV, NUM_SPLITS)``): a program owns one kv head, its ``QG = HQ // HKV`` query heads
(padded to ``QG_P2 >= 16`` rows for ``tl.dot``) and one contiguous token range; it walks the range in
``BLOCK_N`` blocks, unpacks codes, dequantizes (``code * scale + offset`` in float32), and keeps an
online softmax (base 2). It writes partial ``m``, ``l`` and the unnormalised accumulator.
Pass 2 (grid ``(B * HQ,)``) merges the splits.
"""

from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def _unpack(bytes_, ROWS: tl.constexpr, BLOCK_D: tl.constexpr, BITS: tl.constexpr):
    """uint8 ``[ROWS, BLOCK_D // (8 // BITS)]`` -> float32 codes ``[ROWS, BLOCK_D]``."""
    PB: tl.constexpr = 8 // BITS
    b = bytes_.to(tl.int32)
    if PB == 1:
        return b.to(tl.float32)
    else:
        shifts = tl.arange(0, PB) * BITS
        c = (b[:, :, None] >> shifts[None, None, :]) & ((1 << BITS) - 1)
        return tl.reshape(c, (ROWS, BLOCK_D)).to(tl.float32)


@triton.jit
def decode_split_kernel(
    q_ptr, sq_b, sq_h,
    kp_ptr, skp_b, skp_h, skp_t,
    ks_ptr, ko_ptr, sks_b, sks_h, sks_g,
    kf_ptr, skf_b, skf_h, skf_t,
    vp_ptr, svp_b, svp_h, svp_t,
    vs_ptr, vo_ptr, svs_b, svs_h, svs_t,
    vf_ptr, svf_b, svf_h, svf_t,
    valid_ptr, sval_b,
    m_ptr, l_ptr, acc_ptr,
    qk_scale, T, TQK, TQV, TOK_PER_SPLIT, NUM_SPLITS,
    HKV: tl.constexpr, QG: tl.constexpr, QG_P2: tl.constexpr, D: tl.constexpr, BLOCK_D: tl.constexpr,
    BLOCK_N: tl.constexpr, K_BITS: tl.constexpr, V_BITS: tl.constexpr, K_G: tl.constexpr, V_G: tl.constexpr,
    HAS_VALID: tl.constexpr, dot_t: tl.constexpr, PRECISION: tl.constexpr,
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

    K_PB: tl.constexpr = 8 // K_BITS
    V_PB: tl.constexpr = 8 // V_BITS
    K_NB: tl.constexpr = BLOCK_D // K_PB
    V_NB: tl.constexpr = BLOCK_D // V_PB
    KNB_REAL: tl.constexpr = (D * K_BITS + 7) // 8
    VNB_REAL: tl.constexpr = (D * V_BITS + 7) // 8
    kb = tl.arange(0, K_NB)
    vb = tl.arange(0, V_NB)
    vgrp = d // V_G

    m_i = tl.full((QG_P2,), float("-inf"), dtype=tl.float32)
    l_i = tl.zeros((QG_P2,), dtype=tl.float32)
    acc = tl.zeros((QG_P2, BLOCK_D), dtype=tl.float32)

    start = pid_s * TOK_PER_SPLIT
    end = tl.minimum(start + TOK_PER_SPLIT, T)
    kp_base = kp_ptr + b64 * skp_b + h64 * skp_h
    ks_base = b64 * sks_b + h64 * sks_h
    kf_base = kf_ptr + b64 * skf_b + h64 * skf_h
    vp_base = vp_ptr + b64 * svp_b + h64 * svp_h
    vs_base = b64 * svs_b + h64 * svs_h
    vf_base = vf_ptr + b64 * svf_b + h64 * svf_h

    for n0 in range(start, end, BLOCK_N):
        t = n0 + tl.arange(0, BLOCK_N)
        tmask = t < end
        # ---- keys: packed part (t < TQK) and full-precision tail (t >= TQK)
        kq = tmask & (t < TQK)
        kbytes = tl.load(kp_base + t[:, None] * skp_t + kb[None, :],
                         mask=kq[:, None] & (kb[None, :] < KNB_REAL), other=0)
        kcodes = _unpack(kbytes, BLOCK_N, BLOCK_D, K_BITS)
        kpar = ks_base + (t // K_G)[:, None] * sks_g + d[None, :]
        kqm = kq[:, None] & dmask[None, :]
        k_s = tl.load(ks_ptr + kpar, mask=kqm, other=0.0).to(tl.float32)
        k_o = tl.load(ko_ptr + kpar, mask=kqm, other=0.0).to(tl.float32)
        kf = tmask & (t >= TQK)
        k_f = tl.load(kf_base + (t - TQK)[:, None] * skf_t + d[None, :],
                      mask=kf[:, None] & dmask[None, :], other=0.0).to(tl.float32)
        k = tl.where(kq[:, None], kcodes * k_s + k_o, k_f)

        s = tl.dot(q, tl.trans(k.to(dot_t)), input_precision=PRECISION)  # [QG_P2, BLOCK_N], float32
        ok = tmask
        if HAS_VALID:
            vt = tl.load(valid_ptr + b64 * sval_b + t, mask=tmask, other=0)
            ok = ok & (vt != 0)
        s = tl.where(ok[None, :], s, float("-inf"))

        m_new = tl.maximum(m_i, tl.max(s, axis=1))
        m_use = tl.where(m_new == float("-inf"), 0.0, m_new)
        alpha = tl.exp2(m_i - m_use)
        p = tl.exp2(s - m_use[:, None])
        l_i = l_i * alpha + tl.sum(p, axis=1)

        # ---- values: packed part (t < TQV) and tail (t >= TQV)
        vq = tmask & (t < TQV)
        vbytes = tl.load(vp_base + t[:, None] * svp_t + vb[None, :],
                         mask=vq[:, None] & (vb[None, :] < VNB_REAL), other=0)
        vcodes = _unpack(vbytes, BLOCK_N, BLOCK_D, V_BITS)
        vpar = vs_base + t[:, None] * svs_t + vgrp[None, :]
        vqm = vq[:, None] & dmask[None, :]
        v_s = tl.load(vs_ptr + vpar, mask=vqm, other=0.0).to(tl.float32)
        v_o = tl.load(vo_ptr + vpar, mask=vqm, other=0.0).to(tl.float32)
        vf = tmask & (t >= TQV)
        v_f = tl.load(vf_base + (t - TQV)[:, None] * svf_t + d[None, :],
                      mask=vf[:, None] & dmask[None, :], other=0.0).to(tl.float32)
        v = tl.where(vq[:, None], vcodes * v_s + v_o, v_f)

        acc = acc * alpha[:, None] + tl.dot(p.to(dot_t), v.to(dot_t), input_precision=PRECISION)
        m_i = m_new

    row = (pid_bh * NUM_SPLITS + pid_s).to(tl.int64) * QG_P2 + qi
    tl.store(m_ptr + row, m_i)
    tl.store(l_ptr + row, l_i)
    tl.store(acc_ptr + row[:, None] * BLOCK_D + d[None, :], acc)


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
