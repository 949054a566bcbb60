"""kivi — tuning-free 2-bit KV-cache quantization (KIVI) for HuggingFace transformers.

``import kivi`` needs only torch and transformers; optional pieces (triton kernels, plotting,
GGUF loading, the CLI's progress bars) are imported when used.

The public names are loaded on first use (PEP 562): ``import kivi`` itself imports nothing heavy,
so the command line (``python -m kivi``) imports torch and transformers inside its guarded body,
where a Ctrl-C during those first seconds becomes one line and exit 130, not a traceback.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING

__version__ = "0.1.0"

#: public name -> the module that defines it
_LAZY = {
    "KiviCache": "kivi.cache",
    "KiviLayer": "kivi.cache",
    "KiviConfig": "kivi.config",
    "PRESETS": "kivi.config",
    "quantize_model": "kivi.integration",
    "dequantize_model": "kivi.integration",
    "load_model": "kivi.models.load",
    "estimate_kv_memory": "kivi.memory",
}

if TYPE_CHECKING:  # pragma: no cover - for type checkers and IDEs
    from .cache import KiviCache, KiviLayer
    from .config import PRESETS, KiviConfig
    from .integration import dequantize_model, quantize_model
    from .memory import estimate_kv_memory
    from .models.load import load_model


def __getattr__(name: str):
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module 'kivi' has no attribute {name!r}")
    value = getattr(importlib.import_module(module), name)
    globals()[name] = value  # later look-ups skip this function
    return value


def __dir__() -> list[str]:
    return sorted([*globals(), *_LAZY])


__all__ = [
    "KiviConfig",
    "PRESETS",
    "KiviCache",
    "KiviLayer",
    "quantize_model",
    "dequantize_model",
    "load_model",
    "estimate_kv_memory",
]
