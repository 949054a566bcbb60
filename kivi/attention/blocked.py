"""CPU fast path: attention that reads a KIVI layer's packed store block by block.

``q [B, Hq, n, D]`` attends over the tokens ``[start, end)`` of a layer's
:class:`~kivi.cache.layer.AttentionView` s:

* keys: store tokens ``[start, split_k)`` quantized per channel (groups of ``G`` tokens), then
  the full-precision ``fp`` tail;
* values: store tokens ``[start, split_v)`` quantized per token (groups of ``G`` channels), then
  their own ``fp`` tail (``split_v`` generally differs from ``split_k``).

The kv axis is walked in chunks of at most ``block_tokens`` tokens with a streaming (online)
softmax: running max ``m``, running sum ``l`` and a float32 accumulator per query row, so the
transient memory is O(query_chunk x block) whatever the context length. Nothing is ever
dequantized to a full ``[B, H, T, D]`` tensor.

Per key chunk (per-channel groups, ``x = c * scale + base`` with ``base = offset + comp`` or
``-qmax * scale`` when symmetric) the scores factor as
``q.x = (q * scale) . c + q . base`` per group — the codes are only unpacked to floats (one
table lookup per byte). When there are more query rows than tokens per group (prefill chunks), the
chunk is dequantized in place instead (cheaper then). Values are unpacked and scaled per chunk and
accumulated with ``p @ v``.

GQA: the query heads sharing a kv head are folded into the row axis (``[B, Hkv, g * n, D]``);
the cache is never repeated. Masks: see :mod:`kivi.attention.reference`.

Per-query precision (views with a :class:`~kivi.cache.view.QueryRegion`): the tokens of the
region (``[split, split + M)`` as ``fp`` and as they are once out of the window; with position tiers
also the stored tokens demoted during the forward, one version per tier) are read once per version,
and each query row takes its own (a ``torch.where`` on the scores
for keys, split weights for values). Only those tokens (at most about ``n + G`` per tier boundary)
cost more; the rest of the walk is unchanged.
"""

from __future__ import annotations

import torch

from ..cache.view import AttentionView
from ..quant.kv import PackedKV, compensation_values
from ..quant.packing import unpack_codes
from .reference import NEG, check_boundary, grouped_mask, view_geometry

_LUTS: dict[tuple[int, torch.device], torch.Tensor] = {}


def _lut(bits: int, device: torch.device) -> torch.Tensor:
    """``[256, 8 // bits]`` float32: the codes held by each byte value."""
    key = (bits, device)
    t = _LUTS.get(key)
    if t is None:
        per = 8 // bits
        t = ((torch.arange(256)[:, None] >> (torch.arange(per) * bits)) & ((1 << bits) - 1)).float().to(device)
        _LUTS[key] = t
    return t


def codes_float(packed: torch.Tensor, bits: int, n: int) -> torch.Tensor:
    """Packed codes ``[..., bytes]`` -> float32 codes ``[..., n]``."""
    if bits == 8:
        return packed[..., :n].float()
    if bits in (1, 2, 4):
        per = 8 // bits
        out = torch.nn.functional.embedding(packed.int(), _lut(bits, packed.device))  # [..., bytes, per]
        out = out.reshape(*packed.shape[:-1], packed.shape[-1] * per)
        return out if out.shape[-1] == n else out[..., :n]
    return unpack_codes(packed, bits, n).float()


def _base(seg: PackedKV) -> torch.Tensor:
    """Float32 additive term per group (``scale``'s shape): offset (+ compensation)."""
    scale = seg.scale.float()
    if seg.offset is None:
        base = scale * -(2 ** (seg.bits - 1) - 1)
    else:
        base = seg.offset.float()
    comp = compensation_values(seg)
    return base if comp is None else base + comp


