"""`SideFormat`: how one side of the cache (keys or values) is quantized and stored, as one value.

Keys are quantized per channel (``axis="channel"``: each channel in groups of ``group_size`` consecutive
tokens), values per token (``axis="token"``: each token in groups of ``group_size`` channels).
:meth:`kivi.config.KiviConfig.side_format` builds the format of a side (per-layer overrides and per-head
widths applied); :func:`kivi.quant.kv.quantize_side` quantizes through it, and the byte accounting
(:meth:`SideFormat.token_bytes`), the page layout and the backends' support checks read it.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from .packing import packed_size
from .primitives import check_bits
from .rotation import check_rotation

SIDES = ("k", "v")
KEY_AXIS = "channel"  # keys: quantized per channel, groups of G tokens
VALUE_AXIS = "token"  # values: quantized per token, groups of G channels
#: The quantization axis of each side: keys per channel, values per token.
AXIS = {"k": KEY_AXIS, "v": VALUE_AXIS}


@dataclass(frozen=True)
class SideFormat:
    """The quantized format of one side.

    Fields:
        axis: ``"channel"`` (keys: groups of ``group_size`` tokens per channel) or ``"token"`` (values:
            groups of ``group_size`` channels per token).
        bits: code width, one of :data:`kivi.quant.primitives.SUPPORTED_BITS`.
        group_size: elements per quantization group.
        symmetric: symmetric codes (scale only, no offset) instead of asymmetric min/max.
        residual_bits: width of the per-group error-compensation codes (0 = none stored).
        clip: MSE-optimal group ranges (:mod:`kivi.quant.clipping`); write path only, same bytes.
        scale_dtype: dtype of scales / offsets, or ``None`` for the cached tensors' dtype
            (:meth:`param_dtype`).
        check_finite: the quantizer raises on NaN / Inf instead of storing them; write path only.
        rotation: orthogonal rotation of each head's channels before quantization (keys only;
            :mod:`kivi.quant.rotation`): ``"none"`` or ``"hadamard"``. Same bytes; dequantization rotates back.
    """

    axis: str
    bits: int
    group_size: int
    symmetric: bool = False
    residual_bits: int = 0
    clip: bool = False
    scale_dtype: torch.dtype | None = None
    check_finite: bool = True
    rotation: str = "none"

    def __post_init__(self) -> None:
        if self.axis not in AXIS.values():
            raise ValueError(f"axis={self.axis!r} must be 'channel' (keys) or 'token' (values)")
        check_rotation(self.rotation, name="rotation")
        if self.rotation != "none" and self.axis != KEY_AXIS:
            raise ValueError(f"rotation={self.rotation!r} is for keys (axis='channel'); values are not rotated")
        check_bits(self.bits, symmetric=self.symmetric)
        if isinstance(self.group_size, bool) or not isinstance(self.group_size, int) or self.group_size < 1:
            raise ValueError(f"group_size={self.group_size!r} must be an integer >= 1")

    @property
    def side(self) -> str:
        """``"k"`` (keys) or ``"v"`` (values)."""
        return "k" if self.axis == "channel" else "v"

    def param_dtype(self, model_dtype: torch.dtype) -> torch.dtype:
        """dtype of the stored scales / offsets for cached tensors of ``model_dtype``."""
        return model_dtype if self.scale_dtype is None else self.scale_dtype

    def token_bytes(self, head_dim: int, model_dtype: torch.dtype) -> dict[str, float]:
        """Bytes one stored token of one head costs, by field (``codes``, ``scales_zero_points``,
        ``compensation``); the keys' per-group fields are amortised over their ``group_size`` tokens."""
        codes = packed_size(head_dim, self.bits)
        params_per_group = (1 if self.symmetric else 2) * self.param_dtype(model_dtype).itemsize
        rb = self.residual_bits
        if self.axis == "channel":  # head_dim groups per group_size tokens
            params = params_per_group * head_dim / self.group_size
            comp = packed_size(head_dim, rb) / self.group_size if rb else 0.0
        else:  # head_dim // group_size groups per token
            groups = head_dim // self.group_size
            params = params_per_group * groups
            comp = packed_size(groups, rb) if rb else 0.0
        return {"codes": codes, "scales_zero_points": params, "compensation": comp}

    def token_nbytes(self, head_dim: int, model_dtype: torch.dtype) -> float:
        """Bytes one stored token of one head costs (the sum of :meth:`token_bytes`)."""
        return sum(self.token_bytes(head_dim, model_dtype).values())


__all__ = ["SIDES", "AXIS", "KEY_AXIS", "VALUE_AXIS", "SideFormat"]
