"""Which new tokens are padding: the one side channel between a model's forward and its KiviCache.

The cache must leave padded tokens out of every quantization statistic, so it needs the 2-D
``attention_mask [batch, past + new]`` of each forward. transformers does not pass it to
``Cache.update`` (the attention layers only see the 4-D mask built from it, after the cache
update), so a forward pre-hook on the decoder hands it to the cache (:meth:`KiviCache.set_attention_mask`)
and a post-hook clears it. This is the only state kivi sets on a cache from outside a call, and
this module is the only place that sets it.
"""

from __future__ import annotations

from typing import Any

import torch

_HOOK_ATTR = "_kivi_padding_hook"


def decoder_of(model: Any) -> Any:
    """The decoder stack of a causal LM (``model.get_decoder()``, else ``model.model``)."""
    get = getattr(model, "get_decoder", None)
    if callable(get):
        try:
            dec = get()
            if dec is not None:
                return dec
        except (AttributeError, NotImplementedError):
            pass
    return getattr(model, "model", model)


def _forward_cache(kwargs: dict) -> Any:
    """The forward's cache if it takes a padding mask (a KiviCache), else ``None``."""
    cache = kwargs.get("cache", kwargs.get("past_key_values"))
    return cache if callable(getattr(cache, "set_attention_mask", None)) else None


def _pre_hook(module: torch.nn.Module, args: tuple, kwargs: dict) -> None:
    cache = _forward_cache(kwargs)
    if cache is None:
        return
    mask = kwargs.get("attention_mask")
    if mask is None and len(args) >= 2 and isinstance(args[1], torch.Tensor):
        mask = args[1]
    cache.set_attention_mask(mask)


def _post_hook(module: torch.nn.Module, args: tuple, kwargs: dict, output: Any) -> None:
    cache = _forward_cache(kwargs)
    if cache is not None:
        cache.set_attention_mask(None)


def install_padding_hook(model: Any) -> None:
    """Make every forward of ``model``'s decoder pass its 2-D attention mask to a ``KiviCache``."""
    dec = decoder_of(model)
    if getattr(dec, _HOOK_ATTR, None) is not None:
        return
    h1 = dec.register_forward_pre_hook(_pre_hook, with_kwargs=True)
    h2 = dec.register_forward_hook(_post_hook, with_kwargs=True)
    setattr(dec, _HOOK_ATTR, (h1, h2))


__all__ = ["install_padding_hook", "decoder_of"]
