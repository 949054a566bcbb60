"""Per-token (value) quantization and packing in one compiled pass (numba).

The reference is :func:`kivi.quant.kv.quantize_kv` with ``axis="token"``; this computes the same
codes, scales and offsets bit for bit, for the configurations it accepts: asymmetric min/max (optionally
clipped), no error compensation, 1, 2, 3, 4 or 8 bits, finiteness checked. It exists for the decode step, where one
value token leaves the full-precision window of every layer: the torch path spends ~15 small tensor ops
(~300 us on the 2-core development machine) on those 64 numbers, this one call ~10-20 us. Two entries:

* :func:`quantize_tokens_into` (:func:`token_quantizer_supported`: float32 values and parameters) writes
  straight into the cache's block storage (:meth:`kivi.cache.store.BlockStore.append_in_place`);
* :func:`quantize_tokens` (:func:`tokens_quantizable`: float32 / bfloat16 / float16 values, float32 or
  bfloat16 parameters) returns what :func:`kivi.quant.kv.quantize_side` returns (the vLLM pages' write step,
  :mod:`kivi.paged.forward`). bfloat16 parameters are rounded to the nearest bfloat16 (ties to even, as torch
  converts) before the codes are computed against them, as the reference does.

Numerics, kept identical to the torch reference (``fastmath`` off, float32 throughout; ``stored(x)``: ``x``, or
its nearest bfloat16): ``offset = stored(min)``, ``scale = stored((max - offset) / (2**bits - 1))``,
``code = clamp(rint((x - offset) / scale), 0, 2**bits - 1)`` (round half to even, like ``torch.round``), code 0
where ``scale == 0``.
With ``clip=True`` the group's parameters are chosen as :mod:`kivi.quant.clipping` chooses them (same
candidates, same float32 operations, the error summed in the same element order), so the codes stay
bit-identical to the torch reference with clipping on.
Codes are packed as in :mod:`kivi.quant.packing`: a little-endian bit stream along the channels,
code ``c`` at bits ``[c * bits, (c + 1) * bits)`` of the row (for 1, 2, 4, 8 bits ``8 // bits`` codes per
byte; for 3 bits the same stream is the runs of 8 codes in 3 bytes, a code may straddle two bytes).
numba is imported, and the kernel compiled or loaded from numba's on-disk cache, on first use
(:func:`_kernel`, the kernel in :mod:`kivi.quant.numba_quant_kernel`): ``import kivi`` does not import it.
:func:`kivi.optional.numba_available` is kivi's one check for numba (the fused decode attention of
:mod:`kivi.attention.fused_cpu` uses it too).
"""

from __future__ import annotations

import functools

import numpy as np
import torch

from ..optional import numba_available
from .clipping import shrink_factors
from .kv import PackedKV
from .packing import packed_size
from .side_format import VALUE_AXIS, SideFormat

#: dtypes of the values :func:`quantize_tokens` takes (converted to float32 exactly, as the reference does) and of
#: the parameters it stores (float16 parameters: the torch path).
INPUT_DTYPES = (torch.float32, torch.bfloat16, torch.float16)
PARAM_DTYPES = (torch.float32, torch.bfloat16)


def tokens_quantizable(fmt: SideFormat, dtype: torch.dtype) -> bool:
    """Whether :func:`quantize_tokens` reproduces :func:`kivi.quant.kv.quantize_side` for the value format ``fmt``
    and cached tensors of ``dtype``: numba installed, values (per-token groups), asymmetric min/max (optionally
    clipped), no compensation, finiteness checked, ``dtype`` in :data:`INPUT_DTYPES` and parameters in
    :data:`PARAM_DTYPES`."""
    return (
        numba_available()
        and fmt.axis == VALUE_AXIS
        and dtype in INPUT_DTYPES
        and fmt.param_dtype(dtype) in PARAM_DTYPES
        and not fmt.symmetric
        and fmt.residual_bits == 0
        and fmt.check_finite
    )


def token_quantizer_supported(fmt: SideFormat, dtype: torch.dtype) -> bool:
    """Whether :func:`quantize_tokens_into` (float32 values and parameters, written in place) reproduces
    :func:`kivi.quant.kv.quantize_side` for the value format ``fmt`` and cached tensors of ``dtype``."""
    return tokens_quantizable(fmt, dtype) and dtype == torch.float32 and fmt.param_dtype(dtype) == torch.float32


@functools.cache
def _kernel():
    """The compiled kernel (:func:`kivi.quant.numba_quant_kernel.quantize_tokens`, or numba's cached copy); imports
    numba on first use, and first sets aside its cache files that do not read back (:mod:`kivi.numba_cache`, one
    warning; numba then compiles it again)."""
    from ..numba_cache import set_aside_unreadable
    from . import numba_quant_kernel

    try:
        set_aside_unreadable([numba_quant_kernel.quantize_tokens], "kivi's value quantizer")
    except AttributeError:  # a numba whose cache internals differ: numba's own loading decides
        pass
    return numba_quant_kernel.quantize_tokens


