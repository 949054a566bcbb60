"""The numba side of :mod:`kivi.quant.numba_quant`: one group's asymmetric min/max parameters and codes, the rule
every compiled quantizer of kivi calls (values per token here, keys per channel in the vLLM decode step's
writes, :mod:`kivi.paged.write_kernel`).

Importing this module imports numba; :mod:`kivi.quant.numba_quant` imports it on first use. Nothing here uses
``fastmath``: every operation is the float32 operation the torch reference (:func:`kivi.quant.primitives.
quantize_groups`, :func:`kivi.quant.clipping.clipped_params`) performs, in the same order, so the codes and
parameters are bit-identical to it (the module docstring of :mod:`kivi.quant.numba_quant` states the numerics).
"""

from __future__ import annotations

import numba
import numpy as np
from numba import types
from numba.extending import overload

from .numba_bits import bits_f32, f32_bits

inline = numba.njit(inline="always", cache=True)

_F0 = np.float32(0.0)
_F1 = np.float32(1.0)
_F2 = np.float32(2.0)


def as_f32(x):
    """``x`` (a float32, or an int16 holding bfloat16 bits: how numpy sees a bfloat16 tensor) as float32, exactly."""


@overload(as_f32, inline="always")
def _as_f32(x):
    if isinstance(x, types.Float):
        return lambda x: np.float32(x)
    if x == types.int16:
        return lambda x: bits_f32(np.uint32(np.uint16(x)) << np.uint32(16))
    return None


@inline
def stored(v, bf16):
    """``v`` as the parameters store it: itself, or (``bf16``) its nearest bfloat16, ties to even, as torch
    converts (a NaN stays itself)."""
    if not bf16 or v != v:
        return v
    w = f32_bits(v)
    return bits_f32((w + np.uint32(0x7FFF) + ((w >> np.uint32(16)) & np.uint32(1))) & np.uint32(0xFFFF0000))


@inline
def group_code(v, lo, sc, flevels):
    """The code of ``v`` in a group of offset ``lo`` and scale ``sc``: ``clamp(rint((v - lo) / sc), 0, levels)``
    (round half to even, as ``torch.round``), 0 where ``sc == 0``."""
    if sc > _F0:
        q = np.rint((v - lo) / sc)
        return np.int32(min(max(q, _F0), flevels))
    return np.int32(0)


@inline
def group_params(g, levels, shrinks, bf16):
    """``(scale, offset)`` of the finite float32 group ``g`` (a 1-D array, any stride) as stored (``bf16``: rounded
    to bfloat16): min/max when ``shrinks`` is ``[1.0]``, else the clipping candidate of
    :mod:`kivi.quant.clipping` with the smallest squared error (summed in element order), the first on ties."""
    n = g.shape[0]
    flevels = np.float32(levels)
    lo = g[0]
    hi = g[0]
    for c in range(1, n):
        v = g[c]
        lo = min(lo, v)
        hi = max(hi, v)
    R = shrinks.shape[0]
    if R == 1:
        lo = stored(lo, bf16)
        return stored((hi - lo) / flevels, bf16), lo
    mid = (lo + hi) / _F2
    best_err = _F0
    best_lo = lo
    best_sc = _F0
    for ri in range(R):
        r = shrinks[ri]
        clo = lo
        chi = hi
        if r != _F1:
            half = (hi - lo) / _F2 * r
            clo = mid - half
            chi = mid + half
        clo = stored(clo, bf16)
        csc = stored((chi - clo) / flevels, bf16)
        err = _F0
        for c in range(n):
            q = np.float32(group_code(g[c], clo, csc, flevels))
            d = q * csc + clo - g[c]
            err += d * d
        if ri == 0 or err < best_err:
            best_err = err
            best_lo = clo
            best_sc = csc
    return best_sc, best_lo


@inline
def put_code(row, c, bits, q):
    """OR code ``q`` of channel ``c`` into the packed ``row`` (uint8, zeroed before): the little-endian bit stream
    of :mod:`kivi.quant.packing` (for 3 bits a code may straddle two bytes)."""
    p = c * bits
    sh = p & 7
    row[p >> 3] |= np.uint8((q << sh) & 0xFF)
    if sh + bits > 8:
        row[(p >> 3) + 1] |= np.uint8(q >> (8 - sh))


@inline
def all_finite(x):
    """Whether every value of the float32 array ``x`` (any shape) is finite."""
    for v in x.flat:
        if not np.isfinite(v):
            return False
    return True


@numba.njit(
    "int64(float32[:,:,:,:], int64, int64, float32[:], uint8[:,:,:,:], float32[:,:,:,:], float32[:,:,:,:], boolean)",
    cache=True,
)
def quantize_tokens(x, bits, G, shrinks, packed, scale, offset, bf16):
    """Quantize every token row of ``x [B, H, n, D]`` in groups of ``G`` channels into ``packed`` / ``scale`` /
    ``offset`` (float32, holding the stored values; ``bf16``: rounded to bfloat16 first).

    ``shrinks`` (float32): the clipping grid of :mod:`kivi.quant.clipping`, or ``[1.0]`` for min/max.
    Every row is checked before anything is written: returns 1, having written nothing, when a value is not
    finite, else 0.
    """
    B, H, n, D = x.shape
    levels = (1 << bits) - 1
    flevels = np.float32(levels)
    for b in range(B):
        for h in range(H):
            for t in range(n):
                for c in range(D):
                    if not np.isfinite(x[b, h, t, c]):
                        return 1
    for b in range(B):
        for h in range(H):
            for t in range(n):
                row = x[b, h, t]
                out = packed[b, h, t]
                out[:] = 0
                for gi in range(D // G):
                    c0 = gi * G
                    sc, lo = group_params(row[c0 : c0 + G], levels, shrinks, bf16)
                    scale[b, h, t, gi] = sc
                    offset[b, h, t, gi] = lo
                    for c in range(c0, c0 + G):
                        put_code(out, c, bits, group_code(row[c], lo, sc, flevels))
    return 0
