"""Quantized key / value segments: KIVI's two groupings over ``[B, H, T, D]`` tensors.

* keys, ``axis="channel"``: each channel ``d`` is quantized in groups of ``G`` consecutive tokens.
  ``T`` must be a multiple of ``G``.
* values, ``axis="token"``: each token is quantized in groups of ``G`` consecutive channels.
  ``D`` must be a multiple of ``G``.

Codes are bit-packed along the last (channel) axis in both cases, see :mod:`kivi.quant.packing`.

Optional error compensation (``residual_bits > 0``, spec §2.3): per group, the mean quantization
error ``m = mean(x - x_hat)`` lies in ``[-scale/2, scale/2]``; it is stored as a
``residual_bits``-bit code ``c = round(m / scale * 2**rb) + 2**(rb - 1)`` (clamped to the code range;
``c = 2**(rb-1)`` is exactly zero) and added back on dequantization. Its cost is ``rb`` bits per group.
Measured (docs/results.md, "Evaluation results in full"): it barely helps, as round-to-nearest errors have
near-zero means.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import torch

from .packing import pack_codes, unpack_codes
from .primitives import dequantize_groups, group_view, quantize_groups
from .rotation import rotate, unrotate
from .side_format import KEY_AXIS, VALUE_AXIS, SideFormat


@dataclass
class PackedKV:
    """``T`` tokens of keys or values, quantized.

    Fields (``B`` batch, ``H`` kv heads, ``T`` tokens, ``D`` head_dim, ``G`` group size):
        packed: uint8 ``[B, H, T, packed_size(D, bits)]`` — the codes.
        scale:  ``[B, H, T // G, D]`` (keys) or ``[B, H, T, D // G]`` (values).
        offset: like ``scale``, or ``None`` for symmetric quantization.
        comp:   uint8 packed compensation codes ``[..., packed_size(scale.shape[-1], residual_bits)]``
                with ``scale``'s leading shape, or ``None``.
        format: the :class:`~kivi.quant.side_format.SideFormat` the tokens were quantized in (axis, bits, group
                size, symmetry, compensation width); ``bits``, ``group_size``, ``axis`` and ``residual_bits`` read it.
        head_dim: ``D``.
    """

    packed: torch.Tensor
    scale: torch.Tensor
    offset: torch.Tensor | None
    comp: torch.Tensor | None
    format: SideFormat
    head_dim: int

    TENSOR_FIELDS = ("packed", "scale", "offset", "comp")

    @property
    def bits(self) -> int:
        return self.format.bits

    @property
    def group_size(self) -> int:
        return self.format.group_size

    @property
    def axis(self) -> str:
        return self.format.axis

    @property
    def residual_bits(self) -> int:
        return self.format.residual_bits

    @property
    def rotation(self) -> str:
        """The codes quantize ``x R`` (:mod:`kivi.quant.rotation`; keys only); ``"none"``: ``x`` itself."""
        return self.format.rotation

    @property
    def num_tokens(self) -> int:
        return self.packed.shape[-2]

    def tensors(self) -> dict[str, torch.Tensor]:
        return {k: getattr(self, k) for k in self.TENSOR_FIELDS if getattr(self, k) is not None}

    def with_tensors(self, **tensors: torch.Tensor) -> "PackedKV":
        return replace(self, **tensors)

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.tensors().values())


def token_divisor(axis: str, group_size: int, name: str) -> int:
    """Tokens per row of field ``name``: keys' per-group parameters have one row per ``G`` tokens."""
    if axis == KEY_AXIS and name in ("scale", "offset", "comp"):
        return group_size
    return 1


def quantize_kv(
    x: torch.Tensor,
    axis: str,
    bits: int,
    group_size: int,
    *,
    symmetric: bool = False,
    residual_bits: int = 0,
    valid: torch.Tensor | None = None,
    param_dtype: torch.dtype | None = None,
    check_finite: bool = True,
    clip: bool = False,
) -> PackedKV:
    """Quantize ``x [B, H, T, D]`` as keys (``axis="channel"``) or values (``axis="token"``).

    ``valid [B, T]`` (bool) marks real tokens; padding is left out of every statistic.
    ``clip``: MSE-optimal group ranges (:mod:`kivi.quant.clipping`), same stored format.
    """
    if x.dim() != 4:
        raise ValueError(f"x must be [batch, heads, tokens, head_dim], got shape {tuple(x.shape)}")
    if axis not in (KEY_AXIS, VALUE_AXIS):
        raise ValueError(f"axis={axis!r} must be 'channel' (keys) or 'token' (values)")
    dim = -2 if axis == KEY_AXIS else -1
    vmask = None
    if valid is not None:
        vmask = valid[:, None, :, None].to(torch.bool)  # [B, 1, T, 1]
    codes, scale, offset = quantize_groups(
        x, bits, group_size, dim, symmetric=symmetric, valid=vmask, param_dtype=param_dtype, check_finite=check_finite,
        clip=clip,
    )
    comp = None
    if residual_bits:
        x_hat = dequantize_groups(codes, scale, offset, bits, group_size, dim)
        err = group_view(x.float() - x_hat, dim % 4, group_size)
        red = (dim % 4) + 1
        if vmask is not None:
            vg = group_view(torch.broadcast_to(vmask, x.shape), dim % 4, group_size)
            cnt = vg.sum(dim=red).clamp_min(1)
            mean = (err * vg).sum(dim=red) / cnt
        else:
            mean = err.mean(dim=red)
        s = scale.float()
        n = 2**residual_bits
        rel = torch.where(s > 0, mean / torch.where(s > 0, s, torch.ones_like(s)), torch.zeros_like(s))
        # code c stands for (c - n/2) / n steps: zero is exact (a "2**b - 1 levels over [-0.5, 0.5]"
        # grid has no zero, so every near-zero mean would round to +-half a level by float noise).
        ccodes = (torch.round(rel * n) + n // 2).clamp_(0, n - 1).to(torch.uint8)
        comp = pack_codes(ccodes, residual_bits)
    fmt = SideFormat(axis, bits, group_size, symmetric=symmetric, residual_bits=residual_bits, clip=clip,
                     scale_dtype=param_dtype, check_finite=check_finite)
    return PackedKV(packed=pack_codes(codes, bits), scale=scale, offset=offset, comp=comp, format=fmt,
                    head_dim=x.shape[-1])


def quantize_side(x: torch.Tensor, fmt: SideFormat, *, valid: torch.Tensor | None = None) -> PackedKV:
    """Quantize ``x [B, H, T, D]`` (cached tensors) in the side format ``fmt``: :func:`quantize_kv` with every
    setting taken from the format, scales / offsets in ``fmt.param_dtype(x.dtype)``.

    ``valid [B, T]`` (bool) marks real tokens; padding is left out of every statistic. A rotated format
    (``fmt.rotation``) quantizes ``x R`` (float32) and records the rotation in the result's format.
    """
    seg = quantize_kv(rotate(x, fmt.rotation), fmt.axis, fmt.bits, fmt.group_size, symmetric=fmt.symmetric,
                      residual_bits=fmt.residual_bits, valid=valid, param_dtype=fmt.param_dtype(x.dtype),
                      check_finite=fmt.check_finite, clip=fmt.clip)
    return replace(seg, format=fmt)


def compensation_values(p: PackedKV) -> torch.Tensor | None:
    """Decoded per-group mean error (float32, ``scale``'s shape), or ``None``."""
    if p.comp is None:
        return None
    n = 2**p.residual_bits
    c = unpack_codes(p.comp, p.residual_bits, p.scale.shape[-1]).float()
    return (c - n // 2) / n * p.scale.float()


def dequantize_kv(p: PackedKV, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """``PackedKV`` -> ``[B, H, T, D]`` in ``dtype`` (a rotated segment rotated back: the tokens' own basis)."""
    dim = -2 if p.axis == KEY_AXIS else -1
    codes = unpack_codes(p.packed, p.bits, p.head_dim)
    out = dequantize_groups(codes, p.scale, p.offset, p.bits, p.group_size, dim, dtype=torch.float32)
    comp = compensation_values(p)
    if comp is not None:
        g = group_view(out, dim % 4, p.group_size)
        g = g + comp.unsqueeze((dim % 4) + 1)
        out = g.reshape(out.shape)
    return unrotate(out, p.rotation).to(dtype)


__all__ = [
    "PackedKV",
    "quantize_kv",
    "dequantize_kv",
    "compensation_values",
    "quantize_side",
    "token_divisor",
]

