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
* :func:`decode_attention` / :func:`torch_decode_attention` — the loose-tensor signature (one
  quantized segment and a tail per side), and ``*_packed`` variants taking
  :class:`~kivi.quant.kv.PackedKV` objects: the same kernel with a one-row table.

Semantics shared by all: ``scores = scaling * q . k`` in float32; ``kv_valid [B, T]`` (bool, True = attend)
masks tokens out; a row with no valid token returns zeros; the output has ``q``'s dtype.
Limits of the kernel: asymmetric quantization without compensation codes, bits in {1, 2, 3, 4, 8}
(3-bit rows: ``ceil(D / 8) * 3`` bytes, a code may straddle two bytes),
one bit width and group size per side (every block of a store shares them).
"""

from __future__ import annotations

import torch

from ..quant.kv import PackedKV, dequantize_kv
from ..quant.packing import packed_size
from ..quant.side_format import KEY_AXIS, VALUE_AXIS
from ._common import ATTENTION_BITS, check_kernel_bits, next_pow2, param_kind, require_triton
from .segments import KernelSide, build_block_table, kernel_side

_LOG2E = 1.4426950408889634


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


# --------------------------------------------------------------------------------------------- torch


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


def _lastc(t: torch.Tensor) -> torch.Tensor:
    return t if t.stride(-1) == 1 else t.contiguous()


def _side_launch(side: KernelSide, device, dummies) -> tuple[tuple, dict]:
    """Kernel arguments of one side: (positional args, constexpr values)."""
    d_u8, d_f, d_i64 = dummies
    if side.sink_tokens:
        sk = _lastc(side.sink)
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
        fp = _lastc(side.fp)
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
    q3 = _lastc(q[:, :, 0, :])
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


def _loose_side(name, packed, scale, offset, fp, bits, group_size, axis, D, Tq, device) -> KernelSide:
    """A one-block :class:`KernelSide` of the loose-tensor signature (quantized ``[0, Tq)`` ++ ``fp``)."""
    table = None
    if Tq:
        packed, scale, offset = _lastc(packed), _lastc(scale), _lastc(offset)
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


__all__ = [
    "decode_attention", "decode_attention_packed", "decode_attention_sides",
    "torch_decode_attention", "torch_decode_attention_packed", "torch_decode_attention_sides",
]