def quantize_tokens_into(x: torch.Tensor, fmt: SideFormat, packed: torch.Tensor, scale: torch.Tensor,
                         offset: torch.Tensor) -> None:
    """Quantize values ``x [B, H, n, D]`` (float32) per token in the values' format ``fmt`` (its width, group size
    and ``clip``: MSE-optimal group ranges, the choice of :func:`kivi.quant.clipping.clipped_params`) into the given
    (possibly strided) views.

    ``packed [B, H, n, packed_size(D, bits)]`` uint8, ``scale`` / ``offset [B, H, n, D // G]`` float32.
    Raises ``ValueError`` (as :func:`kivi.quant.primitives.quantize_groups` does) on NaN / Inf.
    """
    bits, group_size = fmt.bits, fmt.group_size
    if x.dtype != torch.float32 or scale.dtype != torch.float32 or offset.dtype != torch.float32:
        raise ValueError(f"quantize_tokens_into needs float32 input and parameters, got {x.dtype} / {scale.dtype}")
    if fmt.axis != VALUE_AXIS or fmt.symmetric or fmt.residual_bits:
        raise ValueError(f"quantize_tokens_into writes asymmetric values without compensation, got {fmt}")
    B, H, n, D = x.shape
    if D % group_size:
        raise ValueError(f"group_size={group_size} must divide head_dim={D}")
    if tuple(packed.shape) != (B, H, n, packed_size(D, bits)) or tuple(scale.shape) != (B, H, n, D // group_size):
        raise ValueError(f"output views {tuple(packed.shape)} / {tuple(scale.shape)} do not match x {tuple(x.shape)}")
    if _kernel()(x.detach().numpy(), bits, group_size, shrinks_array(fmt.clip), packed.numpy(), scale.numpy(),
                 offset.numpy(), False):
        raise ValueError(
            "x contains NaN or Inf; KV quantization needs finite values (pass check_finite=False to let a "
            "non-finite value poison its group instead)"
        )


def quantize_tokens(x: torch.Tensor, fmt: SideFormat) -> PackedKV:
    """:func:`kivi.quant.kv.quantize_side` of values ``x [B, H, n, D]`` (on the CPU) in one compiled pass, bit for bit,
    where :func:`tokens_quantizable` says so (``ValueError`` otherwise, and on NaN / Inf as the reference).

    The torch reference spends ~15 small tensor operations on a decode step's few leaving rows; this is one call.
    """
    if x.device.type != "cpu" or not tokens_quantizable(fmt, x.dtype):
        raise ValueError(f"quantize_tokens does not reproduce quantize_side for {fmt} and {x.dtype} values on "
                         f"{x.device.type}: see tokens_quantizable")
    if x.dim() != 4:
        raise ValueError(f"x must be [batch, heads, tokens, head_dim], got shape {tuple(x.shape)}")
    B, H, n, D = x.shape
    G = fmt.group_size
    if G <= 0 or D % G:
        raise ValueError(f"group_size={G} must divide head_dim={D}")
    pdt = fmt.param_dtype(x.dtype)
    packed = torch.empty(B, H, n, packed_size(D, fmt.bits), dtype=torch.uint8)
    scale, offset = torch.empty(B, H, n, D // G), torch.empty(B, H, n, D // G)
    xf = x.detach().float().contiguous()
    if _kernel()(xf.numpy(), fmt.bits, G, shrinks_array(fmt.clip), packed.numpy(), scale.numpy(), offset.numpy(),
                 pdt == torch.bfloat16):
        raise ValueError(
            "x contains NaN or Inf; KV quantization needs finite values (pass check_finite=False to let a "
            "non-finite value poison its group instead)"
        )
    return PackedKV(packed=packed, scale=scale.to(pdt), offset=offset.to(pdt), comp=None, format=fmt, head_dim=D)


@functools.cache
def shrinks_array(clip: bool) -> np.ndarray:
    """The compiled quantizers' ``shrinks`` argument: the clipping grid, or ``[1.0]`` (min/max); made once, never
    written."""
    return (shrink_factors() if clip else torch.ones(1)).numpy()


def warmup() -> None:
    """Compile (or load from numba's cache) the kernel now."""
    _kernel()


__all__ = ["numba_available", "token_quantizer_supported", "quantize_tokens_into", "tokens_quantizable",
           "quantize_tokens", "INPUT_DTYPES", "PARAM_DTYPES", "shrinks_array", "warmup"]
