"""The estimate: FP vs KIVI cache bytes for a model, context and batch, and what fits in a device.

:func:`estimate_kv_memory` resolves the model (:mod:`.sources`), sums every layer's storage
(:mod:`.storage`, from the cache's own schedule) and searches the largest context and batch that fit.
"""

from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass, field
from typing import Any

import torch

from ..cache.support import check_head_dim, check_sliding_layers
from ..config import KiviConfig
from ..quant.side_format import SIDES
from .sources import ModelSpec, model_spec
from .storage import FIELDS, head_layer_bytes
from .units import DTYPE_BYTES, parse_bytes, parse_context
from .weights import check_weight_bits, weight_bytes_breakdown


@dataclass
class MemoryEstimate:
    """Result of :func:`estimate_kv_memory` (bytes unless named otherwise). ``to_dict()`` for JSON."""

    model: str
    context: int
    batch: int
    dtype: str
    num_layers: int
    num_kv_heads: int
    num_heads: int | None
    head_dim: int
    attention: str
    config: dict[str, Any]
    config_description: str
    prefill: int
    fp_bytes_per_token: int
    fp_total_bytes: int
    kivi_bytes_per_token: float
    kivi_total_bytes: int
    kivi_breakdown: dict[str, int]
    kivi_per_token_breakdown: dict[str, float]
    compression_ratio: float
    asymptotic_compression_ratio: float
    layers: list[dict[str, Any]]
    sliding_layers: int
    sliding_window: int | None
    weights_params: int | None
    weights_bytes: int | None
    max_context: int | None
    device_memory: int | None = None
    fp_max_context: int | None = None
    kivi_max_context: int | None = None
    fp_max_batch: int | None = None
    kivi_max_batch: int | None = None
    notes: list[str] = field(default_factory=list)
    #: ``None``: the weights as the spec gives them (``weights_bytes``, or ``params`` x dtype); 16 / 8 / 4:
    #: planned as :func:`kivi.models.quantize_weights` stores them, split in ``weights_breakdown``
    #: (``float``: parameters left in the model dtype; ``codes`` and ``scales`` of the quantized linear layers).
    weight_bits: int | None = None
    weights_breakdown: dict[str, int] | None = None
    #: weights + cache at ``context`` (None when the weights are unknown).
    total_fp_bytes: int | None = None
    total_kivi_bytes: int | None = None

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    def to_json(self, indent: int = 2) -> str:
        return json.dumps(self.to_dict(), indent=indent)


def _resolve_config(config: KiviConfig | str | None) -> KiviConfig:
    if config is None:
        return KiviConfig()
    if isinstance(config, KiviConfig):
        return config
    if isinstance(config, str):
        if config.strip().startswith("{") or config.endswith(".json"):
            return KiviConfig.from_json(config)
        return KiviConfig.preset(config)
    if isinstance(config, dict):
        return KiviConfig.from_dict(config)
    raise TypeError(f"config must be a KiviConfig, a preset name or None, got {type(config).__name__}")


def _layer_plan(cfg: KiviConfig, spec: ModelSpec) -> list[tuple[KiviConfig, int | None, Any, str]]:
    """Per layer: its config, its sliding window (or None), its per-head widths (or None) and a key shared by
    identical layers."""
    plan = []
    for i, lt in enumerate(spec.layer_types):
        lcfg = cfg.for_layer(i)
        window = spec.sliding_window if lt == "sliding_attention" else None
        widths = cfg.layer_head_bits(i)
        plan.append((lcfg, window, widths, json.dumps(lcfg.to_dict(), sort_keys=True) + f"|{window}|{widths}"))
    check_sliding_layers([(lcfg, window) for lcfg, window, _, _ in plan])  # what the cache refuses, refused here
    return plan


def _kivi_total(plan: list, spec: ModelSpec, T: int, P: int, batch: int,
                ) -> tuple[dict[str, float], list[dict[str, Any]]]:
    total = dict.fromkeys(FIELDS, 0.0)
    layers = []
    memo: dict[Any, dict[str, float]] = {}
    for i, (lcfg, window, widths, key) in enumerate(plan):
        if key not in memo:
            memo[key] = head_layer_bytes(lcfg, widths, spec.head_dim, spec.num_kv_heads, batch,
                                         getattr(torch, spec.dtype), T, P, window)
        part = memo[key]
        for k, v in part.items():
            total[k] += v
        kb, vb = widths if widths is not None else (lcfg.k_bits, lcfg.v_bits)  # per kv head where head_bits says
        layers.append({"layer": i, "type": spec.layer_types[i], "k_bits": kb if lcfg.quantize_key else None,
                       "v_bits": vb if lcfg.quantize_value else None, "bytes": int(round(sum(part.values())))})
    return total, layers


