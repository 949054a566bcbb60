"""A :class:`KiviCache` saved to a file and loaded back, bit for bit (a "saved quantized prefix").

The file is a safetensors file. Its tensors are the cache's state exactly as the cache holds it: each
layer's :meth:`~kivi.cache.layer.KiviLayer.state_dict` (per head group and side: the filled rows of
every stored block of every position tier, the full-precision window, the sink, the padding marks),
each tensor named by its path in that dict (``layer0.parts.0.k.store.blocks.0.packed``); plus the
token ids the cache holds (``input_ids``) when the caller gives them. Every config (tiers, per-head
widths) saves: this module knows no layer's fields. Nothing is re-quantized, so
the file is about :attr:`KiviCache.nbytes` (less the unused tail of the last block of each side).

Its safetensors header metadata holds (``__metadata__``):

* ``kivi_format`` = ``"kivi-prefix"`` and ``kivi_format_version`` (this module reads version 2);
* ``kivi_meta``: JSON with the :class:`KiviConfig`, the caller's model/tokenizer ``fingerprint``,
  the kivi / transformers / torch versions, the cache's structure (each layer's state dict with its
  tensors replaced by ``{"tensor": name}``) and the sha256 of every tensor;
* ``kivi_meta_sha256``: the sha256 of ``kivi_meta`` (a changed header byte is caught).

:func:`load_cache` checks, before it builds anything: the file is a kivi prefix file of a version
it reads, it is complete (size against the header's offsets), the header is intact, the
fingerprint and the config equal the caller's, the layers match the model's, and every tensor's
checksum. Each failure is a :class:`PrefixFileError` (a ``ValueError``) with a one-line message
naming what differs.
"""

from __future__ import annotations

import hashlib
import json
import os
import struct
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from ..config import KiviConfig
from .heads import build_layer
from .layer import KiviLayer

FORMAT = "kivi-prefix"
FORMAT_VERSION = 2
#: A safetensors header longer than this is not one kivi wrote (it would be a corrupt length field).
MAX_HEADER_BYTES = 64 << 20
#: KiviConfig fields that say how attention reads the cache, not what it holds: not compared on load.
READ_ONLY_FIELDS = ("attention_backend",)


class PrefixFileError(ValueError):
    """A prefix file cannot be loaded here; the message names the file and what differs."""


@dataclass
class PrefixHeader:
    """What a prefix file's header says (read without touching its tensors)."""

    path: Path
    config: KiviConfig
    fingerprint: dict[str, Any]
    meta: dict[str, Any]  # the whole ``kivi_meta`` JSON
    offsets: dict[str, tuple[int, int]]  # tensor name -> byte range in the payload
    data_start: int  # first payload byte in the file

    @property
    def seq_length(self) -> int:
        return self.meta["cache"]["seq_length"]


# ---------------------------------------------------------------------------------------------- save
def save_cache(cache: Any, path: str | os.PathLike, *, fingerprint: dict[str, Any],
               input_ids: torch.Tensor | None = None) -> Path:
    """Write ``cache`` (a :class:`~kivi.cache.cache.KiviCache`) to ``path`` (see the module docstring); returns the path.

    ``fingerprint``: a JSON-serialisable dict describing the model and tokenizer the cache was made
    with (:func:`kivi.prefix.model_fingerprint`); :func:`load_cache` refuses a different one.
    ``input_ids [B, T]``: the tokens the cache holds (``T`` = the cache's length), stored with it.
    The file is written to a temporary name and renamed: a failed save leaves no partial file and
    never changes the cache.
    """
    from safetensors.torch import save_file

    if not isinstance(fingerprint, dict):
        raise TypeError(f"fingerprint must be a dict (e.g. kivi.prefix.model_fingerprint(model, tokenizer)), "
                        f"got {type(fingerprint).__name__}")
    try:
        json.dumps(fingerprint)
    except TypeError as e:
        raise ValueError(f"fingerprint must be JSON-serialisable: {e}") from None
    tensors: dict[str, torch.Tensor] = {}
    layers = []
    for i, layer in enumerate(cache.layers):
        if not isinstance(layer, KiviLayer):
            raise TypeError(f"layer {i} is a {type(layer).__name__}, not a KiviLayer; only KIVI layers can be saved")
        layers.append(_flatten(layer.state_dict(), f"layer{i}", tensors))
    seq = cache.get_seq_length() if cache.layers else 0
    if input_ids is not None:
        if input_ids.dim() != 2 or input_ids.shape[-1] != seq:
            raise ValueError(f"input_ids of shape {tuple(input_ids.shape)} must be [batch, {seq}] (the cache holds "
                             f"{seq} tokens)")
        tensors["input_ids"] = input_ids.detach().to("cpu", torch.int64).contiguous()
    meta = {
        "config": cache.config.to_dict(),
        "fingerprint": fingerprint,
        "versions": _versions(),
        "cache": {"seq_length": seq, "layers": layers, "input_ids": input_ids is not None},
        "tensor_sha256": {name: tensor_sha256(t) for name, t in tensors.items()},
    }
    text = json.dumps(meta, sort_keys=True)
    header = {"kivi_format": FORMAT, "kivi_format_version": str(FORMAT_VERSION), "kivi_meta": text,
              "kivi_meta_sha256": hashlib.sha256(text.encode()).hexdigest()}
    path = Path(path)
    if not path.parent.is_dir():
        raise FileNotFoundError(f"cannot save to {str(path)!r}: folder {str(path.parent)!r} does not exist")
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    os.close(fd)
    try:
        save_file(tensors, tmp, metadata=header)
        umask = os.umask(0)
        os.umask(umask)
        os.chmod(tmp, 0o666 & ~umask)  # mkstemp's 0600 -> what open() would have given
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
    return path


