"""What a KIVI layer hands to attention for one forward: an :class:`AttentionView` per side, wrapped
in :class:`PackedStates` when attention reads the packed storage itself.

The contract with transformers' attention: a model calls ``key, value = cache.update(k, v, idx)``
and passes ``key`` / ``value`` straight to its attention function. A :class:`KiviCache` built for
packed attention (see :meth:`KiviCache.from_model`) returns two :class:`PackedStates` there; the
``"kivi"`` attention function (:mod:`kivi.attention.interface`) takes the views out of them and
runs the backend named in them. A cache built for materialised attention returns plain tensors
(everything dequantized), which any attention function reads. Nothing else travels between the
two: no context variable, no flag, no state left on the layer.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from ..quant.kv import dequantize_kv

if TYPE_CHECKING:
    from .store import BlockStore


@dataclass
class AttentionView:
    """What one side (keys or values) of a layer shows attention for the current forward.

    ``store`` tokens ``[store.start, split)`` come from storage (quantized unless ``quantized`` is
    False); ``fp [B, H, T_fp, D]`` holds the tokens ``[split, split + T_fp)`` at full precision
    (the old window followed by the new tokens). ``sink [B, H, S, D]`` (or ``None``) holds the
    tokens ``[0, S)`` at full precision; the store then starts at ``S``.
    """

    store: "BlockStore"
    split: int
    fp: torch.Tensor
    quantized: bool
    sink: torch.Tensor | None = None
    start: int = 0  # first token position covered, fixed when the view is made (the store moves on)

    @property
    def only_full_precision(self) -> bool:
        """Nothing stored is visible (no sink, no stored token): all of it is the ``fp`` tensor."""
        return self.quantized and self.sink is None and self.split == self.start


def materialize(view: AttentionView, dtype: torch.dtype | None = None) -> torch.Tensor:
    """``[B, H, T, D]``: the view's sink, its stored tokens dequantized, then its full-precision part.

    The reference path (what ``KiviCache.update`` returns for ``attention_backend="reference"``,
    and what every attention backend is tested against). ``dtype`` defaults to ``view.fp``'s.
    """
    dtype = dtype or view.fp.dtype
    parts = [] if view.sink is None else [view.sink.to(dtype)]
    for _, seg in view.store.iter_blocks(view.split):
        parts.append(dequantize_kv(seg, dtype) if view.quantized else seg.data.to(dtype))
    if view.fp.shape[-2] or not parts:
        parts.append(view.fp.to(dtype))
    return torch.cat(parts, dim=-2) if len(parts) > 1 else parts[0]


@dataclass(frozen=True)
class PackedStates:
    """The keys or values ``KiviCache.update`` returns when attention reads packed storage.

    ``view``: what attention must see of this side; ``backend``: the attention backend the cache
    was built for (``"cpu"`` or ``"triton"``, resolved once when the cache was built). Not a
    tensor: any torch function that receives one (e.g. SDPA, because the model's attention is
    not ``"kivi"``) raises instead of computing over the wrong tokens.
    """

    view: AttentionView
    backend: str

    @classmethod
    def __torch_function__(cls, func, types, args=(), kwargs=None):
        name = getattr(func, "__name__", repr(func))
        raise TypeError(
            f"{name} received kivi PackedStates: this KiviCache was built for the 'kivi' attention "
            "implementation (attention reads the packed cache), but the model's attention is another one. "
            "Build the cache with KiviCache.from_model(model) after quantize_model(model), or with "
            "attention_backend='reference' to get dequantized tensors"
        )


__all__ = ["AttentionView", "PackedStates", "materialize"]
