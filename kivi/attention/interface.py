"""transformers integration: the ``"kivi"`` attention implementation and its mask function.

A model calls ``key, value = cache.update(...)`` and then ``attention(module, query, key, value,
mask, ...)``. :func:`kivi_attention_forward` is that attention function for models switched to
``"kivi"`` by :func:`kivi.quantize_model`:

* ``key`` / ``value`` are :class:`~kivi.cache.view.PackedStates` (a :class:`KiviCache` built for
  packed attention returned them): the views inside say what to read, the backend inside how
  (resolved once when the cache was built). A forward whose views hold nothing stored yet (a
  prefill) is exact attention and goes to transformers' SDPA over the full-precision tokens.
  A ``"reference"`` cache returns ``PackedStates(view, "reference")`` for forwards whose queries
  read tokens at different precisions (speculative verify forwards, chunks after the first:
  :func:`kivi.cache.schedule.query_boundaries`); they run :func:`~kivi.attention.reference.reference_attention`.
* anything else — plain tensors from a cache built with ``attention_backend="reference"``, a
  non-KIVI cache, no cache — is full precision: transformers' SDPA is the right path for it.

Masks: ``"kivi"`` is registered in ``AttentionMaskInterface`` with transformers' ``sdpa_mask``
(boolean, ``None`` when it is a plain causal/decode mask), so padding, causal chunks and sliding
windows reach the attention function exactly as SDPA would get them. Without a registered mask
function transformers builds no mask at all for an unknown implementation.
"""

from __future__ import annotations

from contextlib import contextmanager
from typing import Any, Iterator

import torch
from transformers import AttentionInterface
from transformers.integrations.sdpa_attention import sdpa_attention_forward
from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

from ..backends import ATTN_IMPLEMENTATION, Backend, model_attention_unsupported
from ..cache.view import AttentionView, PackedStates, exact_queries
from .backend_attention import attend, fused_heads


def run_backend(
    backend: Backend | str,
    query: torch.Tensor,
    k_view: AttentionView,
    v_view: AttentionView,
    *,
    scaling: float | None,
    attention_mask: torch.Tensor | None,
) -> torch.Tensor:
    """Attention ``[B, Hq, n, D]`` of ``query`` over the views with the resolved ``backend`` (the object the
    cache carries in its :class:`PackedStates`, or a backend's name): :func:`.backend_attention.attend`."""
    return attend(backend, query, k_view, v_view, scaling=scaling, attention_mask=attention_mask)


def _check_unsupported(module: torch.nn.Module, kwargs: dict) -> None:
    if kwargs.get("softcap") is not None or getattr(getattr(module, "config", None), "attn_logit_softcapping", None):
        raise NotImplementedError(
            "kivi attention does not support attention logit softcapping (e.g. Gemma2); use "
            "KiviConfig(attention_backend='reference')"
        )
    if getattr(module, "sinks", None) is not None or kwargs.get("s_aux") is not None:
        raise NotImplementedError(
            "kivi attention does not support attention sinks; use KiviConfig(attention_backend='reference')"
        )


def kivi_attention_forward(
    module: torch.nn.Module,
    query: torch.Tensor,
    key: torch.Tensor | PackedStates,
    value: torch.Tensor | PackedStates,
    attention_mask: torch.Tensor | None,
    dropout: float = 0.0,
    scaling: float | None = None,
    is_causal: bool | None = None,
    **kwargs,
) -> tuple[torch.Tensor, None]:
    """transformers attention function; returns ``([B, n, Hq, D], None)`` like SDPA's."""
    if not isinstance(key, PackedStates):
        # Full-precision tensors (reference cache, FP layer, no/other cache): plain SDPA is the right path.
        return sdpa_attention_forward(
            module, query, key, value, attention_mask, dropout=dropout, scaling=scaling, is_causal=is_causal, **kwargs
        )
    _check_unsupported(module, kwargs)
    if dropout:
        raise NotImplementedError("kivi attention does not implement attention dropout (training)")
    if attention_mask is not None and attention_mask.dim() != 4:
        raise ValueError(f"kivi attention expects a 4-D mask, got shape {tuple(attention_mask.shape)}")
    k_side, v_side = key.view, value.view  # AttentionView or HeadViews: a sequence of head groups either way
    n = query.shape[2]
    exact = exact_queries(n, k_side, v_side)
    if exact == n:
        # Nothing stored yet (e.g. a prefill): every token is exact, so this is plain attention;
        # torch's SDPA kernels do it faster and in O(chunk) memory.
        return sdpa_attention_forward(
            module, query, k_side.fp, v_side.fp, attention_mask, scaling=scaling, is_causal=is_causal, **kwargs
        )
    if exact:
        # A prefill whose last queries follow the one-token rule (the prompt and the first speculative
        # candidates in one forward: KiviCache.set_prompt_length). The prompt's queries must go through
        # the very SDPA call a plain prefill of the prompt makes (same shapes, same kernel): any other
        # path rounds their outputs differently in the last bits, which changes the next layers' keys and
        # values of the prompt and flips some of their 2-bit codes (measured on SmolLM2 K2V2: prompt keys
        # differed from token 192 on in layer 1 and up, and greedy speculative decoding diverged).
        mask = None if attention_mask is None else attention_mask[..., :exact, :exact]
        head, _ = sdpa_attention_forward(
            module, query[:, :, :exact], k_side.fp[:, :, :exact], v_side.fp[:, :, :exact], mask,
            scaling=scaling, is_causal=is_causal, **kwargs,
        )
        tail = layer_attention(key.backend, query[:, :, exact:], k_side.for_queries(exact),
                               v_side.for_queries(exact), scaling=scaling,
                               attention_mask=None if attention_mask is None else attention_mask[..., exact:, :])
        return torch.cat([head, tail.transpose(1, 2)], dim=1).contiguous(), None
    out = layer_attention(key.backend, query, k_side, v_side, scaling=scaling, attention_mask=attention_mask)
    return out.transpose(1, 2).contiguous(), None