def _flatten(value: Any, name: str, tensors: dict[str, torch.Tensor]) -> Any:
    """``value`` (a :meth:`~kivi.cache.layer.KiviLayer.state_dict`) as JSON: every tensor goes into ``tensors``
    under its dotted path and is replaced by ``{"tensor": path}``."""
    if isinstance(value, torch.Tensor):
        tensors[name] = _cpu(value)
        return {"tensor": name}
    if isinstance(value, dict):
        return {k: _flatten(v, f"{name}.{k}", tensors) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_flatten(v, f"{name}.{j}", tensors) for j, v in enumerate(value)]
    return value


def _unflatten(value: Any, tensors: dict[str, torch.Tensor]) -> Any:
    """The state dict :func:`_flatten` wrote (a tensor name the file lacks is a ``KeyError``)."""
    if isinstance(value, dict):
        if set(value) == {"tensor"}:
            return tensors[value["tensor"]]
        return {k: _unflatten(v, tensors) for k, v in value.items()}
    if isinstance(value, list):
        return [_unflatten(v, tensors) for v in value]
    return value


def _cpu(t: torch.Tensor) -> torch.Tensor:
    return t.detach().to("cpu").contiguous()


def _dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def tensor_sha256(t: torch.Tensor) -> str:
    """sha256 of a tensor's bytes (CPU, contiguous)."""
    return hashlib.sha256(t.contiguous().view(-1).view(torch.uint8).numpy().tobytes()).hexdigest()


def _versions() -> dict[str, str]:
    from importlib import metadata

    import safetensors
    import transformers

    try:
        kivi_version = metadata.version("kivi")
    except metadata.PackageNotFoundError:  # running from a source tree
        kivi_version = "unknown"
    return {"kivi": kivi_version, "transformers": transformers.__version__, "torch": torch.__version__,
            "safetensors": safetensors.__version__}


