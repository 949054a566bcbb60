"""Decode attention over one quantized segment and a full-precision tail per side (the loose-tensor and
:class:`~kivi.quant.kv.PackedKV` signatures): :func:`kivi.kernels.triton_attention.decode_attention_sides`
with a one-row block table, and the plain-torch references beside them.

* :func:`decode_attention` / :func:`torch_decode_attention` — loose tensors (packed codes, scales, offsets and
  a tail per side; bits and group size inferred from the shapes when not given);
* :func:`decode_attention_packed` / :func:`torch_decode_attention_packed` — ``PackedKV`` segments.

Semantics are those of :mod:`kivi.kernels.triton_attention`.
"""

from __future__ import annotations

import torch

from ..quant.kv import PackedKV, dequantize_kv
from ..quant.packing import packed_size
from ..quant.side_format import KEY_AXIS, VALUE_AXIS
from ._common import ATTENTION_BITS, check_kernel_bits, require_triton
from .segments import KernelSide, build_block_table, kernel_side
from .triton_attention import decode_attention_sides, last_contiguous


def _infer_side(name: str, packed, scale, offset, fp, bits, group_size, axis, D):
    """Validate one side; return (Tq, bits, group_size). Infers bits/group_size from shapes when None."""
    if packed is None or packed.shape[-2] == 0:
        return 0, bits or 2, group_size or 1
    if packed.dtype != torch.uint8 or packed.dim() != 4:
        raise ValueError(f"{name}_packed must be uint8 [B, H, T, bytes], got {packed.dtype} {tuple(packed.shape)}")
    if offset is None:
        raise NotImplementedError(f"{name}: symmetric quantization (offset None) is not supported by the kernel")
    Tq = packed.shape[-2]
    nb = packed.shape[-1]
    if bits is None:
        cand = [b for b in ATTENTION_BITS if packed_size(D, b) == nb]
        if len(cand) != 1:
            raise ValueError(f"{name}: cannot infer bits from {nb} bytes for head_dim {D}; pass {name}_bits")
        bits = cand[0]
    check_kernel_bits(bits, f"{name}_bits", ATTENTION_BITS)
    if nb != packed_size(D, bits):
        raise ValueError(f"{name}_packed has {nb} bytes per token, expected {packed_size(D, bits)} for bits={bits}")
    if axis == KEY_AXIS:
        ng = scale.shape[-2]
        if group_size is None:
            if ng == 0 or Tq % ng:
                raise ValueError(f"{name}: cannot infer group_size from {Tq} tokens and {ng} scale rows")
            group_size = Tq // ng
        if Tq % group_size or scale.shape[-2] != Tq // group_size or scale.shape[-1] != D:
            raise ValueError(
                f"{name}_scale shape {tuple(scale.shape)} does not fit {Tq} tokens, group_size={group_size}"
            )
    else:
        ng = scale.shape[-1]
        if group_size is None:
            if ng == 0 or D % ng:
                raise ValueError(f"{name}: cannot infer group_size from head_dim {D} and {ng} groups")
            group_size = D // ng
        if D % group_size or scale.shape[-1] != D // group_size or scale.shape[-2] != Tq:
            raise ValueError(
                f"{name}_scale shape {tuple(scale.shape)} does not fit {Tq} tokens, group_size={group_size}"
            )
    if offset.shape != scale.shape:
        raise ValueError(f"{name}_offset shape {tuple(offset.shape)} != {name}_scale shape {tuple(scale.shape)}")
    return Tq, bits, group_size


