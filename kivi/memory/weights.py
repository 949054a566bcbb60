"""Bytes of a model's weights at 16 (as loaded), 8 or 4 bits: what optimum-quanto stores.

:func:`kivi.models.quantize_weights` turns every linear layer of :func:`kivi.models.quantizable_linears`
into a frozen quanto ``QLinear``; everything else (embeddings, norms, an excluded ``lm_head``, biases)
keeps the model's dtype. Per quantized linear layer of ``out x in`` weights, quanto 0.2.x stores
(read from the tensors of a frozen model's ``state_dict``, checked byte for byte in
``tests/test_weight_quant.py``):

* ``qint8``: codes ``int8 [out, in]`` and one scale per output channel, ``[out, 1]`` in the weight dtype;
* ``qint4``: codes packed two per byte along the first axis of the grouped weight, a scale and a shift
  (the group minimum, float) per group, in the weight dtype. Groups run over ``G`` input channels:
  ``G`` = 128, or the largest of 96 / 64 / 32 that divides ``in`` when 128 does not; with ``in <= 128``
  or no such divisor there are no groups (one scale and shift per output channel,
  :func:`quanto_group_size`). Grouped, the weight is ``[out * in / G, G]``, packed to
  ``[ceil(out * in / G / 2), G]`` bytes, scales and shifts ``[out * in / G, 1]``; ungrouped,
  ``[ceil(out / 2), in]`` bytes and ``[out, 1]`` each;
* both: two scalar buffers (``input_scale``, ``output_scale``) in the weight dtype; a bias stays float.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

#: Weight widths the planner and :func:`kivi.models.quantize_weights` accept (16 = as loaded).
WEIGHT_BITS = (16, 8, 4)


def check_weight_bits(bits: int) -> int:
    """``bits`` if it is one of :data:`WEIGHT_BITS`, else a ``ValueError`` naming the allowed values."""
    if isinstance(bits, bool) or bits not in WEIGHT_BITS:
        raise ValueError(f"weight bits={bits!r} is not supported; allowed: {', '.join(map(str, WEIGHT_BITS))} "
                         "(16 = unquantized)")
    return bits


def quanto_group_size(in_features: int) -> int | None:
    """The group size quanto 0.2.x picks for a ``qint4`` / ``qint2`` weight with ``in_features`` inputs.

    quanto's ``QModuleMixin.__init__``: 128, lowered by 32 while it does not divide ``in_features``
    (not below 32); ``None`` (per output channel) when ``in_features <= 128`` or nothing divides.
    """
    group = 128
    if in_features > group:
        while in_features % group != 0 and group > 32:
            group -= 32
        if in_features % group == 0:
            return group
    return None


@dataclass(frozen=True)
class LinearBytes:
    """Bytes of one quantized linear layer's weight (bias excluded: it stays float)."""

    codes: int
    scales: int  # scales, shifts and quanto's two scalar activation scales

    @property
    def total(self) -> int:
        return self.codes + self.scales


def quanto_linear_bytes(out_features: int, in_features: int, bits: int, dtype_bytes: int) -> LinearBytes:
    """What quanto stores for an ``out x in`` weight quantized to ``bits`` (8 or 4), see the module doc."""
    if bits == 8:
        return LinearBytes(codes=out_features * in_features, scales=(out_features + 2) * dtype_bytes)
    if bits != 4:
        raise ValueError(f"bits={bits!r}: quanto linear layers are planned for 8 or 4 bits")
    group = quanto_group_size(in_features)
    if group is None:
        rows, cols, n_scales = out_features, in_features, out_features
    else:
        rows = out_features * in_features // group
        cols, n_scales = group, rows
    codes = math.ceil(rows / 2) * cols
    return LinearBytes(codes=codes, scales=(2 * n_scales + 2) * dtype_bytes)


def weight_bytes_breakdown(params: int, linear_layers: list[tuple[int, int]] | None, bits: int,
                           dtype_bytes: int) -> dict[str, int]:
    """``{"float": ..., "codes": ..., "scales": ...}`` bytes of a model's weights at ``bits``.

    ``params``: every parameter (tied ones once); ``linear_layers``: ``(out, in)`` of each linear layer
    :func:`kivi.models.quantize_weights` quantizes (needed for 8 / 4 bits). At 16 bits everything is
    ``float``: ``params x dtype_bytes``.
    """
    check_weight_bits(bits)
    if bits == 16:
        return {"float": params * dtype_bytes, "codes": 0, "scales": 0}
    if linear_layers is None:
        raise ValueError(f"weight bits={bits} needs the shapes of the model's linear layers: give a model (alias, "
                         "checkpoint folder, hub id) rather than an explicit shape / --params")
    parts = [quanto_linear_bytes(o, i, bits, dtype_bytes) for o, i in linear_layers]
    quantized_params = sum(o * i for o, i in linear_layers)
    return {"float": (params - quantized_params) * dtype_bytes, "codes": sum(p.codes for p in parts),
            "scales": sum(p.scales for p in parts)}


__all__ = ["WEIGHT_BITS", "LinearBytes", "check_weight_bits", "quanto_group_size", "quanto_linear_bytes",
           "weight_bytes_breakdown"]
