"""Replay a recorded prefill into an empty cache: one full-precision prefill serves many caches.

A prefill hands each layer's cache ``update(keys, values, layer_idx)`` once, with the keys (after RoPE)
and values of the whole prompt, and the attention of a prompt forward into an empty cache is exact
for every cache kivi evaluates (``DynamicCache``, ``KiviCache`` — its prompt queries read every token
at full precision —, transformers' ``QuantizedCache``). So the tensors a layer receives do not depend
on the cache: recorded once (e.g. from a ``DynamicCache()`` built without a config, whose layers keep
every token, sliding-window layers included), handing them to another cache's ``update`` stores
exactly what a real prefill into that cache stores (tests/cache/test_replay.py compares the two).
"""

from __future__ import annotations

from typing import Any, Sequence

import torch


def replay_prefill(cache: Any, states: Sequence[tuple[torch.Tensor, torch.Tensor]]) -> Any:
    """Hand ``states`` (per layer ``(keys, values)``, each ``[B, H_kv, T, D]``, as a prefill gave them to
    its cache) to the empty ``cache`` through ``cache.update``, layer by layer; returns ``cache``.

    Each tensor is cloned first: no cache may alias (and write into) the shared recording. Single
    sequences or unpadded batches only: a padded batch's cache also needs its padding, which a
    prefill sets before ``update`` and this function does not.
    """
    if not states:
        raise ValueError("states is empty: record a prefill of at least one layer first")
    with torch.inference_mode():
        for i, (k, v) in enumerate(states):
            if k is None or v is None or k.shape[:-1] != v.shape[:-1]:
                raise ValueError(f"states[{i}] is not a (keys, values) pair of one prompt")
            cache.update(k.clone(), v.clone(), i)
    return cache


__all__ = ["replay_prefill"]