def _validate(q, k_packed, k_scale, k_offset, k_fp, v_packed, v_scale, v_offset, v_fp,
              k_bits, k_group_size, v_bits, v_group_size, kv_valid):
    if q.dim() != 4 or q.shape[2] != 1:
        raise ValueError(f"q must be [B, Hq, 1, D] (one decode step), got {tuple(q.shape)}")
    B, Hq, _, D = q.shape
    ref = next(t for t in (k_packed, k_fp) if t is not None and t.shape[-2] > 0) if any(
        t is not None and t.shape[-2] > 0 for t in (k_packed, k_fp)) else None
    if ref is None:
        raise ValueError("no key tokens: pass a non-empty quantized segment or full-precision tail")
    Hkv = ref.shape[1]
    if Hq % Hkv:
        raise ValueError(f"query heads {Hq} is not a multiple of kv heads {Hkv}")
    Tqk, k_bits, k_group_size = _infer_side("k", k_packed, k_scale, k_offset, k_fp, k_bits, k_group_size, KEY_AXIS, D)
    Tqv, v_bits, v_group_size = _infer_side("v", v_packed, v_scale, v_offset, v_fp, v_bits, v_group_size, VALUE_AXIS, D)
    Tfk = 0 if k_fp is None else k_fp.shape[-2]
    Tfv = 0 if v_fp is None else v_fp.shape[-2]
    if Tqk + Tfk != Tqv + Tfv:
        raise ValueError(f"keys cover {Tqk}+{Tfk} tokens but values {Tqv}+{Tfv}; both sides must cover the same tokens")
    T = Tqk + Tfk
    for name, t in (("k_packed", k_packed), ("k_fp", k_fp), ("v_packed", v_packed), ("v_fp", v_fp)):
        if t is not None and t.shape[-2] > 0 and (t.shape[0] != B or t.shape[1] != Hkv):
            raise ValueError(f"{name} has shape {tuple(t.shape)}; expected batch {B} and {Hkv} kv heads")
    for name, t in (("k_fp", k_fp), ("v_fp", v_fp)):
        if t is not None and t.shape[-2] > 0 and t.shape[-1] != D:
            raise ValueError(f"{name} head_dim {t.shape[-1]} != q head_dim {D}")
    if kv_valid is not None and tuple(kv_valid.shape) != (B, T):
        raise ValueError(f"kv_valid must be [B, T_total] = {(B, T)}, got {tuple(kv_valid.shape)}")
    return B, Hq, Hkv, D, T, Tqk, Tqv, k_bits, k_group_size, v_bits, v_group_size


def torch_decode_attention(
    q: torch.Tensor,
    k_packed: torch.Tensor | None,
    k_scale: torch.Tensor | None,
    k_offset: torch.Tensor | None,
    k_fp: torch.Tensor | None,
    v_packed: torch.Tensor | None,
    v_scale: torch.Tensor | None,
    v_offset: torch.Tensor | None,
    v_fp: torch.Tensor | None,
    *,
    scaling: float,
    kv_valid: torch.Tensor | None = None,
    k_bits: int | None = None,
    k_group_size: int | None = None,
    v_bits: int | None = None,
    v_group_size: int | None = None,
    **_ignored,
) -> torch.Tensor:
    """Reference for :func:`decode_attention` (same arguments): dequantize, concatenate, softmax in float32."""
    B, Hq, Hkv, D, T, Tqk, Tqv, kb, kg, vb, vg = _validate(
        q, k_packed, k_scale, k_offset, k_fp, v_packed, v_scale, v_offset, v_fp,
        k_bits, k_group_size, v_bits, v_group_size, kv_valid)

    def side(packed, scale, offset, fp, bits, g, axis, Tq):
        parts = []
        if Tq:
            parts.append(dequantize_kv(PackedKV(packed, scale, offset, None, bits, g, axis, D), torch.float32))
        if fp is not None and fp.shape[-2]:
            parts.append(fp.float())
        return torch.cat(parts, dim=-2)

    k = side(k_packed, k_scale, k_offset, k_fp, kb, kg, KEY_AXIS, Tqk)
    v = side(v_packed, v_scale, v_offset, v_fp, vb, vg, VALUE_AXIS, Tqv)
    rep = Hq // Hkv
    k = k.repeat_interleave(rep, dim=1)
    v = v.repeat_interleave(rep, dim=1)
    s = torch.matmul(q.float(), k.transpose(-1, -2)) * scaling  # [B, Hq, 1, T]
    if kv_valid is not None:
        s = s.masked_fill(~kv_valid.bool()[:, None, None, :], float("-inf"))
    p = torch.softmax(s, dim=-1)
    p = torch.nan_to_num(p, nan=0.0)  # rows with no valid token -> zeros
    return torch.matmul(p, v).to(q.dtype)


def torch_decode_attention_packed(q, k: PackedKV | None, k_fp, v: PackedKV | None, v_fp, *, scaling, kv_valid=None):
    """:func:`torch_decode_attention` taking ``PackedKV`` segments (``None`` = no quantized tokens)."""
    return torch_decode_attention(q, *_packed_args(k, k_fp, v, v_fp), scaling=scaling, kv_valid=kv_valid,
                                  **_packed_meta(k, v))


def _loose_side(name, packed, scale, offset, fp, bits, group_size, axis, D, Tq, device) -> KernelSide:
    """A one-block :class:`KernelSide` of the loose-tensor signature (quantized ``[0, Tq)`` ++ ``fp``)."""
    table = None
    if Tq:
        packed, scale, offset = last_contiguous(packed), last_contiguous(scale), last_contiguous(offset)
        if scale.stride() != offset.stride():
            scale, offset = scale.contiguous(), offset.contiguous()
        seg = PackedKV(packed, scale, offset, None, bits, group_size, axis, D)
        table = build_block_table([(0, seg)], axis, device)
    return kernel_side(None, table, Tq, fp if fp is not None and fp.shape[-2] else None)


