"""Demotion: re-express asymmetric codes of ``bits`` on a narrower width inside the same range.

With asymmetric min/max quantization a group's ``b``-bit grid is ``lo + k * scale`` for
``k = 0 .. 2**b - 1``. When ``n`` divides ``b``, ``r = (2**b - 1) / (2**n - 1)`` is an odd integer
(4 -> 2 bits: ``r = 5``; 8 -> 4: 17; 2 -> 1: 3) and the ``n``-bit grid of the same range,
``lo + j * (r * scale)``, is contained in the ``b``-bit one (levels 0, 5, 10, 15 of 15). So::

    code_n  = round(code_b / r)        # exact integer rounding: r is odd, so no ties
    scale_n = r * scale                # rounded once to the stored parameter dtype
    offset  = offset                   # unchanged (the same range, the same zero point)

No full-precision copy is read or kept: the narrower code is the nearest level of the narrower grid
to the wider code's level (error at most ``(r - 1) / 2 * scale`` added to the wider code's error).
"""

from __future__ import annotations

import dataclasses

import torch

from .kv import PackedKV
from .packing import pack_codes, unpack_codes


def demote_ratio(bits: int, to_bits: int) -> int:
    """``(2**bits - 1) / (2**to_bits - 1)``; raises unless ``to_bits`` divides ``bits``."""
    if to_bits > bits or bits % to_bits:
        raise ValueError(f"to_bits={to_bits} must divide bits={bits} (a narrower grid inside the wider one)")
    return (2**bits - 1) // (2**to_bits - 1)


def demote_codes(codes: torch.Tensor, ratio: int) -> torch.Tensor:
    """uint8 codes divided by the odd ``ratio`` and rounded to nearest (no ties): ``(c + (r - 1) / 2) // r``."""
    return ((codes.to(torch.int16) + (ratio - 1) // 2) // ratio).to(torch.uint8)


def demote_kv(p: PackedKV, to_bits: int) -> PackedKV:
    """``p`` (asymmetric, no compensation) re-expressed on ``to_bits`` in each group's own range."""
    if p.offset is None or p.comp is not None:
        raise ValueError("demote_kv needs asymmetric codes without compensation (offset set, comp None)")
    r = demote_ratio(p.bits, to_bits)
    if r == 1:
        return p
    codes = demote_codes(unpack_codes(p.packed, p.bits, p.head_dim), r)
    scale = (p.scale.float() * r).to(p.scale.dtype)
    return PackedKV(packed=pack_codes(codes, to_bits), scale=scale, offset=p.offset.clone(), comp=None,
                    format=dataclasses.replace(p.format, bits=to_bits), head_dim=p.head_dim)


__all__ = ["demote_ratio", "demote_codes", "demote_kv"]
