"""Where a model's KV-cache shape comes from: :class:`ModelSpec` and :func:`model_spec`.

A model is resolved to a :class:`ModelSpec` (layers, KV heads, head_dim, dtype, layer types, weights)
reading only configs: a transformers config (:func:`spec_from_hf_config`), a GGUF header
(:func:`read_gguf_metadata`, :func:`spec_from_gguf`), an alias of :mod:`kivi.models`, a checkpoint
folder, or a hub id (only its config, after a quick reachability probe).
"""

from __future__ import annotations

import dataclasses
import math
import os
import struct
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ..cache.support import check_layer_types, model_head_dim, model_layer_types, text_config
from .units import DEFAULT_DTYPE, DTYPE_BYTES, normalize_dtype


@dataclass
class ModelSpec:
    """The shape of a decoder's KV cache (and, optionally, its weights).

    ``layer_types`` (``"full_attention"`` / ``"sliding_attention"`` per layer; default all full)
    and ``sliding_window`` describe sliding-window models. ``params`` or ``weights_bytes`` give the
    weights' size (``weights_bytes`` wins; otherwise ``params x dtype bytes``). ``linear_layers``:
    ``(out_features, in_features)`` of every linear layer :func:`kivi.models.quantize_weights` would
    quantize (all but ``lm_head``); the planner needs them for 8- and 4-bit weights.
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
    linear_layers: list[tuple[int, int]] | None = None
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
        if self.sliding_window is not None and (isinstance(self.sliding_window, bool)
                                                or not isinstance(self.sliding_window, int) or self.sliding_window < 1):
            raise ValueError(f"sliding_window={self.sliding_window!r} must be a positive integer (tokens) or None")
        if "sliding_attention" in self.layer_types and not self.sliding_window:
            raise ValueError("sliding_attention layers need sliding_window")
        for f in ("params", "weights_bytes", "max_context"):
            v = getattr(self, f)
            if v is not None and (isinstance(v, bool) or not isinstance(v, int) or v < 0):
                raise ValueError(f"{f}={v!r} must be a non-negative integer")
        if self.linear_layers is not None:
            self.linear_layers = [tuple(x) for x in self.linear_layers]
            if not all(len(x) == 2 and all(isinstance(n, int) and not isinstance(n, bool) and n > 0 for n in x)
                       for x in self.linear_layers):
                raise ValueError("linear_layers must be a list of (out_features, in_features) positive integer pairs")

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


def _linear_layers(model: Any) -> list[tuple[int, int]]:
    """``(out, in)`` of the linear layers :func:`kivi.models.quantize_weights` quantizes."""
    from ..models.weights import quantizable_linears

    return [(int(m.out_features), int(m.in_features)) for _, m in quantizable_linears(model)]


def _count_params_from_config(config: Any) -> tuple[int | None, list[tuple[int, int]] | None]:
    """Parameters and quantizable linear layers of the model ``config`` describes, from a meta-device
    instantiation (no memory)."""
    try:
        import torch
        from transformers import AutoModelForCausalLM

        with torch.device("meta"):
            model = AutoModelForCausalLM.from_config(config)
        return int(sum(p.numel() for p in model.parameters())), _linear_layers(model)
    except Exception:  # unknown architecture, remote code...: weights are then unknown
        return None, None


def spec_from_hf_config(config: Any, *, name: str = "model", dtype: Any = None, params: int | None = None,
                        count_params: bool = True, linear_layers: list[tuple[int, int]] | None = None) -> ModelSpec:
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
    if (params is None or linear_layers is None) and count_params:
        counted, linears = _count_params_from_config(config)
        params = counted if params is None else params
        linear_layers = linears if linear_layers is None else linear_layers
    max_ctx = getattr(text, "max_position_embeddings", None)
    return ModelSpec(
        num_layers=int(n_layers), num_kv_heads=int(kv), head_dim=int(head_dim), dtype=dtype, num_heads=int(heads),
        layer_types=[t for t, _ in layers], sliding_window=window, params=params,
        max_context=int(max_ctx) if isinstance(max_ctx, int) else None, name=name,
        model_type=getattr(text, "model_type", None), linear_layers=linear_layers,
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
        from ..models.weights import weight_bytes

        params = int(sum(p.numel() for p in model.parameters()))
        md = dtype if dtype is not None else getattr(model, "dtype", None)
        spec = spec_from_hf_config(model.config,
                                   name=getattr(model.config, "_name_or_path", "") or type(model).__name__,
                                   dtype=md, params=params, linear_layers=_linear_layers(model))
        spec.weights_bytes = weight_bytes(model)  # measured: the model may hold quantized weights
        return spec
    if hasattr(model, "to_dict") and hasattr(model, "model_type"):  # a PretrainedConfig
        return spec_from_hf_config(model, name=type(model).__name__, dtype=dtype)
    if not isinstance(model, (str, os.PathLike)):
        raise TypeError(f"cannot describe a model from {type(model).__name__}")

    from ..models.aliases import KNOWN_ALIASES, alias_gguf_path
    from ..models.conversion_cache import converted_cache_path

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


__all__ = [
    "ModelSpec", "model_spec", "spec_from_hf_config", "spec_from_gguf", "read_gguf_metadata",
]
