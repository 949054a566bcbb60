"""KV-cache memory planner: what a full-precision cache and a KIVI cache cost for a model and context.

The full-precision (FP) cache of a decoder holds, per token and per sequence,
``2 x layers x kv_heads x head_dim x bytes`` (keys and values). :func:`estimate_kv_memory` computes
that and the exact storage a :class:`~kivi.cache.KiviCache` allocates for the same tokens:

* **codes** — ``bits`` per element, bit-packed (:func:`kivi.quant.packing.packed_size`);
* **scales / zero-points** — one scale and one offset (``scale_dtype``, ``"auto"`` = the cache
  dtype) per group: keys per channel per ``G`` tokens, values per ``G`` channels per token;
* **compensation** — ``residual_bits`` per group when error compensation is on;
* **full-precision window** — the ``R`` most recent values and ``R + ((T - R) mod G)`` most recent
  keys (keys leave the window in whole groups of ``G``), at full precision;
* **block reserve** — storage allocated but not yet written: a prefill of ``P`` tokens becomes
  one exact-size block, later tokens are written into blocks of ``block_size`` tokens.

The model is one prefill of ``prefill`` tokens (default: the whole ``context``) followed by
one-token decode steps up to ``context``; for that sequence of forwards the estimate equals
``KiviCache.nbytes`` byte for byte (no padding). Sliding-window layers (Gemma 2/3, Mistral) are
modelled as the cache does it: blocks entirely older than ``window + R + G`` tokens (cut at a
multiple of ``block_size``) are freed during decoding; after a single prefill nothing is freed yet.
The FP baseline keeps the last ``window - 1`` tokens on such layers (transformers'
``DynamicSlidingWindowLayer``).

Activations, logits and the attention workspace are not included: this is the cache alone.
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
import re
import struct
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from .cache.support import check_head_dim, check_layer_types, model_head_dim, model_layer_types, text_config
from .cache.schedule import (
    KEY_AXIS,
    VALUE_AXIS,
    allocated_tokens,
    freed_tokens,
    layer_sink_tokens,
    side_tokens,
    sliding_cut,
)
from .config import KiviConfig
from .quant.kv import kv_bytes_breakdown

__all__ = [
    "ModelSpec",
    "MemoryEstimate",
    "estimate_kv_memory",
    "model_spec",
    "parse_context",
    "parse_bytes",
    "format_bytes",
    "DTYPE_BYTES",
]

DTYPE_BYTES: dict[str, int] = {"float32": 4, "float16": 2, "bfloat16": 2}
_DTYPE_ALIASES = {
    "fp32": "float32", "float": "float32", "f32": "float32", "torch.float32": "float32",
    "fp16": "float16", "half": "float16", "f16": "float16", "torch.float16": "float16",
    "bf16": "bfloat16", "torch.bfloat16": "bfloat16",
}
DEFAULT_DTYPE = "float16"


# --------------------------------------------------------------------------- parsing helpers


def normalize_dtype(dtype: Any) -> str:
    """``torch.float16`` / ``"fp16"`` / ``"float16"`` -> ``"float16"``; raises ``ValueError`` otherwise."""
    s = str(dtype).strip().lower()
    s = _DTYPE_ALIASES.get(s, s)
    if s not in DTYPE_BYTES:
        raise ValueError(f"dtype={dtype!r} is not supported; choose one of {list(DTYPE_BYTES)}")
    return s


_CONTEXT_RE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([kKmM]?)\s*$")


def parse_context(value: Any) -> int:
    """Token counts: ``32768``, ``"32768"``, ``"32k"``/``"32K"`` (x1024), ``"128k"``, ``"1m"`` (x1024²)."""
    if isinstance(value, bool):
        raise ValueError(f"context={value!r} is not a token count")
    if isinstance(value, int):
        n = value
    else:
        m = _CONTEXT_RE.match(str(value))
        if not m:
            raise ValueError(f"context={value!r} is not a token count; use e.g. 32768, 32k, 128K or 1m")
        mult = {"": 1, "k": 1024, "m": 1024**2}[m.group(2).lower()]
        x = float(m.group(1)) * mult
        if x != int(x):
            raise ValueError(f"context={value!r} is not a whole number of tokens")
        n = int(x)
    if n < 1:
        raise ValueError(f"context={value!r} must be at least 1 token")
    return n


_BYTES_UNITS = {
    "": 1, "b": 1,
    "kb": 10**3, "mb": 10**6, "gb": 10**9, "tb": 10**12,
    "kib": 2**10, "mib": 2**20, "gib": 2**30, "tib": 2**40,
    "k": 2**10, "m": 2**20, "g": 2**30, "t": 2**40,
}
_BYTES_RE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([a-zA-Z]*)\s*$")


def parse_bytes(value: Any) -> int:
    """Memory sizes: ``"80GB"`` (10⁹), ``"80GiB"`` (2³⁰), ``"512MB"``, ``"24G"`` (GiB), or a byte count."""
    if isinstance(value, bool):
        raise ValueError(f"memory size {value!r} is not a number of bytes")
    if isinstance(value, (int, float)):
        if value <= 0:
            raise ValueError(f"memory size {value!r} must be positive")
        return int(value)
    m = _BYTES_RE.match(str(value))
    unit = m.group(2).lower() if m else None
    if not m or unit not in _BYTES_UNITS:
        raise ValueError(f"memory size {value!r} is not understood; use e.g. 80GB, 80GiB, 24G, 512MB or a byte count")
    n = int(float(m.group(1)) * _BYTES_UNITS[unit])
    if n <= 0:
        raise ValueError(f"memory size {value!r} must be positive")
    return n


def format_bytes(n: float) -> str:
    """Binary units: ``107374182400`` -> ``"100.00 GiB"``."""
    n = float(n)
    for unit, size in (("TiB", 2**40), ("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if abs(n) >= size:
            return f"{n / size:.2f} {unit}"
    return f"{n:.0f} B"


# --------------------------------------------------------------------------- model description


@dataclass
class ModelSpec:
    """The shape of a decoder's KV cache (and, optionally, its weights).

    ``layer_types`` (``"full_attention"`` / ``"sliding_attention"`` per layer; default all full)
    and ``sliding_window`` describe sliding-window models. ``params`` or ``weights_bytes`` give the
    weights' size (``weights_bytes`` wins; otherwise ``params x dtype bytes``).
    """

    num_layers: int
    num_kv_heads: int
    head_dim: int
    dtype: str = DEFAULT_DTYPE
    num_heads: int | None = None
    layer_types: list[str] | None = None
    sliding_window: int | None = None
    params: int | None = None
    weights_bytes: int | None = None
    max_context: int | None = None
    name: str = "custom"
    model_type: str | None = None

    def __post_init__(self) -> None:
        for f in ("num_layers", "num_kv_heads", "head_dim"):
            v = getattr(self, f)
            if isinstance(v, bool) or not isinstance(v, int) or v < 1:
                raise ValueError(f"{f}={v!r} must be a positive integer")
        if self.num_heads is not None:
            if isinstance(self.num_heads, bool) or not isinstance(self.num_heads, int) or self.num_heads < 1:
                raise ValueError(f"num_heads={self.num_heads!r} must be a positive integer")
            if self.num_heads % self.num_kv_heads:
                raise ValueError(
                    f"num_heads={self.num_heads} must be a multiple of num_kv_heads={self.num_kv_heads} "
                    "(MHA: equal, GQA: a multiple, MQA: num_kv_heads=1)"
                )
        self.dtype = normalize_dtype(self.dtype)
        if self.layer_types is None:
            self.layer_types = ["full_attention"] * self.num_layers
        self.layer_types = list(self.layer_types)
        if len(self.layer_types) != self.num_layers:
            raise ValueError(f"layer_types has {len(self.layer_types)} entries for {self.num_layers} layers")
        check_layer_types(self.layer_types, "ModelSpec")
        if "sliding_attention" in self.layer_types and not self.sliding_window:
            raise ValueError("sliding_attention layers need sliding_window")
        for f in ("params", "weights_bytes", "max_context"):
            v = getattr(self, f)
            if v is not None and (isinstance(v, bool) or not isinstance(v, int) or v < 0):
                raise ValueError(f"{f}={v!r} must be a non-negative integer")

    @property
    def attention(self) -> str:
        if self.num_heads is None:
            return "MQA" if self.num_kv_heads == 1 else "query heads not given"
        if self.num_heads == self.num_kv_heads:
            return "MHA"
        return "MQA" if self.num_kv_heads == 1 else f"GQA ({self.num_heads // self.num_kv_heads} q/kv)"

    @property
    def weight_bytes(self) -> int | None:
        if self.weights_bytes is not None:
            return self.weights_bytes
        if self.params is not None:
            return self.params * DTYPE_BYTES[self.dtype]
        return None


def _count_params_from_config(config: Any) -> int | None:
    """Parameters of the model ``config`` describes, from a meta-device instantiation (no memory)."""
    try:
        import torch
        from transformers import AutoModelForCausalLM

        with torch.device("meta"):
            model = AutoModelForCausalLM.from_config(config)
        return int(sum(p.numel() for p in model.parameters()))
    except Exception:  # unknown architecture, remote code...: weights are then unknown
        return None


def spec_from_hf_config(config: Any, *, name: str = "model", dtype: Any = None, params: int | None = None,
                        count_params: bool = True) -> ModelSpec:
    """A :class:`ModelSpec` from a transformers ``PretrainedConfig``."""
    text = text_config(config)
    n_layers = getattr(text, "num_hidden_layers", None)
    heads = getattr(text, "num_attention_heads", None)
    if not n_layers or not heads:
        raise ValueError(f"{type(config).__name__} has no num_hidden_layers / num_attention_heads; is it a decoder?")
    kv = getattr(text, "num_key_value_heads", None) or heads
    head_dim = model_head_dim(text)
    layers = model_layer_types(config)
    windows = {w for _, w in layers if w is not None}
    window = max(windows) if windows else None
    if dtype is None:
        dtype = getattr(text, "dtype", None) or getattr(config, "dtype", None) or getattr(config, "torch_dtype", None)
        try:
            dtype = normalize_dtype(dtype) if dtype is not None else DEFAULT_DTYPE
        except ValueError:
            dtype = DEFAULT_DTYPE
    if params is None and count_params:
        params = _count_params_from_config(config)
    max_ctx = getattr(text, "max_position_embeddings", None)
    return ModelSpec(
        num_layers=int(n_layers), num_kv_heads=int(kv), head_dim=int(head_dim), dtype=dtype, num_heads=int(heads),
        layer_types=[t for t, _ in layers], sliding_window=window, params=params,
        max_context=int(max_ctx) if isinstance(max_ctx, int) else None, name=name,
        model_type=getattr(text, "model_type", None),
    )


# ------------------------------------------------------------------ GGUF metadata (cheap: header only)

_GGUF_SCALAR = {0: "<B", 1: "<b", 2: "<H", 3: "<h", 4: "<I", 5: "<i", 6: "<f", 7: "<?", 10: "<Q", 11: "<q", 12: "<d"}


def read_gguf_metadata(path: str | os.PathLike) -> tuple[dict[str, Any], int]:
    """Scalar metadata of a GGUF file and its total parameter count, reading only the header.

    Arrays (the tokenizer's vocabulary...) are skipped; their length is reported instead.
    """
    with open(path, "rb") as f:
        def rd(fmt: str) -> Any:
            size = struct.calcsize(fmt)
            buf = f.read(size)
            if len(buf) != size:
                raise ValueError(f"{path}: truncated GGUF header")
            return struct.unpack(fmt, buf)[0]

        def rd_str() -> str:
            n = rd("<Q")
            return f.read(n).decode("utf-8", errors="replace")

        def rd_value(t: int) -> Any:
            if t in _GGUF_SCALAR:
                return rd(_GGUF_SCALAR[t])
            if t == 8:
                return rd_str()
            if t == 9:
                et, n = rd("<I"), rd("<Q")
                if et in _GGUF_SCALAR:
                    f.seek(struct.calcsize(_GGUF_SCALAR[et]) * n, 1)
                elif et == 8:
                    for _ in range(n):
                        f.seek(rd("<Q"), 1)
                else:
                    for _ in range(n):
                        rd_value(et)
                return ("array", n)
            raise ValueError(f"{path}: unknown GGUF value type {t}")

        if f.read(4) != b"GGUF":
            raise ValueError(f"{path} is not a GGUF file (bad magic)")
        version = rd("<I")
        if version < 2:
            raise ValueError(f"{path}: GGUF version {version} is too old")
        n_tensors, n_kv = rd("<Q"), rd("<Q")
        meta: dict[str, Any] = {}
        for _ in range(n_kv):
            key = rd_str()
            meta[key] = rd_value(rd("<I"))
        params = 0
        for _ in range(n_tensors):
            rd_str()
            n_dims = rd("<I")
            params += math.prod(rd("<Q") for _ in range(n_dims))
            rd("<I"), rd("<Q")  # ggml type, offset
    return meta, params


def spec_from_gguf(path: str | os.PathLike, *, name: str | None = None, dtype: Any = None) -> ModelSpec:
    meta, params = read_gguf_metadata(path)
    arch = meta.get("general.architecture")
    g = lambda k, default=None: meta.get(f"{arch}.{k}", default)  # noqa: E731
    n_layers, heads = g("block_count"), g("attention.head_count")
    if not arch or not n_layers or not heads:
        raise ValueError(f"{path}: GGUF metadata has no layer/head counts for architecture {arch!r}")
    if g("attention.sliding_window"):
        # Layer patterns of sliding-window GGUF models are architecture-specific: let transformers decode them.
        from transformers import AutoConfig

        p = Path(path)
        return spec_from_hf_config(AutoConfig.from_pretrained(p.parent, gguf_file=p.name), name=name or p.name,
                                   dtype=dtype, params=params)
    kv = g("attention.head_count_kv", heads)
    if isinstance(kv, tuple):  # per-layer array: not supported here
        raise ValueError(f"{path}: per-layer KV head counts are not supported")
    head_dim = g("attention.key_length") or g("embedding_length") // heads
    return ModelSpec(
        num_layers=int(n_layers), num_kv_heads=int(kv), head_dim=int(head_dim),
        dtype=normalize_dtype(dtype) if dtype is not None else "float32",  # transformers dequantizes GGUF to float32
        num_heads=int(heads), params=int(params), max_context=g("context_length"), name=name or Path(path).name,
        model_type=arch,
    )


def model_spec(model: Any, *, dtype: Any = None) -> ModelSpec:
    """Resolve ``model`` (see :func:`estimate_kv_memory`) to a :class:`ModelSpec`, reading only configs."""
    if isinstance(model, ModelSpec):
        return dataclasses.replace(model, dtype=normalize_dtype(dtype)) if dtype is not None else model
    if isinstance(model, dict):
        d = dict(model)
        if dtype is not None:
            d["dtype"] = dtype
        return ModelSpec(**d)
    if hasattr(model, "config") and hasattr(model, "parameters"):  # a loaded PreTrainedModel
        params = int(sum(p.numel() for p in model.parameters()))
        md = dtype if dtype is not None else getattr(model, "dtype", None)
        return spec_from_hf_config(model.config, name=getattr(model.config, "_name_or_path", "") or type(model).__name__,
                                   dtype=md, params=params)
    if hasattr(model, "to_dict") and hasattr(model, "model_type"):  # a PretrainedConfig
        return spec_from_hf_config(model, name=type(model).__name__, dtype=dtype)
    if not isinstance(model, (str, os.PathLike)):
        raise TypeError(f"cannot describe a model from {type(model).__name__}")

    from .models import KNOWN_ALIASES, alias_gguf_path, converted_cache_path

    name = os.fspath(model)
    key = name.strip().lower()
    if key in KNOWN_ALIASES:
        converted = converted_cache_path(key)
        if (converted / "config.json").is_file():
            from transformers import AutoConfig

            cfg = AutoConfig.from_pretrained(converted)
            spec = spec_from_hf_config(cfg, name=name, dtype=dtype if dtype is not None else "float32")
            if spec.params is None:
                spec.params = read_gguf_metadata(alias_gguf_path(key))[1]
            return spec
        return spec_from_gguf(alias_gguf_path(key), name=name, dtype=dtype)
    path = Path(name).expanduser()
    if name.lower().endswith(".gguf"):
        if not path.is_file():
            raise ValueError(f"GGUF file not found: {path}")
        return spec_from_gguf(path, name=path.name, dtype=dtype)
    if path.is_dir():
        if not (path / "config.json").is_file():
            raise ValueError(f"model folder {str(path)!r} has no config.json, so it is not a transformers checkpoint")
        from transformers import AutoConfig

        return spec_from_hf_config(AutoConfig.from_pretrained(path), name=name, dtype=dtype)
    if path.exists():
        raise ValueError(f"{str(path)!r} is neither a .gguf file nor a checkpoint folder")
    try:
        from transformers import AutoConfig

        # Offline, huggingface_hub retries for ~25 s before failing: check the endpoint first and fall
        # back to the local hub cache when it cannot be reached.
        offline = not _hub_reachable()
        cfg = AutoConfig.from_pretrained(name, local_files_only=offline)
    except Exception as error:
        first = (str(error).strip().splitlines() or [type(error).__name__])[0][:300]
        raise ValueError(
            f"unknown model {name!r}: not an alias (known: {', '.join(KNOWN_ALIASES)}), not a local folder or "
            f".gguf file, and its config could not be read from the Hugging Face hub ({first}). Offline? Give "
            "the shape instead: --num-layers --num-kv-heads --head-dim --dtype"
        ) from None
    return spec_from_hf_config(cfg, name=name, dtype=dtype)


def _hub_reachable(timeout: float = 3.0) -> bool:
    """Whether the Hugging Face endpoint accepts a TCP connection (False when HF_HUB_OFFLINE is set)."""
    if os.environ.get("HF_HUB_OFFLINE", "").strip().lower() in ("1", "true", "yes", "on"):
        return False
    import socket
    from urllib.parse import urlparse

    url = urlparse(os.environ.get("HF_ENDPOINT") or "https://huggingface.co")
    port = url.port or (443 if url.scheme == "https" else 80)
    try:
        with socket.create_connection((url.hostname, port), timeout=timeout):
            return True
    except OSError:
        return False


# --------------------------------------------------------------------------- storage model

#: Fields of a KIVI estimate's breakdown (bytes).
FIELDS = ("codes", "scales_zero_points", "compensation", "fp_window", "fp_sink", "fp_unquantized", "block_reserve")


def side_token_bytes(head_dim: int, bits: int, group_size: int, axis: str, param_bytes: int, symmetric: bool,
                     residual_bits: int) -> dict[str, float]:
    """Bytes per stored token per head, by field (keys' per-group fields amortised over G tokens)."""
    return kv_bytes_breakdown(head_dim, bits, group_size, axis, param_bytes=param_bytes, symmetric=symmetric,
                              residual_bits=residual_bits)


def held_tokens(cfg: KiviConfig, axis: str, quantized: bool, T: int, P: int, window: int | None,
                sink: int) -> tuple[int, int]:
    """(allocated tokens still held, written tokens in them) of one side's block store.

    One prefill of ``P`` tokens (one append: its own block), then one-token decode steps up to ``T``.
    A sliding layer (``window``) evicts at the start of every decode step; the last one ran with
    ``T - 1`` tokens cached. After a single prefill nothing is evicted yet.
    """
    R, G, bs = cfg.residual_length, cfg.group_size, cfg.block_size
    stored = side_tokens(axis, T, R, G, sink, quantized)[1]
    if stored == 0:
        return 0, 0
    first = side_tokens(axis, P, R, G, sink, quantized)[1]
    allocated = allocated_tokens(stored, first, bs)
    freed = 0
    if window is not None and T > P:
        seen_before = T - 1
        stored_before = side_tokens(axis, seen_before, R, G, sink, quantized)[1]
        # BlockStore.evict(cut) exposes from min(cut, length); sliding layers keep no sink, so store
        # positions are absolute positions.
        start = min(sliding_cut(seen_before, window, R, G, bs), stored_before)
        freed = freed_tokens(start, first, bs)
    return allocated - freed, stored - freed


def layer_bytes(cfg: KiviConfig, head_dim: int, heads: int, dtype_bytes: int, T: int, P: int,
                window: int | None, param_bytes: int) -> dict[str, float]:
    """Bytes of one layer (config ``cfg``, ``heads`` = KV heads x batch), by field of :data:`FIELDS`."""
    D = head_dim
    sink = layer_sink_tokens(cfg.sink_tokens, window)
    out = dict.fromkeys(FIELDS, 0.0)
    for axis, quant, bits in ((KEY_AXIS, cfg.quantize_key, cfg.k_bits), (VALUE_AXIS, cfg.quantize_value, cfg.v_bits)):
        held, used = held_tokens(cfg, axis, quant, T, P, window, sink)
        if quant:
            per = side_token_bytes(D, bits, cfg.group_size, axis, param_bytes, cfg.symmetric, cfg.residual_bits)
            for k, v in per.items():
                out[k] += heads * used * v
            out["block_reserve"] += heads * (held - used) * sum(per.values())
            s, _, in_window = side_tokens(axis, T, cfg.residual_length, cfg.group_size, sink)
            out["fp_sink"] += heads * s * D * dtype_bytes
            out["fp_window"] += heads * in_window * D * dtype_bytes
        else:
            out["fp_unquantized"] += heads * used * D * dtype_bytes
            out["block_reserve"] += heads * (held - used) * D * dtype_bytes
    return out



# --------------------------------------------------------------------------- the estimate


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


def _layer_plan(cfg: KiviConfig, spec: ModelSpec) -> list[tuple[KiviConfig, int | None, str]]:
    """Per layer: its config, its sliding window (or None) and a key shared by identical layers."""
    plan = []
    for i, lt in enumerate(spec.layer_types):
        lcfg = cfg.for_layer(i)
        window = spec.sliding_window if lt == "sliding_attention" else None
        plan.append((lcfg, window, json.dumps(lcfg.to_dict(), sort_keys=True) + f"|{window}"))
    return plan


def _kivi_total(plan: list, spec: ModelSpec, T: int, P: int, batch: int, param_bytes: dict[int, int],
                ) -> tuple[dict[str, float], list[dict[str, Any]]]:
    total = dict.fromkeys(FIELDS, 0.0)
    layers = []
    memo: dict[Any, dict[str, float]] = {}
    for i, (lcfg, window, key) in enumerate(plan):
        if key not in memo:
            memo[key] = layer_bytes(lcfg, spec.head_dim, spec.num_kv_heads * batch, DTYPE_BYTES[spec.dtype], T, P,
                                    window, param_bytes[i])
        part = memo[key]
        for k, v in part.items():
            total[k] += v
        layers.append({"layer": i, "type": spec.layer_types[i], "k_bits": lcfg.k_bits if lcfg.quantize_key else None,
                       "v_bits": lcfg.v_bits if lcfg.quantize_value else None, "bytes": int(round(sum(part.values())))})
    return total, layers


def _fp_total(spec: ModelSpec, T: int, batch: int) -> int:
    per_layer_tok = 2 * spec.num_kv_heads * spec.head_dim * DTYPE_BYTES[spec.dtype] * batch
    total = 0
    for lt in spec.layer_types:
        n = min(T, spec.sliding_window - 1) if lt == "sliding_attention" else T
        total += per_layer_tok * n
    return total


def _max_fitting(fn, budget: int, G: int, hi_limit: int = 2**40) -> int:
    """Largest T such that fn(t) <= budget for every t <= T (fn is monotone up to a G-token ripple)."""
    def fits(T: int) -> bool:
        return all(fn(t) <= budget for t in range(max(1, T - G + 1), T + 1))

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
    cfg = _resolve_config(config)
    cfg.validate(num_layers=spec.num_layers)
    sd = None if cfg.scale_dtype == "auto" else cfg.scale_dtype
    check_head_dim(cfg, spec.head_dim, spec.num_layers)
    param_bytes = {i: DTYPE_BYTES[sd or spec.dtype] for i in range(spec.num_layers)}
    dev_mem = parse_bytes(device_memory) if device_memory is not None else None

    b = DTYPE_BYTES[spec.dtype]
    fp_per_token = 2 * spec.num_layers * spec.num_kv_heads * spec.head_dim * b
    fp_total = _fp_total(spec, T, batch)
    plan = _layer_plan(cfg, spec)
    kt, layers = _kivi_total(plan, spec, T, P, batch, param_bytes)
    kivi_total = int(round(sum(kt.values())))

    # Asymptotic cost per token (quantized storage only, every layer holding every token).
    per_tok = {"codes": 0.0, "scales_zero_points": 0.0, "compensation": 0.0, "fp_unquantized": 0.0}
    for i in range(spec.num_layers):
        lcfg = cfg.for_layer(i)
        sides = ((KEY_AXIS, lcfg.quantize_key, lcfg.k_bits), (VALUE_AXIS, lcfg.quantize_value, lcfg.v_bits))
        for axis, quant, bits in sides:
            if quant:
                for k, v in side_token_bytes(spec.head_dim, bits, lcfg.group_size, axis, param_bytes[i],
                                             lcfg.symmetric, lcfg.residual_bits).items():
                    per_tok[k] += spec.num_kv_heads * v
            else:
                per_tok["fp_unquantized"] += spec.num_kv_heads * spec.head_dim * b
    kivi_per_token = sum(per_tok.values())

    notes = [
        "cache only: weights, activations and the attention workspace are extra",
        f"KIVI storage modelled for one prefill of {P} tokens" + (f" then {T - P} decode steps" if T > P else "")
        + f"; later tokens go into blocks of {cfg.block_size} tokens (block_reserve)",
    ]
    n_sliding = sum(1 for t in spec.layer_types if t == "sliding_attention")
    if n_sliding:
        notes.append(
            f"{n_sliding} sliding-window layers (window {spec.sliding_window}): during decoding KIVI frees blocks older "
            f"than window + R + G tokens; FP keeps window - 1 tokens"
        )
    weights = spec.weight_bytes
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
    )
    if spec.max_context and T > spec.max_context:
        notes.append(f"context {T} is longer than the model's max_position_embeddings={spec.max_context}")
    if dev_mem is not None:
        est.device_memory = dev_mem
        budget = dev_mem - (weights or 0)
        if weights is None:
            notes.append("weights size unknown (give --params or --weights-bytes): the whole device memory is used for the cache")
        if budget <= 0:
            est.fp_max_context = est.kivi_max_context = est.fp_max_batch = est.kivi_max_batch = 0
            notes.append("the weights alone do not fit in the device memory")
        else:
            est.fp_max_batch = budget // fp_total if fp_total else None
            est.kivi_max_batch = budget // kivi_total if kivi_total else None
            est.fp_max_context = _max_fitting(lambda t: _fp_total(spec, t, batch), budget, 1)
            g = max(cfg.for_layer(i).group_size for i in range(spec.num_layers))
            est.kivi_max_context = _max_fitting(
                lambda t: sum(_kivi_total(plan, spec, t, t if prefill is None else min(P, t), batch, param_bytes)[0].values()),
                budget, g,
            )
    return est
