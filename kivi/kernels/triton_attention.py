"""Decode attention (one query token) that reads the packed KIVI cache in place.

Each side (keys, values) is a :class:`~kivi.kernels.segments.KernelSide`: full-precision sink tokens,
the stored blocks (each a whole storage block, described by one row of a small device table: no
copy, no concatenation) and the full-precision tail; the attended sequence is
``sink ++ stored ++ tail``. Keys are quantized in whole groups of ``G`` tokens, so in general the
two sides split at different positions while covering the same ``T`` tokens.

* :func:`decode_attention_sides` — Triton, split-K (flash-decoding) in one launch over every piece:
  pass 1 gives each program one kv head with its whole query-head group (GQA without repeating
  the cache) and one token range, with an online softmax; pass 2 merges the ranges.
* :func:`torch_decode_attention_sides` — the plain-torch reference with the same signature:
  dequantize every piece with :func:`kivi.quant.kv.dequantize_kv`, concatenate, softmax in float32.
* the loose-tensor signatures (one quantized segment and a tail per side, or ``PackedKV`` objects) over the
  same kernel with a one-row table: :mod:`kivi.kernels.triton_attention_loose`.

Semantics shared by all: ``scores = scaling * q . k`` in float32; ``kv_valid [B, T]`` (bool, True = attend)
masks tokens out; a row with no valid token returns zeros; the output has ``q``'s dtype.
Limits of the kernel: asymmetric quantization without compensation codes, bits in {1, 2, 3, 4, 8}
(3-bit rows: ``ceil(D / 8) * 3`` bytes, a code may straddle two bytes),
one bit width and group size per side (every block of a store shares them).
"""

from __future__ import annotations

import torch

from ..quant.kv import PackedKV, dequantize_kv
from ..quant.side_format import KEY_AXIS, VALUE_AXIS
from ._common import ATTENTION_BITS, check_kernel_bits, next_pow2, param_kind, require_triton
from .segments import KernelSide

_LOG2E = 1.4426950408889634


# --------------------------------------------------------------------------------------------- torch


def _side_dense(side: KernelSide, D: int) -> torch.Tensor:
    """float32 ``[B, H, T, D]`` of one side: its pieces dequantized / converted and concatenated."""
    parts = []
    for kind, obj, a, e in side.pieces():
        if kind == "fp":
            parts.append(obj.float())
            continue
        seg, r = obj
        if isinstance(seg, PackedKV):
            x = dequantize_kv(seg, torch.float32)
        else:
            x = seg.float()
        parts.append(x[:, :, r : r + e - a])
    return torch.cat(parts, dim=-2)


