"""Plugging KIVI into a HuggingFace model: `quantize_model` and the padding hook.

After ``quantize_model(model, config)``:

* ``model.generate(...)`` builds a :class:`KiviCache` from ``config`` whenever the caller passes no
  cache and no ``cache_implementation`` (a ``KiviCache`` passed explicitly is used as is);
* every forward that receives a ``KiviCache`` tells it which tokens are padding (from the 2-D
  ``attention_mask``), so padding never enters a quantization statistic.

* the model's attention implementation becomes ``"kivi"`` (attention reads the packed cache, see
  :mod:`kivi.attention`) unless the backend is ``"reference"`` and the model's attention is one
  the ``"kivi"`` attention does not implement (logit softcapping, attention sinks). With
  ``"reference"`` the ``"kivi"`` attention hands the cache's dequantized tensors to SDPA, and reads
  the views itself only for forwards whose queries need their own precision (chunked prefill or
  evaluation, speculative verify forwards: see ``docs/python.md``, "Speculative decoding"); ``dequantize_model``
  restores the previous one.

Weights and ``generate`` arguments stay as they were; a model whose linear layers are quantized by
optimum-quanto (:func:`kivi.models.quantize_weights`, before or after this call) works unchanged: nothing
here looks at how the weights are stored (docs/python.md, "KIVI on weight-quantized models"). Tested with
transformers 5.x: the cache goes under the keyword the model's forward takes
(:func:`generate_cache_key`: ``cache=`` in 5.2x, ``past_key_values=`` before).
"""

from __future__ import annotations

import inspect
import types
from typing import Any

from . import attention  # noqa: F401 - registers the "kivi" attention and mask functions with transformers
from .backends import ATTN_IMPLEMENTATION, PACKED_BACKENDS, model_attention_unsupported, resolve_attention_backend
from .cache.kivi_cache import KiviCache
from .cache.padding import install_padding_hook
from .cache.support import check_head_dim, model_head_dim, model_layer_types, plan_layers
from .config import KiviConfig

# Families tested with tiny random models (tests/test_quantize_model.py) and SmolLM2 (Llama).
TESTED_MODEL_TYPES = ("llama", "mistral", "qwen2", "qwen3", "gemma2", "gemma3_text", "phi3")


def check_model_supported(model: Any) -> None:
    """Raise ``ValueError`` naming what is missing when KIVI cannot serve ``model``."""
    cfg = getattr(model, "config", None)
    if cfg is None or not hasattr(cfg, "get_text_config"):
        raise ValueError(f"{type(model).__name__} is not a transformers PreTrainedModel (no .config)")
    if getattr(cfg, "is_encoder_decoder", False):
        raise ValueError(
            f"{type(model).__name__} is an encoder-decoder model; KiviCache supports decoder-only models"
        )
    if not hasattr(model, "generate"):
        raise ValueError(f"{type(model).__name__} has no generate(); use a *ForCausalLM model")
    supports = getattr(type(model), "_supports_default_dynamic_cache", None)
    if callable(supports) and not supports():
        raise ValueError(
            f"{type(model).__name__} does not use transformers' Cache for its attention states "
            "(it brings its own cache), so a KiviCache cannot be plugged in"
        )
    # Raises for layer types that are not plain attention (linear attention, MoE-only, shared KV...).
    model_layer_types(cfg)