def _slice_key_seg(seg: PackedKV, a: int, b: int) -> PackedKV:
    g = seg.group_size
    return seg.with_tensors(
        **{
            k: (v[:, :, a // g : b // g] if k in ("scale", "offset", "comp") else v[:, :, a:b])
            for k, v in seg.tensors().items()
        }
    )


def _slice_value_seg(seg: PackedKV, a: int, b: int) -> PackedKV:
    return seg.with_tensors(**{k: v[:, :, a:b] for k, v in seg.tensors().items()})


def _key_chunks(view: AttentionView, block_tokens: int, region):
    """Yield ``(first_token, kind, obj)`` in token order: kind "q" (PackedKV), "fp" (tensor) or "multi"
    (``(offset in the per-query region, [version tensors])``, ``region = view.region``)."""
    if view.sink is not None:
        yield 0, "fp", view.sink
    store_end = view.split if region is None else min(view.split, region.first)
    for t0, seg in view.store.iter_blocks(store_end):
        if view.quantized:
            bt = max(seg.group_size, block_tokens // seg.group_size * seg.group_size)
            for a in range(0, seg.num_tokens, bt):
                b = min(seg.num_tokens, a + bt)
                yield t0 + a, "q", (seg if (a == 0 and b == seg.num_tokens) else _slice_key_seg(seg, a, b))
        else:
            for a in range(0, seg.num_tokens, block_tokens):
                yield t0 + a, "fp", seg.data[:, :, a : a + block_tokens]
    fp = view.fp
    m = 0
    if region is not None:  # per-query precision: every version of these tokens
        first, versions = region.first, region.versions
        L = versions[0].shape[-2]
        for a in range(0, L, block_tokens):
            yield first + a, "multi", (a, [x[:, :, a : min(L, a + block_tokens)] for x in versions])
        m = first + L - view.split
    for a in range(m, fp.shape[-2], block_tokens):
        yield view.split + a, "fp", fp[:, :, a : a + block_tokens]


def _value_pieces(view: AttentionView, region):
    """List of ``(first, end, kind, obj)`` covering the value tokens in order (see :func:`_key_chunks`)."""
    out = [] if view.sink is None else [(0, view.sink.shape[-2], "fp", view.sink)]
    store_end = view.split if region is None else min(view.split, region.first)
    for t0, seg in view.store.iter_blocks(store_end):
        if view.quantized:
            out.append((t0, t0 + seg.num_tokens, "q", seg))
        else:
            out.append((t0, t0 + seg.num_tokens, "fp", seg.data))
    m = 0
    if region is not None:
        first, versions = region.first, region.versions
        L = versions[0].shape[-2]
        out.append((first, first + L, "multi", versions))
        m = first + L - view.split
    if view.fp.shape[-2] > m:
        out.append((view.split + m, view.split + view.fp.shape[-2], "fp", view.fp[:, :, m:]))
    return out


def _key_scores(qg: torch.Tensor, seg: PackedKV) -> torch.Tensor:
    """Scores ``[B, H, M, T]`` of (pre-scaled) float32 ``qg [B, H, M, D]`` against a key segment."""
    B, H, M, D = qg.shape
    T, G = seg.num_tokens, seg.group_size
    tg = T // G
    c = codes_float(seg.packed, seg.bits, seg.head_dim).view(B, H, tg, G, D)
    scale = seg.scale.float()  # [B, H, tg, D]
    base = _base(seg)
    if M < G:
        # (q * scale) . codes + q . base, per group: [B, H, tg, M, D] @ [B, H, tg, D, G]
        qs = qg.unsqueeze(2) * scale.unsqueeze(3)
        s = torch.matmul(qs, c.transpose(-1, -2))  # [B, H, tg, M, G]
        s += torch.matmul(base, qg.transpose(-1, -2)).unsqueeze(-1)  # [B, H, tg, M, 1]
        return s.permute(0, 1, 3, 2, 4).reshape(B, H, M, T)
    k = torch.addcmul(base.unsqueeze(3), c, scale.unsqueeze(3)).view(B, H, T, D)
    return qg @ k.transpose(-1, -2)


def _value_block(seg: PackedKV) -> torch.Tensor:
    """Float32 values ``[B, H, T, D]`` of a (small) value segment."""
    B, H, T, _ = seg.packed.shape
    D, G = seg.head_dim, seg.group_size
    c = codes_float(seg.packed, seg.bits, D).view(B, H, T, D // G, G)
    v = torch.addcmul(_base(seg).unsqueeze(-1), c, seg.scale.float().unsqueeze(-1))
    return v.view(B, H, T, D)


def blocked_attention(
    q: torch.Tensor,
    k_view: AttentionView,
    v_view: AttentionView,
    *,
    scaling: float | None = None,
    attention_mask: torch.Tensor | None = None,
    block_tokens: int = 1024,
    query_chunk: int = 128,
) -> torch.Tensor:
    """Attention of ``q [B, Hq, n, D]`` over a KIVI layer's views, reading the packed store blockwise.

    ``attention_mask``: as transformers gives it (covers kv positions ``[start, start + kv_len)``,
    boolean True = attend, or additive float), or ``None`` (causal bottom-right when ``n > 1``).
    Returns ``[B, Hq, n, Dv]`` in ``q.dtype``; computes in float32. ``block_tokens`` x ``query_chunk``
    bounds the transient: with SmolLM2 shapes one score tile is 9 heads x 128 x 1024 x 4 B = 4.5 MiB.
    """
    B, hq, n, d = q.shape
    start, kv_len, hkv, dv = view_geometry(q, k_view, v_view)
    for view in (k_view, v_view):
        if view.per_query:
            check_boundary(view, n)
    g = hq // hkv
    end = start + kv_len
    scaling = d**-0.5 if scaling is None else scaling
    mask = None
    if attention_mask is not None:
        if attention_mask.shape[-1] < kv_len:
            raise ValueError(
                f"attention_mask covers {attention_mask.shape[-1]} kv positions, the cache shows {kv_len}"
            )
        mask = grouped_mask(attention_mask, hkv, g)  # [B|1, 1|Hkv, 1|g, n, >=kv_len]
    k_region, v_region = k_view.region, v_view.region
    values = _value_pieces(v_view, v_region)
    out = torch.empty(B, hkv, g, n, dv, dtype=q.dtype, device=q.device)
    qpos_all = torch.arange(end - n, end, device=q.device)
    for q0 in range(0, n, query_chunk):
        q1 = min(n, q0 + query_chunk)
        nc = q1 - q0
        M = g * nc
        qg = (q[:, :, q0:q1].float() * scaling).view(B, hkv, g, nc, d).reshape(B, hkv, M, d)
        m = torch.full((B, hkv, M, 1), NEG, dtype=torch.float32, device=q.device)
        l = torch.zeros(B, hkv, M, 1, dtype=torch.float32, device=q.device)
        acc = torch.zeros(B, hkv, M, dv, dtype=torch.float32, device=q.device)
        causal = mask is None and n > 1
        qpos = qpos_all[q0:q1]
        last_q = end - n + q1 - 1
        for a, kind, obj in _key_chunks(k_view, block_tokens, k_region):
            if causal and a > last_q:
                break
            if kind == "q":
                s = _key_scores(qg, obj)
            elif kind == "multi":  # each query row reads its own version of these keys
                off, versions = obj
                T = versions[0].shape[-2]
                sel = k_region.choice[q0:q1, off : off + T]  # [nc, T]
                s = (qg @ versions[0].float().transpose(-1, -2)).view(B, hkv, g, nc, T)
                for idx in range(1, len(versions)):
                    use = sel == idx
                    if bool(use.any()):
                        s = torch.where(use, (qg @ versions[idx].float().transpose(-1, -2)).view(B, hkv, g, nc, T), s)
                s = s.reshape(B, hkv, M, T)
            else:
                s = qg @ obj.float().transpose(-1, -2)
            T = s.shape[-1]
            b = a + T
            if mask is not None or causal:
                s5 = s.view(B, hkv, g, nc, T)
                if causal:
                    kpos = torch.arange(a, b, device=q.device)
                    s5.masked_fill_(kpos[None, :] > qpos[:, None], NEG)
                elif mask.dtype == torch.bool:
                    s5.masked_fill_(~mask[..., q0:q1, a - start : b - start], NEG)
                else:
                    s5.add_(mask[..., q0:q1, a - start : b - start].float()).clamp_min_(NEG)
            m_new = torch.maximum(m, s.amax(dim=-1, keepdim=True))
            p = s.sub_(m_new).exp_()  # in place: s is this block's own tensor (one score tile alive, not three)
            alpha = torch.exp(m - m_new)
            l.mul_(alpha).add_(p.sum(dim=-1, keepdim=True))
            acc.mul_(alpha)
            m = m_new
            for va, vb, vkind, vobj in values:
                lo, hi = max(a, va), min(b, vb)
                if lo >= hi:
                    continue
                if vkind == "multi":  # split each query row's weights between the versions
                    sel = v_region.choice[q0:q1, lo - va : hi - va]  # [nc, hi - lo]
                    pp = p[..., lo - a : hi - a].reshape(B, hkv, g, nc, hi - lo)
                    for idx, vers in enumerate(vobj):
                        use = sel == idx
                        if bool(use.any()):
                            acc.add_((pp * use).view(B, hkv, M, hi - lo) @ vers[:, :, lo - va : hi - va].float())
                    continue
                if vkind == "q":
                    vt = _value_block(_slice_value_seg(vobj, lo - va, hi - va))
                else:
                    vt = vobj[:, :, lo - va : hi - va].float()
                acc.add_(p[..., lo - a : hi - a] @ vt)
        res = (acc / l).view(B, hkv, g, nc, dv)
        out[:, :, :, q0:q1] = res.to(q.dtype)
    return out.view(B, hq, n, dv)
