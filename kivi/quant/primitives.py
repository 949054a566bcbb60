"""Pure quantization primitives: group-wise round-to-nearest with a scale and an offset.

A tensor ``x`` is split into groups of ``group_size`` consecutive elements along ``axis``.
Each group gets its own parameters and every element an integer code in ``[0, 2**bits)``.

Asymmetric (KIVI, the default)::

    lo, hi = min(group), max(group)
    scale  = (hi - lo) / (2**bits - 1)
    code   = clamp(round((x - lo) / scale), 0, 2**bits - 1)
    x_hat  = code * scale + lo

``lo`` is the *zero point* kept as a float offset, not rounded to an integer: an integer
zero-point (``round(-lo / scale)``, as the spec article writes it) shifts every value of a group by
up to half a step; a float offset keeps the error centred. A group whose values are all equal has
``scale == 0``: its codes are 0 and it dequantizes to ``lo`` exactly (the KIVI reference computes
0/0 = NaN there).

Symmetric (kept for comparison)::

    scale  = max(|group|) / (2**(bits-1) - 1)
    code   = clamp(round(x / scale), -(2**(bits-1) - 1), 2**(bits-1) - 1) + (2**(bits-1) - 1)
    x_hat  = (code - (2**(bits-1) - 1)) * scale

so 2-bit symmetric has three usable levels (-s, 0, s) and no offset to store.

For every element, ``|x - x_hat| <= scale / 2`` up to float rounding (when parameters are stored in
the computation dtype). Groups may be padded with positions excluded from the statistics
(``valid`` mask): padded elements still get codes (clamped into range, always finite) but never
move ``lo``/``hi``.

With ``clip=True`` (asymmetric only) each group's ``[lo, hi]`` is shrunk around its middle by the
factor of a small grid that minimises the group's squared error (:mod:`kivi.quant.clipping`); the
stored format is unchanged and the error is never larger than min/max's.

Non-finite input (NaN/Inf) raises ``ValueError`` when ``check_finite`` (default) is set; with it
off, a group holding a NaN dequantizes to NaN for the whole group.
"""

from __future__ import annotations

import torch

from .clipping import clipped_params

SUPPORTED_BITS = (1, 2, 3, 4, 8)


def check_bits(bits: int, *, name: str = "bits", symmetric: bool = False) -> None:
    """Raise ``ValueError`` unless ``bits`` is a supported code width."""
    if isinstance(bits, bool) or not isinstance(bits, int) or bits not in SUPPORTED_BITS:
        raise ValueError(f"{name}={bits!r} is not supported; allowed values are {list(SUPPORTED_BITS)}")
    if symmetric and bits < 2:
        raise ValueError(f"{name}={bits} with symmetric quantization leaves no level besides 0; use bits >= 2")


