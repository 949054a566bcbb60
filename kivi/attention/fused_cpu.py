"""Fused CPU decode attention (numba): one query token per sequence, straight from the packed codes.

Dispatch rule of the ``"cpu"`` backend (:func:`kivi.attention.interface.run_backend`): the fused
kernel runs when numba is importable (optional dependency, extra ``kivi[cpu]``), the query length is
1 and :func:`fused_decode_supported` accepts the views and mask — quantized sides with 1, 2, 4 or
8 bits (asymmetric, symmetric and with error compensation), full-precision sides, any GQA ratio,
any batch, a mask whose last row is a per-kv-position validity (boolean, or additive 0 / "min").
Everything else — prefill and chunked queries (n > 1), 3-bit codes, value groups
whose channel count is not a multiple of 4 (``group_size % 4 != 0``: values are read 4 channels at a time), per-head masks, additive masks with other values — goes through :func:`kivi.attention.blocked.blocked_attention`. This is a
documented dispatch, not a silent fallback: :func:`fused_decode_available` says whether numba is
there, :func:`fused_decode_supported` whether a given call qualifies.

Algorithm: one kernel call per layer and step. The host describes each side (keys, values) as a
table of *pieces* (:func:`_side_table`: the store blocks, quantized or not, and the fp tail; kv
positions, addresses and strides — no copies), so a call covers the whole view whatever the number
of blocks. A block's columns are memoised in its store (``BlockStore.derived``, dropped whenever a
block is added, dropped or replaced) while they point at the block's own float32 tensors, so a
decode step only adds the fp tail's row. Per ``(batch b, kv head h)`` and its ``g = Hq / Hkv`` query heads:

* split-K: ``prange`` runs over ``(b, h, chunk of kv positions)`` tasks (both cores work even at
  batch 1 with few kv heads); every task keeps its own ``(m, l, acc)`` online-softmax state, walks
  its chunk in steps of :data:`SUB` tokens (scores for the step from the key pieces it overlaps,
  softmax update, then the value pieces it overlaps) and a final merge combines the tasks with
  log-sum-exp weights;
* codes are unpacked *token-major*: the rows of a block are transposed to 32-bit words
  (:func:`_transpose_words`, ``tw[word, token]``) so that every unpack loop runs over tokens —
  contiguous, vectorised in 32-bit lanes (the :func:`_code` intrinsic: numba would widen the
  integer arithmetic to 64 bits, and AVX2 has no vector int64 -> float conversion) — and each
  pass over a word serves :data:`HC` = 4 query heads while 3 or more remain, then single heads
  (GQA without repeating the cache; a pass with 3 real heads carries a zero row);
* keys (per-channel groups of ``G`` tokens, ``x = code * scale + base``, ``base`` = offset,
  offset + compensation, or ``-qmax * scale`` when symmetric): per group,
  ``q'_{i,d} = q_{i,d} * scale_d * scaling`` and ``c_i = scaling * sum_d q_{i,d} * base_d``; then
  ``s_i(t) = c_i + sum_d q'_{i,d} * code_d(t)``, 4 channels x 4 heads per pass
  (:func:`_key_pass4`, :func:`_key_pass1`), vectorised over the group's tokens;
* values (per-token groups of ``G`` channels, ``G % 4 == 0``): ``w_i(t) = p_i(t) * scale_{t,grp}``
  per token and group, then ``acc_{i,d} += sum_t w_i(t) * code_d(t)`` — a reduction over the
  block's tokens, 2 channels x 4 heads per pass (8 accumulators in registers; :func:`_value_pass4`,
  :func:`_value_pass1`); the offsets
  are summed separately per group (``sum_t p_i * base_{t,grp}``) and added when the task writes
  its result;
* masked positions get the score ``finfo(float32).min`` (exactly like the reference: a fully
  masked row attends uniformly instead of producing NaN).

Computation is in float32 (``q``, and scales / offsets stored in another dtype, are converted on
every call — a cost that grows with the context for bf16/fp16 caches; codes stay uint8). The
softmax uses a vectorisable expf (:func:`_exp_into`, relative error ~1e-7).
Threads: two compiled entry points with the same tasks, ``prange`` on numba's pool and a serial
one on the calling thread; :func:`fused_decode_attention` picks the serial one below
:data:`SERIAL_BELOW` ``batch x kv heads x kv positions`` (measured) or as told by ``threaded=``.
``NUMBA_NUM_THREADS`` / ``numba.set_num_threads`` size the pool and ``NUMBA_THREADING_LAYER``
picks it (numba's default order: tbb, omp, workqueue). Measured on the 2-core development machine
with torch matmuls between calls (as in a decoder): the ``omp`` pool 1.15-1.9x faster than
serial from 3K units, the ``workqueue`` pool slower than serial at every size (0.68-0.94x). With
other processes busy on the cores, ``omp``'s spinning threads can lose; set the variable then.
Compile: ``@njit(fastmath=True, cache=True)`` (the
threaded entry with ``parallel=True``) with one explicit signature, so the first call of a
process either loads the on-disk cache or compiles once (~15 s for both entries).
"""

from __future__ import annotations

import numpy as np
import torch

from ..cache.view import AttentionView
from ..quant.fused_cpu import numba_available
from ..quant.fused_cpu import warmup as _warmup_quantizer
from ..quant.kv import PackedKV, compensation_values
from .reference import view_geometry

