"""A saved prefix file read as untrusted input: what it must hold, derived before anything is allocated.

A prefix file (:mod:`kivi.cache.persist`) carries a sha256 of its metadata and of every tensor, but
anyone can recompute those: they catch damage, not a forged file. So the loader trusts no size the
file states. From the configuration (the caller's, or the file's when none is given), the model's
shape where known and the file's token counts (checked against each other and against the cache's
schedule, :mod:`kivi.cache.schedule`), :mod:`kivi.cache.persist_plan` derives the name, dtype and
shape of every tensor the file must hold; :func:`check_tensor_table` compares the file's safetensors
table with it before a byte is read; :func:`check_allocation` bounds what the built cache allocates
beyond the file's own bytes (block rows the file does not hold: the unused tail of a side's last block,
the rows before a store's start in its first block held);
:func:`check_values` refuses non-finite floats, non-boolean masks and token ids outside the
vocabulary. Every failure is a :class:`PrefixFileError` with one line naming the file, the field,
what was found and what was expected.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

#: safetensors dtype names -> torch dtypes (the ones a prefix file may hold).
SAFETENSORS_DTYPES = {"F64": torch.float64, "F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16,
                      "I64": torch.int64, "I32": torch.int32, "I16": torch.int16, "I8": torch.int8,
                      "U8": torch.uint8, "BOOL": torch.bool}
#: dtypes a layer's keys / values may have (the model's activations).
LAYER_DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16,
                "float64": torch.float64}
#: Bytes the unused tails of the last blocks may add beyond the file's own tensor bytes when that is more than
#: the file holds (a short prefix in large blocks): a larger claim is refused before anything is allocated.
TAIL_ALLOWANCE_BYTES = 64 << 20


class PrefixFileError(ValueError):
    """A prefix file cannot be loaded here; the message names the file and what differs."""


@dataclass(frozen=True)
class TensorSpec:
    """dtype and shape of one tensor (expected, or as a file's table states it with its byte range)."""

    dtype: torch.dtype
    shape: tuple[int, ...]
    begin: int = 0
    end: int = 0

    @property
    def nbytes(self) -> int:
        return math.prod(self.shape) * torch.empty((), dtype=self.dtype).element_size()

    def describe(self) -> str:
        return f"{dtype_name(self.dtype)} [{', '.join('?' if n is None else str(n) for n in self.shape)}]"


def dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


class Described(str):
    """A description shown as it is (not quoted) in an error message."""


def _show(value: Any, limit: int = 60) -> str:
    text = value if isinstance(value, Described) else repr(value)
    return text if len(text) <= limit else text[: limit - 3] + "..."


def fail(path: Path, field: str, found: Any, expected: str) -> PrefixFileError:
    """The one error shape: ``<file>: <field>: found <value>, expected <what>``."""
    return PrefixFileError(f"{path}: {field}: found {_show(found)}, expected {expected}")


def _is_int(x: Any) -> bool:
    return isinstance(x, int) and not isinstance(x, bool)


class _Reader:
    """Typed access to the file's JSON metadata: a missing key or a wrong type is a :class:`PrefixFileError`."""

    def __init__(self, path: Path):
        self.path = path

    def get(self, obj: dict, key: str, where: str, kind: str, *, minimum: int | None = 0) -> Any:
        field = f"{where}.{key}" if where else key
        if not isinstance(obj, dict) or key not in obj:
            raise PrefixFileError(f"{self.path}: metadata field {field} is missing")
        value = obj[key]
        if kind == "int":
            if not _is_int(value) or (minimum is not None and value < minimum):
                raise fail(self.path, field, value, f"an integer >= {minimum}" if minimum is not None else "an integer")
        elif kind == "int?":
            if value is not None and (not _is_int(value) or value < 1):
                raise fail(self.path, field, value, "null or an integer >= 1")
        elif kind == "bool":
            if not isinstance(value, bool):
                raise fail(self.path, field, value, "true or false")
        elif kind == "ints":
            if not isinstance(value, list) or not all(_is_int(v) and v >= 0 for v in value):
                raise fail(self.path, field, value, "a list of integers >= 0")
        elif kind == "bools":
            if not isinstance(value, list) or not all(isinstance(v, bool) for v in value):
                raise fail(self.path, field, value, "a list of true/false")
        elif kind == "dict":
            if not isinstance(value, dict):
                raise fail(self.path, field, value, "a JSON object")
        elif kind == "list":
            if not isinstance(value, list):
                raise fail(self.path, field, value, "a JSON list")
        elif kind == "str?":
            if value is not None and not isinstance(value, str):
                raise fail(self.path, field, value, "null or a string")
        return value


# ---------------------------------------------------------------------------------------------- the table
def parse_table(path: Path, table: dict[str, Any], payload: int) -> dict[str, TensorSpec]:
    """The safetensors tensor table (header JSON without ``__metadata__``) as :class:`TensorSpec`\\ s, checked:
    known dtypes, integer shapes, byte ranges that match dtype x shape and tile ``[0, payload)`` exactly."""
    out: dict[str, TensorSpec] = {}
    for name, info in table.items():
        where = f"tensor table entry {name!r}"
        if not isinstance(info, dict):
            raise fail(path, where, info, "an object with dtype, shape, data_offsets")
        dtype, shape, offsets = info.get("dtype"), info.get("shape"), info.get("data_offsets")
        if dtype not in SAFETENSORS_DTYPES:
            raise fail(path, f"{where} dtype", dtype, f"one of {sorted(SAFETENSORS_DTYPES)}")
        if not isinstance(shape, list) or not all(_is_int(s) and s >= 0 for s in shape):
            raise fail(path, f"{where} shape", shape, "a list of integers >= 0")
        if (not isinstance(offsets, list) or len(offsets) != 2 or not all(_is_int(o) for o in offsets)
                or not 0 <= offsets[0] <= offsets[1]):
            raise fail(path, f"{where} data_offsets", offsets, "[begin, end] with 0 <= begin <= end")
        spec = TensorSpec(SAFETENSORS_DTYPES[dtype], tuple(shape), offsets[0], offsets[1])
        if spec.end - spec.begin != spec.nbytes:
            raise fail(path, f"{where} data_offsets", offsets, f"{spec.nbytes} bytes for {spec.describe()}")
        out[name] = spec
    pos = 0
    for name, spec in sorted(out.items(), key=lambda kv: (kv[1].begin, kv[1].end)):
        if spec.begin != pos:
            raise fail(path, f"tensor table entry {name!r} data_offsets", [spec.begin, spec.end],
                       f"to start at byte {pos} (tensors back to back, no gap or overlap)")
        pos = spec.end
    if pos != payload:
        raise PrefixFileError(f"{path}: tensor table covers {pos} bytes, the file holds {payload} after its header")
    return out


def check_tensor_table(path: Path, table: dict[str, TensorSpec], expected: dict[str, TensorSpec]) -> None:
    """Raise unless the file's tensors are exactly ``expected``: same names, dtypes and shapes."""
    for name in sorted(set(expected) | set(table)):
        if name not in table:
            raise fail(path, f"tensor {name}", Described("nothing"), expected[name].describe())
        if name not in expected:
            raise fail(path, f"tensor {name}", Described(table[name].describe()),
                       "no such tensor (not in the cache's state)")
        got, want = table[name], expected[name]
        if (got.dtype, got.shape) != (want.dtype, want.shape):
            raise fail(path, f"tensor {name}", Described(got.describe()), want.describe())


# ---------------------------------------------------------------------------------------------- structure
def cache_dims(table: dict[str, TensorSpec], known: dict[str, int | None], meta: dict[str, Any]
               ) -> dict[str, int | None]:
    """Batch, kv heads and head_dim: the caller's (model / fingerprint) where known, else as the file's
    tensors state them (``None`` when no tensor has that axis); every tensor is then checked against
    these, so all must agree."""
    dims = {"batch": None, **known}
    for name, spec in sorted(table.items()):
        if not name.startswith("layer") or len(spec.shape) not in (2, 4):
            continue
        dims["batch"] = spec.shape[0] if dims["batch"] is None else dims["batch"]
        if len(spec.shape) == 4:
            dims["heads"] = spec.shape[1] if dims.get("heads") is None else dims["heads"]
            if dims.get("head_dim") is None and name.rsplit(".", 1)[-1] in ("window", "sink", "data"):
                dims["head_dim"] = spec.shape[3]
    ids = table.get("input_ids")
    if dims["batch"] is None and ids is not None and len(ids.shape) == 2:  # a cache holding no tensor yet
        dims["batch"] = ids.shape[0]
    if dims.get("head_dim") is None:  # only packed blocks hold channels: their template names head_dim
        for tm in _templates_in(meta):
            if _is_int(tm.get("head_dim")) and tm["head_dim"] > 0:
                dims["head_dim"] = tm["head_dim"]
    return dims


def check_allocation(path: Path, tails: int, payload: int) -> None:
    """Refuse a file whose cache would allocate more beyond its own bytes than :data:`TAIL_ALLOWANCE_BYTES`
    or the file's size, whichever is larger (a forged ``block_size`` / capacity)."""
    allowed = max(payload, TAIL_ALLOWANCE_BYTES)
    if tails > allowed:
        raise fail(
            path,
            "unused block capacity",
            Described(f"{tails} bytes"),
            f"at most {allowed} bytes beyond the file's {payload} bytes of tensors",
        )


def _templates_in(obj: Any) -> Any:
    """Every store ``template`` object in a file's cache metadata (whatever its nesting: parts, tiers)."""
    if isinstance(obj, dict):
        if isinstance(obj.get("template"), dict):
            yield obj["template"]
        for v in obj.values():
            yield from _templates_in(v)
    elif isinstance(obj, list):
        for v in obj:
            yield from _templates_in(v)


# ---------------------------------------------------------------------------------------------- values
def check_values(path: Path, name: str, t: torch.Tensor, vocab_size: int | None) -> None:
    """Floats finite, masks 0/1, token ids in ``[0, vocab_size)`` (``>= 0`` when the vocabulary is unknown)."""
    if t.dtype.is_floating_point:
        bad = ~torch.isfinite(t)
        if bool(bad.any()):
            raise fail(path, f"tensor {name}", Described(f"{int(bad.sum())} non-finite values"), "finite values only")
    elif t.dtype == torch.bool:
        raw = t.view(torch.uint8)
        if bool((raw > 1).any()):
            raise fail(path, f"tensor {name}", Described(f"byte {int(raw.max())}"), "0 or 1 (a boolean mask)")
    elif name == "input_ids" and t.numel():
        lo, hi = int(t.min()), int(t.max())
        top = vocab_size if vocab_size is not None else None
        if lo < 0 or (top is not None and hi >= top):
            raise fail(
                path, "tensor input_ids", Described(f"ids {lo}..{hi}"), f"ids in [0, {top})" if top else "ids >= 0"
            )


def layer_dtype(path: Path, value: Any, where: str) -> torch.dtype:
    if value not in LAYER_DTYPES:
        raise fail(path, where, value, f"one of {sorted(LAYER_DTYPES)}")
    return LAYER_DTYPES[value]


def known_dims(fingerprint: dict[str, Any], heads: int | None, head_dim: int | None) -> dict[str, int | None]:
    """Head count and head_dim from the model when given, else from the (already matched) fingerprint."""
    def pick(given: int | None, key: str) -> int | None:
        if given is not None:
            return given
        v = fingerprint.get(key)
        return v if _is_int(v) and v > 0 else None

    return {"heads": pick(heads, "num_key_value_heads"), "head_dim": pick(head_dim, "head_dim")}


__all__ = ["PrefixFileError", "TensorSpec", "Described", "fail", "parse_table", "check_tensor_table", "cache_dims",
           "check_allocation", "dtype_name", "check_values", "known_dims", "layer_dtype", "SAFETENSORS_DTYPES",
           "LAYER_DTYPES", "TAIL_ALLOWANCE_BYTES"]
