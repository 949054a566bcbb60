"""Helpers shared by the Triton kernel modules (plain Python, no triton import at module level)."""

from __future__ import annotations

import os
import sys

import torch

from ..optional import triton_available
from ..quant.packing import WORD_BITS
from ..quant.primitives import SUPPORTED_BITS

_INSTALL_HINT = "Triton kernels need the optional dependency: pip install 'kivi[triton]' (or pip install triton)"


def require_triton(device: torch.device) -> None:
    """Raise a clear error unless triton can run kernels on ``device``.

    CUDA tensors need a working triton; CPU tensors need the interpreter: ``TRITON_INTERPRET=1``
    must be in the environment *before* triton is first imported (triton reads it at import time).
    """
    if not triton_available():
        raise ImportError(_INSTALL_HINT)
    if device.type == "cpu":
        already = "triton" in sys.modules
        if os.environ.get("TRITON_INTERPRET", "0") != "1" and not already:
            raise RuntimeError(
                "Triton kernels on CPU tensors run only under the interpreter: set TRITON_INTERPRET=1 "
                "in the environment before triton is imported (or move the tensors to a GPU)"
            )
        import triton.language as tl
        from triton.runtime.interpreter import InterpretedFunction

        if not isinstance(tl.sum, InterpretedFunction):
            raise RuntimeError(
                "triton was imported without TRITON_INTERPRET=1, so its kernels cannot run on CPU tensors; "
                "set TRITON_INTERPRET=1 before anything imports triton"
            )
    elif device.type != "cuda":
        raise ValueError(f"Triton kernels run on CUDA tensors (or CPU under TRITON_INTERPRET=1), got {device}")


def next_pow2(n: int) -> int:
    return 1 << max(0, int(n) - 1).bit_length()


#: Widths the decode attention kernel reads: every supported width (3 bits: each run of 8 codes in 3 bytes
#: is read as its 24-bit integer, a code may straddle two bytes). The quantize kernels write only
#: :data:`WORD_BITS`.
ATTENTION_BITS = SUPPORTED_BITS


def check_kernel_bits(bits: int, name: str = "bits", allowed: tuple[int, ...] = WORD_BITS) -> None:
    """Raise unless ``bits`` is in ``allowed`` (default: the quantize kernels' widths, 1/2/4/8)."""
    if isinstance(bits, bool) or bits not in allowed:
        extra = ""
        if bits == 3 and 3 not in allowed:
            extra = (" (3-bit packing spans byte boundaries; the Triton quantize kernels do not write it: "
                     "use the torch path kivi.quant.kv.quantize_kv)")
        raise ValueError(f"{name}={bits!r}: this Triton kernel supports bits in {list(allowed)}{extra}")


def param_kind(dtype: torch.dtype) -> int:
    """Code of the dtype scales/offsets are stored in: 0 float32, 1 float16, 2 bfloat16."""
    kinds = {torch.float32: 0, torch.float16: 1, torch.bfloat16: 2}
    if dtype not in kinds:
        raise ValueError(f"unsupported dtype {dtype}; expected float32, float16 or bfloat16")
    return kinds[dtype]
