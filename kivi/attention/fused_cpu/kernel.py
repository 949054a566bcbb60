"""The numba decode kernel: one call per layer and step, straight from the packed codes.

Importing this module imports numba and declares the entry points (:func:`decode_threaded`,
:func:`decode_serial`, the paged ones: :data:`ENTRIES`); :func:`load_entries` compiles them, or loads them from
numba's on-disk cache, and :mod:`.dispatch` calls it on first use after a child process has filled a cold
cache (why: :func:`load_entries`). Every function is decorated here at module level, so a name means one
thing and ``cache=True`` finds the compiled code again in the next process.

Inputs: ``q [B, Hq, D]`` float32, the piece descriptor tables of keys and values (:mod:`.tables`;
each row names the kv heads ``[h0, h1)`` its tensors hold, so a layer with per-head widths is one table
of every head group's pieces and one call),
``prm = [key bits, key group, value bits, value group]`` (the widest piece of a side; each quantized
piece's own width is its ``_BITS`` column), a ``[B, kv_len]`` validity row, and the
output ``[B, Hq, Dv]``. Per ``(batch b, kv head h)`` and its ``g = Hq / Hkv`` query heads:

* split-K: ``prange`` runs over ``(b, h, chunk of kv positions)`` tasks (both cores work even at
  batch 1 with few kv heads); every task keeps its own ``(m, l, acc)`` online-softmax state, walks
  its chunk in steps of :data:`SUB` tokens (scores for the step from the key pieces it overlaps,
  softmax update, then the value pieces it overlaps) and :func:`_merge` combines the tasks with
  log-sum-exp weights;
* codes are unpacked *token-major*: a block's rows are transposed to 32-bit words
  (:func:`_transpose_words`; 3-bit rows: one 24-bit run of 8 codes per word, :func:`_transpose_runs`)
  so that every unpack loop runs over tokens, vectorised in 32-bit lanes (the :func:`_code`
  intrinsic), and each pass over a word serves :data:`HC` = 4 query heads while 4 or more remain, 3
  when 3 remain, then single heads (GQA without repeating the cache);
* keys (per-channel groups, ``x = code * scale + base``; ``base`` = offset, offset +
  compensation, or ``-qmax * scale`` when symmetric): ``s_i(t) = c_i + sum_d q'_{i,d} code_d(t)``
  with ``q' = q * scale * scaling`` and ``c_i = scaling * q_i . base`` per group
  (:func:`_key_scores`);
* values (per-token groups of ``G`` channels, ``G % 4 == 0``): ``acc_{i,d} += sum_t p_i(t)
  scale_t code_d(t)``, the offsets summed separately per group (:func:`_value_accumulate`);
* masked positions score ``finfo(float32).min`` (like the reference: a fully masked row attends
  uniformly instead of producing NaN).

Computation is in float32; the softmax uses a vectorisable expf (:func:`_exp_into`, relative
error ~1e-7). Compile: ``fastmath=True, cache=True`` everywhere, the helpers ``inline="always"``, the entry
points with one signature each, given at :func:`load_entries` (the threaded ones ``parallel=True``); the
per-task functions (:func:`_task`, :func:`_paged_task`, :func:`_paged_slot_task`, :func:`_ring_slot_task`) are
plain jit calls, so each is compiled once and shared by its serial and threaded entry instead of inlined into
both. The six entries compile in 85 s on a 2-core VM (numba 0.68.1; 151 s on another VM for
the same code), 204-237 s while the slot tasks were inlined, 11.5 min with every ``@jit`` callee inlined.
"""

from __future__ import annotations

import os

import numba
import numpy as np
from numba import carray, prange, types
from numba.extending import intrinsic

from ...quant.numba_bits import bits_f32
from .columns import (
    _BITS,
    _BS,
    _BS0,
    _BS1,
    _BS2,
    _DATA,
    _DS0,
    _DS1,
    _DS2,
    _H0,
    _H1,
    _HI,
    _LO,
    _QUANT,
    _SC,
    _SS0,
    _SS1,
    _SS2,
    NCOL,
)

# The descriptor columns are compiled in as constants, but numba's on-disk cache is keyed on this
# file only: a layout change in columns.py must change this file too, or a stale cache would read
# the wrong columns. Hence this check.
if (_LO, _HI, _QUANT, _DATA, _DS0, _DS1, _DS2, _SC, _SS0, _SS1, _SS2, _BS, _BS0, _BS1, _BS2, _BITS, _H0, _H1,
        NCOL) != (*range(18), 18):
    raise ImportError("the descriptor layout of columns.py changed: update the check in kernel.py")

_NEG32 = np.finfo(np.float32).min  # the score of a masked position
_F0 = np.float32(0.0)

#: Tokens per inner step of a task: the scores of one step (``g x SUB`` floats) stay in L1.
SUB = 256

jit = numba.njit(fastmath=True, cache=True)
inline = numba.njit(inline="always", fastmath=True, cache=True)
# The entry points: compiled (or loaded from numba's cache) by load_entries() for their one signature each
# (ENTRIES), not at import; see load_entries for why.
entry_threaded = numba.njit(parallel=True, fastmath=True, cache=True)
entry_serial = numba.njit(fastmath=True, cache=True)


# --------------------------------------------------------------------------------------------- intrinsics
def _pointer(dtype):
    """An intrinsic casting an int64 address to a ``dtype`` pointer (for :func:`numba.carray`)."""

    @intrinsic
    def cast(typingctx, addr):
        sig = types.CPointer(dtype)(types.int64)

        def codegen(context, builder, signature, args):
            return builder.inttoptr(args[0], context.get_value_type(signature.return_type))

        return sig, codegen

    return cast


_u8p = _pointer(types.uint8)
_u32p = _pointer(types.uint32)
_f32p = _pointer(types.float32)


@intrinsic
def _code(typingctx, x, shift, mask):
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


# --------------------------------------------------------------------------------------------- kernel
@inline
def _u8_rows(addr, off, n):
    """The ``n`` bytes at ``addr + off`` as a 1-D uint8 array (no copy)."""
    return carray(_u8p(addr + off), (n,))


@inline
def _u32_rows(addr, off, n):
    """The ``n`` uint32 at ``addr + 4 * off`` as a 1-D array (no copy; ``addr`` 4-byte aligned)."""
    return carray(_u32p(addr + 4 * off), (n,))


@inline
def _f32_rows(addr, off, n):
    """The ``n`` float32 at ``addr + 4 * off`` as a 1-D array (no copy)."""
    return carray(_f32p(addr + 4 * off), (n,))


