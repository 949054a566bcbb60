"""Quantize + pack KV tensors with Triton (GPU; CPU under ``TRITON_INTERPRET=1``).

Each takes the side's :class:`~kivi.quant.side_format.SideFormat`, as its reference
:func:`kivi.quant.kv.quantize_side` does (asymmetric, no compensation, no clipping, no rotation: other formats are
refused). The kernels return the same :class:`~kivi.quant.kv.PackedKV` fields: codes equal the reference's (up to
rounding ties that float differences could flip), scale/offset in ``fmt.param_dtype(x.dtype)``.

Triton is imported only when a kernel is launched, so importing this module never needs it.
"""

from __future__ import annotations

import torch

from ..quant.kv import PackedKV
from ..quant.packing import packed_size
from ..quant.side_format import KEY_AXIS, VALUE_AXIS, SideFormat
from ._common import check_kernel_bits, next_pow2, param_kind, require_triton


def _check(x: torch.Tensor, fmt: SideFormat, axis: str) -> None:
    if not isinstance(fmt, SideFormat) or fmt.axis != axis:
        raise ValueError(f"fmt must be a SideFormat of axis {axis!r}, got {fmt!r}")
    for setting, what in ((fmt.symmetric, "is asymmetric only (KIVI)"),
                          (fmt.residual_bits, "does not compute error-compensation codes (residual_bits)"),
                          (fmt.clip, "does not clip group ranges (clip)"),
                          (fmt.rotation != "none", f"does not rotate keys (rotation={fmt.rotation!r})")):
        if setting:
            raise NotImplementedError(f"the Triton quantizer {what}; use kivi.quant.kv.quantize_side")
    check_kernel_bits(fmt.bits)
    if x.dim() != 4:
        raise ValueError(f"x must be [batch, heads, tokens, head_dim], got shape {tuple(x.shape)}")
    if not x.is_floating_point():
        raise ValueError(f"x must be a floating-point tensor, got dtype {x.dtype}")


def _prepare(x, valid, fmt: SideFormat):
    require_triton(x.device)
    if fmt.check_finite and not bool(torch.isfinite(x).all()):
        raise ValueError("x contains NaN or Inf; KV quantization needs finite values")
    pdt = fmt.param_dtype(x.dtype)
    param_kind(pdt)
    param_kind(x.dtype)
    x = x.contiguous()
    B, H, T, D = x.shape
    if valid is not None:
        if tuple(valid.shape) != (B, T):
            raise ValueError(f"valid must be [batch, tokens] = {(B, T)}, got {tuple(valid.shape)}")
        valid = valid.to(device=x.device, dtype=torch.uint8).contiguous()
    return x, valid, pdt


def quantize_pack_keys(k: torch.Tensor, fmt: SideFormat, *, valid: torch.Tensor | None = None) -> PackedKV:
    """Keys ``k [B, H, T, D]`` in the key format ``fmt`` (axis ``"channel"``: each channel in groups of
    ``fmt.group_size`` tokens) -> :class:`~kivi.quant.kv.PackedKV`, the fields of
    :func:`kivi.quant.kv.quantize_side` ``(k, fmt)``: scales / offsets in ``fmt.param_dtype(k.dtype)``; NaN / Inf
    refused with ``fmt.check_finite``. Asymmetric, no compensation, no clipping, no rotation, 1/2/4/8 bits.

    ``T`` must be a multiple of the group size. ``valid [B, T]`` (bool) leaves padding out of the statistics.
    """
    _check(k, fmt, KEY_AXIS)
    bits, group_size = fmt.bits, fmt.group_size
    B, H, T, D = k.shape
    if T % group_size:
        raise ValueError(f"keys: T={T} tokens is not a multiple of group_size={group_size}; quantize whole groups only")
    x, valid, pdt = _prepare(k, valid, fmt)
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
    return PackedKV(packed=packed, scale=scale, offset=offset, comp=None, head_dim=D, format=fmt)


def quantize_pack_values(v: torch.Tensor, fmt: SideFormat, *, valid: torch.Tensor | None = None,
                         block_t: int | None = None) -> PackedKV:
    """Values ``v [B, H, T, D]`` in the value format ``fmt`` (axis ``"token"``: each token in groups of
    ``fmt.group_size`` channels) -> :class:`~kivi.quant.kv.PackedKV`, as :func:`quantize_pack_keys`.

    ``D`` must be a multiple of the group size; any ``T``. ``block_t``: tokens a program quantizes (a tuning knob).
    """
    _check(v, fmt, VALUE_AXIS)
    bits, group_size = fmt.bits, fmt.group_size
    B, H, T, D = v.shape
    if D % group_size:
        raise ValueError(f"values: head_dim={D} is not a multiple of group_size={group_size}")
    x, valid, pdt = _prepare(v, valid, fmt)
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
    return PackedKV(packed=packed, scale=scale, offset=offset, comp=None, head_dim=D, format=fmt)


__all__ = ["quantize_pack_keys", "quantize_pack_values"]
