"""Cache specs: a :class:`KiviConfig`, ``None`` / ``"fp"`` (transformers' ``DynamicCache``) or a named
baseline (transformers' ``QuantizedCache`` with the quanto or hqq backend).

This is the one place the tools build and measure caches: :func:`make_cache` builds every cache the
evaluation functions, ``kivi demo`` and the benchmarks use, and :func:`cache_nbytes` counts the bytes
of any of them (a ``KiviCache`` by its own ``nbytes`` / ``memory_breakdown()``, a baseline by the
tensors it really holds); :func:`bits_per_element` divides those bytes by the cached key/value
elements.
"""

from __future__ import annotations

import contextlib
from typing import Any, Iterator, Union

import torch

from ..cache.support import model_head_dim
from ..config import KiviConfig

# name -> QuantizedCache(backend=..., ...) arguments. q_group_size / residual_length follow transformers'
# defaults (64 / 128). quanto: axis 0 = groups along the channels of each token (per-token), axis -1 = groups
# along tokens of each channel (per-channel, as KIVI does for keys). hqq: axis 1 = groups of consecutive
# elements of a token's channels (per-token; the axis transformers' docs use for hqq), with hqq's
# half-quadratic optimization of scale and zero-point.
BASELINES: dict[str, dict[str, Any] | None] = {
    "fp": None,
    "quanto-int4": {"backend": "quanto", "nbits": 4, "axis_key": 0, "axis_value": 0, "q_group_size": 64,
                    "residual_length": 128},
    "quanto-int2": {"backend": "quanto", "nbits": 2, "axis_key": 0, "axis_value": 0, "q_group_size": 64,
                    "residual_length": 128},
    "quanto-int2-perchannel": {"backend": "quanto", "nbits": 2, "axis_key": -1, "axis_value": 0, "q_group_size": 64,
                               "residual_length": 128},
    "quanto-int4-perchannel": {"backend": "quanto", "nbits": 4, "axis_key": -1, "axis_value": 0, "q_group_size": 64,
                               "residual_length": 128},
    "hqq-int4": {"backend": "hqq", "nbits": 4, "axis_key": 1, "axis_value": 1, "q_group_size": 64,
                 "residual_length": 128},
    "hqq-int2": {"backend": "hqq", "nbits": 2, "axis_key": 1, "axis_value": 1, "q_group_size": 64,
                 "residual_length": 128},
}

#: the package each QuantizedCache backend imports, and how to install it
_BACKEND_PACKAGES = {"quanto": ("optimum.quanto", "optimum-quanto"), "hqq": ("hqq.core.quantize", "hqq")}

CacheSpec = Union[KiviConfig, str, None]


class BaselineUnavailable(RuntimeError):
    """A baseline cannot be built here (e.g. optimum-quanto missing); the message says why."""

    user_facing = True  # the CLI prints it as one line


def check_spec(spec: CacheSpec) -> CacheSpec:
    """Validate a spec; returns it (``"fp"`` normalised to ``None``)."""
    if spec is None or isinstance(spec, KiviConfig):
        return spec
    if isinstance(spec, str):
        key = spec.strip().lower()
        if key not in BASELINES:
            raise ValueError(f"unknown baseline {spec!r}; choose one of {list(BASELINES)}")
        return None if key == "fp" else key
    raise ValueError(f"a cache spec must be a KiviConfig, a baseline name or None, got {type(spec).__name__}")


def spec_name(spec: CacheSpec) -> str:
    """Short human-readable description (``"fp"``, ``"quanto-int2"``, ``"K2 V2 G32 R128"``)."""
    spec = check_spec(spec)
    if spec is None:
        return "fp"
    if isinstance(spec, str):
        return spec
    return spec.describe()


def spec_to_json(spec: CacheSpec) -> Any:
    spec = check_spec(spec)
    if isinstance(spec, KiviConfig):
        return spec.to_dict()
    return spec or "fp"


def baseline_unavailable_reason(name: str) -> str | None:
    """``None`` if the baseline can be built here, else a one-line reason."""
    name = check_spec(name)
    if name is None or isinstance(name, KiviConfig):
        return None
    import importlib  # noqa: PLC0415

    module, package = _BACKEND_PACKAGES[BASELINES[name]["backend"]]
    try:
        importlib.import_module(module)
    except Exception as e:  # ImportError, or a broken install
        return f"{package} is not importable ({type(e).__name__}: {e}); `pip install {package}`"
    return None


