"""Bit packing of integer codes into bytes.

Layout (little-endian bit stream along the last axis):

* 1, 2, 4, 8 bits: ``8 // bits`` codes per byte, code ``j`` of a byte in bits ``[j*bits, (j+1)*bits)``
  (2 bits: 4 codes per byte, the first in the lowest two bits). ``n`` codes take ``ceil(n*bits/8)`` bytes.
* 3 bits: runs of 8 codes form a little-endian 24-bit integer (code ``j`` at bits ``[3j, 3j+3)``),
  stored as 3 bytes. ``n`` codes take ``ceil(n/8)*3`` bytes.

Shapes: ``codes [..., n]`` (uint8, values < 2**bits) -> ``packed [..., packed_size(n, bits)]`` (uint8).
The tail is zero-padded and ``unpack_codes`` takes ``n`` back.
"""

from __future__ import annotations

import torch

from .primitives import SUPPORTED_BITS, check_bits

#: Widths whose codes fill a byte evenly (``8 // bits`` per byte, none spanning two bytes): every
#: supported width but 3. The Triton quantize kernels and the numba value quantizer handle only these; the
#: numba decode kernel (:mod:`kivi.attention.fused_cpu`) and the Triton decode kernel
#: (``kivi.kernels._common.ATTENTION_BITS``) also read 3-bit runs.
WORD_BITS = tuple(b for b in SUPPORTED_BITS if 8 % b == 0)  # (1, 2, 4, 8)


def packed_size(n: int, bits: int) -> int:
    """Bytes used along the last axis for ``n`` codes of ``bits`` bits."""
    if bits == 3:
        return -(-n // 8) * 3
    return -(-n * bits // 8)


def pack_codes(codes: torch.Tensor, bits: int) -> torch.Tensor:
    """Pack uint8 ``codes [..., n]`` into ``[..., packed_size(n, bits)]`` uint8 bytes."""
    check_bits(bits)
    if codes.dtype != torch.uint8:
        raise ValueError(f"codes must be uint8, got {codes.dtype}")
    if bits == 8:
        return codes.contiguous()
    n = codes.shape[-1]
    run = 8 if bits == 3 else 8 // bits
    pad = (-n) % run
    if pad:
        codes = torch.nn.functional.pad(codes, (0, pad))
    if bits in WORD_BITS:
        per_byte = 8 // bits
        c = codes.reshape(*codes.shape[:-1], -1, per_byte)  # [..., bytes, codes_per_byte]
        shifts = torch.arange(per_byte, device=codes.device, dtype=torch.uint8) * bits
        out = (c << shifts).sum(dim=-1, dtype=torch.int32).to(torch.uint8)
        return out.reshape(*codes.shape[:-1], -1)
    # 3 bits: assemble each run of 8 codes as a 24-bit integer, then split it into bytes.
    runs = codes.reshape(*codes.shape[:-1], -1, 8)
    shifts = torch.arange(8, device=codes.device, dtype=torch.int64) * bits
    word = (runs.to(torch.int64) << shifts).sum(dim=-1)  # [..., runs]
    byte_shifts = torch.arange(bits, device=codes.device, dtype=torch.int64) * 8
    out = ((word.unsqueeze(-1) >> byte_shifts) & 0xFF).to(torch.uint8)
    return out.reshape(*codes.shape[:-1], -1)


def unpack_codes(packed: torch.Tensor, bits: int, n: int) -> torch.Tensor:
    """Inverse of :func:`pack_codes`: ``[..., packed_size(n, bits)]`` -> uint8 ``[..., n]``."""
    check_bits(bits)
    if packed.dtype != torch.uint8:
        raise ValueError(f"packed must be uint8, got {packed.dtype}")
    if packed.shape[-1] != packed_size(n, bits):
        raise ValueError(
            f"packed last axis has {packed.shape[-1]} bytes, expected {packed_size(n, bits)} for n={n}, bits={bits}"
        )
    if bits == 8:
        return packed[..., :n]
    mask = (1 << bits) - 1
    if bits in WORD_BITS:
        per_byte = 8 // bits
        shifts = torch.arange(per_byte, device=packed.device, dtype=torch.uint8) * bits
        codes = (packed.unsqueeze(-1) >> shifts) & mask
        return codes.reshape(*packed.shape[:-1], -1)[..., :n]
    runs = packed.reshape(*packed.shape[:-1], -1, bits).to(torch.int64)
    byte_shifts = torch.arange(bits, device=packed.device, dtype=torch.int64) * 8
    word = (runs << byte_shifts).sum(dim=-1)  # [..., runs]
    shifts = torch.arange(8, device=packed.device, dtype=torch.int64) * bits
    codes = ((word.unsqueeze(-1) >> shifts) & mask).to(torch.uint8)
    return codes.reshape(*packed.shape[:-1], -1)[..., :n]
