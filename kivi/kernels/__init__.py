"""Optional Triton kernels: quantize + pack, and decode attention that reads the packed cache in place
(sink tokens, every stored block through a small descriptor table, the full-precision window: one launch).

``import kivi.kernels`` never imports triton; :func:`triton_available` says whether it is installed.
Each kernel has a plain-torch reference beside it (``kivi.quant.kv.quantize_kv`` for the quantizers,
:func:`torch_decode_attention_packed` for attention). On CPU tensors the kernels run only under
``TRITON_INTERPRET=1`` set before triton is imported (that is how the tests run them).
"""

from ._common import triton_available
from .segments import BlockTable, KernelSide, build_block_table, kernel_side
from .triton_attention import decode_attention_sides, torch_decode_attention_sides
from .triton_attention_loose import decode_attention_packed, torch_decode_attention_packed
from .triton_quant import quantize_pack_keys, quantize_pack_values

__all__ = [
    "triton_available",
    "quantize_pack_keys",
    "quantize_pack_values",
    "decode_attention_packed",
    "torch_decode_attention_packed",
    "decode_attention_sides",
    "torch_decode_attention_sides",
    "BlockTable",
    "KernelSide",
    "build_block_table",
    "kernel_side",
]
