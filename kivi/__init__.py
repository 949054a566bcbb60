"""kivi — tuning-free 2-bit KV-cache quantization (KIVI) for HuggingFace transformers.

``import kivi`` needs only torch and transformers; optional pieces (triton kernels, plotting,
GGUF loading, the CLI's progress bars) are imported when used.
"""

from .cache import KiviCache, KiviLayer
from .config import PRESETS, KiviConfig
from .integration import dequantize_model, quantize_model

__version__ = "0.1.0"


def __getattr__(name):  # lazy: keep `import kivi` light
    if name in ("load_model",):
        from .models import load_model

        return load_model
    if name in ("estimate_kv_memory",):
        from .memory import estimate_kv_memory

        return estimate_kv_memory
    raise AttributeError(f"module 'kivi' has no attribute {name!r}")


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