def torch_decode_attention_sides(q: torch.Tensor, k: KernelSide, v: KernelSide, *, scaling: float,
                                 kv_valid: torch.Tensor | None = None, **_ignored) -> torch.Tensor:
    """Reference for :func:`decode_attention_sides` (same arguments): dequantize every piece, concatenate,
    softmax attention in float32 (rows with no valid token give zeros)."""
    B, Hq, Hkv, D, T = _validate_sides(q, k, v, kv_valid)
    kd = _side_dense(k, D).repeat_interleave(Hq // Hkv, dim=1)
    vd = _side_dense(v, D).repeat_interleave(Hq // Hkv, dim=1)
    s = torch.matmul(q.float(), kd.transpose(-1, -2)) * scaling  # [B, Hq, 1, T]
    if kv_valid is not None:
        s = s.masked_fill(~kv_valid.bool()[:, None, None, :], float("-inf"))
    p = torch.nan_to_num(torch.softmax(s, dim=-1), nan=0.0)
    return torch.matmul(p, vd).to(q.dtype)


# -------------------------------------------------------------------------------------------- triton


def _num_splits(device: torch.device, programs: int, n_blocks: int) -> int:
    if device.type == "cuda":
        sms = torch.cuda.get_device_properties(device).multi_processor_count
        want = min(128, -(-4 * sms // max(1, programs)))  # the merge kernel holds all splits in registers
    else:  # interpreter: few programs, but more than one split so the merge is exercised
        want = 3
    return max(1, min(n_blocks, want))


def _side_shape(name: str, side: KernelSide) -> tuple[int, int, int] | None:
    """``(B, H, D)`` of a side's tensors (checked to agree), or ``None`` when it holds no token."""
    shapes = []
    for kind, obj, _a, _e in side.pieces():
        t = obj if kind == "fp" else (obj[0].packed if isinstance(obj[0], PackedKV) else obj[0])
        D = obj[0].head_dim if kind == "block" and isinstance(obj[0], PackedKV) else t.shape[-1]
        if t.dim() != 4:
            raise ValueError(f"{name}: pieces must be 4-D [B, H, T, D], got {tuple(t.shape)}")
        shapes.append((t.shape[0], t.shape[1], D))
    if not shapes:
        return None
    if len(set(shapes)) > 1:
        raise ValueError(f"{name}: pieces disagree on (batch, kv heads, head_dim): {sorted(set(shapes))}")
    return shapes[0]


def _validate_sides(q, k: KernelSide, v: KernelSide, kv_valid):
    if q.dim() != 4 or q.shape[2] != 1:
        raise ValueError(f"q must be [B, Hq, 1, D] (one decode step), got {tuple(q.shape)}")
    B, Hq, _, D = q.shape
    if k.num_tokens != v.num_tokens:
        raise ValueError(
            f"keys cover {k.num_tokens} tokens but values {v.num_tokens}; both sides must cover the same tokens"
        )
    if k.origin != v.origin:
        raise ValueError(f"keys start at position {k.origin} but values at {v.origin}")
    T = k.num_tokens
    if T == 0:
        raise ValueError("no key tokens: the sides hold nothing to attend to")
    ks, vs = _side_shape("k", k), _side_shape("v", v)
    if ks != vs:
        raise ValueError(f"keys are (batch, kv heads, head_dim) {ks} but values {vs}")
    if ks[0] != B or ks[2] != D:
        raise ValueError(f"cache (batch, kv heads, head_dim) {ks} does not fit q {tuple(q.shape)}")
    Hkv = ks[1]
    if Hq % Hkv:
        raise ValueError(f"query heads {Hq} is not a multiple of kv heads {Hkv}")
    for name, side, axis in (("k", k, KEY_AXIS), ("v", v, VALUE_AXIS)):
        tab = side.blocks
        if tab is not None and tab.quantized:
            check_kernel_bits(tab.bits, f"{name}_bits", ATTENTION_BITS)
            if tab.segments[0].axis != axis:
                raise ValueError(f"{name}: blocks must be quantized with axis={axis!r}, got {tab.segments[0].axis!r}")
    if kv_valid is not None and tuple(kv_valid.shape) != (B, T):
        raise ValueError(f"kv_valid must be [B, T_total] = {(B, T)}, got {tuple(kv_valid.shape)}")
    return B, Hq, Hkv, D, T


_DUMMIES: dict[tuple, tuple[torch.Tensor, torch.Tensor, torch.Tensor]] = {}


def _dummies(device: torch.device, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """One-element uint8 / ``dtype`` / int64 tensors passed for absent pieces (never read: their loads are
    masked off or their loops empty); made once per device and dtype, not per decode step."""
    key = (device, dtype)
    if key not in _DUMMIES:
        _DUMMIES[key] = tuple(torch.zeros(1, dtype=t, device=device) for t in (torch.uint8, dtype, torch.int64))
    return _DUMMIES[key]


def last_contiguous(t: torch.Tensor) -> torch.Tensor:
    """``t``, or a contiguous copy when its last axis is strided (the kernels read rows of contiguous elements)."""
    return t if t.stride(-1) == 1 else t.contiguous()


def _side_launch(side: KernelSide, device, dummies) -> tuple[tuple, dict]:
    """Kernel arguments of one side: (positional args, constexpr values)."""
    d_u8, d_f, d_i64 = dummies
    if side.sink_tokens:
        sk = last_contiguous(side.sink)
        sink_args = (sk, sk.stride(0), sk.stride(1), sk.stride(2), side.sink_tokens)
    else:
        sink_args = (d_f, 0, 0, 0, 0)
    tab = side.blocks
    nblk = side.n_blocks
    if nblk:
        if tab.rows.device != device:
            raise ValueError(f"the block table is on {tab.rows.device}, q on {device}")
        par = tab.params if tab.quantized else d_f
        tab_args = (tab.rows, nblk, side.split, tab.data, tab.data_row_stride, par, tab.param_row_stride)
        meta = dict(QUANT=tab.quantized, BITS=tab.bits if tab.quantized else 8, G=tab.group_size,
                    DATA_UNIT=tab.data_unit, PAR_UNIT=tab.param_unit)
    else:
        tab_args = (d_i64, 0, side.split, d_u8, 0, d_f, 0)
        meta = dict(QUANT=False, BITS=8, G=1, DATA_UNIT=1, PAR_UNIT=1)
    if side.fp is not None and side.fp.shape[-2]:
        fp = last_contiguous(side.fp)
        fp_args = (fp, fp.stride(0), fp.stride(1), fp.stride(2))
    else:
        fp_args = (d_f, 0, 0, 0)
    meta["SINK"] = bool(side.sink_tokens)
    return sink_args + tab_args + fp_args, meta


def decode_attention_sides(
    q: torch.Tensor,
    k: KernelSide,
    v: KernelSide,
    *,
    scaling: float,
    kv_valid: torch.Tensor | None = None,
    num_splits: int | None = None,
    block_n: int | None = None,
    num_warps: int = 4,
) -> torch.Tensor:
    """Attention of one decode step over keys ``k`` and values ``v`` (:class:`KernelSide`: sink, stored
    blocks, full-precision tail), read in place by one split-K launch and one merge launch.

    Args:
        q: ``[B, Hq, 1, D]`` (fp16 / bf16 / fp32); ``Hq`` a multiple of the cache's kv heads (GQA).
        k, v: the two sides, built by :func:`kivi.kernels.segments.kernel_side`; keys' blocks quantized per
            channel (``axis="channel"``), values' per token, or both full precision; they cover the same
            ``T`` positions (their splits may differ).
        scaling: softmax scale (usually ``D ** -0.5``).
        kv_valid: optional bool ``[B, T]`` (True = attend), relative positions.
        num_splits, block_n, num_warps: tuning knobs (defaults fill the GPU).

    Returns ``[B, Hq, 1, D]`` in ``q.dtype``; a row with no valid token is zeros.
    """
    B, Hq, Hkv, D, T = _validate_sides(q, k, v, kv_valid)
    device = q.device
    require_triton(device)
    param_kind(q.dtype)
    import triton.language as tl

    from . import _attention_kernels as K

    dummies = _dummies(device, q.dtype)
    q3 = last_contiguous(q[:, :, 0, :])
    k_args, k_meta = _side_launch(k, device, dummies)
    v_args, v_meta = _side_launch(v, device, dummies)
    if kv_valid is not None:
        valid = kv_valid.to(device=device, dtype=torch.uint8).contiguous()
        valid_args = (valid, valid.stride(0))
    else:
        valid_args = (dummies[0], 0)

    qg = Hq // Hkv
    qg_p2 = max(16, next_pow2(qg))
    block_d = max(16, next_pow2(D))
    if block_n is None:
        block_n = 64 if device.type == "cuda" else 32
    n_tiles = -(-T // block_n)
    splits = num_splits or _num_splits(device, B * Hkv, n_tiles)
    splits = max(1, min(splits, n_tiles))
    tok_per_split = -(-n_tiles // splits) * block_n
    splits = -(-T // tok_per_split)

    m = torch.empty(B * Hkv * splits * qg_p2, dtype=torch.float32, device=device)
    l = torch.empty_like(m)
    acc = torch.empty(B * Hkv * splits * qg_p2, block_d, dtype=torch.float32, device=device)
    dot_t = {torch.float16: tl.float16, torch.bfloat16: tl.bfloat16, torch.float32: tl.float32}[q.dtype]
    if device.type == "cpu" and q.dtype == torch.bfloat16:
        dot_t = tl.float32  # the interpreter's bf16 tl.dot multiplies the raw uint16 bits (triton 3.9)
    precision = "ieee" if dot_t == tl.float32 else "tf32"

    K.decode_split_kernel[(B * Hkv, splits)](
        q3, q3.stride(0), q3.stride(1),
        *k_args, *v_args, *valid_args,
        m, l, acc,
        float(scaling) * _LOG2E, T, k.origin, tok_per_split, splits,
        HKV=Hkv, QG=qg, QG_P2=qg_p2, D=D, BLOCK_D=block_d, BLOCK_N=block_n,
        **{f"K_{n}": val for n, val in k_meta.items()}, **{f"V_{n}": val for n, val in v_meta.items()},
        HAS_VALID=kv_valid is not None, dot_t=dot_t, PRECISION=precision, SCAN=32, num_warps=num_warps,
    )
    out = torch.empty(B, Hq, 1, D, dtype=q.dtype, device=device)
    K.decode_reduce_kernel[(B * Hq,)](
        m, l, acc, out, out.stride(0), out.stride(1),
        splits, HQ=Hq, QG=qg, QG_P2=qg_p2, D=D, BLOCK_D=block_d, S_P2=max(2, next_pow2(splits)),
    )
    return out


__all__ = ["decode_attention_sides", "last_contiguous", "torch_decode_attention_sides"]