def float_cache_bytes(spec: ModelSpec, T: int, batch: int) -> int:
    """Bytes a full-precision cache of ``batch`` sequences of ``T`` tokens holds (sliding layers keep
    their window); the baseline every estimate and budget compares with."""
    per_layer_tok = 2 * spec.num_kv_heads * spec.head_dim * DTYPE_BYTES[spec.dtype] * batch
    total = 0
    for lt in spec.layer_types:
        n = min(T, spec.sliding_window - 1) if lt == "sliding_attention" else T
        total += per_layer_tok * n
    return total


def peak_lengths(T: int, G: int, drops: Any = ()) -> list[int]:
    """The token counts ``<= T`` where a cache growing to ``T`` tokens can be largest: the last ``G`` (keys leave
    the window a group at a time) and the last ``G`` before each ``N < T`` of ``drops`` (``quantize_after``
    values: the cache shrinks at ``N + 1``). Between those drops it only grows, up to its key-group ripple."""
    ends = {T} | {n for n in drops if 0 < n < T}
    return sorted({t for end in ends for t in range(max(1, end - G + 1), end + 1)})


def _max_fitting(fn, budget: int, G: int, hi_limit: int = 2**40, drops: Any = ()) -> int:
    """Largest T such that fn(t) <= budget for every t <= T (fn is monotone up to a G-token ripple, except
    where it drops: after each ``quantize_after`` of ``drops``, :func:`peak_lengths`)."""
    def fits(T: int) -> bool:
        return all(fn(t) <= budget for t in peak_lengths(T, G, drops))

    if not fits(1):
        return 0
    lo, hi = 1, 2
    while hi < hi_limit and fits(hi):
        lo, hi = hi, hi * 2
    if hi >= hi_limit and fits(hi_limit):
        return hi_limit
    while hi - lo > 1:
        mid = (lo + hi) // 2
        if fits(mid):
            lo = mid
        else:
            hi = mid
    return lo


