"""Ground-truth attention over a KIVI layer's views: dequantize everything, then plain softmax.

Same semantics as :func:`kivi.cache.view.materialize` followed by an attention that
groups query heads (GQA) instead of repeating the cache.

Masks, as transformers gives them, cover kv positions ``[kv_offset, kv_offset + kv_length)``
where ``kv_offset`` is the views' ``start``: a boolean ``[B, 1|Hq, n, kv_length]`` mask (True =
attend) or an additive float mask. ``None`` means: no padding; causal (bottom-right aligned: the
``n`` queries are the last ``n`` kv positions) when ``n > 1``, everything when ``n == 1``.
"""

from __future__ import annotations

import torch

from ..cache.view import AttentionView
from ..cache.view import materialize as materialize_view

NEG = torch.finfo(torch.float32).min


def grouped_mask(mask: torch.Tensor, hkv: int, g: int) -> torch.Tensor:
    """``[B|1, 1|Hq, n, T]`` -> ``[B|1, 1|Hkv, 1|g, n, T]`` (query head ``h = kv_head * g + j``)."""
    if mask.dim() != 4:
        raise ValueError(f"attention_mask must be 4-D [batch, heads, q, kv], got shape {tuple(mask.shape)}")
    if mask.shape[1] == 1:
        return mask.unsqueeze(2)
    return mask.reshape(mask.shape[0], hkv, g, *mask.shape[2:])


def dense_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    *,
    scaling: float | None = None,
    attention_mask: torch.Tensor | None = None,
) -> torch.Tensor:
    """Softmax attention in float32. ``q [B, Hq, n, D]``, ``k/v [B, Hkv, T, D]`` -> ``[B, Hq, n, Dv]``."""
    B, hq, n, d = q.shape
    hkv, T = k.shape[1], k.shape[2]
    if hq % hkv:
        raise ValueError(f"{hq} query heads are not a multiple of {hkv} kv heads")
    g = hq // hkv
    scaling = d**-0.5 if scaling is None else scaling
    qg = q.float().reshape(B, hkv, g * n, d)
    s = (qg @ k.float().transpose(-1, -2)) * scaling  # [B, Hkv, g*n, T]
    s = s.view(B, hkv, g, n, T)
    if attention_mask is not None:
        m = grouped_mask(attention_mask[..., :T], hkv, g)
        if m.dtype == torch.bool:
            s = s.masked_fill(~m, NEG)
        else:
            s = (s + m.float()).clamp_min(NEG)
    elif n > 1:
        qpos = torch.arange(T - n, T, device=q.device)
        s = s.masked_fill(torch.arange(T, device=q.device)[None, :] > qpos[:, None], NEG)
    p = torch.softmax(s, dim=-1).view(B, hkv, g * n, T)
    out = p @ v.float()
    return out.view(B, hq, n, v.shape[-1]).to(q.dtype)


def reference_attention(
    q: torch.Tensor,
    k_view: AttentionView,
    v_view: AttentionView,
    *,
    scaling: float | None = None,
    attention_mask: torch.Tensor | None = None,
    dtype: torch.dtype | None = None,
) -> torch.Tensor:
    """Attention of ``q [B, Hq, n, D]`` over a KIVI layer's views (dequantize, then attend).

    ``dtype``: the dtype the cache is materialised in (default: the views' full-precision dtype,
    as :func:`kivi.cache.view.materialize` does). Returns ``[B, Hq, n, Dv]`` in ``q.dtype``.
    """
    k = materialize_view(k_view, dtype)
    v = materialize_view(v_view, dtype)
    if k.shape[-2] != v.shape[-2]:
        raise ValueError(f"key view holds {k.shape[-2]} tokens but value view {v.shape[-2]}")
    return dense_attention(q, k, v, scaling=scaling, attention_mask=attention_mask)


def view_geometry(q: torch.Tensor, k_view, v_view) -> tuple[int, int, int, int]:
    """Check that ``q [B, Hq, n, D]`` and the two views line up; return ``(start, kv_len, hkv, dv)``."""
    hq, hkv = q.shape[1], k_view.fp.shape[1]
    if hq % hkv:
        raise ValueError(f"{hq} query heads are not a multiple of {hkv} kv heads")
    start = k_view.start
    end = k_view.split + k_view.fp.shape[-2]
    v_end = v_view.split + v_view.fp.shape[-2]
    if v_end != end or v_view.start != start:
        raise ValueError(f"key view covers [{start}, {end}) but value view [{v_view.start}, {v_end})")
    return start, end - start, hkv, v_view.fp.shape[-1]