@inline
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
        e = p * bits_f32(np.int32((k + np.float32(127.0)) * np.float32(8388608.0)))
        e = e if x > np.float32(-87.0) else _F0
        si[t] = e
        tot += e
    return tot


#: Query heads handled per pass over a block's codes (register blocking). Passes take 4 heads while
#: 4 or more remain, 3 when 3 remain (GQA ratio 3, SmolLM2's: no zero row), then single heads (MHA, ratio 2).
HC = 4


@inline
def _transpose_packed(words, n, nw, tw):
    """``tw[w, t] = words[nw * t + w]`` for rows of ``nw`` = 2, 4 or 8 words stored back to back.

    The words of a row are named one by one (a fixed count per branch), so LLVM reads the rows as one
    interleaved group (wide loads and shuffles) instead of one scalar move per word (with :func:`_token_params`:
    a 2,048-token head of SmolLM2's 2-bit rows of 4 words, key scores 0.90x, value accumulation 0.70x their time,
    ``studies/kernel_parts_ab.py`` in the git tag studies-archive). Same values as the general loop.
    """
    if nw == 2:
        u0, u1 = tw[0], tw[1]
        for t in range(n):
            u0[t] = words[2 * t]
            u1[t] = words[2 * t + 1]
    elif nw == 4:
        u0, u1, u2, u3 = tw[0], tw[1], tw[2], tw[3]
        for t in range(n):
            u0[t] = words[4 * t]
            u1[t] = words[4 * t + 1]
            u2[t] = words[4 * t + 2]
            u3[t] = words[4 * t + 3]
    else:
        u0, u1, u2, u3, u4, u5, u6, u7 = tw[0], tw[1], tw[2], tw[3], tw[4], tw[5], tw[6], tw[7]
        for t in range(n):
            u0[t] = words[8 * t]
            u1[t] = words[8 * t + 1]
            u2[t] = words[8 * t + 2]
            u3[t] = words[8 * t + 3]
            u4[t] = words[8 * t + 4]
            u5[t] = words[8 * t + 5]
            u6[t] = words[8 * t + 6]
            u7[t] = words[8 * t + 7]


@inline
def _transpose_words(codes, r0, n, ds2, nbytes, nw, tw):
    """Rows ``r0 .. r0+n`` of a piece's codes into ``tw[w, t]`` = little-endian uint32 of row bytes ``[4w, 4w+4)``.

    Transposed so the unpack loops run over *tokens* (contiguous, vectorised); bytes past
    ``nbytes`` read as 0. Channel ``c`` of word ``w`` (``32 // bits`` per word) sits at bits
    ``[bits * c, bits * (c + 1))`` — the packing is a little-endian bit stream along the channels.
    Rows of 2, 4 or 8 words stored back to back go through :func:`_transpose_packed`; other rows whose bytes
    are 4-aligned are read as words; otherwise assembled from bytes.
    """
    addr = codes.ctypes.data
    if ds2 == 4 * nw and nbytes == ds2 and addr % 4 == 0 and (nw == 2 or nw == 4 or nw == 8):
        _transpose_packed(_u32_rows(addr, nw * r0, nw * n), n, nw, tw)
        return
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