def estimate_kv_memory(
    model_or_spec: Any,
    context: int | str,
    batch: int = 1,
    config: KiviConfig | str | None = None,
    device_memory: int | str | None = None,
    dtype: Any = None,
    *,
    prefill: int | None = None,
    weight_bits: int | None = None,
) -> MemoryEstimate:
    """KV-cache memory of ``model_or_spec`` at ``context`` tokens x ``batch`` sequences, FP vs KIVI.

    Args:
        model_or_spec: a :class:`ModelSpec` (or a dict of its fields), a loaded transformers model, a
            ``PretrainedConfig``, or a string: an alias (``"smollm2"``), a ``.gguf`` file, a checkpoint
            folder or a hub id (only the config is read).
        context: tokens per sequence (``32768`` or ``"32k"``, ``"128K"``, ``"1m"``).
        batch: sequences.
        config: a :class:`KiviConfig`, a preset name (``"balanced"``...), a JSON file, or ``None``
            (the default ``KiviConfig()``: 2-bit keys and values, G=32, R=128).
        device_memory: bytes (or ``"80GB"``, ``"80GiB"``) of the accelerator; adds the largest context
            and batch that fit after the weights.
        dtype: the cache dtype (default: the model's; ``float16`` for explicit shapes).
        prefill: tokens of the first forward (default ``context``: one prefill, no decode).
        weight_bits: ``None`` keeps the weights as the spec gives them (a loaded model: its measured
            bytes); 16 / 8 / 4 plans them as :func:`kivi.models.quantize_weights` would store them
            (:mod:`.weights`: quanto codes + scales for the linear layers, the rest in the model dtype).

    Returns:
        A :class:`MemoryEstimate`; ``kivi_total_bytes`` equals ``KiviCache.nbytes`` after the same
        forwards (no padding).
    """
    spec = model_spec(model_or_spec, dtype=dtype)
    T = parse_context(context)
    if isinstance(batch, bool) or not isinstance(batch, int) or batch < 1:
        raise ValueError(f"batch={batch!r} must be a positive integer")
    P = T if prefill is None else int(prefill)
    if not 1 <= P <= T:
        raise ValueError(f"prefill={prefill!r} must be between 1 and context={T}")
    if weight_bits is not None:
        check_weight_bits(weight_bits)
    cfg = _resolve_config(config)
    cfg.validate(num_layers=spec.num_layers)
    cfg.check_kv_heads(spec.num_kv_heads)
    check_head_dim(cfg, spec.head_dim, spec.num_layers)
    dev_mem = parse_bytes(device_memory) if device_memory is not None else None

    b = DTYPE_BYTES[spec.dtype]
    fp_per_token = 2 * spec.num_layers * spec.num_kv_heads * spec.head_dim * b
    fp_total = float_cache_bytes(spec, T, batch)
    plan = _layer_plan(cfg, spec)
    kt, layers = _kivi_total(plan, spec, T, P, batch)
    kivi_total = int(round(sum(kt.values())))

    # Asymptotic cost per token (quantized storage only, every layer holding every token; with position
    # tiers, the oldest tier's widths: where all but a bounded number of tokens end up).
    per_tok = {"codes": 0.0, "scales_zero_points": 0.0, "compensation": 0.0, "fp_unquantized": 0.0}
    for i in range(spec.num_layers):
        lcfg = cfg.for_layer(i)
        for j, (side, quant) in enumerate(zip(SIDES, (lcfg.quantize_key, lcfg.quantize_value))):
            for h in range(spec.num_kv_heads):
                if not quant:
                    per_tok["fp_unquantized"] += spec.head_dim * b
                    continue
                fmt = cfg.side_format(side, i, h)
                if lcfg.tiers:  # the oldest tier's widths: what a long context holds per token
                    fmt = dataclasses.replace(fmt, bits=lcfg.tiers[-1][1][j])
                for k, v in fmt.token_bytes(spec.head_dim, getattr(torch, spec.dtype)).items():
                    per_tok[k] += v
    kivi_per_token = sum(per_tok.values())

    notes = [
        "cache only: weights, activations and the attention workspace are extra",
        f"KIVI storage modelled for one prefill of {P} tokens" + (f" then {T - P} decode steps" if T > P else "")
        + f"; later tokens go into blocks of {cfg.block_size} tokens (block_reserve)",
    ]
    n_sliding = sum(1 for t in spec.layer_types if t == "sliding_attention")
    if n_sliding:
        notes.append(
            f"{n_sliding} sliding-window layers (window {spec.sliding_window}): "
            "during decoding KIVI frees blocks older "
            f"than window + R + G tokens; FP keeps window - 1 tokens"
        )
    weights = spec.weight_bytes
    weights_parts = None
    if weight_bits is not None:
        if spec.params is None:
            raise ValueError(f"weight_bits={weight_bits} needs the model's parameter count (give --params or a model)")
        weights_parts = weight_bytes_breakdown(spec.params, spec.linear_layers, weight_bits, DTYPE_BYTES[spec.dtype])
        weights = sum(weights_parts.values())
        notes[0] = "weights + cache; activations and the attention workspace are extra"
    est = MemoryEstimate(
        model=spec.name, context=T, batch=batch, dtype=spec.dtype, num_layers=spec.num_layers,
        num_kv_heads=spec.num_kv_heads, num_heads=spec.num_heads, head_dim=spec.head_dim, attention=spec.attention,
        config=cfg.to_dict(), config_description=cfg.describe(), prefill=P,
        fp_bytes_per_token=fp_per_token, fp_total_bytes=fp_total,
        kivi_bytes_per_token=kivi_per_token, kivi_total_bytes=kivi_total,
        kivi_breakdown={k: int(round(v)) for k, v in kt.items()},
        kivi_per_token_breakdown=per_tok,
        compression_ratio=fp_total / kivi_total if kivi_total else float("inf"),
        asymptotic_compression_ratio=fp_per_token / kivi_per_token,
        layers=layers, sliding_layers=n_sliding, sliding_window=spec.sliding_window,
        weights_params=spec.params, weights_bytes=weights, max_context=spec.max_context, notes=notes,
        weight_bits=weight_bits, weights_breakdown=weights_parts,
        total_fp_bytes=None if weights is None else weights + fp_total,
        total_kivi_bytes=None if weights is None else weights + kivi_total,
    )
    if spec.max_context and T > spec.max_context:
        notes.append(f"context {T} is longer than the model's max_position_embeddings={spec.max_context}")
    if dev_mem is not None:
        est.device_memory = dev_mem
        budget = dev_mem - (weights or 0)
        if weights is None:
            notes.append(
                "weights size unknown (give --params or --weights-bytes): the whole device memory is used for the cache"
            )
        if budget <= 0:
            est.fp_max_context = est.kivi_max_context = est.fp_max_batch = est.kivi_max_batch = 0
            notes.append("the weights alone do not fit in the device memory")
        else:
            est.fp_max_batch = budget // fp_total if fp_total else None
            # quantize_after = N < T: the cache was larger at N tokens (full precision) than at T
            drops = {cfg.for_layer(i).quantize_after for i in range(spec.num_layers)}
            peak = max([kivi_total]
                       + [int(round(sum(_kivi_total(plan, spec, n, min(P, n), batch)[0].values())))
                          for n in drops if 0 < n < T])
            est.kivi_max_batch = budget // peak if peak else None
            est.fp_max_context = _max_fitting(lambda t: float_cache_bytes(spec, t, batch), budget, 1)
            g = max(cfg.for_layer(i).group_size for i in range(spec.num_layers))
            est.kivi_max_context = _max_fitting(
                lambda t: sum(
                    _kivi_total(plan, spec, t, t if prefill is None else min(P, t), batch)[0].values()
                ),
                budget,
                g,
                drops=drops,
            )
    return est


__all__ = ["MemoryEstimate", "estimate_kv_memory", "float_cache_bytes"]
