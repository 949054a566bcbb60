"""What a model must be for a :class:`~kivi.cache.KiviCache`: its layer types and head_dim.

One definition for the cache, :func:`kivi.quantize_model` and the planner (:mod:`kivi.memory`).
"""

from __future__ import annotations

from typing import Any

from transformers.cache_utils import get_layer_types_and_kwargs

from ..config import KiviConfig
from ..quant.rotation import rotation_head_dim_problem

#: Attention layers whose keys/values go through ``Cache.update`` (a KiviLayer each).
SUPPORTED_LAYER_TYPES = ("full_attention", "sliding_attention")


def text_config(model_config: Any) -> Any:
    """The decoder's config of ``model_config`` (itself for plain decoder configs)."""
    get = getattr(model_config, "get_text_config", None)
    return get(decoder=True) if callable(get) else model_config


def check_layer_types(layer_types: list[str], owner: str = "the model") -> None:
    """Raise one ``ValueError`` naming every layer type of ``layer_types`` KiviCache does not support."""
    bad = sorted({t for t in layer_types if t not in SUPPORTED_LAYER_TYPES})
    if bad:
        where = [i for i, t in enumerate(layer_types) if t not in SUPPORTED_LAYER_TYPES]
        shown = ", ".join(map(str, where[:8])) + (", ..." if len(where) > 8 else "")
        raise ValueError(
            f"{owner} has layer types {bad} (layers {shown}); KiviCache supports {list(SUPPORTED_LAYER_TYPES)} "
            "(attention layers whose keys/values go through Cache.update)"
        )


def model_layer_types(model_config: Any) -> list[tuple[str, int | None]]:
    """``[(layer_type, sliding_window or None), ...]``, one per decoder layer of ``model_config``.

    Raises ``ValueError`` naming the unsupported layer types (linear attention, MoE-only, shared KV...).
    """
    layer_types, kwargs = get_layer_types_and_kwargs(text_config(model_config))
    check_layer_types(layer_types, type(model_config).__name__)
    return [(t, kw["sliding_window"] if t == "sliding_attention" else None) for t, kw in zip(layer_types, kwargs)]


def model_head_dim(model_config: Any) -> int:
    """Channels per attention head: ``head_dim`` when the config gives it, else ``hidden_size // heads``."""
    text = text_config(model_config)
    return int(getattr(text, "head_dim", None) or text.hidden_size // text.num_attention_heads)


def max_position_embeddings(model_config: Any) -> int | None:
    """The longest context (in tokens) the model was built for: ``max_position_embeddings`` of the config,
    else of its text config; ``None`` when neither gives a positive int."""
    candidates = [model_config]
    if hasattr(model_config, "get_text_config"):
        candidates.append(model_config.get_text_config())
    for cfg in candidates:
        value = getattr(cfg, "max_position_embeddings", None)
        if isinstance(value, int) and not isinstance(value, bool) and value > 0:
            return value
    return None


def check_head_dim(config: KiviConfig, head_dim: int, num_layers: int = 1) -> None:
    """Raise ``ValueError`` when a layer quantizes values and its ``group_size`` does not divide ``head_dim``,
    or when ``key_rotation`` cannot rotate heads of ``head_dim`` channels (Hadamard: a power of two).

    Values are grouped per token over channels, so a group must not straddle heads. ``config``'s
    ``layer_specific_config`` is applied for layers ``0 .. num_layers - 1``.
    """
    why = rotation_head_dim_problem(config.key_rotation, head_dim)
    if why:
        raise ValueError(why)
    for i in range(num_layers):
        lcfg = config.for_layer(i) if i in config.layer_specific_config else config
        if lcfg.quantize_value and head_dim % lcfg.group_size:
            where = f"layer_specific_config[{i}]." if i in config.layer_specific_config else ""
            raise ValueError(
                f"{where}group_size={lcfg.group_size} must divide head_dim={head_dim} (values are grouped per token "
                "over channels)"
            )


def check_sliding_layers(plan: list[tuple[KiviConfig, int | None]]) -> None:
    """Refuse, in one ``ValueError``, a form a sliding-window layer cannot hold: position tiers, or
    ``quantize_after`` (its eviction frees stored blocks only). ``plan``: ``[(layer config, window or None)]``."""
    for name, off in (("tiers", "tiers=None"), ("quantize_after", "quantize_after=0")):
        bad = [i for i, (c, window) in enumerate(plan) if getattr(c, name) and window is not None]
        if bad:
            raise ValueError(f"{name} is not supported on sliding-window layers (layers {bad[:8]} of this model); "
                             f"use layer_specific_config to give them {off}")


def plan_layers(model_config: Any, config: KiviConfig) -> list[tuple[KiviConfig, int | None]]:
    """Per decoder layer of ``model_config``: its KIVI config and its sliding window (``None``: full).

    Validates ``config`` against the model: supported layer types, layer indices, and one
    ``(residual_length, group_size)`` for all sliding layers (transformers builds one sliding mask
    for all of them, and every sliding layer must drop tokens at the same positions). Raises
    ``ValueError`` naming the problem.
    """
    layer_types = model_layer_types(model_config)  # raises on unsupported layer types
    config.validate(num_layers=len(layer_types))
    plan = [(config.for_layer(i), window) for i, (_, window) in enumerate(layer_types)]
    check_sliding_layers(plan)
    sliding = sorted({(c.residual_length, c.group_size) for c, window in plan if window is not None})
    if len(sliding) > 1:
        raise ValueError(
            "sliding-window layers must share residual_length and group_size (transformers builds one mask for "
            f"all of them); layer_specific_config gives {sliding}"
        )
    return plan


__all__ = [
    "plan_layers", "check_sliding_layers",
    "SUPPORTED_LAYER_TYPES", "text_config", "check_layer_types", "model_layer_types", "model_head_dim",
    "check_head_dim", "max_position_embeddings",
]