def make_cache(model: Any, spec: CacheSpec, *, read_packed: bool = False):
    """A fresh, empty cache for ``model`` as described by ``spec``.

    * ``None`` / ``"fp"``: transformers' ``DynamicCache`` (full precision);
    * a :class:`KiviConfig`: ``KiviCache.from_model(model, spec)``. Its attention runs through kivi's
      kernels only on a model prepared with ``quantize_model(model, spec)``; on an unprepared model
      the model's own attention reads the dequantized cache (same numbers, slower), and a forward of
      several tokens into it must run under :func:`kivi.attention.interface.reading_views` (the
      evaluation functions do: each query reads the history at its own precision). With
      ``read_packed`` the config's ``attention_backend`` is resolved as :func:`kivi.quantize_model`
      resolves it (``"auto"``: the packed ``"cpu"`` path on CPU) even on an unprepared model: the
      caller must then run every forward into the cache under
      :func:`kivi.attention.interface.reading_views` (the evaluation functions do);
    * a name from :data:`BASELINES`: transformers' ``QuantizedCache(backend="quanto" | "hqq", ...)``; raises
      :class:`BaselineUnavailable` when it cannot be built here (optimum-quanto / hqq missing).
    """
    spec = check_spec(spec)
    if spec is None:
        from transformers import DynamicCache  # noqa: PLC0415

        return DynamicCache(config=model.config)
    if isinstance(spec, KiviConfig):
        from ..cache.kivi_cache import KiviCache  # noqa: PLC0415

        if not read_packed:
            return KiviCache.from_model(model, spec, reading_views=True)
        with _runs_kivi_attention(model):
            return KiviCache.from_model(model, spec, reading_views=True)
    reason = baseline_unavailable_reason(spec)
    if reason:
        raise BaselineUnavailable(reason)
    from transformers.cache_utils import QuantizedCache  # noqa: PLC0415

    kwargs = dict(BASELINES[spec])
    backend = kwargs.pop("backend")
    try:
        return QuantizedCache(backend=backend, config=model.config, **kwargs)
    except Exception as e:  # noqa: BLE001 - report any construction failure as unavailability
        raise BaselineUnavailable(f"QuantizedCache(backend={backend!r}) failed: {type(e).__name__}: {e}") from e


@contextlib.contextmanager
def _runs_kivi_attention(model: Any) -> Iterator[None]:
    """``model`` runs the ``"kivi"`` attention inside the block (restored after), so that
    ``KiviCache.from_model`` resolves the backend as for a prepared model (``cache_attention_backend``
    gives an unprepared model ``"reference"`` because its own attention could not read packed views;
    :func:`make_cache`'s caller promises to run the forwards under ``reading_views``, which can). A model
    whose attention ``"kivi"`` does not implement is left as it is (it gets ``"reference"``)."""
    from ..attention.interface import running_kivi_attention  # noqa: PLC0415 - registers "kivi" too

    with running_kivi_attention(model):
        yield


def _tensor_bytes(t: Any) -> int:
    """Bytes of a tensor, recursing into tensor subclasses (quanto's packed tensors) and into the tuples and
    dicts a quantized layer keeps (hqq's ``(codes, {"scale": ..., "zero": ...})``)."""
    if t is None:
        return 0
    if isinstance(t, (tuple, list)):
        return sum(_tensor_bytes(x) for x in t)
    if isinstance(t, dict):
        return sum(_tensor_bytes(x) for x in t.values())
    flatten = getattr(t, "__tensor_flatten__", None)
    if flatten is not None and type(t) is not torch.Tensor:
        names, _ = flatten()
        return sum(_tensor_bytes(getattr(t, n)) for n in names)
    if isinstance(t, torch.Tensor):
        return t.numel() * t.element_size()
    return 0