SUPPORTED_BITS = (1, 2, 4, 8)
NEG = float(torch.finfo(torch.float32).min)

_KERNEL = None


def fused_decode_available() -> bool:
    """True when numba can be imported (the fused decode kernel can run)."""
    return numba_available()


# --------------------------------------------------------------------------------------------- kernel
# The kernel is written as plain module-level Python and compiled lazily by :func:`_kernel`
# (``import kivi`` never imports numba). Module-level functions keep numba's on-disk cache valid
# across processes (closures would not be found again). ``prange``, ``carray`` and the pointer
# casts ``_u8p`` / ``_f32p`` are bound to the numba objects before compilation.
prange = range
carray = None
_u8p = None
_u32p = None
_f32p = None
_bits_f32 = None
_code = None
_NEG32 = np.float32(NEG)
_ALL_VALID = np.ones((1, 1), dtype=np.bool_)  # the kernel's mask argument when there is no mask
_F0 = np.float32(0.0)

#: Tokens per inner step of a task: the scores of one step (``g x SUB`` floats) stay in L1.
SUB = 256

# Columns of a piece descriptor (one int64 row per piece of a side, see :func:`_side_table`).
# Strides are in elements of the array they describe; addresses are ``data_ptr()`` values.
_LO, _HI, _QUANT = 0, 1, 2  # kv positions [lo, hi) (relative to the view start); quantized?
_DATA, _DS0, _DS1, _DS2 = 3, 4, 5, 6  # codes (uint8) or full-precision data (float32): b, h, t strides
_SC, _SS0, _SS1, _SS2 = 7, 8, 9, 10  # float32 scale (quantized pieces)
_BS, _BS0, _BS1, _BS2 = 11, 12, 13, 14  # float32 base (quantized pieces)
NCOL = 15


def _u8_rows(addr, off, n):
    """The ``n`` bytes at ``addr + off`` as a 1-D uint8 array (no copy)."""
    return carray(_u8p(addr + off), (n,))


def _u32_rows(addr, off, n):
    """The ``n`` uint32 at ``addr + 4 * off`` as a 1-D array (no copy; ``addr`` 4-byte aligned)."""
    return carray(_u32p(addr + 4 * off), (n,))


def _f32_rows(addr, off, n):
    """The ``n`` float32 at ``addr + 4 * off`` as a 1-D array (no copy)."""
    return carray(_f32p(addr + 4 * off), (n,))


def _exp_into(si, n, mx):
    """``si[t] = exp(si[t] - mx)`` for ``t < n`` (all arguments ``<= 0``); returns their sum.

    A branch-free expf that LLVM vectorises (numba's ``np.exp`` is a scalar libm call per element,
    ~15% of a 32K decode): ``2**k * e**r`` with ``k = round(x / ln 2)``, ``|r| <= ln(2) / 2``, the
    Cephes ``expf`` polynomial for ``e**r`` (relative error ~1e-7) and ``2**k`` built from its
    exponent bits. ``x < -87`` (masked positions, ``finfo.min - mx``) gives exactly 0, like libm.
    """
    tot = _F0
    for t in range(n):
        x = max(si[t] - mx, np.float32(-87.0))
        k = np.floor(x * np.float32(1.44269504) + np.float32(0.5))
        r = x - k * np.float32(0.693359375) + k * np.float32(2.12194440e-4)
        p = np.float32(1.9875691500e-4)
        p = p * r + np.float32(1.3981999507e-3)
        p = p * r + np.float32(8.3334519073e-3)
        p = p * r + np.float32(4.1665795894e-2)
        p = p * r + np.float32(1.6666665459e-1)
        p = p * r + np.float32(5.0000001201e-1)
        p = p * r * r + r + np.float32(1.0)
        e = p * _bits_f32(np.int32((k + np.float32(127.0)) * np.float32(8388608.0)))
        e = e if x > np.float32(-87.0) else _F0
        si[t] = e
        tot += e
    return tot


#: Query heads handled per pass over a block's codes (register blocking). Passes take 4 heads while
#: 3 or more remain (a GQA ratio of 3 runs one 4-head pass with a zero row: a quarter of its
#: multiply-adds wasted, still cheaper than unpacking twice), then single heads (MHA, ratio 2).
HC = 4