@inline
def _transpose_runs(codes, r0, n, ds2, nw, tw):
    """:func:`_transpose_words` for 3-bit codes: ``tw[w, t]`` = the 24-bit run of row bytes ``[3w, 3w+3)``.

    3-bit packing stores runs of 8 codes as a little-endian 24-bit integer in 3 bytes
    (:mod:`kivi.quant.packing`), so a run in the low 24 bits of a 32-bit word is read like a word of
    8 codes: channel ``c`` of run ``w`` (``8w <= c < 8w + 8``) at bits ``[3(c - 8w), 3(c - 8w) + 3)``.
    Rows of a multiple of 4 runs (``D % 32 == 0``) at 4-aligned addresses are read as three words
    per four runs; otherwise runs are assembled from bytes.
    """
    addr = codes.ctypes.data
    if nw % 4 == 0 and ds2 % 4 == 0 and addr % 4 == 0:
        words = _u32_rows(addr, 0, codes.shape[0] // 4)
        ws2 = ds2 // 4
        lo24, lo16, lo8 = np.uint32(0xFFFFFF), np.uint32(0xFFFF), np.uint32(0xFF)
        s8, s16, s24 = np.uint32(8), np.uint32(16), np.uint32(24)
        for t in range(n):
            base = (r0 + t) * ws2
            for j in range(nw // 4):
                x0, x1, x2 = words[base + 3 * j], words[base + 3 * j + 1], words[base + 3 * j + 2]
                tw[4 * j, t] = x0 & lo24
                tw[4 * j + 1, t] = (x0 >> s24) | ((x1 & lo16) << s8)
                tw[4 * j + 2, t] = (x1 >> s16) | ((x2 & lo8) << s16)
                tw[4 * j + 3, t] = x2 >> s8
        return
    for t in range(n):
        base = (r0 + t) * ds2
        for w in range(nw):
            j = base + 3 * w
            tw[w, t] = (np.uint32(codes[j]) | (np.uint32(codes[j + 1]) << np.uint32(8))
                        | (np.uint32(codes[j + 2]) << np.uint32(16)))


@inline
def _row_layout(D, bits):
    """``(channels per word, code bytes per row, words per row)`` of ``D`` channels at ``bits``.

    A "word" is what :func:`_transpose_words` / :func:`_transpose_runs` put in one uint32 lane: 4
    bytes (``32 // bits`` channels) for 1, 2, 4, 8 bits, a 3-byte run of 8 channels for 3 bits. Words
    per row never decrease with the width (``ceil(D/32), ceil(D/16), ceil(D/8), ceil(D/8), ceil(D/4)``
    for 1, 2, 3, 4, 8 bits), so the widest piece of a side sizes the buffer for all of them.
    """
    if bits == 3:
        nw = (D + 7) // 8
        return 8, 3 * nw, nw
    nbytes = (D * bits + 7) // 8
    return 32 // bits, nbytes, (nbytes + 3) // 4


@inline
def _transpose(codes, r0, n, ds2, bits, nbytes, nw, tw):
    """Rows ``r0 .. r0+n`` of a piece's codes to token-major words (:func:`_row_layout`)."""
    if bits == 3:
        _transpose_runs(codes, r0, n, ds2, nw, tw)
    else:
        _transpose_words(codes, r0, n, ds2, nbytes, nw, tw)


@inline
def _pass_width(g, i0):
    """Heads of the pass starting at head ``i0``: :data:`HC` while that many remain, 3 when 3 remain, else 1."""
    r = g - i0
    return HC if r >= HC else (3 if r == 3 else 1)


@jit
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


@jit
def _key_pass3(tw, nw, cpw, bits, D, qp, i0, s, o, n):
    """:func:`_key_pass4` for the 3 heads ``i0 .. i0 + 2``."""
    mask = np.uint32((1 << bits) - 1)
    b1, b2, b3 = np.uint32(bits), np.uint32(2 * bits), np.uint32(3 * bits)
    s0, s1, s2 = s[i0, o : o + n], s[i0 + 1, o : o + n], s[i0 + 2, o : o + n]
    for w in range(nw):
        tww = tw[w]
        for m in range(cpw // 4):
            c = w * cpw + 4 * m
            if c >= D:
                break
            a0, a1, a2, a3 = qp[i0, c], qp[i0, c + 1], qp[i0, c + 2], qp[i0, c + 3]
            e0, e1, e2, e3 = qp[i0 + 1, c], qp[i0 + 1, c + 1], qp[i0 + 1, c + 2], qp[i0 + 1, c + 3]
            f0, f1, f2, f3 = qp[i0 + 2, c], qp[i0 + 2, c + 1], qp[i0 + 2, c + 2], qp[i0 + 2, c + 3]
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


@jit
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


@jit
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


@jit
def _value_pass3(tw, nw, cpw, bits, Dv, G, wt, i0, accq, n):
    """:func:`_value_pass4` for the 3 heads ``i0 .. i0 + 2`` (6 accumulators)."""
    mask = np.uint32((1 << bits) - 1)
    b1 = np.uint32(bits)
    a0, a1, a2 = accq[i0], accq[i0 + 1], accq[i0 + 2]
    for w in range(nw):
        tww = tw[w]
        for m in range(cpw // 2):
            c = w * cpw + 2 * m
            if c >= Dv:
                break
            gg = c // G
            w0, w1, w2 = wt[i0, gg, :n], wt[i0 + 1, gg, :n], wt[i0 + 2, gg, :n]
            sh0 = np.uint32(2 * bits * m)
            sh1 = sh0 + b1
            r00 = r01 = r10 = r11 = r20 = r21 = _F0
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
            a0[c] += r00
            a0[c + 1] += r01
            a1[c] += r10
            a1[c + 1] += r11
            a2[c] += r20
            a2[c + 1] += r21


@jit
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


@jit
def _key_scores(d, p, b, h, a, e, qsc, bits, G, c0, s, qp, tw):
    """Scores ``s[i, t - c0]`` of the ``g`` query heads for kv positions ``[a, e)`` of key piece ``p``
    (``h``: the kv head within the piece's tensors).

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
    cpw, nbytes, nw = _row_layout(D, bits)
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
        _transpose(codes, r, n, ds2, bits, nbytes, nw, tw)
        i0 = np.int64(0)  # not a literal 0: numba would compile each pass for Literal[int](0) as well
        while i0 < g:
            w = _pass_width(g, i0)
            if w == HC:
                _key_pass4(tw, nw, cpw, bits, D, qp, i0, s, o, n)
            elif w == 3:
                _key_pass3(tw, nw, cpw, bits, D, qp, i0, s, o, n)
            else:
                _key_pass1(tw, nw, cpw, bits, D, qp, i0, s, o, n)
            i0 += w
        r = rend


@inline
def _token_params(x, xs2, r0, n, nvg, out):
    """``out[gg, t] = x[(r0 + t) * xs2 + gg]``: a value piece's per-token parameters (``nvg`` groups a row, rows
    ``xs2`` apart) token-contiguous. Rows of 2 or 4 groups stored back to back take a branch naming each group
    (LLVM reads them as one interleaved group); same values as the general loop."""
    if xs2 == nvg and nvg == 2:
        o0, o1 = out[0], out[1]
        for t in range(n):
            o0[t] = x[(r0 + t) * 2]
            o1[t] = x[(r0 + t) * 2 + 1]
        return
    if xs2 == nvg and nvg == 4:
        o0, o1, o2, o3 = out[0], out[1], out[2], out[3]
        for t in range(n):
            o0[t] = x[(r0 + t) * 4]
            o1[t] = x[(r0 + t) * 4 + 1]
            o2[t] = x[(r0 + t) * 4 + 2]
            o3[t] = x[(r0 + t) * 4 + 3]
        return
    for gg in range(nvg):
        og = out[gg]
        for t in range(n):
            og[t] = x[(r0 + t) * xs2 + gg]


@jit
def _value_accumulate(d, p, b, h, a, e, bits, G, c0, pr, accq, accf, accb, wt, sbt, tw):
    """Add ``sum_t p[i, t] v_t`` over kv positions ``[a, e)`` of value piece ``p`` to the accumulators
    (``h``: the kv head within the piece's tensors).

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
    cpw, nbytes, nw = _row_layout(Dv, bits)
    nvg = Dv // G
    n = r1 - r0
    o = r0 + lo - c0
    codes = _u8_rows(d[p, _DATA], boff, (r1 - 1) * ds2 + nbytes)
    ss2, bs2 = d[p, _SS2], d[p, _BS2]
    sc = _f32_rows(d[p, _SC], b * d[p, _SS0] + h * d[p, _SS1], (r1 - 1) * ss2 + nvg)
    bs = _f32_rows(d[p, _BS], b * d[p, _BS0] + h * d[p, _BS1], (r1 - 1) * bs2 + nvg)
    _transpose(codes, r0, n, ds2, bits, nbytes, nw, tw)
    _token_params(sc, ss2, r0, n, nvg, sbt[0])  # the rows' scales and bases, token-contiguous (shared by the heads)
    _token_params(bs, bs2, r0, n, nvg, sbt[1])
    for i in range(g):
        pi = pr[i, o : o + n]
        for gg in range(nvg):
            wig, sg, bg = wt[i, gg], sbt[0, gg], sbt[1, gg]
            tot = _F0
            for t in range(n):
                wig[t] = pi[t] * sg[t]
                tot += pi[t] * bg[t]
            accb[i, gg] += tot
    i0 = np.int64(0)  # not a literal 0 (see _key_scores)
    while i0 < g:
        w = _pass_width(g, i0)
        if w == HC:
            _value_pass4(tw, nw, cpw, bits, Dv, G, wt, i0, accq, n)
        elif w == 3:
            _value_pass3(tw, nw, cpw, bits, Dv, G, wt, i0, accq, n)
        else:
            _value_pass1(tw, nw, cpw, bits, Dv, G, wt, i0, accq, n)
        i0 += w


@jit
def _task(q, kd, vd, prm, valid, has_mask, scaling, b, h, t0, t1, om, ol, oacc):
    """Kv head ``h`` of sequence ``b`` over kv positions ``[t0, t1)``: this task's softmax state.

    Writes ``om[i]`` (max score), ``ol[i]`` (sum of ``exp(s - m)``) and ``oacc[i, :]`` (the
    unnormalised ``sum exp(s - m) v``, natural channel order) for the ``g`` query heads of ``h``.
    Walks ``[t0, t1)`` in steps of :data:`SUB` tokens with an online softmax.
    """
    g = om.shape[0]
    D = q.shape[2]
    Dv = oacc.shape[1]
    kbits, kG, vbits, vG = prm[0], prm[1], prm[2], prm[3]
    nw = max(_row_layout(D, kbits)[2], _row_layout(Dv, vbits)[2])  # the widest piece's words
    nvg = Dv // vG if vG > 1 else 1
    qsc = np.empty((g, D), dtype=np.float32)
    for i in range(g):
        for k in range(D):
            qsc[i, k] = q[b, h * g + i, k] * scaling
    s = np.zeros((g, SUB), dtype=np.float32)
    qp = np.zeros((g, (D + 3) // 4 * 4), dtype=np.float32)  # channels read 4 at a time
    tw = np.empty((nw, SUB), dtype=np.uint32)
    wt = np.zeros((g, nvg, SUB), dtype=np.float32)
    sbt = np.empty((2, nvg, SUB), dtype=np.float32)
    accq = np.zeros((g, Dv), dtype=np.float32)
    accf = np.zeros((g, Dv), dtype=np.float32)
    accb = np.zeros((g, Dv), dtype=np.float32)
    m_run = np.full(g, _NEG32, dtype=np.float32)
    l_run = np.zeros(g, dtype=np.float32)
    for c0 in range(t0, t1, SUB):
        c1 = min(t1, c0 + SUB)
        n = c1 - c0
        for p in range(kd.shape[0]):
            a, e = max(c0, kd[p, _LO]), min(c1, kd[p, _HI])
            if a < e and kd[p, _H0] <= h < kd[p, _H1]:  # the piece holds kv head h (as its head h - h0)
                _key_scores(kd, p, b, h - kd[p, _H0], a, e, qsc, kd[p, _BITS], kG, c0, s, qp, tw)
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
            if a < e and vd[p, _H0] <= h < vd[p, _H1]:
                _value_accumulate(
                    vd, p, b, h - vd[p, _H0], a, e, vd[p, _BITS], vG, c0, s, accq, accf, accb, wt, sbt, tw
                )
    for i in range(g):
        om[i] = m_run[i]
        ol[i] = l_run[i]
        for k in range(Dv):
            oacc[i, k] = accq[i, k] + accf[i, k] + accb[i, k // vG]


@jit
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


@inline
def _run_task(task, nch, q, kd, vd, prm, valid, has_mask, scaling, hkv, kv_len, chunk, pm, pl, pacc):
    """Task ``task`` = ``(chunk c, b, kv head)`` in row-major order; its state goes to row ``(b, kv head, c)``.

    Chunks outermost: ``prange`` hands each thread a contiguous share of the tasks, so every thread reads
    a share of every kv head. Heads of different widths (per-head widths, 4-bit codes cost ~1.2x 2-bit ones
    to read) then load the threads evenly; a head-major order can give one thread the wide heads (on
    SmolLM2's per-head mixes both orders run equally fast).
    """
    nbh = pm.shape[0] // nch
    c = task // nbh
    bh = task - c * nbh
    b = bh // hkv
    h = bh - b * hkv
    t0 = c * chunk
    slot = bh * nch + c
    _task(q, kd, vd, prm, valid, has_mask, scaling, b, h, t0, min(kv_len, t0 + chunk), pm[slot], pl[slot], pacc[slot])


@inline
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


_SIGNATURE = (
    "void(float32[:,:,::1], int64[:,::1], int64[:,::1], int64[::1], boolean[:,::1], int64, float32, "
    "int64, int64, int64, float32[:,:,::1])"
)


@entry_threaded
def decode_threaded(q, kd, vd, prm, valid, has_mask, scaling, hkv, kv_len, chunk, out):
    """Entry point, threaded: tasks ``(b, kv head, chunk of kv positions)`` in ``prange``, then merge."""
    nch, ntask, pm, pl, pacc = _partials(q, hkv, kv_len, chunk, out.shape[2])
    for task in prange(ntask):
        _run_task(task, nch, q, kd, vd, prm, valid, has_mask, scaling, hkv, kv_len, chunk, pm, pl, pacc)
    _merge(pm, pl, pacc, nch, out)


@entry_serial
def decode_serial(q, kd, vd, prm, valid, has_mask, scaling, hkv, kv_len, chunk, out):
    """Entry point, calling thread only (small calls: no thread-pool hand-off); same tasks as above."""
    nch, ntask, pm, pl, pacc = _partials(q, hkv, kv_len, chunk, out.shape[2])
    for task in range(ntask):
        _run_task(task, nch, q, kd, vd, prm, valid, has_mask, scaling, hkv, kv_len, chunk, pm, pl, pacc)
    _merge(pm, pl, pacc, nch, out)


# --------------------------------------------------------------------------------------------- paged batch decode
# One call per layer for a batch of requests whose quantized tokens live in pages of a block pool (kivi's
# page layout: kivi.batching.layout) and whose full-precision rows (sink, window, new token) come as a
# padded float32 array. Each task ``(request, kv head, chunk)`` writes the descriptor rows of its request's
# pieces (the same rows :mod:`.tables` builds on the host for a view) and runs :func:`_task` on them, so the
# unpack loops, head passes and online softmax are the single-sequence kernel's. The layout vector's
# columns are the ones :class:`.paged.PagedLayout` writes (checked in paged.py).
_PL_BLOCK, _PL_P, _PL_G, _PL_KBITS, _PL_VBITS, _PL_KROW, _PL_VROW = 0, 1, 2, 3, 4, 5, 6
_PL_KPACK, _PL_KSC, _PL_KOFF, _PL_VPACK, _PL_VSC, _PL_VOFF, _PL_PDT = 7, 8, 9, 10, 11, 12, 13
PAGED_NCOL = 14
_u16p = _pointer(types.uint16)


@inline
def _half_f32(x, pdt):
    """The 16-bit float ``x`` (uint32 holding its bits) as float32: ``pdt`` 1 = bfloat16, 2 = float16."""
    if pdt == 1:
        return bits_f32(x << np.uint32(16))
    sign = (x & np.uint32(0x8000)) << np.uint32(16)
    e = (x >> np.uint32(10)) & np.uint32(0x1F)
    m = x & np.uint32(0x3FF)
    if e == 0:  # zero or subnormal: m * 2**-24
        f = np.float32(m) * np.float32(5.9604644775390625e-08)
        return -f if sign else f
    if e == 31:  # inf / nan
        return bits_f32(sign | np.uint32(0x7F800000) | (m << np.uint32(13)))
    return bits_f32(sign | ((e + np.uint32(112)) << np.uint32(23)) | (m << np.uint32(13)))


@inline
def _half_into(addr, pdt, n, out):
    """The ``n`` 16-bit floats at ``addr`` (``pdt`` 1 = bfloat16, 2 = float16) as float32 into ``out[:n]``: one
    view of the row, the dtype branch outside the loop (a bfloat16 row converts in vector lanes)."""
    y = carray(_u16p(addr), (n,))
    if pdt == 1:
        for i in range(n):
            out[i] = bits_f32(np.uint32(y[i]) << np.uint32(16))
    else:
        for i in range(n):
            out[i] = _half_f32(np.uint32(y[i]), 2)


@inline
def _param_rows(addr, pdt, n, sym_qmax, out_sc, out_bs, base_addr):
    """Head rows of a page's scale (at ``addr``) and base (offset at ``base_addr``, or ``-qmax * scale`` when
    ``base_addr < 0``) as float32 into ``out_sc`` / ``out_bs`` (``n`` values each; params of dtype ``pdt``)."""
    if pdt == 0:
        x = _f32_rows(addr, 0, n)
        for i in range(n):
            out_sc[i] = x[i]
    else:
        _half_into(addr, pdt, n, out_sc)
    if base_addr < 0:
        for i in range(n):
            out_bs[i] = -sym_qmax * out_sc[i]
    elif pdt == 0:
        x = _f32_rows(base_addr, 0, n)
        for i in range(n):
            out_bs[i] = x[i]
    else:
        _half_into(base_addr, pdt, n, out_bs)


@inline
def _paged_rows(pool, lay, side, bt, b, h, H, D, ns, nst, nw, fsink, fwin, fds1, fds2, t0, t1, d, scr):
    """Descriptor rows (``d``) of one side of request ``b`` for kv head ``h``: its sink (``ns`` float32
    full-precision rows at address ``fsink``), its pages (store positions ``[0, nst)`` after the sink, page
    ``j`` in block ``bt[b, j]``) and its window (``nw`` float32 rows at ``fwin``); the full-precision rows'
    head and row strides are ``fds1`` / ``fds2`` floats. Pages outside ``[t0, t1)`` are left out. A page
    whose parameters are not float32 asymmetric gets float32 copies of head ``h``'s rows in ``scr[j]``.
    Returns the number of rows."""
    P, G = lay[_PL_P], lay[_PL_G]
    bits = lay[_PL_KBITS + side]
    rowb = lay[_PL_KROW + side]
    pack, sco, offo = lay[_PL_KPACK + 3 * side], lay[_PL_KSC + 3 * side], lay[_PL_KOFF + 3 * side]
    pdt = lay[_PL_PDT]
    prow = P // G if side == 0 else P  # parameter rows per page and head
    pcol = D if side == 0 else D // G  # parameters per row
    direct = pdt == 0 and offo >= 0
    qmax = np.float32(2 ** (bits - 1) - 1)
    n = 0
    if ns > 0:
        d[n, :] = 0
        d[n, _LO], d[n, _HI], d[n, _DATA], d[n, _DS1], d[n, _DS2], d[n, _H1] = 0, ns, fsink, fds1, fds2, H
        n += 1
    for j in range((nst + P - 1) // P):
        lo = ns + j * P
        hi = min(ns + nst, lo + P)
        if hi <= t0 or lo >= t1:
            continue
        blk = pool.ctypes.data + np.int64(bt[b, j]) * lay[_PL_BLOCK]
        d[n, :] = 0
        d[n, _LO], d[n, _HI], d[n, _QUANT], d[n, _BITS], d[n, _H1] = lo, hi, 1, bits, H
        d[n, _DATA], d[n, _DS1], d[n, _DS2] = blk + pack, P * rowb, rowb
        if direct:
            d[n, _SC], d[n, _SS1], d[n, _SS2] = blk + sco, prow * pcol, pcol
            d[n, _BS], d[n, _BS1], d[n, _BS2] = blk + offo, prow * pcol, pcol
        else:
            size = 4 if pdt == 0 else 2
            at = h * prow * pcol * size
            _param_rows(
                blk + sco + at, pdt, prow * pcol, qmax, scr[j, 0], scr[j, 1], blk + offo + at if offo >= 0 else -1
            )
            # the copies hold head h only: head strides 0
            d[n, _SC], d[n, _SS2] = scr[j, 0].ctypes.data, pcol
            d[n, _BS], d[n, _BS2] = scr[j, 1].ctypes.data, pcol
        n += 1
    if nw > 0:
        d[n, :] = 0
        lo = ns + nst
        d[n, _LO], d[n, _HI], d[n, _DATA], d[n, _DS1], d[n, _DS2], d[n, _H1] = lo, lo + nw, fwin, fds1, fds2, H
        n += 1
    return n


@jit
def _paged_task(q, pool, lay, bt, cnt, fpk, fpv, H, D, scaling, b, h, t0, t1, om, ol, oacc, valid, kscr, vscr):
    """Kv head ``h`` of request ``b`` over its kv positions ``[t0, t1)``: :func:`_task` on the request's pieces
    (``fpk`` / ``fpv``: where each side's full-precision rows are, ``[sink address, window address, head
    stride, row stride]``; ``kscr`` / ``vscr``: room for float32 copies of its pages' parameters, see
    :func:`_paged_rows`)."""
    P, G = lay[_PL_P], lay[_PL_G]
    npk, npv = (cnt[b, 1] + P - 1) // P, (cnt[b, 4] + P - 1) // P
    kd = np.empty((npk + 2, NCOL), dtype=np.int64)
    vd = np.empty((npv + 2, NCOL), dtype=np.int64)
    nk = _paged_rows(pool, lay, 0, bt, b, h, H, D, cnt[b, 0], cnt[b, 1], cnt[b, 2], fpk[0], fpk[1], fpk[2], fpk[3],
                     t0, t1, kd, kscr)
    nv = _paged_rows(pool, lay, 1, bt, b, h, H, D, cnt[b, 3], cnt[b, 4], cnt[b, 5], fpv[0], fpv[1], fpv[2], fpv[3],
                     t0, t1, vd, vscr)
    prm = np.array([lay[_PL_KBITS], G, lay[_PL_VBITS], G], dtype=np.int64)
    # the rows address the request's data directly (sequence strides 0)
    _task(q, kd[:nk], vd[:nv], prm, valid, 0, scaling, b, h, t0, t1, om, ol, oacc)


@inline
def _gathered_fp(fp, b, w0):
    """Where request ``b``'s rows are in a gathered ``fp [N, slots, H, D]`` float32 array: sink from slot 0,
    window from slot ``w0`` (:func:`_paged_task`'s ``[sink, window, head stride, row stride]``)."""
    _, slots, H, D = fp.shape
    fpa = fp.ctypes.data + 4 * b * slots * H * D
    return (fpa, fpa + 4 * w0 * H * D, D, H * D)


@inline
def _paged_scratch(cnt, lay, D, ntask):
    """Per task, room for float32 copies of a request's page parameters (scale and base of one head), needed
    unless they are float32 and asymmetric (then the rows point into the pages). Allocated by the entry
    points for all tasks: the rows hold raw addresses, and numba frees an array after its last visible use."""
    P, G = lay[_PL_P], lay[_PL_G]
    most = 0
    for b in range(cnt.shape[0]):
        most = max(most, (max(cnt[b, 1], cnt[b, 4]) + P - 1) // P)
    if lay[_PL_PDT] == 0 and lay[_PL_KOFF] >= 0:
        most = 0
    kscr = np.empty((ntask, most, 2, (P // G) * D), dtype=np.float32)
    vscr = np.empty((ntask, most, 2, P * (D // G)), dtype=np.float32)
    return kscr, vscr


@inline
def _paged_plan(cnt, hkv, chunk):
    """Split-K tasks of a ragged batch: per request ``nch[b]`` chunks of ``chunk`` kv positions, partial-state
    slots from ``slot0[b]`` (``(h, c)`` at ``slot0[b] + h * nch[b] + c``), and the task order: chunk index
    outermost, so numba's contiguous shares of the tasks mix long and short requests."""
    N = cnt.shape[0]
    nch = np.empty(N, dtype=np.int64)
    slot0 = np.empty(N + 1, dtype=np.int64)
    slot0[0] = 0
    most = 0
    for b in range(N):
        nch[b] = max(1, (cnt[b, 0] + cnt[b, 1] + cnt[b, 2] + chunk - 1) // chunk)
        slot0[b + 1] = slot0[b] + nch[b] * hkv
        most = max(most, nch[b])
    order = np.empty(slot0[N], dtype=np.int64)
    k = 0
    for c in range(most):
        for b in range(N):
            if c < nch[b]:
                for h in range(hkv):
                    order[k] = slot0[b] + h * nch[b] + c
                    k += 1
    return nch, slot0, order


@inline
def _task_of(slot, nch, slot0, cnt, chunk):
    """``(request b, kv head h, t0, t1)`` of the task whose partial state goes to ``slot``."""
    b = 0
    while slot0[b + 1] <= slot:
        b += 1
    r = slot - slot0[b]
    h = r // nch[b]
    c = r - h * nch[b]
    t0 = c * chunk
    return b, h, t0, min(cnt[b, 0] + cnt[b, 1] + cnt[b, 2], t0 + chunk)


@jit
def _paged_slot_task(slot, nch, slot0, q, pool, lay, bt, cnt, kfp, vfp, w0, scaling, hkv, chunk, pm, pl, pacc,
                     valid, kscr, vscr):
    """Run the task whose partial state goes to ``slot`` (full-precision rows gathered in ``kfp`` / ``vfp``)."""
    b, h, t0, t1 = _task_of(slot, nch, slot0, cnt, chunk)
    _, _, H, D = kfp.shape
    _paged_task(q, pool, lay, bt, cnt, _gathered_fp(kfp, b, w0), _gathered_fp(vfp, b, w0), H, D, scaling, b, h, t0,
                t1, pm[slot], pl[slot], pacc[slot], valid, kscr[slot], vscr[slot])


@jit
def _paged_merge(pm, pl, pacc, nch, slot0, out):
    """Combine each ``(request, kv head)``'s ``nch[b]`` partial states (log-sum-exp) into ``out``."""
    N, Hq, Dv = out.shape
    g = pm.shape[1]
    hkv = Hq // g
    for b in range(N):
        for h in range(hkv):
            s0 = slot0[b] + h * nch[b]
            for i in range(g):
                mx = _NEG32
                for c in range(nch[b]):
                    mx = max(mx, pm[s0 + c, i])
                tot = _F0
                o = out[b, h * g + i]
                o[:] = 0.0
                for c in range(nch[b]):
                    w = np.exp(pm[s0 + c, i] - mx)
                    tot += w * pl[s0 + c, i]
                    pa = pacc[s0 + c, i]
                    for k in range(Dv):
                        o[k] += w * pa[k]
                for k in range(Dv):
                    o[k] /= tot


_PAGED_SIGNATURE = (
    "void(float32[:,:,::1], uint8[::1], int64[::1], int32[:,::1], int64[:,::1], float32[:,:,:,::1], "
    "float32[:,:,:,::1], int64, float32, int64, int64, float32[:,:,::1])"
)


@entry_threaded
def paged_decode_threaded(q, pool, lay, bt, cnt, kfp, vfp, w0, scaling, hkv, chunk, out):
    """Paged entry point, threaded: tasks ``(request, kv head, chunk)`` in ``prange``, then merge."""
    nch, slot0, order = _paged_plan(cnt, hkv, chunk)
    g = q.shape[1] // hkv
    ntask = order.shape[0]
    pm = np.empty((ntask, g), dtype=np.float32)
    pl = np.empty((ntask, g), dtype=np.float32)
    pacc = np.empty((ntask, g, out.shape[2]), dtype=np.float32)
    valid = np.ones((1, 1), dtype=np.bool_)
    kscr, vscr = _paged_scratch(cnt, lay, q.shape[2], ntask)
    for k in prange(ntask):
        _paged_slot_task(order[k], nch, slot0, q, pool, lay, bt, cnt, kfp, vfp, w0, scaling, hkv, chunk, pm, pl,
                         pacc, valid, kscr, vscr)
    _paged_merge(pm, pl, pacc, nch, slot0, out)


@entry_serial
def paged_decode_serial(q, pool, lay, bt, cnt, kfp, vfp, w0, scaling, hkv, chunk, out):
    """Paged entry point, calling thread only; same tasks as above."""
    nch, slot0, order = _paged_plan(cnt, hkv, chunk)
    g = q.shape[1] // hkv
    ntask = order.shape[0]
    pm = np.empty((ntask, g), dtype=np.float32)
    pl = np.empty((ntask, g), dtype=np.float32)
    pacc = np.empty((ntask, g, out.shape[2]), dtype=np.float32)
    valid = np.ones((1, 1), dtype=np.bool_)
    kscr, vscr = _paged_scratch(cnt, lay, q.shape[2], ntask)
    for k in range(ntask):
        _paged_slot_task(order[k], nch, slot0, q, pool, lay, bt, cnt, kfp, vfp, w0, scaling, hkv, chunk, pm, pl,
                         pacc, valid, kscr, vscr)
    _paged_merge(pm, pl, pacc, nch, slot0, out)


# ------------------------------------------------------------------------------------- paged decode, rows in place
# The same tasks, the full-precision rows read where they live: a rows pool ``[blocks, rows_per_block, H, D]``
# (float32 / bfloat16 / float16, any strides but the channel's) described by one layout row per side (columns
# ``_RL_*``, written by :class:`.paged.RingRows`), a slot table ``int32 [N, w0 + ring]`` of row ids
# (``block * rows_per_block + row``) per side, and the step's new token ``[N, H, D]`` per side. Each task copies
# the rows its chunk covers, of its kv head, to float32 scratch (:func:`_ring_stage`; ``fscr [N * H, 2, w0 + ring
# + 1, D]``, given by the caller so that it is reused between calls) and runs the pieces over it.
_RL_ADDR, _RL_SBLOCK, _RL_SROW, _RL_SHEAD, _RL_RPB, _RL_DTYPE = 0, 1, 2, 3, 4, 5
RING_NCOL = 6


@inline
def _ring_row(rl, rid, h, D, out):
    """Kv head ``h`` of row ``rid`` (block ``rid // rows_per_block``) of rows pool ``rl``, as float32 into ``out``."""
    blk = rid // rl[_RL_RPB]
    addr = rl[_RL_ADDR] + blk * rl[_RL_SBLOCK] + (rid - blk * rl[_RL_RPB]) * rl[_RL_SROW] + h * rl[_RL_SHEAD]
    dt = rl[_RL_DTYPE]
    if dt == 0:
        x = _f32_rows(addr, 0, D)
        for k in range(D):
            out[k] = x[k]
    else:
        _half_into(addr, dt, D, out)


@inline
def _ring_stage(rl, slots, new, b, h, ns, nst, nw, w0, t0, t1, out):
    """Kv head ``h``'s full-precision rows of one side of request ``b`` as float32 in ``out [rows, D]``: sink token
    ``t < ns`` at ``out[t]`` (row ``slots[b, t]``), window token ``j < nw`` (position ``t = ns + nst + j``) at
    ``out[ns + j]`` — the first ``nw - 1`` from row ``slots[b, c]``, ``c`` the slot of
    :func:`kivi.paged.ring.ring_slot` (``t`` below ``w0``, else ``w0 + t % ring``, ``ring = slots.shape[1] - w0``;
    the one ring rule, restated here: compiled code cannot call it), the last from ``new[b]``. Only positions in
    ``[t0, t1)``: the task reads no other."""
    ring = slots.shape[1] - w0
    D = out.shape[1]
    for t in range(max(0, t0), min(ns, t1)):
        _ring_row(rl, np.int64(slots[b, t]), h, D, out[t])
    lo = ns + nst
    for t in range(max(lo, t0), min(lo + nw, t1)):
        j = t - lo
        o = out[ns + j]
        if j == nw - 1:
            x = new[b, h]
            for k in range(D):
                o[k] = x[k]
        else:
            _ring_row(rl, np.int64(slots[b, t if t < w0 else w0 + t % ring]), h, D, o)


@jit
def _ring_slot_task(slot, nch, slot0, q, pool, lay, bt, cnt, ks, vs, rl, knew, vnew, w0, scaling, hkv, chunk, pm, pl,
                    pacc, valid, kscr, vscr, fscr):
    """Run the task whose partial state goes to ``slot`` (full-precision rows read through the slot tables)."""
    b, h, t0, t1 = _task_of(slot, nch, slot0, cnt, chunk)
    fk, fv = fscr[b * hkv + h, 0], fscr[b * hkv + h, 1]  # shared by the head's chunks: they stage disjoint rows
    _ring_stage(rl[0], ks, knew, b, h, cnt[b, 0], cnt[b, 1], cnt[b, 2], w0, t0, t1, fk)
    _ring_stage(rl[1], vs, vnew, b, h, cnt[b, 3], cnt[b, 4], cnt[b, 5], w0, t0, t1, fv)
    H, D = knew.shape[1], knew.shape[2]
    ka, va = np.int64(fk.ctypes.data), np.int64(fv.ctypes.data)
    zero, row = np.int64(0), np.int64(D)  # the scratch holds head h only: head stride 0
    _paged_task(q, pool, lay, bt, cnt, (ka, ka + 4 * cnt[b, 0] * D, zero, row),
                (va, va + 4 * cnt[b, 3] * D, zero, row), H, D, scaling, b, h, t0, t1, pm[slot], pl[slot], pacc[slot],
                valid, kscr[slot], vscr[slot])


_RING_SIGNATURE = (
    "void(float32[:,:,::1], uint8[::1], int64[::1], int32[:,::1], int64[:,::1], int32[:,::1], int32[:,::1], "
    "int64[:,::1], float32[:,:,::1], float32[:,:,::1], int64, float32, int64, int64, float32[:,:,:,::1], "
    "float32[:,:,::1])"
)


@entry_threaded
def paged_ring_decode_threaded(q, pool, lay, bt, cnt, ks, vs, rl, knew, vnew, w0, scaling, hkv, chunk, fscr,
                              out):
    """Paged entry point with rows in place, threaded: tasks ``(request, kv head, chunk)`` in ``prange``, then merge."""
    nch, slot0, order = _paged_plan(cnt, hkv, chunk)
    g = q.shape[1] // hkv
    ntask = order.shape[0]
    pm = np.empty((ntask, g), dtype=np.float32)
    pl = np.empty((ntask, g), dtype=np.float32)
    pacc = np.empty((ntask, g, out.shape[2]), dtype=np.float32)
    valid = np.ones((1, 1), dtype=np.bool_)
    kscr, vscr = _paged_scratch(cnt, lay, q.shape[2], ntask)
    for k in prange(ntask):
        _ring_slot_task(order[k], nch, slot0, q, pool, lay, bt, cnt, ks, vs, rl, knew, vnew, w0, scaling, hkv, chunk,
                        pm, pl, pacc, valid, kscr, vscr, fscr)
    _paged_merge(pm, pl, pacc, nch, slot0, out)


@entry_serial
def paged_ring_decode_serial(q, pool, lay, bt, cnt, ks, vs, rl, knew, vnew, w0, scaling, hkv, chunk, fscr, out):
    """Paged entry point with rows in place, calling thread only; same tasks as above."""
    nch, slot0, order = _paged_plan(cnt, hkv, chunk)
    g = q.shape[1] // hkv
    ntask = order.shape[0]
    pm = np.empty((ntask, g), dtype=np.float32)
    pl = np.empty((ntask, g), dtype=np.float32)
    pacc = np.empty((ntask, g, out.shape[2]), dtype=np.float32)
    valid = np.ones((1, 1), dtype=np.bool_)
    kscr, vscr = _paged_scratch(cnt, lay, q.shape[2], ntask)
    for k in range(ntask):
        _ring_slot_task(order[k], nch, slot0, q, pool, lay, bt, cnt, ks, vs, rl, knew, vnew, w0, scaling, hkv, chunk,
                        pm, pl, pacc, valid, kscr, vscr, fscr)
    _paged_merge(pm, pl, pacc, nch, slot0, out)


# --------------------------------------------------------------------------------------------- loading the entries
#: Every entry point with the one signature it is compiled for.
ENTRIES = (
    (decode_threaded, _SIGNATURE),
    (decode_serial, _SIGNATURE),
    (paged_decode_threaded, _PAGED_SIGNATURE),
    (paged_decode_serial, _PAGED_SIGNATURE),
    (paged_ring_decode_threaded, _RING_SIGNATURE),
    (paged_ring_decode_serial, _RING_SIGNATURE),
)
#: Every compiled function of this module (entries and ``@jit`` callees): whose cache files
#: :func:`kivi.numba_cache.set_aside_unreadable` checks.
DISPATCHERS = tuple(f for f in dict(globals()).values() if isinstance(f, numba.core.dispatcher.Dispatcher))


def _selected(names) -> list:
    """The ``(entry, signature)`` pairs of :data:`ENTRIES` named in ``names`` (all for ``None``), in
    :data:`ENTRIES` order; ``ValueError`` for a name that is not an entry."""
    if names is None:
        return list(ENTRIES)
    known = {entry.__name__ for entry, _ in ENTRIES}
    unknown = sorted(set(names) - known)
    if unknown:
        raise ValueError(f"not entry points of the decode kernel: {unknown}; entries are {sorted(known)}")
    return [(entry, sig) for entry, sig in ENTRIES if entry.__name__ in names]


def cache_missing(names=None) -> list[str]:
    """The entry points (of ``names``; ``None``: all) numba's on-disk cache has no code for (this machine, this
    source), loading nothing.

    It asks numba's cache index with the key numba's own lookup computes (``Dispatcher.compile`` looks the
    signature up the same way before it compiles); an index entry whose data file is gone is missing too (numba
    would compile it in this process). These are numba internals (``_cache``, ``_index_key``, ``_cache_file``,
    ``_data_path``, as numba 0.65 and 0.68 define them), tested in tests/attention/test_kernel_cache.py; a
    numba that renames them raises ``AttributeError`` here rather than answering wrong (the caller warns). Where
    numba cannot cache at all (``NullCache``: no writable cache directory) the answer is ``[]``: nothing to fill.
    """
    from numba.core.caching import NullCache

    missing = []
    for entry, sig in _selected(names):
        cache = entry._cache
        if isinstance(cache, NullCache):  # caching unavailable here
            return []
        entry.targetctx.refresh()
        data = cache._cache_file._load_index().get(cache._index_key(sig, entry.targetctx.codegen()))
        if data is None or not os.path.exists(cache._cache_file._data_path(data)):  # a data file set aside: a miss
            missing.append(entry.__name__)
    return missing


def load_entries(names=None) -> None:
    """Compile the entry points named in ``names`` (``None``: all), or load them from numba's on-disk cache, then
    close them to new signatures.

    Why not at import, and why the caller fills a cold cache in another process first
    (:func:`.dispatch._kernel`): under ``fastmath`` the code numba runs right after compiling differs in
    rounding from the code it saves and loads back. A freshly compiled entry calls the separately compiled
    copies of its ``@jit`` callees and parallel loop bodies, while the saved object holds its own copies,
    optimised again after linking, and reassociation reorders float sums differently in the two (about 1 ulp of
    float32; enough to flip a near-tie between two tokens). A process that runs code loaded from the cache
    gives the same bits as every other such process. Measured: docs/kernels.md, "The fused CPU decode kernel".
    """
    for entry, sig in _selected(names):
        if not entry.signatures:  # idempotent: a second call finds the overload and compiling closed
            entry.compile(sig)
        entry.disable_compile()  # as numba does for a signature given at decoration: calls convert, never compile


def fill_entries(names) -> None:
    """What the child of :func:`.dispatch._fill_cache` runs: compile the entries ``names`` and save them to numba's
    cache, every ``@jit`` callee compiled here (their caches turned off: neither read nor written).

    So the saved code does not depend on what an earlier fill left in the cache, nor on which entries are filled
    together (each links callees compiled in this process from the source): an entry compiled against callees
    loaded from the cache links the same callee code, yet its outputs differed from the entry compiled with fresh
    callees in the last float32 bit (``tests/attention/test_kernel_cache.py``, the unreadable-file test, failed
    that way). Entries named together share the compile of their callees.
    """
    entries = {entry for entry, _ in _selected(names)}
    for f in DISPATCHERS:
        if f not in entries:
            f._cache.disable()
    load_entries(names)
