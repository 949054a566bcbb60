"""The header of a saved prefix file (:mod:`kivi.cache.persist`): read, and checked against the caller.

:func:`read_header` reads what the file says about itself without touching its tensors: a kivi prefix
file of a version this kivi reads, complete (its size against the tensor table, whose byte ranges must
tile the payload), with intact metadata (``kivi_meta`` against ``kivi_meta_sha256``: damage, not
forgery, see docs/python.md "Trust"). :func:`check_fingerprint`, :func:`check_config` and
:func:`check_layers` compare it with the caller's model, tokenizer and configuration.
"""

from __future__ import annotations

import hashlib
import json
import os
import struct
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ..config import KiviConfig
from .persist_checks import PrefixFileError, TensorSpec, _Reader, parse_table

FORMAT = "kivi-prefix"
FORMAT_VERSION = 2
#: A safetensors header longer than this is not one kivi wrote (it would be a corrupt length field).
MAX_HEADER_BYTES = 64 << 20
#: KiviConfig fields that say how attention reads the cache, not what it holds: not compared on load.
READ_ONLY_FIELDS = ("attention_backend",)


@dataclass
class PrefixHeader:
    """What a prefix file's header says (read without touching its tensors)."""

    path: Path
    config: KiviConfig
    fingerprint: dict[str, Any]
    meta: dict[str, Any]  # the whole ``kivi_meta`` JSON
    table: dict[str, TensorSpec]  # tensor name -> dtype, shape, byte range in the payload (checked to tile it)
    data_start: int  # first payload byte in the file

    @property
    def offsets(self) -> dict[str, tuple[int, int]]:
        """Tensor name -> byte range in the payload."""
        return {name: (t.begin, t.end) for name, t in self.table.items()}

    @property
    def payload(self) -> int:
        """Bytes of tensor data (the file less its header)."""
        return max((t.end for t in self.table.values()), default=0)

    @property
    def seq_length(self) -> int:
        return self.meta["cache"]["seq_length"]


def read_header(path: str | os.PathLike) -> PrefixHeader:
    """Read and check a prefix file's header: kivi format and version, complete file, intact metadata."""
    path = Path(path)
    if not path.is_file():
        raise PrefixFileError(f"prefix file {str(path)!r} does not exist" if not path.exists()
                              else f"prefix file {str(path)!r} is not a file")
    size = path.stat().st_size
    with open(path, "rb") as f:
        head = f.read(8)
        if len(head) < 8:
            raise PrefixFileError(f"{path}: not a kivi prefix file ({size} bytes, too short for a safetensors header)")
        (n,) = struct.unpack("<Q", head)
        if n > MAX_HEADER_BYTES:
            raise PrefixFileError(f"{path}: not a kivi prefix file (not a safetensors file: header length {n})")
        if 8 + n > size:
            raise PrefixFileError(f"{path}: file is truncated: {size} bytes, its header alone needs {8 + n}")
        raw = f.read(n)
    try:
        header = json.loads(raw)
        if not isinstance(header, dict):
            raise ValueError("not a JSON object")
    except (ValueError, UnicodeDecodeError):
        raise PrefixFileError(f"{path}: not a kivi prefix file (its header is not safetensors JSON)") from None
    md = header.pop("__metadata__", None) or {}
    if not isinstance(md, dict) or md.get("kivi_format") != FORMAT:
        raise PrefixFileError(f"{path}: a safetensors file but not a kivi prefix file (no kivi_format={FORMAT!r} "
                              "in its metadata)")
    version = md.get("kivi_format_version", "")
    if not isinstance(version, str) or not version.isdigit() or int(version) > FORMAT_VERSION:
        raise PrefixFileError(f"{path}: kivi prefix format version {version!r}; this kivi reads versions up to "
                              f"{FORMAT_VERSION} (upgrade kivi)")
    if int(version) < FORMAT_VERSION:
        raise PrefixFileError(f"{path}: kivi prefix format version {version!r} (an older kivi's layout); this kivi "
                              f"reads version {FORMAT_VERSION}: save the prefix again with this kivi")
    end = 8 + n + _table_end(header)
    if size < end:
        raise PrefixFileError(f"{path}: file is truncated: {size} of {end} bytes")
    if size > end:
        raise PrefixFileError(f"{path}: file has {size - end} bytes after its data ({size} bytes, expected "
                              f"{end}); it is not the file kivi wrote")
    table = parse_table(path, header, end - 8 - n)
    text = md.get("kivi_meta", "")
    if not isinstance(text, str) or hashlib.sha256(text.encode()).hexdigest() != md.get("kivi_meta_sha256"):
        raise PrefixFileError(f"{path}: metadata checksum mismatch (the header was altered or corrupted)")
    try:
        meta = json.loads(text)
    except ValueError:
        raise PrefixFileError(f"{path}: metadata field kivi_meta is not JSON") from None
    r = _Reader(path)
    if not isinstance(meta, dict):
        raise PrefixFileError(f"{path}: metadata field kivi_meta: found {type(meta).__name__}, expected a JSON object")
    try:
        config = KiviConfig.from_dict(r.get(meta, "config", "", "dict"))
    except (ValueError, TypeError) as e:
        raise PrefixFileError(f"{path}: metadata field config: {str(e).splitlines()[0] if str(e) else e!r}") from None
    fingerprint = r.get(meta, "fingerprint", "", "dict")
    return PrefixHeader(path, config, fingerprint, meta, table, 8 + n)