# ---------------------------------------------------------------------------------------------- checks
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
    if md.get("kivi_format") != FORMAT:
        raise PrefixFileError(f"{path}: a safetensors file but not a kivi prefix file (no kivi_format={FORMAT!r} "
                              "in its metadata)")
    version = md.get("kivi_format_version", "")
    if not version.isdigit() or int(version) > FORMAT_VERSION:
        raise PrefixFileError(f"{path}: kivi prefix format version {version!r}; this kivi reads versions up to "
                              f"{FORMAT_VERSION} (upgrade kivi)")
    if int(version) < FORMAT_VERSION:
        raise PrefixFileError(f"{path}: kivi prefix format version {version!r} (an older kivi's layout); this kivi "
                              f"reads version {FORMAT_VERSION}: save the prefix again with this kivi")
    try:
        offsets = {name: tuple(int(x) for x in info["data_offsets"]) for name, info in header.items()}
    except (TypeError, KeyError, ValueError):
        raise PrefixFileError(f"{path}: header is corrupted (bad tensor entries)") from None
    expected = 8 + n + max((end for _, end in offsets.values()), default=0)
    if size < expected:
        raise PrefixFileError(f"{path}: file is truncated: {size} of {expected} bytes")
    if size > expected:
        raise PrefixFileError(f"{path}: file has {size - expected} bytes after its data ({size} bytes, expected "
                              f"{expected}); it is not the file kivi wrote")
    text = md.get("kivi_meta", "")
    if hashlib.sha256(text.encode()).hexdigest() != md.get("kivi_meta_sha256"):
        raise PrefixFileError(f"{path}: metadata checksum mismatch (the header was altered or corrupted)")
    meta = json.loads(text)
    config = KiviConfig.from_dict(meta["config"])
    return PrefixHeader(path, config, meta["fingerprint"], meta, offsets, 8 + n)


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
        lead = (f"prefix file was saved for model {saved.get('architecture')} (weights {show(saved.get('weights_sha256'))}), "
                f"this model is {fingerprint.get('architecture')} (weights {show(fingerprint.get('weights_sha256'))})")
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
    layers = header.meta["cache"]["layers"]
    if len(layers) != len(windows):
        raise PrefixFileError(f"{header.path}: the prefix has {len(layers)} layers, the model has {len(windows)}")
    for i, (lm, window) in enumerate(zip(layers, windows)):
        if lm["sliding_window"] != window:
            raise PrefixFileError(f"{header.path}: layer {i} has sliding window {lm['sliding_window']} in the file, "
                                  f"{window} in the model")


# ---------------------------------------------------------------------------------------------- load
def load_cache(path: str | os.PathLike, *, fingerprint: dict[str, Any], config: KiviConfig | None = None,
               windows: list[int | None] | None = None, device: str | torch.device = "cpu") -> tuple[KiviConfig, list[KiviLayer], torch.Tensor | None]:
    """``(config, layers, input_ids or None)`` of the cache in a file written by :func:`save_cache`
    (:meth:`KiviCache.load <kivi.cache.cache.KiviCache.load>` builds the cache from them).

    Checks in this order, each failure a :class:`PrefixFileError` before anything is built: the
    header (:func:`read_header`), ``fingerprint`` (:func:`check_fingerprint`), ``config`` when
    given (:func:`check_config`), the layers against the model's ``windows`` when given (:func:`check_layers`),
    every tensor's checksum and shape. The layers live on ``device``; the config is ``config`` when
    given (it may differ in ``attention_backend``), else the file's.
    """
    from safetensors import safe_open

    header = read_header(path)
    check_fingerprint(header, fingerprint)
    if config is not None:
        check_config(header, config)
    if windows is not None:
        check_layers(header, windows)
    meta = header.meta
    sums = meta["tensor_sha256"]
    if set(sums) != set(header.offsets):
        missing = sorted(set(sums) - set(header.offsets)) or sorted(set(header.offsets) - set(sums))
        raise PrefixFileError(f"{header.path}: tensor list does not match the metadata (e.g. {missing[0]!r})")
    tensors: dict[str, torch.Tensor] = {}
    try:
        with safe_open(str(header.path), framework="pt") as f:
            for name in sorted(sums):
                t = f.get_tensor(name)
                if tensor_sha256(t) != sums[name]:
                    raise PrefixFileError(f"{header.path}: checksum mismatch in tensor {name}")
                tensors[name] = t
    except PrefixFileError:
        raise
    except Exception as e:  # safetensors' own errors on a damaged header
        raise PrefixFileError(f"{header.path}: cannot read tensors ({str(e).splitlines()[0]})") from None
    cfg = config if config is not None else header.config
    layers = []
    for i, lm in enumerate(meta["cache"]["layers"]):
        layer = build_layer(cfg, i, lm.get("sliding_window") if isinstance(lm, dict) else None)
        try:
            layer.load_state_dict(_unflatten(lm, tensors), device)
        except (KeyError, TypeError, ValueError, IndexError, AttributeError) as e:
            raise PrefixFileError(f"{header.path}: layer {i} does not match this config's layout ({e})") from None
        layers.append(layer)
    ids = tensors.get("input_ids")
    return cfg, layers, None if ids is None else ids.to(device)


__all__ = ["save_cache", "load_cache", "read_header", "check_fingerprint", "check_config", "check_layers",
           "tensor_sha256", "PrefixFileError", "PrefixHeader", "FORMAT", "FORMAT_VERSION"]
