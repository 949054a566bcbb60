"""Units of the planner: dtypes and their sizes, token counts (``"32k"``), memory sizes (``"80GB"``)."""

from __future__ import annotations

import re
from typing import Any

DTYPE_BYTES: dict[str, int] = {"float32": 4, "float16": 2, "bfloat16": 2}
_DTYPE_ALIASES = {
    "fp32": "float32", "float": "float32", "f32": "float32", "torch.float32": "float32",
    "fp16": "float16", "half": "float16", "f16": "float16", "torch.float16": "float16",
    "bf16": "bfloat16", "torch.bfloat16": "bfloat16",
}
DEFAULT_DTYPE = "float16"


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


__all__ = ["DTYPE_BYTES", "DEFAULT_DTYPE", "normalize_dtype", "parse_context", "parse_bytes", "format_bytes"]
