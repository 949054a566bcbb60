"""Saved quantized prefixes for a model: prefill a document once, save its KIVI cache, load it elsewhere.

* :func:`model_fingerprint` — what a saved cache is only valid for: the model's architecture,
  layers, KV heads, head_dim, dtype, RoPE parameters, a sha256 of its weights and one of its tokenizer.
* :func:`prefill` — run the model over ``input_ids`` into a KIVI cache (one forward).
* :func:`save_prefix` / :func:`load_prefix` — :meth:`KiviCache.save` / :meth:`KiviCache.load` with
  the fingerprint computed here and the token ids stored alongside.
* :class:`SaveAfterPrefill` — saves the cache of a ``generate()`` call right after its prefill.

The file format and its checks live in :mod:`kivi.cache.persist`.
"""

from __future__ import annotations

import hashlib
import json
import os
from dataclasses import dataclass
from typing import Any

import torch
from transformers import LogitsProcessor

from .cache.kivi_cache import KiviCache
from .cache.persist import read_header
from .cache.support import model_head_dim, model_layer_types, text_config
from .config import KiviConfig

WEIGHT_HASHES = ("all", "sample")
#: Elements hashed per parameter with ``weights="sample"`` (evenly spaced, first and last included).
SAMPLE_ELEMENTS = 4096


def weights_sha256(model: Any, mode: str = "all") -> str:
    """sha256 over every parameter's name, dtype, shape and bytes (``"all"``) or an evenly spaced sample of
    :data:`SAMPLE_ELEMENTS` of its elements (``"sample"``: cheaper, misses a change between samples).

    Measured on SmolLM2-135M (float32, 538 MB): ``"all"`` 0.69 s on this 2-core VM
    (see docs/python.md, "Saved quantized prefixes").
    """
    if mode not in WEIGHT_HASHES:
        raise ValueError(f"weights={mode!r} is not allowed; choose one of {list(WEIGHT_HASHES)}")
    h = hashlib.sha256()
    for name, p in model.named_parameters():
        flat = p.detach().reshape(-1)
        h.update(f"{name}|{str(p.dtype)}|{tuple(p.shape)}|".encode())
        if mode == "sample" and flat.numel() > SAMPLE_ELEMENTS:
            idx = torch.arange(SAMPLE_ELEMENTS, device=flat.device) * (flat.numel() - 1) // (SAMPLE_ELEMENTS - 1)
            flat = flat[idx]
        h.update(memoryview(flat.to("cpu").contiguous().view(torch.uint8).numpy()))
    return h.hexdigest()


def tokenizer_sha256(tokenizer: Any) -> str:
    """sha256 of the tokenizer's full definition (fast tokenizers: its ``tokenizer.json``, with vocabulary,
    merges, normalizer and added tokens), else of its sorted vocabulary and special tokens."""
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if backend is not None:
        text = backend.to_str()
    else:
        text = json.dumps({"vocab": sorted(tokenizer.get_vocab().items()),
                           "special": sorted(map(str, getattr(tokenizer, "all_special_tokens", [])))})
    return hashlib.sha256(text.encode()).hexdigest()


def model_fingerprint(model: Any, tokenizer: Any = None, *, weights: str = "all") -> dict[str, Any]:
    """A JSON dict describing ``model`` (and ``tokenizer``) for :meth:`KiviCache.save` / ``load``.

    Two fingerprints are equal when the model has the same class, layers, KV heads, head_dim, dtype,
    RoPE parameters and weights (``weights``: see :func:`weights_sha256`) and the tokenizer the same
    definition (``tokenizer=None``: ``tokenizer_sha256`` is ``None``, and a file saved with one refuses it).
    """
    cfg = text_config(model.config)
    rope = getattr(cfg, "rope_parameters", None) or getattr(cfg, "rope_scaling", None)
    return {
        "architecture": type(model).__name__,
        "config_class": type(model.config).__name__,
        "model_type": getattr(cfg, "model_type", None),
        "num_hidden_layers": cfg.num_hidden_layers,
        "num_key_value_heads": getattr(cfg, "num_key_value_heads", None) or cfg.num_attention_heads,
        "head_dim": model_head_dim(cfg),
        "sliding_windows": [w for _, w in model_layer_types(model.config)],
        "vocab_size": getattr(cfg, "vocab_size", None),
        "rope": json.dumps(rope, sort_keys=True, default=str),
        "dtype": str(model.dtype).removeprefix("torch."),
        "weights_hash": weights,
        "weights_sha256": weights_sha256(model, weights),
        "tokenizer_sha256": None if tokenizer is None else tokenizer_sha256(tokenizer),
    }