def quantize_model(model: Any, config: KiviConfig | None = None, *,
                   prefill_chunk_size: int | None = None) -> Any:
    """Make ``model`` use a KIVI cache; returns the same model object.

    Validates ``config`` against the model (e.g. a ``layer_specific_config`` index beyond the
    model's layers, a ``group_size`` that does not divide ``head_dim``).

    ``prefill_chunk_size``: when given, ``generate()`` feeds a long prompt in chunks of this many
    tokens (transformers' ``generation_config.prefill_chunk_size``; never overrides a value the
    user set there). Each chunk attends to the history as decoding will see it (quantized beyond
    the window), as :func:`kivi.attention.chunked_prefill` does. Default ``None``: transformers'
    one-shot prefill, the faster one on CPU (measured at 8K tokens on SmolLM2: chunks of 512 lowered
    KIVI 2/2's prefill peak from +264 to +76 MiB but made the prefill 3.7x as long); each layer's
    full-precision keys/values are freed after that layer's attention either way.
    """
    config = config if config is not None else KiviConfig()
    if not isinstance(config, KiviConfig):
        raise TypeError(f"config must be a KiviConfig, got {type(config).__name__}")
    if prefill_chunk_size is not None and (
        isinstance(prefill_chunk_size, bool) or not isinstance(prefill_chunk_size, int) or prefill_chunk_size < 1
    ):
        raise ValueError(f"prefill_chunk_size={prefill_chunk_size!r} must be a positive int or None")
    check_model_supported(model)
    plan_layers(model.config, config)  # validates the config against the model's layers
    text_cfg = model.config.get_text_config(decoder=True)
    check_head_dim(config, model_head_dim(text_cfg), text_cfg.num_hidden_layers)
    # attention_backend: "auto" resolved once here; a packed backend -> the model runs "kivi" attention,
    # and KiviCache.from_model hands this result to every cache it builds for the model.
    backend = resolve_attention_backend(
        config.attention_backend, getattr(model, "device", None), config=config, model_config=model.config
    )
    model.kivi_config = config
    model.kivi_attention_backend = backend
    current = model.config._attn_implementation
    # "reference" runs "kivi" attention too where it can: per-query precision (multi-token forwards
    # into a non-empty cache) cannot be expressed as the plain tensors SDPA reads.
    runs_kivi = backend in PACKED_BACKENDS or model_attention_unsupported(model.config) is None
    if runs_kivi and current != ATTN_IMPLEMENTATION:
        model._kivi_previous_attn_implementation = current
        model.set_attn_implementation(ATTN_IMPLEMENTATION)
    elif not runs_kivi and current == ATTN_IMPLEMENTATION:
        model.set_attn_implementation(getattr(model, "_kivi_previous_attn_implementation", None) or "sdpa")
    install_padding_hook(model)
    gen = getattr(model, "generation_config", None)
    if gen is not None:
        if not hasattr(model, "_kivi_previous_prefill_chunk_size"):
            model._kivi_previous_prefill_chunk_size = gen.prefill_chunk_size  # the user's own setting
        if model._kivi_previous_prefill_chunk_size is None:  # never override a chunk size the user chose
            gen.prefill_chunk_size = prefill_chunk_size

    if not getattr(model, "_kivi_patched_generate", False):
        original = model._prepare_cache_for_generation

        def _prepare_cache_for_generation(self, generation_config, model_kwargs, *args, **kwargs):
            key = generate_cache_key(self)
            wants_default = (
                model_kwargs.get(key) is None
                and generation_config.use_cache is not False
                and generation_config.cache_implementation is None
                and getattr(self, "kivi_config", None) is not None
            )
            if wants_default:
                model_kwargs[key] = KiviCache.from_model(self, self.kivi_config)
            else:
                result = original(generation_config, model_kwargs, *args, **kwargs)
            cache = model_kwargs.get(key)
            if isinstance(cache, KiviCache) and cache.get_seq_length() == 0:
                # The prompt's queries are the exact prefill; speculative candidates that transformers
                # runs in the same first forward must see what one-token decoding would
                # (docs/python.md, "Speculative decoding").
                cache.set_prompt_length(_prompt_length(generation_config, model_kwargs))
            return None if wants_default else result

        model._prepare_cache_for_generation = types.MethodType(_prepare_cache_for_generation, model)
        model._kivi_patched_generate = True
    return model


def generate_cache_key(model: Any) -> str:
    """The keyword under which ``generate`` keeps the cache in ``model_kwargs`` and hands it to the model's
    forward: ``"cache"`` where the forward takes it (transformers 5.2x), else ``"past_key_values"`` (earlier
    5.x, e.g. the 5.19 that vLLM 0.32 pins). A cache stored under the other name is silently ignored by
    ``generate``, which then decodes with its own full-precision cache."""
    return "cache" if "cache" in inspect.signature(model.forward).parameters else "past_key_values"


def _prompt_length(generation_config: Any, model_kwargs: dict) -> int | None:
    """The prompt's length as ``generate`` knows it when it prepares the cache (``None``: unknown).

    From the 2-D attention mask; transformers 5 drops an all-ones mask before this point
    (``model_kwargs["attention_mask"] = None``) and keeps its length in ``generation_config._mask_length``
    (read by its own ``_prefill``), so that is the prompt length then. Without it every query of the first
    forward would be exact, the speculative candidates' too (measured: the first forward of prompt-lookup
    decoding on SmolLM2 ran as one 446-query prefill, so it was neither one-token decoding for the
    candidates nor the plain prompt prefill for the prompt).
    """
    mask = model_kwargs.get("attention_mask")
    if mask is not None:
        return mask.shape[-1] if mask.dim() == 2 else None
    length = getattr(generation_config, "_mask_length", None)
    return length if isinstance(length, int) and length > 0 else None


def dequantize_model(model: Any) -> Any:
    """Undo :func:`quantize_model`: ``generate`` goes back to transformers' default cache."""
    if getattr(model, "_kivi_patched_generate", False):
        del model._prepare_cache_for_generation
        model._kivi_patched_generate = False
    model.kivi_config = None
    model.kivi_attention_backend = None
    if hasattr(model, "_kivi_previous_prefill_chunk_size"):
        model.generation_config.prefill_chunk_size = model._kivi_previous_prefill_chunk_size
        del model._kivi_previous_prefill_chunk_size
    if model.config._attn_implementation == ATTN_IMPLEMENTATION:
        model.set_attn_implementation(getattr(model, "_kivi_previous_attn_implementation", None) or "sdpa")
    return model