def _transpose_words(codes, r0, n, ds2, nbytes, nw, tw):
    """Rows ``r0 .. r0+n`` of a piece's codes into ``tw[w, t]`` = little-endian uint32 of row bytes ``[4w, 4w+4)``.

    Transposed so the unpack loops run over *tokens* (contiguous, vectorised); bytes past
    ``nbytes`` read as 0. Channel ``c`` of word ``w`` (``32 // bits`` per word) sits at bits
    ``[bits * c, bits * (c + 1))`` — the packing is a little-endian bit stream along the channels.
    Rows whose bytes are 4-aligned are read as words; otherwise assembled from bytes.
    """
    addr = codes.ctypes.data
    if nbytes % 4 == 0 and ds2 % 4 == 0 and addr % 4 == 0:
        words = _u32_rows(addr, 0, (codes.shape[0] + 3) // 4)
        ws2 = ds2 // 4
        for t in range(n):
            base = (r0 + t) * ws2
            for w in range(nw):
                tw[w, t] = words[base + w]
        return
    for t in range(n):
        base = (r0 + t) * ds2
        for w in range(nw):
            j = 4 * w
            x = np.uint32(0)
            for u in range(min(4, nbytes - j)):
                x |= np.uint32(codes[base + j + u]) << np.uint32(8 * u)
            tw[w, t] = x


def _pass_width(g, i0):
    """Heads of the pass starting at head ``i0``: :data:`HC` while 3 or more remain, else 1."""
    return HC if g - i0 >= 3 else 1


def _padded_heads(g):
    """Rows the head passes touch (the last 4-head pass may run past ``g`` on zero rows)."""
    i0 = 0
    while i0 < g:
        i0 += _pass_width(g, i0)
    return i0


def _key_pass4(tw, nw, cpw, bits, D, qp, i0, s, o, n):
    """``s[i0 + j, o + t] += sum_c qp[i0 + j, c] * code_c(t)`` for 4 heads ``j``, 4 channels at a time."""
    mask = np.uint32((1 << bits) - 1)
    b1, b2, b3 = np.uint32(bits), np.uint32(2 * bits), np.uint32(3 * bits)
    s0, s1, s2, s3 = s[i0, o : o + n], s[i0 + 1, o : o + n], s[i0 + 2, o : o + n], s[i0 + 3, o : o + n]
    for w in range(nw):
        tww = tw[w]
        for m in range(cpw // 4):
            c = w * cpw + 4 * m
            if c >= D:
                break
            a0, a1, a2, a3 = qp[i0, c], qp[i0, c + 1], qp[i0, c + 2], qp[i0, c + 3]
            e0, e1, e2, e3 = qp[i0 + 1, c], qp[i0 + 1, c + 1], qp[i0 + 1, c + 2], qp[i0 + 1, c + 3]
            f0, f1, f2, f3 = qp[i0 + 2, c], qp[i0 + 2, c + 1], qp[i0 + 2, c + 2], qp[i0 + 2, c + 3]
            h0, h1, h2, h3 = qp[i0 + 3, c], qp[i0 + 3, c + 1], qp[i0 + 3, c + 2], qp[i0 + 3, c + 3]
            sh0 = np.uint32(4 * bits * m)
            sh1, sh2, sh3 = sh0 + b1, sh0 + b2, sh0 + b3
            for t in range(n):
                x = tww[t]
                x0 = _code(x, sh0, mask)
                x1 = _code(x, sh1, mask)
                x2 = _code(x, sh2, mask)
                x3 = _code(x, sh3, mask)
                s0[t] += a0 * x0 + a1 * x1 + a2 * x2 + a3 * x3
                s1[t] += e0 * x0 + e1 * x1 + e2 * x2 + e3 * x3
                s2[t] += f0 * x0 + f1 * x1 + f2 * x2 + f3 * x3
                s3[t] += h0 * x0 + h1 * x1 + h2 * x2 + h3 * x3


def _key_pass1(tw, nw, cpw, bits, D, qp, i0, s, o, n):
    """:func:`_key_pass4` for the single head ``i0``."""
    mask = np.uint32((1 << bits) - 1)
    b1, b2, b3 = np.uint32(bits), np.uint32(2 * bits), np.uint32(3 * bits)
    s0 = s[i0, o : o + n]
    for w in range(nw):
        tww = tw[w]
        for m in range(cpw // 4):
            c = w * cpw + 4 * m
            if c >= D:
                break
            a0, a1, a2, a3 = qp[i0, c], qp[i0, c + 1], qp[i0, c + 2], qp[i0, c + 3]
            sh0 = np.uint32(4 * bits * m)
            sh1, sh2, sh3 = sh0 + b1, sh0 + b2, sh0 + b3
            for t in range(n):
                x = tww[t]
                s0[t] += (a0 * _code(x, sh0, mask) + a1 * _code(x, sh1, mask)
                          + a2 * _code(x, sh2, mask) + a3 * _code(x, sh3, mask))


def _value_pass4(tw, nw, cpw, bits, Dv, G, wt, i0, accq, n):
    """``accq[i0 + j, c] += sum_t wt[i0 + j, grp(c), t] * code_c(t)`` for 4 heads, 2 channels at a time
    (8 accumulators stay in registers)."""
    mask = np.uint32((1 << bits) - 1)
    b1 = np.uint32(bits)
    a0, a1, a2, a3 = accq[i0], accq[i0 + 1], accq[i0 + 2], accq[i0 + 3]
    for w in range(nw):
        tww = tw[w]
        for m in range(cpw // 2):
            c = w * cpw + 2 * m
            if c >= Dv:
                break
            gg = c // G
            w0, w1, w2, w3 = wt[i0, gg, :n], wt[i0 + 1, gg, :n], wt[i0 + 2, gg, :n], wt[i0 + 3, gg, :n]
            sh0 = np.uint32(2 * bits * m)
            sh1 = sh0 + b1
            r00 = r01 = r10 = r11 = r20 = r21 = r30 = r31 = _F0
            for t in range(n):
                x = tww[t]
                x0 = _code(x, sh0, mask)
                x1 = _code(x, sh1, mask)
                y = w0[t]
                r00 += y * x0
                r01 += y * x1
                y = w1[t]
                r10 += y * x0
                r11 += y * x1
                y = w2[t]
                r20 += y * x0
                r21 += y * x1
                y = w3[t]
                r30 += y * x0
                r31 += y * x1
            a0[c] += r00
            a0[c + 1] += r01
            a1[c] += r10
            a1[c + 1] += r11
            a2[c] += r20
            a2[c + 1] += r21
            a3[c] += r30
            a3[c + 1] += r31


def _value_pass1(tw, nw, cpw, bits, Dv, G, wt, i0, accq, n):
    """:func:`_value_pass4` for the single head ``i0``, 4 channels at a time."""
    mask = np.uint32((1 << bits) - 1)
    b1, b2, b3 = np.uint32(bits), np.uint32(2 * bits), np.uint32(3 * bits)
    a0 = accq[i0]
    for w in range(nw):
        tww = tw[w]
        for m in range(cpw // 4):
            c = w * cpw + 4 * m
            if c >= Dv:
                break
            w0 = wt[i0, c // G, :n]
            sh0 = np.uint32(4 * bits * m)
            sh1, sh2, sh3 = sh0 + b1, sh0 + b2, sh0 + b3
            r0 = r1 = r2 = r3 = _F0
            for t in range(n):
                x = tww[t]
                y = w0[t]
                r0 += y * _code(x, sh0, mask)
                r1 += y * _code(x, sh1, mask)
                r2 += y * _code(x, sh2, mask)
                r3 += y * _code(x, sh3, mask)
            a0[c] += r0
            a0[c + 1] += r1
            a0[c + 2] += r2
            a0[c + 3] += r3


def _key_scores(d, p, b, h, a, e, qsc, bits, G, c0, s, qp, tw):
    """Scores ``s[i, t - c0]`` of the ``g`` query heads for kv positions ``[a, e)`` of key piece ``p``.

    Quantized pieces (per-channel groups of ``G`` tokens, ``x = code * scale + base``), per group:
    ``qp_i = qsc_i * scale`` and the scores start at ``qsc_i . base``; the group's codes are transposed to
    words (:func:`_transpose_words`) and each head pass (:func:`_key_pass4` / :func:`_key_pass1`)
    adds ``sum_c qp_{i,c} * code_c(t)`` to the scores, 4 channels at a time.
    """
    g, D = qsc.shape
    lo = d[p, _LO]
    r0, r1 = a - lo, e - lo  # rows of the piece
    boff = b * d[p, _DS0] + h * d[p, _DS1]
    ds2 = d[p, _DS2]
    if d[p, _QUANT] == 0:
        x = _f32_rows(d[p, _DATA], boff, (r1 - 1) * ds2 + D)
        for r in range(r0, r1):
            xr = x[r * ds2 : r * ds2 + D]
            for i in range(g):
                qi = qsc[i]
                acc = _F0
                for k in range(D):
                    acc += qi[k] * xr[k]
                s[i, r + lo - c0] = acc
        return
    cpw = 32 // bits  # channels per word
    nbytes = (D * bits + 7) // 8
    nw = (nbytes + 3) // 4
    codes = _u8_rows(d[p, _DATA], boff, (r1 - 1) * ds2 + nbytes)
    ss2, bs2 = d[p, _SS2], d[p, _BS2]
    ngrp = (r1 - 1) // G + 1
    sc = _f32_rows(d[p, _SC], b * d[p, _SS0] + h * d[p, _SS1], (ngrp - 1) * ss2 + D)
    bs = _f32_rows(d[p, _BS], b * d[p, _BS0] + h * d[p, _BS1], (ngrp - 1) * bs2 + D)
    r = r0
    while r < r1:
        grp = r // G
        rend = min(r1, (grp + 1) * G)
        n = rend - r
        o = r + lo - c0
        scr = sc[grp * ss2 : grp * ss2 + D]
        bsr = bs[grp * bs2 : grp * bs2 + D]
        for i in range(g):
            qi = qsc[i]
            cc = _F0
            for k in range(D):
                cc += qi[k] * bsr[k]
                qp[i, k] = qi[k] * scr[k]
            si = s[i]
            for t in range(n):
                si[o + t] = cc
        _transpose_words(codes, r, n, ds2, nbytes, nw, tw)
        i0 = 0
        while i0 < g:
            w = _pass_width(g, i0)
            if w == HC:
                _key_pass4(tw, nw, cpw, bits, D, qp, i0, s, o, n)
            else:
                _key_pass1(tw, nw, cpw, bits, D, qp, i0, s, o, n)
            i0 += w
        r = rend


def _value_accumulate(d, p, b, h, a, e, bits, G, c0, pr, accq, accf, accb, wt, sbt, tw):
    """Add ``sum_t p[i, t] v_t`` over kv positions ``[a, e)`` of value piece ``p`` to the accumulators.

    Quantized pieces (per-token groups of ``G`` channels, ``v = code * scale + base``): the rows'
    codes are transposed to words, ``wt[i, grp, t] = p_i(t) * scale_{t,grp}``, and each head pass
    (:func:`_value_pass4` / :func:`_value_pass1`) reduces ``sum_t wt * code`` over the tokens into
    ``accq`` (natural channel order); the bases go to ``accb[i, group]`` (``sum_t p_i * base``).
    Full-precision pieces go to ``accf``.
    """
    g = accf.shape[0]
    Dv = accf.shape[1]
    lo = d[p, _LO]
    r0, r1 = a - lo, e - lo
    boff = b * d[p, _DS0] + h * d[p, _DS1]
    ds2 = d[p, _DS2]
    if d[p, _QUANT] == 0:
        x = _f32_rows(d[p, _DATA], boff, (r1 - 1) * ds2 + Dv)
        for r in range(r0, r1):
            xr = x[r * ds2 : r * ds2 + Dv]
            for i in range(g):
                pe = pr[i, r + lo - c0]
                ai = accf[i]
                for k in range(Dv):
                    ai[k] += pe * xr[k]
        return
    cpw = 32 // bits
    nbytes = (Dv * bits) // 8  # G % 4 == 0 and G | Dv: whole bytes
    nw = (nbytes + 3) // 4
    nvg = Dv // G
    n = r1 - r0
    o = r0 + lo - c0
    codes = _u8_rows(d[p, _DATA], boff, (r1 - 1) * ds2 + nbytes)
    ss2, bs2 = d[p, _SS2], d[p, _BS2]
    sc = _f32_rows(d[p, _SC], b * d[p, _SS0] + h * d[p, _SS1], (r1 - 1) * ss2 + nvg)
    bs = _f32_rows(d[p, _BS], b * d[p, _BS0] + h * d[p, _BS1], (r1 - 1) * bs2 + nvg)
    _transpose_words(codes, r0, n, ds2, nbytes, nw, tw)
    for gg in range(nvg):  # the rows' scales and bases, token-contiguous (shared by the heads)
        sg, bg = sbt[0, gg], sbt[1, gg]
        for t in range(n):
            sg[t] = sc[(r0 + t) * ss2 + gg]
            bg[t] = bs[(r0 + t) * bs2 + gg]
    for i in range(g):
        pi = pr[i, o : o + n]
        for gg in range(nvg):
            wig, sg, bg = wt[i, gg], sbt[0, gg], sbt[1, gg]
            tot = _F0
            for t in range(n):
                wig[t] = pi[t] * sg[t]
                tot += pi[t] * bg[t]
            accb[i, gg] += tot
    i0 = 0
    while i0 < g:
        w = _pass_width(g, i0)
        if w == HC:
            _value_pass4(tw, nw, cpw, bits, Dv, G, wt, i0, accq, n)
        else:
            _value_pass1(tw, nw, cpw, bits, Dv, G, wt, i0, accq, n)
        i0 += w


def _task(q, kd, vd, prm, valid, has_mask, scaling, b, h, t0, t1, om, ol, oacc):
    """Kv head ``h`` of sequence ``b`` over kv positions ``[t0, t1)``: this task's softmax state.

    Writes ``om[i]`` (max score), ``ol[i]`` (sum of ``exp(s - m)``) and ``oacc[i, :]`` (the
    unnormalised ``sum exp(s - m) v``, natural channel order) for the ``g`` query heads of ``h``.
    Walks ``[t0, t1)`` in steps of :data:`SUB` tokens with an online softmax.
    """
    g = om.shape[0]
    gp = _padded_heads(g)  # rows the head passes touch (zero rows past g)
    D = q.shape[2]
    Dv = oacc.shape[1]
    kbits, kG, vbits, vG = prm[0], prm[1], prm[2], prm[3]
    nw = max(((D * kbits + 7) // 8 + 3) // 4, ((Dv * vbits + 7) // 8 + 3) // 4)
    nvg = Dv // vG if vG > 1 else 1
    qsc = np.empty((g, D), dtype=np.float32)
    for i in range(g):
        for k in range(D):
            qsc[i, k] = q[b, h * g + i, k] * scaling
    s = np.zeros((gp, SUB), dtype=np.float32)
    qp = np.zeros((gp, (D + 3) // 4 * 4), dtype=np.float32)  # channels read 4 at a time
    tw = np.empty((nw, SUB), dtype=np.uint32)
    wt = np.zeros((gp, nvg, SUB), dtype=np.float32)
    sbt = np.empty((2, nvg, SUB), dtype=np.float32)
    accq = np.zeros((gp, Dv), dtype=np.float32)
    accf = np.zeros((g, Dv), dtype=np.float32)
    accb = np.zeros((g, Dv), dtype=np.float32)
    m_run = np.full(g, _NEG32, dtype=np.float32)
    l_run = np.zeros(g, dtype=np.float32)
    for c0 in range(t0, t1, SUB):
        c1 = min(t1, c0 + SUB)
        n = c1 - c0
        for p in range(kd.shape[0]):
            a, e = max(c0, kd[p, _LO]), min(c1, kd[p, _HI])
            if a < e:
                _key_scores(kd, p, b, h, a, e, qsc, kbits, kG, c0, s, qp, tw)
        if has_mask:
            for t in range(c0, c1):
                if not valid[b, t]:
                    for i in range(g):
                        s[i, t - c0] = _NEG32
        for i in range(g):
            si = s[i]
            mx = m_run[i]
            for t in range(n):
                mx = max(mx, si[t])
            alpha = np.exp(m_run[i] - mx)
            tot = _exp_into(si, n, mx)
            l_run[i] = l_run[i] * alpha + tot
            m_run[i] = mx
            for k in range(Dv):
                accq[i, k] *= alpha
                accf[i, k] *= alpha
                accb[i, k] *= alpha
        for p in range(vd.shape[0]):
            a, e = max(c0, vd[p, _LO]), min(c1, vd[p, _HI])
            if a < e:
                _value_accumulate(vd, p, b, h, a, e, vbits, vG, c0, s, accq, accf, accb, wt, sbt, tw)
    for i in range(g):
        om[i] = m_run[i]
        ol[i] = l_run[i]
        for k in range(Dv):
            oacc[i, k] = accq[i, k] + accf[i, k] + accb[i, k // vG]


def _merge(pm, pl, pacc, nch, out):
    """Combine the ``nch`` split-K partial states of every ``(b, kv head)`` (log-sum-exp) into ``out``."""
    B, Hq, Dv = out.shape
    g = pm.shape[1]
    hkv = Hq // g
    for bh in range(B * hkv):
        b = bh // hkv
        h = bh - b * hkv
        for i in range(g):
            mx = _NEG32
            for c in range(nch):
                mx = max(mx, pm[bh * nch + c, i])
            tot = _F0
            o = out[b, h * g + i]
            o[:] = 0.0
            for c in range(nch):
                w = np.exp(pm[bh * nch + c, i] - mx)
                tot += w * pl[bh * nch + c, i]
                pa = pacc[bh * nch + c, i]
                for k in range(Dv):
                    o[k] += w * pa[k]
            for k in range(Dv):
                o[k] /= tot


def _run_task(task, nch, q, kd, vd, prm, valid, has_mask, scaling, hkv, kv_len, chunk, pm, pl, pacc):
    """Task ``task`` = ``(b, kv head, chunk c)`` in row-major order; its state goes to row ``task``."""
    bh = task // nch
    c = task - bh * nch
    b = bh // hkv
    h = bh - b * hkv
    t0 = c * chunk
    _task(q, kd, vd, prm, valid, has_mask, scaling, b, h, t0, min(kv_len, t0 + chunk), pm[task], pl[task], pacc[task])


def _partials(q, hkv, kv_len, chunk, dv):
    """``(chunks per head, tasks, max, sum, accumulator)`` buffers of the split-K tasks."""
    B, Hq, _ = q.shape
    g = Hq // hkv
    nch = (kv_len + chunk - 1) // chunk
    ntask = B * hkv * nch
    pm = np.empty((ntask, g), dtype=np.float32)
    pl = np.empty((ntask, g), dtype=np.float32)
    pacc = np.empty((ntask, g, dv), dtype=np.float32)
    return nch, ntask, pm, pl, pacc


def _decode_py(q, kd, vd, prm, valid, has_mask, scaling, hkv, kv_len, chunk, out):
    """Entry point, threaded: tasks ``(b, kv head, chunk of kv positions)`` in ``prange``, then merge."""
    nch, ntask, pm, pl, pacc = _partials(q, hkv, kv_len, chunk, out.shape[2])
    for task in prange(ntask):
        _run_task(task, nch, q, kd, vd, prm, valid, has_mask, scaling, hkv, kv_len, chunk, pm, pl, pacc)
    _merge(pm, pl, pacc, nch, out)


def _decode_serial_py(q, kd, vd, prm, valid, has_mask, scaling, hkv, kv_len, chunk, out):
    """Entry point, calling thread only (small calls: no thread-pool hand-off); same tasks as above."""
    nch, ntask, pm, pl, pacc = _partials(q, hkv, kv_len, chunk, out.shape[2])
    for task in range(ntask):
        _run_task(task, nch, q, kd, vd, prm, valid, has_mask, scaling, hkv, kv_len, chunk, pm, pl, pacc)
    _merge(pm, pl, pacc, nch, out)


_SIGNATURE = (
    "void(float32[:,:,::1], int64[:,::1], int64[:,::1], int64[::1], boolean[:,::1], int64, float32, "
    "int64, int64, int64, float32[:,:,::1])"
)


def _build_kernel():
    """Compile (or load from numba's cache) the decode kernel. Imports numba lazily."""
    global prange, carray, _u8p, _u32p, _f32p, _bits_f32, _code, _transpose_words, _key_scores, _value_accumulate, _task, _merge
    global _run_task, _partials, _pass_width, _padded_heads, _key_pass4, _key_pass1, _value_pass4, _value_pass1
    import numba
    from numba import types
    from numba.extending import intrinsic

    def pointer(dtype):
        @intrinsic
        def cast(typingctx, addr):
            sig = types.CPointer(dtype)(types.int64)

            def codegen(context, builder, signature, args):
                return builder.inttoptr(args[0], context.get_value_type(signature.return_type))

            return sig, codegen

        return cast

    @intrinsic
    def bits_f32(typingctx, x):
        """The float32 whose bit pattern is the int32 ``x``."""
        sig = types.float32(types.int32)

        def codegen(context, builder, signature, args):
            return builder.bitcast(args[0], context.get_value_type(types.float32))

        return sig, codegen

    @intrinsic
    def code(typingctx, x, shift, mask):
        """``float32((x >> shift) & mask)`` in 32-bit lanes (uint32 arguments).

        Written as an intrinsic because numba widens integer arithmetic to 64 bits, and AVX2 has
        no vector int64 -> float conversion: the unpack loops would stay scalar. The masked code is
        non-negative, so a signed conversion is exact.
        """
        sig = types.float32(types.uint32, types.uint32, types.uint32)

        def codegen(context, builder, signature, args):
            v = builder.and_(builder.lshr(args[0], args[1]), args[2])
            return builder.sitofp(v, context.get_value_type(types.float32))

        return sig, codegen

    prange, carray = numba.prange, numba.carray
    _u8p, _u32p, _f32p = pointer(types.uint8), pointer(types.uint32), pointer(types.float32)
    _bits_f32, _code = bits_f32, code
    jit = numba.njit(fastmath=True, cache=True)
    inline = numba.njit(inline="always", fastmath=True, cache=True)
    for name in ("_u8_rows", "_u32_rows", "_f32_rows", "_transpose_words", "_exp_into"):
        globals()[name] = inline(globals()[name])
    _key_pass4, _key_pass1, _value_pass4, _value_pass1 = (jit(f) for f in (_key_pass4, _key_pass1, _value_pass4, _value_pass1))
    _key_scores, _value_accumulate, _task, _merge = (jit(f) for f in (_key_scores, _value_accumulate, _task, _merge))
    _run_task, _partials = inline(_run_task), inline(_partials)
    _pass_width, _padded_heads = inline(_pass_width), inline(_padded_heads)
    threaded = numba.njit(_SIGNATURE, parallel=True, fastmath=True, cache=True)(_decode_py)
    serial = numba.njit(_SIGNATURE, fastmath=True, cache=True)(_decode_serial_py)
    return threaded, serial


def _kernel():
    """``(threaded, serial)``: the two compiled entry points (same signature)."""
    global _KERNEL
    if _KERNEL is None:
        _KERNEL = _build_kernel()
    return _KERNEL


def warmup() -> float:
    """Compile (or load) the decode kernel and the value quantizer now; returns the seconds it took."""
    import time

    t0 = time.perf_counter()
    _kernel()
    _warmup_quantizer()
    return time.perf_counter() - t0


# --------------------------------------------------------------------------------------------- host side
def _np(t: torch.Tensor):
    return t.detach().numpy()


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
        cols = (0, *_addr(_rows_f32(data), keep)) + (0,) * 8
    else:
        seg = store.template.with_tensors(**blk)
        packed = seg.packed if seg.packed.stride(-1) == 1 else seg.packed.contiguous()
        direct = (packed is seg.packed and seg.scale.dtype == torch.float32 and seg.scale.stride(-1) == 1
                  and seg.offset is not None and seg.offset.dtype == torch.float32 and seg.offset.stride(-1) == 1
                  and seg.comp is None)
        cols = (1, *_addr(packed, keep), *_addr(_rows_f32(seg.scale), keep), *_addr(_rows_f32(_base(seg)), keep))
    return direct, cols, tuple(keep)


def _store_rows(view: AttentionView, start: int, keep: list) -> list[tuple]:
    """Descriptor rows of the store blocks holding tokens ``[store.start, view.split)``, in token order.

    Each row describes a whole block (``lo`` = its first token relative to ``start``, possibly
    negative after an eviction: the kernel only visits positions ``>= 0``) up to ``view.split``.
    Columns that point at the blocks' own tensors are memoised in ``store.derived`` (cleared
    whenever blocks are added, dropped or replaced), so a decode step does not rebuild them.
    float32 copies (bf16 / fp16 parameters, ...) are made per call and not kept: memoising them
    would hold a float32 copy of every scale and offset, as many bytes again as the 2-bit codes.
    """
    store = view.store
    memo = store.derived.setdefault("fused_cpu", {})
    rows = []
    for i, (blk, b0, cap) in enumerate(zip(store.blocks, store.starts, store.caps)):
        if blk is None or b0 + cap <= store.start:
            continue
        if b0 >= view.split:
            break
        hi = min(view.split, b0 + cap)
        ent = memo.get(i)
        if ent is None:
            ent = _block_entry(store, blk, view.quantized)
            if ent[0]:
                memo[i] = ent
        keep.append(ent[2])
        rows.append((b0 - start, hi - start, *ent[1]))
    return rows


def _side_table(view: AttentionView, start: int, keep: list) -> tuple[np.ndarray, int, int]:
    """``(descriptors [P, NCOL] int64, bits, group_size)`` of one side's pieces, in token order.

    Pieces are the sink (if any), the store blocks (quantized or full precision) and the fp tail. Each descriptor
    row holds the piece's kv positions (relative to ``start``) and the address and strides of its
    codes / data, scale and base (float32; converted here when stored in another dtype). Nothing
    is copied when the store holds float32 parameters; everything referenced is appended to
    ``keep`` so it outlives the kernel call. ``bits`` / ``group_size`` are 8 / 1 when the side is
    not quantized.
    """
    rows = []
    bits, group = 8, 1
    if view.sink is not None:  # full-precision sink tokens [0, S)
        lo = 0 - start
        rows.append((lo, lo + view.sink.shape[-2], 0, *_addr(_rows_f32(view.sink), keep)) + (0,) * 8)
    if view.store.template is not None and view.split > view.store.start:
        rows += _store_rows(view, start, keep)
        if view.quantized:
            bits, group = view.store.template.bits, view.store.template.group_size
    nfp = view.fp.shape[-2]
    if nfp:
        lo = view.split - start
        rows.append((lo, lo + nfp, 0, *_addr(_rows_f32(view.fp), keep)) + (0,) * 8)
    table = np.array(rows, dtype=np.int64).reshape(len(rows), NCOL)
    return table, bits, group


def _valid_row(attention_mask: torch.Tensor | None, batch: int, kv_len: int) -> torch.Tensor | None:
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


def fused_decode_supported(q: torch.Tensor, k_view: AttentionView, v_view: AttentionView,
                           attention_mask: torch.Tensor | None = None) -> bool:
    """Whether :func:`fused_decode_attention` handles this call (numba present, n == 1, formats)."""
    if not fused_decode_available() or q.dim() != 4 or q.shape[2] != 1 or q.device.type != "cpu":
        return False
    for view in (k_view, v_view):
        if view.quantized and view.store.template is not None:
            t = view.store.template
            if t.bits not in SUPPORTED_BITS:
                return False
            if t.axis == "token" and t.group_size % 4:
                return False  # the kernel reads value channels 4 at a time, within one group
    if q.shape[1] % k_view.fp.shape[1]:
        return False
    if attention_mask is not None:
        if attention_mask.dim() != 4 or attention_mask.shape[1] != 1:
            return False
        if attention_mask.dtype != torch.bool:
            row = attention_mask[:, 0, -1]
            keep = row > torch.finfo(row.dtype).min / 2
            if bool((row[keep] != 0).any()):
                return False
    return True


#: Below this many ``batch x kv heads x kv positions`` a call runs on the calling thread only.
#: Measured on the idle 2-core development machine with ``benchmarks/bench_fused_threads.py``
#: (omp pool, a torch matmul before each call, medians of 30, 9q/3kv heads, D=64, 2-bit):
#: serial / threaded = 0.89-1.01 at 1.5K units, 1.15-1.19 at 3K, 1.2-1.35 at 6K-12K, 1.4-1.9 from
#: 24K (B=1 and B=4 alike; ``results/bench_fused_threads.txt``).
SERIAL_BELOW = 3072


def _use_threads(batch: int, hkv: int, kv_len: int) -> bool:
    """Whether a call of this size goes to numba's thread pool (see :data:`SERIAL_BELOW`)."""
    return batch * hkv * kv_len >= SERIAL_BELOW


def _chunk_tokens(ntok: int, tasks_bh: int, threads: int) -> int:
    """Tokens per split-K task: at least 2 tasks per thread, a task count divisible by ``threads``.

    numba's ``prange`` (omp layer) hands each thread an equal contiguous share of the tasks, so a
    task count that does not divide evenly leaves a thread idle at the end: 9 tasks on 2 threads
    (batch 1, 3 kv heads, the earlier "4 per thread" rule) ran 5 + 4, 11% longer than 6 tasks
    (3 + 3). Chunks are multiples of 64 tokens (whole key groups of 32 or 64 tokens).
    """
    tasks_bh = max(tasks_bh, 1)
    want = max(1, -(-2 * threads // tasks_bh))
    for extra in range(threads):  # smallest count >= want whose total divides evenly
        if (tasks_bh * (want + extra)) % threads == 0:
            want += extra
            break
    chunk = max(SUB, -(-ntok // want))
    return -(-chunk // 64) * 64


def fused_decode_attention(
    q: torch.Tensor,
    k_view: AttentionView,
    v_view: AttentionView,
    *,
    scaling: float | None = None,
    attention_mask: torch.Tensor | None = None,
    threaded: bool | None = None,
) -> torch.Tensor:
    """Decode attention of ``q [B, Hq, 1, D]`` over a KIVI layer's views; ``[B, Hq, 1, Dv]`` in ``q.dtype``.

    Same semantics as :func:`kivi.attention.reference.reference_attention` for one query token.
    ``threaded``: run on numba's thread pool (split-K tasks) or on the calling thread only;
    ``None`` chooses threads when ``B * Hkv * kv_len >= SERIAL_BELOW``.
    """
    B, hq, n, d = q.shape
    if n != 1:
        raise ValueError(f"fused_decode_attention takes one query token per sequence, got {n}")
    start, kv_len, hkv, dv = view_geometry(q, k_view, v_view)
    if kv_len == 0:
        raise ValueError("fused_decode_attention: empty cache view")
    scaling = d**-0.5 if scaling is None else scaling
    if threaded is None:
        threaded = _use_threads(B, hkv, kv_len)
    kernel = _kernel()[0 if threaded else 1]
    valid = _valid_row(attention_mask, B, kv_len)
    has_mask = valid is not None
    valid_np = _np(valid) if has_mask else _ALL_VALID

    keep: list = []
    kd, kbits, kG = _side_table(k_view, start, keep)
    vd, vbits, vG = _side_table(v_view, start, keep)
    prm = np.array([kbits, kG, vbits, vG], dtype=np.int64)
    q32 = _np(q.reshape(B, hq, d).float().contiguous())  # a view when q is contiguous float32
    out = torch.empty(B, hq, 1, dv)
    if threaded:
        import numba

        chunk = _chunk_tokens(kv_len, B * hkv, numba.get_num_threads())
    else:
        chunk = kv_len
    kernel(q32, kd, vd, prm, valid_np, int(has_mask), np.float32(scaling), hkv, kv_len, chunk,
           out.numpy().reshape(B, hq, dv))
    return out if q.dtype == torch.float32 else out.to(q.dtype)


__all__ = ["fused_decode_available", "fused_decode_supported", "fused_decode_attention", "warmup", "SUPPORTED_BITS"]
