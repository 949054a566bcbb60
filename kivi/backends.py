"""Choosing how attention reads a KIVI cache (``KiviConfig.attention_backend``), once.

* ``"reference"`` — the cache dequantizes each layer's history and returns plain tensors; the
  model's own attention (SDPA) runs over them. Ground truth; slow at long context.
* ``"cpu"`` — attention reads the packed storage: decode steps (one query token) run the fused
  numba kernel (:mod:`kivi.attention.fused_cpu`) when the format qualifies, everything else the
  blocked torch path (:func:`kivi.attention.blocked.blocked_attention`, any torch device).
* ``"triton"`` — ``kivi.kernels.triton_attention`` (CUDA).
* ``"auto"`` — ``"reference"`` for models whose attention the packed paths do not implement
  (logit softcapping, e.g. Gemma2; attention sinks); else ``"triton"`` on a CUDA device when
  triton is installed and the config is one the kernel implements (asymmetric, no compensation;
  every code width, 3 bits included; sink tokens and any number of stored blocks are read in place); else ``"cpu"``.

The decision is made once: :func:`kivi.quantize_model` resolves it for the model (and switches the
model's attention to ``"kivi"`` unless it is ``"reference"``); :meth:`KiviCache.from_model` takes
that result, and the cache hands it to attention inside what ``update`` returns
(:class:`kivi.cache.view.PackedStates`). An explicitly requested backend that cannot run raises;
nothing falls back silently — and ``"cpu"`` without numba (decode at about a third of the speed)
is announced with a warning that says how to fix it.
"""

from __future__ import annotations

import warnings
from typing import Any

from .config import ATTENTION_BACKENDS
from .optional import numba_available, triton_available

#: Name of the attention implementation kivi registers with transformers (kivi.attention.interface).
ATTN_IMPLEMENTATION = "kivi"

#: Backends that make attention read the packed cache (the model then runs ``"kivi"`` attention).
PACKED_BACKENDS = ("cpu", "triton")

NUMBA_MISSING = (
    "kivi: numba is not installed, so the 'cpu' attention backend decodes through the blocked torch path "
    "(about 3x slower than the fused numba kernel at 8K tokens on SmolLM2). Fix: pip install 'numba>=0.60'"
)


def _device_type(device: Any) -> str | None:
    if device is None:
        return None
    return getattr(device, "type", None) or str(device).split(":")[0]


def model_attention_unsupported(model_config: Any) -> str | None:
    """Why the packed paths ("cpu", "triton") cannot run this model's attention, or ``None``."""
    if model_config is None:
        return None
    text = model_config.get_text_config(decoder=True) if hasattr(model_config, "get_text_config") else model_config
    if getattr(text, "attn_logit_softcapping", None) is not None:
        return "its attention uses logit softcapping (attn_logit_softcapping)"
    if getattr(text, "use_sinks", False) or getattr(text, "sinks", None) is not None:
        return "its attention uses attention sinks"
    return None


def kernel_config_unsupported(config: Any) -> str | None:
    """Why the Triton kernel cannot read caches made with ``config`` (a KiviConfig), or ``None``."""
    if config is None:
        return None
    cfgs = [config] + [config.for_layer(i) for i in config.layer_specific_config]
    for c in cfgs:
        if c.symmetric:
            return "symmetric quantization"
        if c.residual_bits:
            return "error compensation (residual_bits > 0)"
    # Every code width the config allows (1, 2, 3, 4, 8; per-head widths too) is read by the kernel.
    return None


def resolve_attention_backend(requested: str, device: Any = None, *, config: Any = None,
                              model_config: Any = None) -> str:
    """Resolve ``requested`` (one of ``ATTENTION_BACKENDS``) for ``device``; raise if it cannot run.

    ``device=None`` (unknown) resolves ``"auto"`` to ``"cpu"``, the pure-torch path that runs on
    any device. ``config`` (KiviConfig) and ``model_config`` narrow what can run (see module doc).
    """
    if requested not in ATTENTION_BACKENDS:
        raise ValueError(f"attention_backend={requested!r} is not allowed; choose one of {list(ATTENTION_BACKENDS)}")
    dev = _device_type(device)
    model_why = model_attention_unsupported(model_config)
    if requested == "auto":
        if model_why:
            return "reference"
        if dev == "cuda" and triton_available() and kernel_config_unsupported(config) is None:
            return "triton"
        if dev in (None, "cpu") and not numba_available():
            warnings.warn(NUMBA_MISSING, RuntimeWarning, stacklevel=2)
        return "cpu"
    if requested in PACKED_BACKENDS and model_why:
        raise ValueError(f"attention_backend={requested!r} cannot run this model: {model_why}; use 'reference'")
    if requested == "triton":
        if not triton_available():
            raise RuntimeError(
                "attention_backend='triton' was requested but is not available: the 'triton' package is not "
                "installed (pip install 'kivi[triton]')"
            )
        if dev is not None and dev != "cuda":
            raise RuntimeError(f"attention_backend='triton' needs a CUDA device; the model is on {dev!r}")
        kwhy = kernel_config_unsupported(config)
        if kwhy:
            raise ValueError(f"attention_backend='triton' does not implement {kwhy}; use 'cpu' or 'reference'")
    if requested == "cpu" and dev in (None, "cpu") and not numba_available():
        warnings.warn(NUMBA_MISSING, RuntimeWarning, stacklevel=2)
    return requested


def cache_attention_backend(model: Any, config: Any) -> str:
    """The backend a cache built for ``model`` and ``config`` gives attention.

    The result :func:`kivi.quantize_model` resolved, when ``config`` is the model's own KIVI
    config; otherwise resolved now. A model whose attention implementation is not ``"kivi"`` reads
    dequantized tensors (``"reference"``), and an explicit packed backend for it raises: its
    attention could not read packed states.
    """
    runs_kivi = getattr(getattr(model, "config", None), "_attn_implementation", None) == ATTN_IMPLEMENTATION
    if config is getattr(model, "kivi_config", None) and getattr(model, "kivi_attention_backend", None):
        backend = model.kivi_attention_backend
    else:
        backend = resolve_attention_backend(
            config.attention_backend, getattr(model, "device", None), config=config, model_config=model.config
        )
    if backend in PACKED_BACKENDS and not runs_kivi:
        if config.attention_backend != "auto":
            raise ValueError(
                f"attention_backend={config.attention_backend!r} needs the model's attention to read the packed "
                f"cache, but it runs {model.config._attn_implementation!r}: call kivi.quantize_model(model, config) first"
            )
        return "reference"
    return backend


def attention_reads_views(model: Any, *, reading_views: bool = False) -> bool:
    """Whether the attention that reads a cache built now for ``model`` reads kivi's views
    (:class:`~kivi.cache.view.PackedStates`), which can give each query of a forward its own precision.

    True when the model runs the ``"kivi"`` attention now (after :func:`kivi.quantize_model`), or when
    ``reading_views`` (the caller runs every forward under :func:`kivi.attention.interface.reading_views`)
    and ``"kivi"`` implements the model's attention; False for any other attention (it reads tensors only).
    """
    config = getattr(model, "config", None)
    if model_attention_unsupported(config) is not None:
        return False
    return reading_views or getattr(config, "_attn_implementation", None) == ATTN_IMPLEMENTATION


__all__ = [
    "ATTN_IMPLEMENTATION",
    "PACKED_BACKENDS",
    "resolve_attention_backend",
    "cache_attention_backend",
    "attention_reads_views",
    "model_attention_unsupported",
    "kernel_config_unsupported",
]
