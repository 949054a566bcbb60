"""The attention each backend computes over a layer's views: one function per backend class.

:class:`kivi.backends.Backend` objects (configuration layer) say what they are and what they support;
the cache hands the resolved object to attention inside :class:`~kivi.cache.view.PackedStates`. What
each computes reads the cache's views and kernels, which sit above the configuration layer, so it lives
here, one function per class (:data:`ATTENTION`), called by :func:`attend`.

* ``reference``: :func:`~kivi.attention.reference.reference_attention` (dequantize + attend).
* ``cpu``: the fused numba decode kernel for one query token when the call qualifies
  (:func:`kivi.attention.fused_cpu.fused_decode_supported`; the stored formats are decided once per
  cache, :attr:`kivi.backends.CpuBackend.kernel_reads_layouts`), else the blocked torch path.
* ``triton``: :func:`~kivi.attention.triton_backend.triton_view_attention`; views with position tiers
  go to the blocked path (the Triton kernels read one width per side), chosen here explicitly.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Callable

import torch

from ..backends import Backend, CpuBackend, ReferenceBackend, TritonBackend, backend_named
from . import fused_cpu
from .blocked import blocked_attention
from .reference import reference_attention

if TYPE_CHECKING:
    from ..cache.heads import HeadViews
    from ..cache.view import AttentionView


def _reference(backend: Backend, query, k_view, v_view, *, scaling, attention_mask) -> torch.Tensor:
    return reference_attention(query, k_view, v_view, scaling=scaling, attention_mask=attention_mask)


def _formats_checked(backend: Backend) -> bool:
    return getattr(backend, "kernel_reads_layouts", None) is True


def _cpu(backend: Backend, query, k_view, v_view, *, scaling, attention_mask) -> torch.Tensor:
    if fused_cpu.fused_decode_supported(query, k_view, v_view, attention_mask,
                                        formats_checked=_formats_checked(backend)):
        return fused_cpu.fused_decode_attention(query, k_view, v_view, scaling=scaling, attention_mask=attention_mask)
    return blocked_attention(query, k_view, v_view, scaling=scaling, attention_mask=attention_mask)


def _triton(backend: Backend, query, k_view, v_view, *, scaling, attention_mask) -> torch.Tensor:
    if k_view.tiered or v_view.tiered:
        return blocked_attention(query, k_view, v_view, scaling=scaling, attention_mask=attention_mask)
    from .triton_backend import triton_view_attention  # imports triton: only for this explicit choice

    return triton_view_attention(query, k_view, v_view, scaling=scaling, attention_mask=attention_mask)


#: What each backend class computes over one head group's views (``[B, Hq, n, D]``).
ATTENTION: dict[type[Backend], Callable[..., torch.Tensor]] = {
    ReferenceBackend: _reference, CpuBackend: _cpu, TritonBackend: _triton,
}


def attend(backend: Backend | str, query: torch.Tensor, k_view: AttentionView, v_view: AttentionView, *,
           scaling: float | None, attention_mask: torch.Tensor | None) -> torch.Tensor:
    """Attention ``[B, Hq, n, D]`` of ``query`` over the views with ``backend`` (a resolved
    :class:`~kivi.backends.Backend`, or the name of one)."""
    backend = backend_named(backend)
    return ATTENTION[type(backend)](backend, query, k_view, v_view, scaling=scaling, attention_mask=attention_mask)


def fused_heads(backend: Backend | str, query: torch.Tensor, k_views: HeadViews, v_views: HeadViews, *,
                scaling: float | None, attention_mask: torch.Tensor | None) -> torch.Tensor | None:
    """A layer with per-head widths in one fused kernel call (``[B, Hq, 1, D]``) when ``backend`` is
    ``"cpu"`` and every head group qualifies; ``None`` otherwise (the groups then run one by one)."""
    backend = backend_named(backend)
    if not isinstance(backend, CpuBackend):
        return None
    if not fused_cpu.fused_decode_heads_supported(query, k_views, v_views, attention_mask,
                                                  formats_checked=_formats_checked(backend)):
        return None
    return fused_cpu.fused_decode_heads(query, k_views, v_views, scaling=scaling, attention_mask=attention_mask)


__all__ = ["ATTENTION", "attend", "fused_heads"]
