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

from ..backends import ATTN_IMPLEMENTATION, model_attention_unsupported
from ..cache.view import AttentionView, PackedStates


def run_backend(
    backend: str,
    query: torch.Tensor,
    k_view: AttentionView,
    v_view: AttentionView,
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
    if backend == "triton" and (k_view.tiered or v_view.tiered):
        # The Triton kernels read one width per side; position tiers (docs/tiers.md) are read by the
        # blocked torch path (any device), chosen here explicitly.
        from .blocked import blocked_attention

        return blocked_attention(query, k_view, v_view, scaling=scaling, attention_mask=attention_mask)
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
    k_view, v_view = key.view, value.view
    if k_view.only_full_precision and v_view.only_full_precision:
        # Nothing stored yet (e.g. a prefill): every token is exact, so this is plain attention;
        # torch's SDPA kernels do it faster and in O(chunk) memory.
        return sdpa_attention_forward(
            module, query, k_view.fp, v_view.fp, attention_mask, scaling=scaling, is_causal=is_causal, **kwargs
        )
    out = run_backend(key.backend, query, k_view, v_view, scaling=scaling, attention_mask=attention_mask)
    return out.transpose(1, 2).contiguous(), None


@contextmanager
def reading_views(model: Any, cache: Any) -> Iterator[None]:
    """Run ``model`` with the ``"kivi"`` attention inside the block when ``cache`` is a KIVI cache and the
    model runs another attention that ``"kivi"`` implements; restore it after.

    For tools that feed a model not prepared by :func:`kivi.quantize_model` several tokens per forward
    (chunked evaluation): such forwards give each query its own precision, which the cache can only
    return as views (:class:`~kivi.cache.view.PackedStates`); ``"kivi"`` hands plain tensors to SDPA,
    so nothing else changes. A model whose attention ``"kivi"`` does not implement is left as it is.
    """
    from ..cache.cache import KiviCache  # noqa: PLC0415 - cache sits below attention; lazy keeps imports light

    config = getattr(model, "config", None)
    current = getattr(config, "_attn_implementation", None)
    if (not isinstance(cache, KiviCache) or current == ATTN_IMPLEMENTATION
            or model_attention_unsupported(config) is not None):
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
