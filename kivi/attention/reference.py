"""Ground-truth attention over a KIVI layer's views: dequantize everything, then plain softmax.

Same semantics as :func:`kivi.cache.view.materialize` followed by an attention that
groups query heads (GQA) instead of repeating the cache. A view with a per-query region
(:class:`~kivi.cache.view.QueryRegion`) is materialised once per version of the region, and each
query reads its own mix of them (scores for keys, weights for values).

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
    k_alts: tuple = (),
    v_alts: tuple = (),
) -> torch.Tensor:
    """Softmax attention in float32. ``q [B, Hq, n, D]``, ``k/v [B, Hkv, T, D]`` -> ``[B, Hq, n, Dv]``.

    ``k_alts``: pairs ``(k2 [B, Hkv, T, D], use [n, T] bool)``: query ``i`` reads key ``j`` from ``k2``
    where ``use[i, j]`` (per-query precision; a later pair wins where two say so); ``v_alts`` likewise.
    """
    B, hq, n, d = q.shape
    hkv, T = k.shape[1], k.shape[2]
    if hq % hkv:
        raise ValueError(f"{hq} query heads are not a multiple of {hkv} kv heads")
    g = hq // hkv
    scaling = d**-0.5 if scaling is None else scaling
    qg = q.float().reshape(B, hkv, g * n, d)
    s = (qg @ k.float().transpose(-1, -2)) * scaling  # [B, Hkv, g*n, T]
    s = s.view(B, hkv, g, n, T)
    for k2, use in k_alts:
        s2 = ((qg @ k2.float().transpose(-1, -2)) * scaling).view(B, hkv, g, n, T)
        s = torch.where(use, s2, s)
    if attention_mask is not None:
        m = grouped_mask(attention_mask[..., :T], hkv, g)
        if m.dtype == torch.bool:
            s = s.masked_fill(~m, NEG)
        else:
            s = (s + m.float()).clamp_min(NEG)
    elif n > 1:
        qpos = torch.arange(T - n, T, device=q.device)
        s = s.masked_fill(torch.arange(T, device=q.device)[None, :] > qpos[:, None], NEG)
    p = torch.softmax(s, dim=-1)
    if not v_alts:
        return (p.view(B, hkv, g * n, T) @ v.float()).view(B, hq, n, v.shape[-1]).to(q.dtype)
    base = torch.ones(n, T, dtype=torch.bool, device=q.device)
    sources = []
    for v2, use in reversed(v_alts):  # the last pair wins: each position counted once
        sources.append((v2, use & base))
        base = base & ~use
    out = torch.zeros(B, hkv, g * n, v.shape[-1], dtype=torch.float32, device=q.device)
    for vt, use in [(v, base), *sources]:
        out += (p * use).view(B, hkv, g * n, T) @ vt.float()
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
    alts = []
    for view, full in ((k_view, k), (v_view, v)):
        alts.append(variant_alternatives(view, full, q.shape[2]) if view.per_query else ())
    return dense_attention(q, k, v, scaling=scaling, attention_mask=attention_mask, k_alts=alts[0], v_alts=alts[1])


def variant_alternatives(view: AttentionView, full: torch.Tensor, n: int) -> tuple:
    """``((x_k [B, H, T, D], use_k [n, T] bool), ...)``: ``full`` (the view materialised) with the per-query
    region replaced by each of its versions, and where each query reads that version."""
    check_boundary(view, n)
    region = view.region
    versions, choice = region.versions, region.choice
    off, L, T = region.first - view.start, versions[0].shape[-2], full.shape[-2]
    out = []
    for idx in range(1, len(versions)):
        use = torch.zeros(n, T, dtype=torch.bool, device=full.device)
        use[:, off:off + L] = choice == idx
        if bool(use.any()):
            alt = full.clone()
            alt[:, :, off:off + L] = versions[idx].to(full.dtype)
            out.append((alt, use))
    return tuple(out)


def check_boundary(view: AttentionView, n: int) -> None:
    """A per-query region must say what each query of the forward reads: one row per query."""
    if view.region.queries != n:
        raise ValueError(f"the view's per-query region covers {view.region.queries} queries, the forward has {n}")


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
