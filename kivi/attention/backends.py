"""Choosing how attention reads a KIVI cache (``KiviConfig.attention_backend``).

* ``"reference"`` — every layer dequantizes its whole cache, then the model's own attention runs
  (``KiviLayer.update`` = append + materialize). Ground truth; slow at long context.
* ``"cpu"`` — :func:`kivi.attention.blocked.blocked_attention`: pure torch, reads the packed store
  block by block with an online softmax (works on any torch device; tuned for CPU); decode steps
  (one query token) run the numba kernel of :mod:`kivi.attention.fused_cpu` instead when numba is
  installed and the format qualifies.
* ``"triton"`` — ``kivi.kernels.triton_attention.decode_attention`` (CUDA).
* ``"auto"`` — resolved once, when the model is quantized / the cache is built: ``"reference"``
  for models whose attention the fused paths do not implement (logit softcapping, e.g. Gemma2;
  attention sinks); else ``"triton"`` on a CUDA device when triton imports and the config is one
  the kernel implements (asymmetric, 1/2/4/8 bits, no compensation, no sink tokens); else ``"cpu"``.

An explicitly requested backend that is not available raises; nothing falls back silently.
This module imports nothing from :mod:`kivi.cache` (the cache imports it lazily).
"""

from __future__ import annotations

import importlib
import importlib.util
from typing import Any

from ..quant.packing import WORD_BITS

BACKENDS = ("auto", "reference", "cpu", "triton")


def triton_available() -> tuple[bool, str]:
    """(available, why not) for the triton backend."""
    if importlib.util.find_spec("triton") is None:
        return False, "the 'triton' package is not installed"
    try:
        mod = importlib.import_module("kivi.kernels.triton_attention")
    except Exception as e:  # noqa: BLE001 - report why
        return False, f"kivi.kernels.triton_attention cannot be imported ({type(e).__name__}: {e})"
    if not callable(getattr(mod, "decode_attention", None)):
        return False, "kivi.kernels.triton_attention has no decode_attention()"
    return True, ""


def _device_type(device: Any) -> str | None:
    if device is None:
        return None
    return getattr(device, "type", None) or str(device).split(":")[0]


def model_attention_unsupported(model_config: Any) -> str | None:
    """Why the fused paths ("cpu", "triton") cannot run this model's attention, or ``None``."""
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
    if getattr(config, "sink_tokens", 0):
        return "full-precision sink tokens (sink_tokens > 0)"
    cfgs = [config] + [config.for_layer(i) for i in config.layer_specific_config]
    for c in cfgs:
        if c.symmetric:
            return "symmetric quantization"
        if c.residual_bits:
            return "error compensation (residual_bits > 0)"
        odd = [b for b in (c.k_bits, c.v_bits) if b not in WORD_BITS]
        if odd:
            return f"{odd[0]}-bit codes"
    return None


def resolve_attention_backend(requested: str, device: Any = None, *, config: Any = None,
                              model_config: Any = None) -> str:
    """Resolve ``requested`` (one of :data:`BACKENDS`) for ``device``; raise if it cannot run.

    ``device=None`` (unknown) resolves ``"auto"`` to ``"cpu"``, the pure-torch path that runs on
    any device. ``config`` (KiviConfig) and ``model_config`` narrow what can run (see module doc).
    """
    if requested not in BACKENDS:
        raise ValueError(f"attention_backend={requested!r} is not allowed; choose one of {list(BACKENDS)}")
    dev = _device_type(device)
    model_why = model_attention_unsupported(model_config)
    if requested == "auto":
        if model_why:
            return "reference"
        if dev == "cuda" and triton_available()[0] and kernel_config_unsupported(config) is None:
            return "triton"
        return "cpu"
    if requested in ("cpu", "triton") and model_why:
        raise ValueError(f"attention_backend={requested!r} cannot run this model: {model_why}; use 'reference'")
    if requested == "triton":
        ok, why = triton_available()
        if not ok:
            raise RuntimeError(f"attention_backend='triton' was requested but is not available: {why}")
        if dev is not None and dev != "cuda":
            raise RuntimeError(f"attention_backend='triton' needs a CUDA device; the model is on {dev!r}")
        kwhy = kernel_config_unsupported(config)
        if kwhy:
            raise ValueError(f"attention_backend='triton' does not implement {kwhy}; use 'cpu' or 'reference'")
    return requested