def group_view(x: torch.Tensor, axis: int, group_size: int) -> torch.Tensor:
    """View ``x`` as ``[..., n_groups, group_size, ...]`` (grouped axis split in two)."""
    axis = axis % x.dim()
    n = x.shape[axis]
    if group_size <= 0:
        raise ValueError(f"group_size={group_size} must be a positive integer")
    if n % group_size != 0:
        raise ValueError(
            f"length {n} of axis {axis} is not a multiple of group_size={group_size}; "
            "pad it or quantize whole groups only"
        )
    shape = list(x.shape)
    shape[axis : axis + 1] = [n // group_size, group_size]
    return x.reshape(shape)


def quantize_groups(
    x: torch.Tensor,
    bits: int,
    group_size: int,
    axis: int = -1,
    *,
    symmetric: bool = False,
    valid: torch.Tensor | None = None,
    param_dtype: torch.dtype | None = None,
    check_finite: bool = True,
    clip: bool = False,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """Quantize ``x`` in groups of ``group_size`` along ``axis``.

    Args:
        x: any float tensor; ``x.shape[axis]`` must be a multiple of ``group_size``.
        bits: code width, one of ``SUPPORTED_BITS``.
        valid: optional bool tensor broadcastable to ``x``; ``False`` elements are left out of the
            group statistics (padding). A group with no valid element gets scale 0 and offset 0.
        param_dtype: dtype in which scale/offset are stored (default ``x.dtype``). Codes are computed
            against the *stored* parameters so dequantization is consistent with what is kept.
        clip: MSE-optimal shrink of each group's range (:func:`kivi.quant.clipping.clipped_params`);
            asymmetric only.

    Returns:
        ``codes`` (uint8, same shape as ``x``), ``scale`` and ``offset`` (``None`` when symmetric),
        each of ``x``'s shape with ``axis`` reduced to ``x.shape[axis] // group_size``.
    """
    check_bits(bits, symmetric=symmetric)
    if clip and symmetric:
        raise ValueError("clip=True is only implemented for asymmetric quantization (symmetric=False)")
    if not x.is_floating_point():
        raise ValueError(f"x must be a floating-point tensor, got dtype {x.dtype}")
    if check_finite and not bool(torch.isfinite(x).all()):
        raise ValueError(
            "x contains NaN or Inf; KV quantization needs finite values (pass check_finite=False to let a "
            "non-finite value poison its group instead)"
        )
    param_dtype = param_dtype or x.dtype
    axis = axis % x.dim()
    xg = group_view(x.float(), axis, group_size)  # [..., n_groups, G, ...]
    red = axis + 1  # the within-group dimension
    vg = None
    if valid is not None:
        vg = group_view(torch.broadcast_to(valid, x.shape), axis, group_size)

    if symmetric:
        qmax = 2 ** (bits - 1) - 1
        mag = xg.abs() if vg is None else xg.abs().masked_fill(~vg, 0.0)
        amax = mag.amax(dim=red)
        scale = (amax / qmax).to(param_dtype)
        s = scale.float().unsqueeze(red)
        safe = torch.where(s > 0, s, torch.ones_like(s))
        q = torch.round(xg / safe).clamp_(-qmax, qmax)
        q = torch.where(s > 0, q, torch.zeros_like(q))
        codes = (q + qmax).to(torch.uint8)
        return codes.reshape(x.shape), scale, None

    levels = 2**bits - 1
    if vg is None:
        lo = xg.amin(dim=red)
        hi = xg.amax(dim=red)
    else:
        lo = xg.masked_fill(~vg, float("inf")).amin(dim=red)
        hi = xg.masked_fill(~vg, float("-inf")).amax(dim=red)
        empty = ~vg.any(dim=red)
        lo = lo.masked_fill(empty, 0.0)
        hi = hi.masked_fill(empty, 0.0)
    if clip:
        scale, offset = clipped_params(xg, lo, hi, red, levels, param_dtype, vg)
    else:
        offset = lo.to(param_dtype)
        scale = ((hi - offset.float()) / levels).to(param_dtype)
    s = scale.float().unsqueeze(red)
    o = offset.float().unsqueeze(red)
    safe = torch.where(s > 0, s, torch.ones_like(s))
    q = torch.round((xg - o) / safe).clamp_(0, levels)
    q = torch.where(s > 0, q, torch.zeros_like(q))
    codes = q.to(torch.uint8)
    return codes.reshape(x.shape), scale, offset


def dequantize_groups(
    codes: torch.Tensor,
    scale: torch.Tensor,
    offset: torch.Tensor | None,
    bits: int,
    group_size: int,
    axis: int = -1,
    *,
    dtype: torch.dtype = torch.float32,
) -> torch.Tensor:
    """Inverse of :func:`quantize_groups`: ``codes * scale + offset`` (or the symmetric form)."""
    axis = axis % codes.dim()
    cg = group_view(codes, axis, group_size).float()
    red = axis + 1
    s = scale.float().unsqueeze(red)
    if offset is None:
        qmax = 2 ** (bits - 1) - 1
        out = (cg - qmax) * s
    else:
        out = cg * s + offset.float().unsqueeze(red)
    return out.reshape(codes.shape).to(dtype)


def fake_quantize(
    x: torch.Tensor, bits: int, group_size: int, axis: int = -1, *, symmetric: bool = False
) -> torch.Tensor:
    """Quantize then dequantize (same dtype as ``x``); handy for measurements and tests."""
    codes, scale, offset = quantize_groups(x, bits, group_size, axis, symmetric=symmetric)
    return dequantize_groups(codes, scale, offset, bits, group_size, axis, dtype=x.dtype)
