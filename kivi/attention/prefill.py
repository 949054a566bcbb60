"""Chunked prefill: a long prompt in pieces, so peak memory is bounded by the chunk.

Each chunk is an ordinary forward with the cache (``use_cache=True``), exactly like a generation
step with ``n = chunk_size`` tokens: the cache returns, for every chunk, the quantized history plus
the full-precision window and the chunk (see :mod:`kivi.cache.layer`), so a chunked prefill sees
the same history as token-by-token generation would, and activations (MLP, scores) are those of one
chunk. Only the last chunk's last logits are computed (``logits_to_keep=1``).

Choice: chunking is explicit (this function) rather than hidden inside ``generate``; pass the
filled cache to ``model.generate(..., cache=cache)`` with the full ``input_ids`` to continue.
"""

from __future__ import annotations

from typing import Any

import torch


@torch.no_grad()
def chunked_prefill(
    model: Any,
    input_ids: torch.Tensor,
    cache: Any,
    chunk_size: int = 512,
    attention_mask: torch.Tensor | None = None,
) -> torch.Tensor:
    """Feed ``input_ids [B, T]`` through ``model`` in chunks of ``chunk_size`` tokens into ``cache``.

    ``attention_mask [B, T]`` (1 = token, 0 = padding, left padding) is optional. Returns the
    logits of the last position, ``[B, vocab]``.
    """
    if chunk_size < 1:
        raise ValueError(f"chunk_size={chunk_size} must be >= 1")
    if input_ids.dim() != 2 or input_ids.shape[1] == 0:
        raise ValueError(f"input_ids must be [batch, tokens] with tokens > 0, got {tuple(input_ids.shape)}")
    T = input_ids.shape[1]
    past = cache.get_seq_length()
    position_ids = None
    if attention_mask is not None:
        if attention_mask.shape != input_ids.shape:
            raise ValueError(
                f"attention_mask {tuple(attention_mask.shape)} must match input_ids {tuple(input_ids.shape)}"
            )
        if past:
            raise ValueError("chunked_prefill with an attention_mask needs an empty cache")
        position_ids = (attention_mask.long().cumsum(-1) - 1).clamp_min(0)
    logits = None
    for i in range(0, T, chunk_size):
        j = min(T, i + chunk_size)
        kw: dict[str, Any] = {}
        if attention_mask is not None:
            kw["attention_mask"] = attention_mask[:, :j]
            kw["position_ids"] = position_ids[:, i:j]
        out = model(input_ids=input_ids[:, i:j], cache=cache, use_cache=True, logits_to_keep=1, **kw)
        logits = out.logits[:, -1]
    return logits
