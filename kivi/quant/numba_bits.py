"""numba's bit casts between float32 and 32-bit integers: the one home of these intrinsics, used by every
compiled kernel of kivi (the quantizers of :mod:`kivi.quant.numba_quant_kernel`, the vLLM decode step's writes,
the decode kernel of :mod:`kivi.attention.fused_cpu.kernel`).

Importing this module imports numba.
"""

from __future__ import annotations

from numba import types
from numba.extending import intrinsic


@intrinsic
def f32_bits(typingctx, x):
    """The bit pattern (uint32) of the float32 ``x``."""
    sig = types.uint32(types.float32)

    def codegen(context, builder, signature, args):
        return builder.bitcast(args[0], context.get_value_type(types.uint32))

    return sig, codegen


@intrinsic
def bits_f32(typingctx, x):
    """The float32 whose bit pattern is the 32-bit integer ``x``: an int32 as it is, any other integer converted
    to uint32 first (as numba converts an argument to a declared type)."""
    if not isinstance(x, types.Integer):
        return None
    sig = types.float32(types.int32 if x == types.int32 else types.uint32)

    def codegen(context, builder, signature, args):
        return builder.bitcast(args[0], context.get_value_type(types.float32))

    return sig, codegen


__all__ = ["bits_f32", "f32_bits"]