def decode_attention(
    q: torch.Tensor,
    k_packed: torch.Tensor | None,
    k_scale: torch.Tensor | None,
    k_offset: torch.Tensor | None,
    k_fp: torch.Tensor | None,
    v_packed: torch.Tensor | None,
    v_scale: torch.Tensor | None,
    v_offset: torch.Tensor | None,
    v_fp: torch.Tensor | None,
    *,
    scaling: float,
    kv_valid: torch.Tensor | None = None,
    k_bits: int | None = None,
    k_group_size: int | None = None,
    v_bits: int | None = None,
    v_group_size: int | None = None,
    num_splits: int | None = None,
    block_n: int | None = None,
    num_warps: int = 4,
) -> torch.Tensor:
    """Attention of one decode step over ``packed keys ++ k_fp`` / ``packed values ++ v_fp``.

    Args:
        q: ``[B, Hq, 1, D]`` (fp16 / bf16 / fp32).
        k_packed, k_scale, k_offset: keys' ``PackedKV`` fields over ``Tq_k`` tokens (``axis="channel"``:
            ``k_packed [B, Hkv, Tq_k, packed_size(D, k_bits)]``, ``k_scale/k_offset [B, Hkv, Tq_k // G_k, D]``),
            or ``None`` when nothing is quantized.
        k_fp: ``[B, Hkv, Tf_k, D]`` full-precision tail (or ``None``).
        v_packed, v_scale, v_offset: values' fields over ``Tq_v`` tokens (``axis="token"``:
            ``v_scale/v_offset [B, Hkv, Tq_v, D // G_v]``), or ``None``.
        v_fp: ``[B, Hkv, Tf_v, D]`` tail; ``Tq_k + Tf_k == Tq_v + Tf_v``.
        scaling: softmax scale (usually ``D ** -0.5``).
        kv_valid: optional bool ``[B, T]`` (True = attend), in the order quantized ++ tail.
        k_bits, k_group_size, v_bits, v_group_size: inferred from the shapes when ``None``.
        num_splits, block_n, num_warps: tuning knobs (defaults fill the GPU).

    One quantized segment per side: :func:`decode_attention_sides` with a one-row block table (built
    per call; a cache memoises its tables). Every tensor may be a strided view as long as its last
    axis is contiguous (others are copied). Returns ``[B, Hq, 1, D]`` in ``q.dtype``.
    """
    B, Hq, Hkv, D, T, Tqk, Tqv, kb, kg, vb, vg = _validate(
        q, k_packed, k_scale, k_offset, k_fp, v_packed, v_scale, v_offset, v_fp,
        k_bits, k_group_size, v_bits, v_group_size, kv_valid)
    require_triton(q.device)
    ks = _loose_side("k", k_packed, k_scale, k_offset, k_fp, kb, kg, KEY_AXIS, D, Tqk, q.device)
    vs = _loose_side("v", v_packed, v_scale, v_offset, v_fp, vb, vg, VALUE_AXIS, D, Tqv, q.device)
    return decode_attention_sides(q, ks, vs, scaling=scaling, kv_valid=kv_valid, num_splits=num_splits,
                                  block_n=block_n, num_warps=num_warps)


def _packed_args(k, k_fp, v, v_fp):
    for name, p, axis in (("k", k, KEY_AXIS), ("v", v, VALUE_AXIS)):
        if p is not None:
            if p.axis != axis:
                raise ValueError(f"{name} must be a PackedKV with axis={axis!r}, got {p.axis!r}")
            if p.comp is not None:
                raise NotImplementedError(f"{name}: compensation codes (residual_bits) are not supported by the kernel")
    return (
        None if k is None else k.packed, None if k is None else k.scale, None if k is None else k.offset, k_fp,
        None if v is None else v.packed, None if v is None else v.scale, None if v is None else v.offset, v_fp,
    )


def _packed_meta(k, v):
    return dict(
        k_bits=None if k is None else k.bits, k_group_size=None if k is None else k.group_size,
        v_bits=None if v is None else v.bits, v_group_size=None if v is None else v.group_size,
    )


def decode_attention_packed(q, k: PackedKV | None, k_fp, v: PackedKV | None, v_fp, *, scaling, kv_valid=None,
                            **knobs):
    """:func:`decode_attention` taking ``PackedKV`` segments (``None`` = no quantized tokens on that side)."""
    return decode_attention(q, *_packed_args(k, k_fp, v, v_fp), scaling=scaling, kv_valid=kv_valid,
                            **_packed_meta(k, v), **knobs)


__all__ = ["decode_attention", "decode_attention_packed", "torch_decode_attention", "torch_decode_attention_packed"]
