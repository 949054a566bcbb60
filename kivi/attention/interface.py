"""transformers integration: the ``"kivi"`` attention implementation and its mask function.

How the attention function reaches the packed cache without materialising it:

1. ``quantize_model`` (backend != "reference") switches the model to ``attn_implementation="kivi"``.
2. The decoder's forward pre-hook (:func:`kivi.integration._padding_pre_hook`) sees the forward's
   ``KiviCache``; it publishes it in a context variable (:func:`active_cache`) and, when the model
   runs ``"kivi"`` attention and the cache's resolved backend is not ``"reference"``, sets
   ``cache._kivi_defer_attention``. The post-hook clears both.
3. With that flag, ``KiviCache.update`` only *appends* (``KiviLayer.append`` records
   ``layer.last_views``) and returns the new tokens as cheap placeholders.
4. :func:`kivi_attention_forward` finds the layer via ``module.layer_idx`` in the active cache,
   takes (and clears) its ``last_views`` and runs the cache's backend over them.

Anything else — no active cache, a non-KIVI cache, a non-KIVI layer inside a KiviCache, a cache
whose backend is ``"reference"`` — receives real
key/value tensors from ``update`` and goes through transformers' SDPA attention: the correct path
for full-precision tensors, not a fallback of a quantized layer.

Masks: ``"kivi"`` is registered in ``AttentionMaskInterface`` with transformers' ``sdpa_mask``
(boolean, ``None`` when it is a plain causal/decode mask), so padding, causal chunks and sliding
windows reach the attention function exactly as SDPA would get them. Without a registered mask
function transformers builds no mask at all for an unknown implementation.
"""

from __future__ import annotations

from contextvars import ContextVar
from typing import Any

import torch
from transformers import AttentionInterface
from transformers.integrations.sdpa_attention import sdpa_attention_forward
from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

from ..cache.layer import KiviLayer

ATTN_IMPLEMENTATION = "kivi"

_ACTIVE_CACHE: ContextVar[Any] = ContextVar("kivi_active_cache", default=None)


def active_cache() -> Any:
    """The ``KiviCache`` of the forward in progress (set by the decoder pre-hook), or ``None``."""
    return _ACTIVE_CACHE.get()


def set_active_cache(cache: Any) -> None:
    _ACTIVE_CACHE.set(cache)


def run_backend(
    backend: str,
    query: torch.Tensor,
    k_view,
    v_view,
    *,
    scaling: float | None,
    attention_mask: torch.Tensor | None,
) -> torch.Tensor:
    """Attention ``[B, Hq, n, D]`` of ``query`` over the views with the resolved ``backend``."""
    if backend == "cpu":
        # Documented dispatch (kivi.attention.fused_cpu): the fused numba decode kernel for one
        # query token when numba is installed and the format/mask qualify; blocked torch path otherwise.
        from .fused_cpu import fused_decode_attention, fused_decode_supported

        if fused_decode_supported(query, k_view, v_view, attention_mask):
            return fused_decode_attention(query, k_view, v_view, scaling=scaling, attention_mask=attention_mask)
        from .blocked import blocked_attention

        return blocked_attention(query, k_view, v_view, scaling=scaling, attention_mask=attention_mask)
    if backend == "reference":
        from .reference import reference_attention

        return reference_attention(query, k_view, v_view, scaling=scaling, attention_mask=attention_mask)
    if backend == "triton":
        from .triton_backend import triton_view_attention  # raises if triton is absent: explicit choice

        return triton_view_attention(query, k_view, v_view, scaling=scaling, attention_mask=attention_mask)
    raise ValueError(f"attention backend {backend!r} is not resolved; expected 'cpu', 'reference' or 'triton'")


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


def _only_full_precision(view) -> bool:
    """The view holds no stored (quantized or sink) token: all of it is its ``fp`` tensor."""
    return view.quantized and view.sink is None and view.split == view.start


def kivi_attention_forward(
    module: torch.nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    dropout: float = 0.0,
    scaling: float | None = None,
    is_causal: bool | None = None,
    **kwargs,
) -> tuple[torch.Tensor, None]:
    """transformers attention function; returns ``([B, n, Hq, D], None)`` like SDPA's."""
    _check_unsupported(module, kwargs)
    cache = _ACTIVE_CACHE.get()
    layer = None
    if cache is not None and getattr(cache, "_kivi_defer_attention", False):
        idx = getattr(module, "layer_idx", None)
        if idx is None:
            raise RuntimeError(f"{type(module).__name__} has no layer_idx; kivi attention cannot find its cache layer")
        layer = cache.layers[idx] if idx < len(cache.layers) else None
    if isinstance(layer, KiviLayer):
        views = layer.last_views
        if views is None:
            raise RuntimeError(
                f"kivi attention: layer {module.layer_idx} has no pending views (Cache.update was not called "
                "for this forward)"
            )
        layer.last_views = None  # never reuse stale views
        if dropout:
            raise NotImplementedError("kivi attention does not implement attention dropout (training)")
        if attention_mask is not None and attention_mask.dim() != 4:
            raise ValueError(f"kivi attention expects a 4-D mask, got shape {tuple(attention_mask.shape)}")
        if all(_only_full_precision(v) for v in views):
            # Nothing stored yet (e.g. a prefill): every token is exact, so this is plain attention;
            # torch's SDPA kernels do it faster and in O(chunk) memory.
            return sdpa_attention_forward(
                module, query, views[0].fp, views[1].fp, attention_mask, scaling=scaling, is_causal=is_causal, **kwargs
            )
        out = run_backend(
            cache.attention_backend, query, views[0], views[1], scaling=scaling, attention_mask=attention_mask
        )
        return out.transpose(1, 2).contiguous(), None
    # Full-precision tensors (FP layer, no/other cache, reference backend): plain SDPA is the right path.
    return sdpa_attention_forward(
        module, query, key, value, attention_mask, dropout=dropout, scaling=scaling, is_causal=is_causal, **kwargs
    )


def register() -> None:
    """Register ``"kivi"`` in transformers' attention and mask interfaces (idempotent)."""
    AttentionInterface.register(ATTN_IMPLEMENTATION, kivi_attention_forward)
    AttentionMaskInterface.register(ATTN_IMPLEMENTATION, sdpa_mask)


register()