def _table_end(table: dict[str, Any]) -> int:
    """Largest end offset a safetensors table names (0 where entries are malformed: parse_table says why)."""
    ends = [info["data_offsets"][1] for info in table.values() if isinstance(info, dict)
            and isinstance(info.get("data_offsets"), list) and len(info["data_offsets"]) == 2
            and isinstance(info["data_offsets"][1], int) and not isinstance(info["data_offsets"][1], bool)]
    return max(ends, default=0)


def check_fingerprint(header: PrefixHeader, fingerprint: dict[str, Any]) -> None:
    """Raise naming what differs between the file's fingerprint and ``fingerprint`` (this model's)."""
    saved = header.fingerprint
    diffs = [k for k in sorted(set(saved) | set(fingerprint)) if saved.get(k) != fingerprint.get(k)]
    if not diffs:
        return

    def show(v: Any) -> str:
        if v is None:
            return "none"
        s = str(v)
        return s[:12] + "…" if isinstance(v, str) and len(s) == 64 else s

    what = "; ".join(f"{k} {show(saved.get(k))} vs {show(fingerprint.get(k))}" for k in diffs)
    if "weights_sha256" in diffs:
        lead = (
            f"prefix file was saved for model {saved.get('architecture')} "
            f"(weights {show(saved.get('weights_sha256'))}), "
            f"this model is {fingerprint.get('architecture')} (weights {show(fingerprint.get('weights_sha256'))})"
        )
        raise PrefixFileError(f"{header.path}: {lead}; differs (file vs this): {what}")
    raise PrefixFileError(f"{header.path}: prefix file was saved for a different model or tokenizer; differs "
                          f"(file vs this): {what}")


def check_config(header: PrefixHeader, config: KiviConfig) -> None:
    """Raise naming every field where ``config`` differs from the file's (``attention_backend`` aside)."""
    saved, given = header.config.to_dict(), config.to_dict()
    diffs = [k for k in saved if k not in READ_ONLY_FIELDS and saved[k] != given.get(k)]
    if diffs:
        what = ", ".join(f"{k} {saved[k]} vs {given.get(k)}" for k in diffs)
        raise PrefixFileError(f"{header.path}: config differs (file vs given): {what}")


def check_layers(header: PrefixHeader, windows: list[int | None]) -> None:
    """Raise when the file's layers (count, sliding windows) are not the model's (``windows``: one per layer,
    ``None`` for full attention; :func:`kivi.cache.support.model_layer_types`)."""
    r = _Reader(header.path)
    layers = r.get(r.get(header.meta, "cache", "", "dict"), "layers", "cache", "list")
    if len(layers) != len(windows):
        raise PrefixFileError(f"{header.path}: the prefix has {len(layers)} layers, the model has {len(windows)}")
    for i, (lm, window) in enumerate(zip(layers, windows)):
        saved = r.get(lm, "sliding_window", f"cache.layers[{i}]", "int?")
        if saved != window:
            raise PrefixFileError(f"{header.path}: layer {i} has sliding window {saved} in the file, "
                                  f"{window} in the model")


__all__ = ["read_header", "check_fingerprint", "check_config", "check_layers", "PrefixHeader", "FORMAT",
           "FORMAT_VERSION", "MAX_HEADER_BYTES", "READ_ONLY_FIELDS"]
