"""The ``"kivi_paged"`` attention: each request of a continuous batch attends over its KIVI pages, packed.

transformers lets a model run a registered attention function over whatever ``cache.update`` returned.
With a packed attention backend (``cpu``), :class:`~kivi.batching.paged_cache.KiviPagedCache` returns a
:class:`PagedBatchViews` per side instead of tensors: for every request of the batch, the
:class:`~kivi.cache.view.AttentionView` kivi's own cache would hand attention (sink, pages as a
:class:`~kivi.cache.store.BlockStore` aliasing the page memory — no copy, no dequantization —, window
and new tokens). :func:`paged_attention_forward` splits the batch's queries by request and runs kivi's
backend on each (:func:`kivi.attention.interface.run_backend`: the fused numba decode kernel for one
query token, the blocked online-softmax path otherwise). A request with nothing quantized yet attends
in full precision with torch's SDPA (bottom-right causal). No attention mask is built for the batch; a
sliding layer (transformers passes ``sliding_window``) gets a per-request window mask (:func:`window_mask`).

The plain reference beside it is the cache's materialized mode (``attention_backend="reference"``):
the pages dequantized one layer at a time and transformers' SDPA with its varlen mask; tests compare
the two.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from transformers import AttentionInterface
from transformers.integrations.sdpa_attention import sdpa_attention_forward

from ..attention.interface import run_backend
from ..cache.view import AttentionView, exact_queries
from ..paged.decode import PagedDecode, run_paged_decode

#: The attention implementation name a model runs while a KIVI-pages manager with a packed backend runs.
PAGED_ATTN_IMPLEMENTATION = "kivi_paged"


@dataclass(frozen=True)
class PagedBatchViews:
    """One side (keys or values) of one layer for the whole batch: ``views[i]`` for request ``i``,
    whose ``q_lens[i]`` new tokens are consecutive in the batch's query axis; ``backend`` reads them.
    Requests at the batch positions ``decode_rows`` (one query token, something quantized) have no view
    (``None``): one paged decode kernel call reads them all, ``decode``, one row each (the same
    :class:`~kivi.paged.decode.PagedDecode` on both sides)."""

    views: tuple[AttentionView | None, ...]
    q_lens: tuple[int, ...]
    backend: str
    decode: PagedDecode | None = None
    decode_rows: tuple[int, ...] = ()

    @classmethod
    def __torch_function__(cls, func, types, args=(), kwargs=None):
        name = getattr(func, "__name__", repr(func))
        raise TypeError(f"{name} received KIVI paged views: the model's attention must be "
                        f"{PAGED_ATTN_IMPLEMENTATION!r} (kivi.batching.init_continuous_batching sets it)")


def window_mask(n: int, t: int, sliding_window: int | None, device: torch.device) -> torch.Tensor | None:
    """Bool ``[1, 1, n, t]`` (True: attend) for the ``n`` newest of ``t`` positions, aligned bottom-right:
    query ``i`` (position ``p = t - n + i``) sees keys ``k <= p`` and, with a sliding window ``W``,
    ``k > p - W`` (transformers' ``sliding_window_overlay``). ``None`` when plain causality is all there is
    to say and the callee applies it (``n == 1`` or ``n == t``, and no key out of the window)."""
    out_of_window = sliding_window is not None and t > sliding_window
    if not out_of_window and (n == 1 or n == t):
        return None
    ones = torch.ones(n, t, dtype=torch.bool, device=device)
    mask = ones.tril(t - n)
    if out_of_window:
        mask &= ~ones.tril(t - n - sliding_window)
    return mask[None, None]


def fp_attention(module: torch.nn.Module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                 scaling: float | None, sliding_window: int | None = None) -> torch.Tensor:
    """``[1, Hq, n, D]`` attention of the ``n`` newest positions over ``key``/``value`` ``[1, Hkv, T, D]``
    (full precision; causal, aligned bottom-right: query ``i`` sees keys ``< T - n + i + 1``, and only the
    last ``sliding_window`` of them when given: :func:`window_mask`).

    transformers' own SDPA function, called as kivi's ``"kivi"`` attention calls it for a forward with
    nothing quantized yet, so a request's prefill is computed exactly as one-request ``generate()`` does."""
    n, t = query.shape[-2], key.shape[-2]
    mask = window_mask(n, t, sliding_window, query.device)
    out, _ = sdpa_attention_forward(module, query, key, value, mask, scaling=scaling)
    return out.transpose(1, 2)  # sdpa_attention_forward returns [1, n, Hq, D]


def paged_attention_forward(module: torch.nn.Module, query: torch.Tensor, key: PagedBatchViews,
                            value: PagedBatchViews, attention_mask: torch.Tensor | None, dropout: float = 0.0,
                            scaling: float | None = None, **kwargs) -> tuple[torch.Tensor, None]:
    """transformers attention function: ``query [1, Hq, sum(q), D]`` -> ``([1, sum(q), Hq, D], None)``."""
    if not isinstance(key, PagedBatchViews) or not isinstance(value, PagedBatchViews):
        raise TypeError(f"the {PAGED_ATTN_IMPLEMENTATION!r} attention reads KIVI pages; it got "
                        f"{type(key).__name__} (run it through kivi.batching.init_continuous_batching)")
    if dropout:
        raise NotImplementedError("KIVI paged attention does not implement attention dropout (training)")
    if getattr(module, "sinks", None) is not None or kwargs.get("softcap") is not None:
        raise NotImplementedError("KIVI paged attention does not support attention sinks or logit softcapping")
    window = kwargs.get("sliding_window")  # a sliding layer's window (transformers passes it per layer)
    decode, rows = key.decode, key.decode_rows
    if decode is not None and len(rows) == len(key.q_lens):  # a decode step: one kernel call
        out = run_paged_decode(decode, query[0].transpose(0, 1), scaling=scaling)  # [N, Hq, D]
        return out.unsqueeze(0), None
    out = torch.empty_like(query)  # [1, Hq, n, D] (pages hold keys and values of one head_dim)
    starts = [0]
    for n in key.q_lens:
        starts.append(starts[-1] + n)
    if decode is not None:  # the decoding requests of a mixed batch: one call, their rows scattered back
        pos = torch.tensor([starts[i] for i in rows], device=query.device)
        out[0, :, pos] = run_paged_decode(decode, query[0, :, pos].transpose(0, 1),
                                          scaling=scaling).transpose(0, 1).to(out.dtype)
    for i, (kv, vv) in enumerate(zip(key.views, value.views)):
        if kv is None:
            continue
        q = query[:, :, starts[i]: starts[i + 1]]
        if exact_queries(q.shape[-2], kv, vv) == q.shape[-2]:
            out[:, :, starts[i]: starts[i + 1]] = fp_attention(module, q, kv.fp, vv.fp, scaling, window)
        else:
            t = kv.split + kv.fp.shape[-2]  # the request's tokens (the views start at kv.start: pages left the window)
            mask = None
            if window is not None and t > window:
                mask = window_mask(q.shape[-2], t, window, q.device)[..., kv.start:]  # covers [start, t)
            out[:, :, starts[i]: starts[i + 1]] = run_backend(key.backend, q, kv, vv, scaling=scaling,
                                                              attention_mask=mask)
    return out.transpose(1, 2).contiguous(), None


def register() -> None:
    """Register ``"kivi_paged"`` with transformers' attention functions (idempotent). No mask function is
    registered: transformers then builds no batch mask, and each request is causal on its own here."""
    AttentionInterface.register(PAGED_ATTN_IMPLEMENTATION, paged_attention_forward)


register()

__all__ = ["PAGED_ATTN_IMPLEMENTATION", "PagedBatchViews", "paged_attention_forward", "fp_attention",
           "window_mask", "register"]