def cache_nbytes(cache: Any) -> int:
    """Bytes of every tensor ``cache`` holds, for any cache :func:`make_cache` builds.

    A ``KiviCache`` reports its own (``cache.nbytes``, the sum of ``cache.memory_breakdown()``); for
    a ``DynamicCache`` or a quanto / hqq ``QuantizedCache`` this sums the full-precision key/value tensors
    and the packed quantized ones (their data, scales and zero-points). Uninitialised layers count 0.
    """
    nb = getattr(cache, "nbytes", None)
    if isinstance(nb, int):
        return nb
    total = 0
    for layer in getattr(cache, "layers", []):
        for name in ("keys", "values", "_quantized_keys", "_quantized_values"):
            total += _tensor_bytes(getattr(layer, name, None))
    return total


def spec_kind(spec: CacheSpec) -> str:
    """``"fp"``, ``"baseline"``, ``"preset:<name>"`` (a config equal to a preset) or ``"kivi"``."""
    from ..config import PRESETS  # noqa: PLC0415

    spec = check_spec(spec)
    if spec is None:
        return "fp"
    if isinstance(spec, str):
        return "baseline"
    for name in PRESETS:
        if KiviConfig.preset(name).to_dict() == spec.to_dict():
            return f"preset:{name}"
    return "kivi"


def kv_geometry(model: Any) -> tuple[int, int, int]:
    """``(layers, kv_heads, head_dim)`` of a decoder model."""
    cfg = model.config.get_text_config(decoder=True)
    heads = cfg.num_attention_heads
    kv = getattr(cfg, "num_key_value_heads", None) or heads
    head_dim = model_head_dim(cfg)
    return cfg.num_hidden_layers, kv, head_dim


def bits_per_element(model: Any, cache: Any, tokens: int, batch: int = 1) -> float:
    """``cache_nbytes * 8 / (2 * layers * kv_heads * head_dim * tokens * batch)``."""
    layers, kv, hd = kv_geometry(model)
    denom = 2 * layers * kv * hd * tokens * batch
    if denom <= 0:
        raise ValueError("cannot compute bits per element of an empty cache")
    return cache_nbytes(cache) * 8 / denom


def fill_random(model: Any, cache: Any, tokens: int, *, batch: int = 1, prefix: int | None = None, chunk: int = 16,
                dtype: torch.dtype | None = None, seed: int = 0) -> Any:
    """Append ``tokens`` tokens of random keys/values (standard normal) to every layer of ``cache``; returns it.

    No model forward runs: the cache sees the same ``update`` calls a prefill of ``prefix`` tokens
    (default: all of them) followed by forwards of ``chunk`` tokens would make, so block allocation,
    quantization and the full-precision window are as in a real run; only the numbers are not the
    model's. For sizes and decode speed, not for quality.
    """
    for name, n in (("tokens", tokens), ("batch", batch), ("chunk", chunk)):
        if isinstance(n, bool) or not isinstance(n, int) or n < 1:
            raise ValueError(f"{name}={n!r} must be a positive int")
    layers, kv, hd = kv_geometry(model)
    dtype = dtype or next(model.parameters()).dtype
    prefix = tokens if prefix is None else min(prefix, tokens)
    g = torch.Generator().manual_seed(seed)
    spans = [(0, prefix)] + [(s, min(s + chunk, tokens)) for s in range(prefix, tokens, chunk)]
    for a, b in spans:
        for li in range(layers):
            k = torch.randn(batch, kv, b - a, hd, generator=g).to(dtype)
            v = torch.randn(batch, kv, b - a, hd, generator=g).to(dtype)
            cache.update(k, v, li)
    return cache


def synthetic_bits(model: Any, spec: CacheSpec, tokens: int, *, prefix: int | None = None, chunk: int = 16,
                   dtype: torch.dtype | None = None) -> float:
    """Bits per element of ``spec``'s cache after ``tokens`` tokens, without running the model.

    Fills a fresh cache with :func:`fill_random` in the same prefill + chunk pattern as the
    evaluation (prefill ``prefix`` tokens, then ``chunk`` tokens at a time), so block allocation and
    the full-precision window are exactly as in a real run; only the model forward is skipped.
    """
    cache = fill_random(model, make_cache(model, spec), tokens, prefix=prefix, chunk=chunk, dtype=dtype)
    return bits_per_element(model, cache, tokens)
