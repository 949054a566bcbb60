"""The ``"triton"`` attention backend: adapts a layer's views to the Triton decode kernel.

Decode steps (one new token per sequence) run :func:`kivi.kernels.triton_attention.decode_attention_sides`,
which reads each side in place: the full-precision sink tokens, every stored block (quantized, or
full precision for a side stored unquantized) and the full-precision window, in one split-K launch.
Nothing is concatenated: the stored blocks are described by a small device table
(:func:`kivi.kernels.segments.build_block_table`) that is built once per set of blocks and memoised
in the store (``BlockStore.derived["triton"]``, dropped whenever a block is added, dropped or
replaced), so a decode step uploads nothing but its own scalars.

What the kernel does not read goes, by this rule (:func:`decode_route`), to the blocked torch path
(:func:`kivi.attention.blocked.blocked_attention`) on the same device — the documented design of the
backend, not a fallback:

* forwards of several tokens (prefill chunks, speculative verify forwards, chunked evaluation):
  the kernel is a decode kernel; these also carry the per-query precision
  (:class:`~kivi.cache.view.AttentionView` ``region``), which the blocked path reads;
* masks that are not one boolean validity row per sequence (an additive float mask, a per-head
  mask): the kernel takes ``kv_valid [B, T]``; the ``"kivi"`` attention registers transformers'
  boolean ``sdpa_mask``, so model forwards never hit this.

A one-token view with a per-query region cannot exist (``kivi.cache.schedule.query_boundaries``)
and raises; formats the kernel does not implement (symmetric codes, compensation codes) raise
when the table is built (``resolve_attention_backend`` refuses them before a cache is made).
"""

from __future__ import annotations

import torch

from ..cache.view import AttentionView
from ..quant.side_format import VALUE_AXIS
from .reference import view_geometry

_MEMO_KEY = "triton"


def _block_table(view: AttentionView, device: torch.device):
    """The memoised :class:`~kivi.kernels.segments.BlockTable` of the view's store (whole blocks), or ``None``."""
    from ..kernels.segments import build_block_table

    store = view.store
    if store.template is None or view.split <= store.start:
        return None
    table = store.derived.get(_MEMO_KEY)
    if table is None or table.rows.device != device:
        blocks = [
            (b0, store.template.with_tensors(**blk) if view.quantized else blk["data"])
            for blk, b0 in zip(store.blocks, store.starts)
            if blk is not None
        ]
        table = build_block_table(blocks, store.template.axis if view.quantized else VALUE_AXIS, device)
        store.derived[_MEMO_KEY] = table
    return table


def kernel_side_of(view: AttentionView, device: torch.device):
    """:class:`~kivi.kernels.segments.KernelSide` of one view: positions relative to ``view.start``."""
    from ..kernels.segments import kernel_side

    if view.sink is not None and view.start != 0:
        raise ValueError(f"a view with sink tokens must start at position 0, this one starts at {view.start}")
    fp = view.fp if view.fp.shape[-2] else None
    return kernel_side(view.sink, _block_table(view, device), view.split - view.start, fp, origin=view.start)


def kv_valid_from_mask(attention_mask: torch.Tensor | None, batch: int, kv_len: int) -> torch.Tensor | None:
    """``[B, kv_len]`` bool (True = attend) from a boolean 4-D mask ``[B|1, 1, n, >=kv_len]`` (last query row)."""
    if attention_mask is None:
        return None
    if attention_mask.dtype != torch.bool or attention_mask.dim() != 4 or attention_mask.shape[1] != 1:
        raise ValueError(f"the Triton decode kernel reads a boolean [B, 1, n, T] mask, got {attention_mask.dtype} "
                         f"{tuple(attention_mask.shape)}")
    if attention_mask.shape[-1] < kv_len:
        raise ValueError(f"attention_mask covers {attention_mask.shape[-1]} kv positions, the cache shows {kv_len}")
    return attention_mask[:, 0, -1, :kv_len].expand(batch, kv_len)


def decode_route(query: torch.Tensor, attention_mask: torch.Tensor | None) -> str | None:
    """``None`` when the Triton kernel reads this forward, else why the blocked torch path does."""
    if query.shape[2] != 1:
        return f"a forward of {query.shape[2]} query tokens (the kernel is a decode kernel)"
    if attention_mask is not None and (attention_mask.dtype != torch.bool or attention_mask.dim() != 4
                                       or attention_mask.shape[1] != 1):
        return (f"a {attention_mask.dtype} mask of shape {tuple(attention_mask.shape)} "
                "(the kernel reads a boolean validity row)")
    return None


def triton_view_attention(query, k_view: AttentionView, v_view: AttentionView, *, scaling, attention_mask,
                          **knobs):
    """Attention ``[B, Hq, n, D]`` of ``query`` over the views: the Triton kernel for decode steps,
    the blocked path for what :func:`decode_route` names. ``knobs``: the kernel's tuning arguments."""
    if decode_route(query, attention_mask) is not None:
        from .blocked import blocked_attention

        return blocked_attention(query, k_view, v_view, scaling=scaling, attention_mask=attention_mask)
    from ..kernels.triton_attention import decode_attention_sides

    if k_view.per_query or v_view.per_query:
        raise ValueError("the Triton decode kernel reads one precision per token; a one-query forward has no "
                         "per-query boundary (kivi.cache.schedule.query_boundaries)")
    _, kv_len, _, _ = view_geometry(query, k_view, v_view)
    device = query.device
    ks, vs = kernel_side_of(k_view, device), kernel_side_of(v_view, device)
    scaling = scaling if scaling is not None else query.shape[-1] ** -0.5
    valid = kv_valid_from_mask(attention_mask, query.shape[0], kv_len)
    return decode_attention_sides(query, ks, vs, scaling=scaling, kv_valid=valid, **knobs)
