"""Quantize + pack KV tensors with Triton (GPU; CPU under ``TRITON_INTERPRET=1``).

Reference: :func:`kivi.quant.kv.quantize_kv` (asymmetric, no compensation). The kernels return the
same :class:`~kivi.quant.kv.PackedKV` fields: codes equal the reference's (up to rounding ties that
float differences could flip), scale/offset in ``x.dtype`` (``param_dtype`` overrides).

Triton is imported only when a kernel is launched, so importing this module never needs it.
"""

from __future__ import annotations

import torch

from ..quant.kv import PackedKV
from ..quant.packing import packed_size
from ..quant.side_format import KEY_AXIS, VALUE_AXIS, SideFormat
from ._common import check_kernel_bits, next_pow2, param_kind, require_triton


def _check(x: torch.Tensor, bits: int, group_size: int, symmetric: bool, residual_bits: int) -> None:
    if symmetric:
        raise NotImplementedError("the Triton quantizer is asymmetric only (KIVI); use kivi.quant.kv.quantize_kv")
    if residual_bits:
        raise NotImplementedError(
            "the Triton quantizer does not compute error-compensation codes (residual_bits); "
            "use kivi.quant.kv.quantize_kv"
        )
    check_kernel_bits(bits)
    if x.dim() != 4:
        raise ValueError(f"x must be [batch, heads, tokens, head_dim], got shape {tuple(x.shape)}")
    if not x.is_floating_point():
        raise ValueError(f"x must be a floating-point tensor, got dtype {x.dtype}")
    if isinstance(group_size, bool) or not isinstance(group_size, int) or group_size <= 0:
        raise ValueError(f"group_size={group_size!r} must be a positive integer")


def _prepare(x, valid, param_dtype, check_finite):
    require_triton(x.device)
    if check_finite and not bool(torch.isfinite(x).all()):
        raise ValueError("x contains NaN or Inf; KV quantization needs finite values")
    pdt = param_dtype or x.dtype
    param_kind(pdt)
    param_kind(x.dtype)
    x = x.contiguous()
    B, H, T, D = x.shape
    if valid is not None:
        if tuple(valid.shape) != (B, T):
            raise ValueError(f"valid must be [batch, tokens] = {(B, T)}, got {tuple(valid.shape)}")
        valid = valid.to(device=x.device, dtype=torch.uint8).contiguous()
    return x, valid, pdt


def quantize_pack_keys(
    k: torch.Tensor,
    bits: int,
    group_size: int,
    *,
    valid: torch.Tensor | None = None,
    param_dtype: torch.dtype | None = None,
    symmetric: bool = False,
    residual_bits: int = 0,
    check_finite: bool = True,
) -> PackedKV:
    """Keys ``k [B, H, T, D]`` -> ``PackedKV(axis="channel")``: each channel in groups of ``group_size`` tokens.

    ``T`` must be a multiple of ``group_size``. ``valid [B, T]`` (bool) leaves padding out of the statistics.
    """
    _check(k, bits, group_size, symmetric, residual_bits)
    B, H, T, D = k.shape
    if T % group_size:
        raise ValueError(f"keys: T={T} tokens is not a multiple of group_size={group_size}; quantize whole groups only")
    x, valid, pdt = _prepare(k, valid, param_dtype, check_finite)
    nbytes = packed_size(D, bits)
    packed = torch.empty(B, H, T, nbytes, dtype=torch.uint8, device=x.device)
    scale = torch.empty(B, H, T // group_size, D, dtype=pdt, device=x.device)
    offset = torch.empty_like(scale)
    if T:
        from . import _quant_kernels as K

        block_d = max(next_pow2(D), 8 // bits)
        K.quant_keys_kernel[(B * H, T // group_size)](
            x, valid if valid is not None else x, packed, scale, offset,
            H, T, D, nbytes,
            G=group_size, G_P2=next_pow2(group_size), BLOCK_D=block_d, BITS=bits,
            PARAM_KIND=param_kind(pdt), HAS_VALID=valid is not None,
        )
    return PackedKV(packed=packed, scale=scale, offset=offset, comp=None, head_dim=D,
                    format=SideFormat(KEY_AXIS, bits, group_size, scale_dtype=pdt, check_finite=check_finite))


def quantize_pack_values(
    v: torch.Tensor,
    bits: int,
    group_size: int,
    *,
    valid: torch.Tensor | None = None,
    param_dtype: torch.dtype | None = None,
    symmetric: bool = False,
    residual_bits: int = 0,
    check_finite: bool = True,
    block_t: int | None = None,
) -> PackedKV:
    """Values ``v [B, H, T, D]`` -> ``PackedKV(axis="token")``: each token in groups of ``group_size`` channels.

    ``D`` must be a multiple of ``group_size``; any ``T``.
    """
    _check(v, bits, group_size, symmetric, residual_bits)
    B, H, T, D = v.shape
    if D % group_size:
        raise ValueError(f"values: head_dim={D} is not a multiple of group_size={group_size}")
    x, valid, pdt = _prepare(v, valid, param_dtype, check_finite)
    nbytes = packed_size(D, bits)
    ng = D // group_size
    packed = torch.empty(B, H, T, nbytes, dtype=torch.uint8, device=x.device)
    scale = torch.empty(B, H, T, ng, dtype=pdt, device=x.device)
    offset = torch.empty_like(scale)
    if T:
        from . import _quant_kernels as K

        block_d = max(next_pow2(D), 8 // bits)
        if block_t is None:
            block_t = max(1, min(64 if x.is_cuda else 32, next_pow2(T), 8192 // block_d))
        K.quant_values_kernel[(B * H, -(-T // block_t))](
            x, valid if valid is not None else x, packed, scale, offset,
            H, T, D, nbytes,
            G=group_size, NG=ng, BLOCK_T=block_t, BLOCK_D=block_d, BITS=bits,
            PARAM_KIND=param_kind(pdt), HAS_VALID=valid is not None,
        )
    return PackedKV(packed=packed, scale=scale, offset=offset, comp=None, head_dim=D,
                    format=SideFormat(VALUE_AXIS, bits, group_size, scale_dtype=pdt, check_finite=check_finite))


__all__ = ["quantize_pack_keys", "quantize_pack_values"]
