"""The ``"kivi_paged"`` attention: a continuous batch's attention over its KIVI pages, one paged step per layer.

transformers lets a model run a registered attention function over whatever ``cache.update`` returned.
:class:`~kivi.batching.paged_cache.KiviPagedCache` returns a :class:`StepInput` (the batch's new keys and values of
one layer); :func:`paged_attention_forward` hands it back with the queries to the cache
(:meth:`~kivi.batching.paged_cache.KiviPagedCache.attend`), which runs the paged core's step over its pages:
each request attends over its sink, pages, window and new tokens (kivi's backend, ``"cpu"`` or ``"reference"``;
decode rows in one paged decode kernel call), a sliding layer with its window applied per request. No
attention mask is built for the batch.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
from transformers import AttentionInterface

#: The attention implementation name a model runs while a KIVI-pages manager runs.
PAGED_ATTN_IMPLEMENTATION = "kivi_paged"


@dataclass(frozen=True)
class StepInput:
    """One layer's new keys and values of the batch, ``[n, H, D]`` each (request by request), for ``cache``'s
    step at ``layer``: what ``update`` hands attention (both sides get the same object)."""

    cache: Any
    layer: int
    key: torch.Tensor
    value: torch.Tensor

    @classmethod
    def __torch_function__(cls, func, types, args=(), kwargs=None):
        name = getattr(func, "__name__", repr(func))
        raise TypeError(f"{name} received KIVI paged step inputs: the model's attention must be "
                        f"{PAGED_ATTN_IMPLEMENTATION!r} (kivi.batching.init_continuous_batching sets it)")


def paged_attention_forward(module: torch.nn.Module, query: torch.Tensor, key: StepInput, value: StepInput,
                            attention_mask: torch.Tensor | None, dropout: float = 0.0, scaling: float | None = None,
                            **kwargs) -> tuple[torch.Tensor, None]:
    """transformers attention function: ``query [1, Hq, n, D]`` -> ``([1, n, Hq, D], None)``."""
    if not isinstance(key, StepInput) or value is not key:
        raise TypeError(f"the {PAGED_ATTN_IMPLEMENTATION!r} attention reads KIVI pages; it got "
                        f"{type(key).__name__} (run it through kivi.batching.init_continuous_batching)")
    if dropout:
        raise NotImplementedError("KIVI paged attention does not implement attention dropout (training)")
    if getattr(module, "sinks", None) is not None or kwargs.get("softcap") is not None:
        raise NotImplementedError("KIVI paged attention does not support attention sinks or logit softcapping")
    scale = scaling if scaling is not None else query.shape[-1] ** -0.5
    out = key.cache.attend(key.layer, query[0].transpose(0, 1), key.key, key.value, scale)  # [n, Hq, D]
    return out.unsqueeze(0), None


def register() -> None:
    """Register ``"kivi_paged"`` with transformers' attention functions (idempotent). No mask function is
    registered: transformers then builds no batch mask, and each request is causal on its own in the step."""
    AttentionInterface.register(PAGED_ATTN_IMPLEMENTATION, paged_attention_forward)


register()

__all__ = ["PAGED_ATTN_IMPLEMENTATION", "StepInput", "paged_attention_forward", "register"]
