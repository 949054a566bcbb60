"""Quantization primitives (pure functions), bit packing and quantized K/V segments."""

from .kv import PackedKV, dequantize_kv, quantize_kv
from .packing import pack_codes, packed_size, unpack_codes
from .primitives import SUPPORTED_BITS, dequantize_groups, fake_quantize, quantize_groups

__all__ = [
    "SUPPORTED_BITS",
    "quantize_groups",
    "dequantize_groups",
    "fake_quantize",
    "pack_codes",
    "unpack_codes",
    "packed_size",
    "PackedKV",
    "quantize_kv",
    "dequantize_kv",
]
