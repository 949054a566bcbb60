"""Decode attention over one quantized segment and a full-precision tail per side: :class:`~kivi.quant.kv.PackedKV`
segments (each carrying its :class:`~kivi.quant.side_format.SideFormat`: widths, group sizes, axis are read off the
data, never passed beside it) through :func:`kivi.kernels.triton_attention.decode_attention_sides` with a one-row
block table, and the plain-torch reference beside it.

* :func:`decode_attention_packed` — the Triton kernel;
* :func:`torch_decode_attention_packed` — its reference (same arguments).

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


def _check_segment(name: str, p: PackedKV | None, axis: str, D: int) -> int:
    """Check one side's segment against the format it carries; return its token count (0: none)."""
    if p is None or p.num_tokens == 0:
        return 0
    if p.axis != axis:
        raise ValueError(f"{name} must be a PackedKV with axis={axis!r}, got {p.axis!r}")
    if p.comp is not None:
        raise NotImplementedError(f"{name}: compensation codes (residual_bits) are not supported by the kernel")
    if p.offset is None:
        raise NotImplementedError(f"{name}: symmetric quantization (offset None) is not supported by the kernel")
    packed, scale, G, Tq = p.packed, p.scale, p.group_size, p.num_tokens
    if packed.dtype != torch.uint8 or packed.dim() != 4:
        raise ValueError(f"{name}.packed must be uint8 [B, H, T, bytes], got {packed.dtype} {tuple(packed.shape)}")
    check_kernel_bits(p.bits, f"{name}.bits", ATTENTION_BITS)
    if packed.shape[-1] != packed_size(D, p.bits):
        raise ValueError(f"{name}.packed has {packed.shape[-1]} bytes per token, expected {packed_size(D, p.bits)} "
                         f"for bits={p.bits}")
    want = (Tq // G, D) if axis == KEY_AXIS else (Tq, D // G)
    if (Tq % G if axis == KEY_AXIS else D % G) or tuple(scale.shape[-2:]) != want:
        raise ValueError(f"{name}.scale shape {tuple(scale.shape)} does not fit {Tq} tokens, group_size={G}")
    if p.offset.shape != scale.shape:
        raise ValueError(f"{name}.offset shape {tuple(p.offset.shape)} != {name}.scale shape {tuple(scale.shape)}")
    return Tq


def _validate(q, k: PackedKV | None, k_fp, v: PackedKV | None, v_fp, kv_valid):
    if q.dim() != 4 or q.shape[2] != 1:
        raise ValueError(f"q must be [B, Hq, 1, D] (one decode step), got {tuple(q.shape)}")
    B, Hq, _, D = q.shape
    present = [t for t in (None if k is None else k.packed, k_fp) if t is not None and t.shape[-2] > 0]
    if not present:
        raise ValueError("no key tokens: pass a non-empty quantized segment or full-precision tail")
    Hkv = present[0].shape[1]
    if Hq % Hkv:
        raise ValueError(f"query heads {Hq} is not a multiple of kv heads {Hkv}")
    Tqk = _check_segment("k", k, KEY_AXIS, D)
    Tqv = _check_segment("v", v, VALUE_AXIS, D)
    Tfk = 0 if k_fp is None else k_fp.shape[-2]
    Tfv = 0 if v_fp is None else v_fp.shape[-2]
    if Tqk + Tfk != Tqv + Tfv:
        raise ValueError(f"keys cover {Tqk}+{Tfk} tokens but values {Tqv}+{Tfv}; both sides must cover the same tokens")
    T = Tqk + Tfk
    for name, t in (("k.packed", None if k is None else k.packed), ("k_fp", k_fp),
                    ("v.packed", None if v is None else v.packed), ("v_fp", v_fp)):
        if t is not None and t.shape[-2] > 0 and (t.shape[0] != B or t.shape[1] != Hkv):
            raise ValueError(f"{name} has shape {tuple(t.shape)}; expected batch {B} and {Hkv} kv heads")
    for name, t in (("k_fp", k_fp), ("v_fp", v_fp)):
        if t is not None and t.shape[-2] > 0 and t.shape[-1] != D:
            raise ValueError(f"{name} head_dim {t.shape[-1]} != q head_dim {D}")
    if kv_valid is not None and tuple(kv_valid.shape) != (B, T):
        raise ValueError(f"kv_valid must be [B, T_total] = {(B, T)}, got {tuple(kv_valid.shape)}")
    return Hq, Hkv, Tqk, Tqv


def torch_decode_attention_packed(q: torch.Tensor, k: PackedKV | None, k_fp: torch.Tensor | None,
                                  v: PackedKV | None, v_fp: torch.Tensor | None, *, scaling: float,
                                  kv_valid: torch.Tensor | None = None, **_knobs) -> torch.Tensor:
    """Reference for :func:`decode_attention_packed` (same arguments; the kernel's tuning knobs ignored):
    dequantize, concatenate, softmax in float32."""
    Hq, Hkv, Tqk, Tqv = _validate(q, k, k_fp, v, v_fp, kv_valid)

    def side(p, fp, Tq):
        parts = [dequantize_kv(p, torch.float32)] if Tq else []
        if fp is not None and fp.shape[-2]:
            parts.append(fp.float())
        return torch.cat(parts, dim=-2)

    rep = Hq // Hkv
    kd = side(k, k_fp, Tqk).repeat_interleave(rep, dim=1)
    vd = side(v, v_fp, Tqv).repeat_interleave(rep, dim=1)
    s = torch.matmul(q.float(), kd.transpose(-1, -2)) * scaling  # [B, Hq, 1, T]
    if kv_valid is not None:
        s = s.masked_fill(~kv_valid.bool()[:, None, None, :], float("-inf"))
    p = torch.softmax(s, dim=-1)
    p = torch.nan_to_num(p, nan=0.0)  # rows with no valid token -> zeros
    return torch.matmul(p, vd).to(q.dtype)


def _one_block_side(p: PackedKV | None, fp: torch.Tensor | None, Tq: int, device) -> KernelSide:
    """A one-block :class:`KernelSide`: the segment ``p`` over ``[0, Tq)`` ++ ``fp``."""
    table = None
    if Tq:
        packed, scale, offset = last_contiguous(p.packed), last_contiguous(p.scale), last_contiguous(p.offset)
        if scale.stride() != offset.stride():
            scale, offset = scale.contiguous(), offset.contiguous()
        table = build_block_table([(0, p.with_tensors(packed=packed, scale=scale, offset=offset))], p.axis, device)
    return kernel_side(None, table, Tq, fp if fp is not None and fp.shape[-2] else None)


def decode_attention_packed(q: torch.Tensor, k: PackedKV | None, k_fp: torch.Tensor | None, v: PackedKV | None,
                            v_fp: torch.Tensor | None, *, scaling: float, kv_valid: torch.Tensor | None = None,
                            num_splits: int | None = None, block_n: int | None = None,
                            num_warps: int = 4) -> torch.Tensor:
    """Attention of one decode step over ``k ++ k_fp`` / ``v ++ v_fp``.

    Args:
        q: ``[B, Hq, 1, D]`` (fp16 / bf16 / fp32).
        k: keys' segment over ``Tq_k`` tokens (``axis="channel"``, asymmetric, no compensation), or ``None``.
        k_fp: ``[B, Hkv, Tf_k, D]`` full-precision tail (or ``None``).
        v: values' segment over ``Tq_v`` tokens (``axis="token"``), or ``None``.
        v_fp: ``[B, Hkv, Tf_v, D]`` tail; ``Tq_k + Tf_k == Tq_v + Tf_v``.
        scaling: softmax scale (usually ``D ** -0.5``).
        kv_valid: optional bool ``[B, T]`` (True = attend), in the order quantized ++ tail.
        num_splits, block_n, num_warps: tuning knobs (defaults fill the GPU).

    Widths and group sizes are the segments' own (:attr:`PackedKV.format`). One quantized segment per side:
    :func:`decode_attention_sides` with a one-row block table (built per call; a cache memoises its tables).
    Every tensor may be a strided view as long as its last axis is contiguous (others are copied). Returns
    ``[B, Hq, 1, D]`` in ``q.dtype``.
    """
    _, _, Tqk, Tqv = _validate(q, k, k_fp, v, v_fp, kv_valid)
    require_triton(q.device)
    ks = _one_block_side(k, k_fp, Tqk, q.device)
    vs = _one_block_side(v, v_fp, Tqv, q.device)
    return decode_attention_sides(q, ks, vs, scaling=scaling, kv_valid=kv_valid, num_splits=num_splits,
                                  block_n=block_n, num_warps=num_warps)


__all__ = ["decode_attention_packed", "torch_decode_attention_packed"]