def layer_attention(backend: Backend | str, query: torch.Tensor, k_side, v_side, *, scaling: float | None,
                    attention_mask: torch.Tensor | None) -> torch.Tensor:
    """``[B, Hq, n, D]``: attention of ``query`` over one layer's sides (``AttentionView`` s, or
    :class:`~kivi.cache.heads.HeadViews` of a layer with per-head widths). A side of several head groups
    is read in one fused kernel call where the ``"cpu"`` backend takes the call
    (:func:`.backend_attention.fused_heads`), else group by group (:func:`head_groups_attention`)."""
    if len(k_side.views) > 1:
        out = fused_heads(backend, query, k_side, v_side, scaling=scaling, attention_mask=attention_mask)
        if out is not None:
            return out
    return head_groups_attention(backend, query, k_side, v_side, scaling=scaling, attention_mask=attention_mask)


def head_groups_attention(backend: Backend | str, query: torch.Tensor, k_side, v_side, *,
                          scaling: float | None, attention_mask: torch.Tensor | None) -> torch.Tensor:
    """``[B, Hq, n, D]``: :func:`run_backend` of every head group with its query heads, concatenated in head
    order (a layer of one group: :func:`run_backend` of its views as they are; the reference of the
    one-call fused decode of several groups).

    Query head ``h`` reads kv head ``h // g`` (``g = Hq // Hkv``, transformers' GQA layout), so kv heads
    ``[lo, hi)`` are read by query heads ``[lo * g, hi * g)``.
    """
    if len(k_side.views) == 1:
        return run_backend(backend, query, k_side.views[0], v_side.views[0], scaling=scaling,
                           attention_mask=attention_mask)
    hkv, hq = k_side.groups[-1].stop, query.shape[1]
    if hq % hkv:
        raise ValueError(f"{hq} query heads are not a multiple of {hkv} kv heads")
    g = hq // hkv
    outs = []
    for grp, kv, vv in zip(k_side.groups, k_side.views, v_side.views):
        q = query[:, grp.start * g : grp.stop * g].contiguous()
        mask = attention_mask
        if mask is not None and mask.shape[1] != 1:
            mask = mask[:, grp.start * g : grp.stop * g]
        outs.append(run_backend(backend, q, kv, vv, scaling=scaling, attention_mask=mask))  # [B, hq_grp, n, D]
    return torch.cat(outs, dim=1)


@contextmanager
def reading_views(model: Any, cache: Any) -> Iterator[None]:
    """Run ``model`` with the ``"kivi"`` attention inside the block when ``cache`` is a KIVI cache and the
    model runs another attention that ``"kivi"`` implements; restore it after.

    For tools that feed a model not prepared by :func:`kivi.quantize_model` several tokens per forward
    (chunked evaluation): such forwards give each query its own precision, which the cache can only
    return as views (:class:`~kivi.cache.view.PackedStates`); ``"kivi"`` hands plain tensors to SDPA,
    so nothing else changes. A model whose attention ``"kivi"`` does not implement is left as it is.
    ``cache`` must have been built for this (``KiviCache.from_model(model, cfg, reading_views=True)``, or
    after :func:`kivi.quantize_model`): one built for a model's own attention returns tensors only, and
    would give every query the history as it was before the forward, so it is refused.
    """
    from ..cache.kivi_cache import KiviCache  # noqa: PLC0415 - cache sits below attention; lazy keeps imports light

    if not isinstance(cache, KiviCache):
        yield
        return
    if not cache.reads_views and model_attention_unsupported(getattr(model, "config", None)) is None:
        raise ValueError(
            "reading_views: this KiviCache was built for a model whose attention reads tensors only, so a "
            "forward of several tokens would give every query the history as it was before the forward; build "
            "it with KiviCache.from_model(model, config, reading_views=True) (or after kivi.quantize_model)"
        )
    with running_kivi_attention(model):
        yield


@contextmanager
def running_kivi_attention(model: Any) -> Iterator[None]:
    """``model`` runs the ``"kivi"`` attention inside the block (its own restored after); a model already on
    it, or whose attention ``"kivi"`` does not implement, is left as it is."""
    config = getattr(model, "config", None)
    current = getattr(config, "_attn_implementation", None)
    if current == ATTN_IMPLEMENTATION or model_attention_unsupported(config) is not None:
        yield
        return
    model.set_attn_implementation(ATTN_IMPLEMENTATION)
    try:
        yield
    finally:
        model.set_attn_implementation(current)


def register() -> None:
    """Register ``"kivi"`` in transformers' attention and mask interfaces (idempotent)."""
    AttentionInterface.register(ATTN_IMPLEMENTATION, kivi_attention_forward)
    AttentionMaskInterface.register(ATTN_IMPLEMENTATION, sdpa_mask)


register()
