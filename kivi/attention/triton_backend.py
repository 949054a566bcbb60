"""The ``"triton"`` attention backend: adapts a layer's views to the Triton decode kernel.

Decode steps (one new token per sequence) run :func:`kivi.kernels.triton_attention.decode_attention`
on the packed codes. Forwards of several tokens (prefill chunks, speculative verify forwards,
chunked evaluation) run the blocked torch path (:func:`kivi.attention.blocked.blocked_attention`)
on the same device: the kernel is a decode kernel, and this split is the documented design of the
backend, not a fallback. In particular the per-query precision boundary of a multi-token forward
(:class:`~kivi.cache.view.AttentionView` ``fp_from`` / ``left``) is read by the blocked path; a
decode step never has one, and the kernel refuses a view that does.

Known cost: the kernel takes one contiguous quantized segment per side, so the stored blocks are
concatenated (``BlockStore.read``) each decode step; a long prefill is a single block, so this is a
copy of the decode-time blocks only when the prompt dominates, but it is still a copy. A
multi-segment kernel launch would remove it.
"""

from __future__ import annotations

import torch

from ..cache.view import AttentionView


def _side(view: AttentionView):
    """(quantized segment or None, full-precision tail) of one side."""
    if view.sink is not None:
        raise ValueError(
            "attention_backend='triton' does not support sink_tokens > 0 yet; use sink_tokens=0 or "
            "attention_backend='cpu' (blocked torch path, runs on GPUs too)"
        )
    stored = view.store.read(view.split)
    if view.quantized:
        return stored, view.fp
    data = stored.data if stored is not None else view.fp[:, :, :0]
    return None, torch.cat([data, view.fp], dim=-2) if view.fp.shape[-2] else data


def kv_valid_from_mask(attention_mask: torch.Tensor | None, kv_len: int) -> torch.Tensor | None:
    """``[B, kv_len]`` bool (True = attend) from a transformers 4-D mask for one query row."""
    if attention_mask is None:
        return None
    row = attention_mask[:, 0, -1, :kv_len]
    if row.dtype == torch.bool:
        return row
    return row > torch.finfo(row.dtype).min / 2


def triton_view_attention(query, k_view: AttentionView, v_view: AttentionView, *, scaling, attention_mask):
    if query.shape[2] != 1:
        from .blocked import blocked_attention

        return blocked_attention(query, k_view, v_view, scaling=scaling, attention_mask=attention_mask)
    from ..kernels.triton_attention import decode_attention_packed

    if k_view.per_query or v_view.per_query:
        raise ValueError("the Triton decode kernel reads one precision per token; a one-query forward has no "
                         "per-query boundary (kivi.cache.schedule.query_boundaries)")

    k_seg, k_fp = _side(k_view)
    v_seg, v_fp = _side(v_view)
    kv_len = (0 if k_seg is None else k_seg.num_tokens) + k_fp.shape[-2]
    scaling = scaling if scaling is not None else query.shape[-1] ** -0.5
    return decode_attention_packed(
        query, k_seg, k_fp, v_seg, v_fp, scaling=scaling, kv_valid=kv_valid_from_mask(attention_mask, kv_len)
    )