def prefill(model: Any, input_ids: torch.Tensor, cache: KiviCache | None = None) -> KiviCache:
    """Run ``model`` over ``input_ids [B, T]`` (no padding) into ``cache`` (default: ``KiviCache.from_model``)."""
    cache = cache if cache is not None else KiviCache.from_model(model)
    with torch.inference_mode():
        model(input_ids=input_ids, attention_mask=torch.ones_like(input_ids), cache=cache, use_cache=True,
              logits_to_keep=1)
    return cache


def save_prefix(path: str | os.PathLike, cache: KiviCache, model: Any, tokenizer: Any,
                input_ids: torch.Tensor, *, weights: str = "all") -> None:
    """Save ``cache`` (holding ``input_ids``) with the fingerprint of ``model`` and ``tokenizer``."""
    cache.save(path, fingerprint=model_fingerprint(model, tokenizer, weights=weights), input_ids=input_ids)


@dataclass
class SavedPrefix:
    """A loaded prefix: the cache and the token ids it holds (``[B, T]``, ``T = cache.get_seq_length()``)."""

    cache: KiviCache
    input_ids: torch.Tensor | None

    def continuation_ids(self, new_ids: torch.Tensor) -> torch.Tensor:
        """``[B, T + n]``: the prefix's ids followed by ``new_ids [B, n]`` (what ``generate()`` takes)."""
        if self.input_ids is None:
            raise ValueError("this prefix was saved without its input_ids; pass the full token ids yourself")
        if new_ids.dim() != 2 or new_ids.shape[-1] < 1:
            raise ValueError(f"new_ids of shape {tuple(new_ids.shape)} must be [batch, n >= 1]: generate() needs "
                             "at least one token after the prefix")
        return torch.cat([self.input_ids, new_ids.to(self.input_ids.device)], dim=-1)


def load_prefix(path: str | os.PathLike, model: Any, tokenizer: Any, *, config: KiviConfig | None = None,
                attention_backend: str | None = None) -> SavedPrefix:
    """Load a prefix saved by :func:`save_prefix` for ``model`` / ``tokenizer`` (checked, see
    :mod:`kivi.cache.persist`). ``config`` defaults to ``model.kivi_config`` when the model has one."""
    header = read_header(path)  # fail on a bad file before hashing the weights
    mode = header.fingerprint.get("weights_hash", "all")
    fingerprint = model_fingerprint(model, tokenizer, weights=mode if mode in WEIGHT_HASHES else "all")
    cache, ids = KiviCache.load_with_ids(path, fingerprint=fingerprint, model=model, config=config,
                                         attention_backend=attention_backend)
    return SavedPrefix(cache, ids)


class SaveAfterPrefill(LogitsProcessor):
    """A ``generate()`` logits processor that saves the cache once, right after the prefill.

    ``generate()`` offers no point between its prefill and its first decode step; its logits
    processors run there (the cache then holds exactly the prompt). This one saves ``cache`` with
    ``save(cache)`` on its first call and changes no score, so the generated tokens are those of
    the same ``generate()`` without it.
    """

    def __init__(self, cache: KiviCache, save: Any):
        self.cache = cache
        self.save = save
        self.saved = False

    def __call__(self, input_ids: torch.Tensor, scores: torch.Tensor) -> torch.Tensor:
        if not self.saved:
            self.save(self.cache)
            self.saved = True
        return scores


__all__ = ["model_fingerprint", "weights_sha256", "tokenizer_sha256", "prefill", "save_prefix", "load_prefix",
           "SavedPrefix", "SaveAfterPrefill", "WEIGHT_HASHES"]
