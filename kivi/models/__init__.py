"""Models: loading them (:mod:`.load`, aliases in :mod:`.aliases`), the converted-copy cache of GGUF files
(:mod:`.conversion_cache`), and quantizing and measuring their weights (:mod:`.weights`).

The names below are re-exported so that ``from kivi.models import load_model`` keeps working; code that
replaces one of them (a test's ``monkeypatch``) patches the module that defines it, e.g.
``kivi.models.load.load_model``.
"""

from __future__ import annotations

from .aliases import KNOWN_ALIASES, GgufAlias, alias_gguf_path
from .conversion_cache import (
    KEY_DIGITS,
    STALE_TEMP_SECONDS,
    ConvertedCopy,
    converted_cache_path,
    disk_bytes,
    gguf_content_key,
    gguf_sha256,
    kivi_cache_dir,
    list_converted,
    mark_used,
    read_marker,
    remove_converted,
)
from .errors import ModelLoadError
from .load import DTYPE_NAMES, load_model, model_max_context
from .weights import (
    WEIGHT_QUANT_EXCLUDE,
    WeightQuantizationUnavailable,
    quantizable_linears,
    quantize_weights,
    weight_bytes,
)

__all__ = [
    "KNOWN_ALIASES",
    "DTYPE_NAMES",
    "GgufAlias",
    "ModelLoadError",
    "alias_gguf_path",
    "converted_cache_path",
    "gguf_content_key",
    "gguf_sha256",
    "kivi_cache_dir",
    "list_converted",
    "load_model",
    "model_max_context",
    "remove_converted",
    "quantize_weights",
    "WeightQuantizationUnavailable",
    "quantizable_linears",
    "weight_bytes",
    "ConvertedCopy",
    "KEY_DIGITS",
    "STALE_TEMP_SECONDS",
    "WEIGHT_QUANT_EXCLUDE",
    "disk_bytes",
    "mark_used",
    "read_marker",
]
