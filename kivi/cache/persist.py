"""A :class:`KiviCache` saved to a file and loaded back, bit for bit (a "saved quantized prefix").

The file is a safetensors file. Its tensors are the cache's state exactly as the cache holds it: each
layer's :meth:`~kivi.cache.layer.KiviLayer.state_dict` (per head group and side: the filled rows of
every stored block of every position tier, the full-precision window, the sink, the padding marks),
each tensor named by its path in that dict (``layer0.parts.0.k.store.blocks.0.packed``); plus the
token ids the cache holds (``input_ids``) when the caller gives them. Every config (tiers, per-head
widths) saves: this module knows no layer's fields. Nothing is re-quantized, so
the file is about :attr:`KiviCache.nbytes` (less the unused tail of the last block of each side).

Its safetensors header metadata holds (``__metadata__``):

* ``kivi_format`` = ``"kivi-prefix"`` and ``kivi_format_version`` (this module reads version 2; an
  older file is refused with a line saying to save it again);
* ``kivi_meta``: JSON with the :class:`KiviConfig`, the caller's model/tokenizer ``fingerprint``,
  the kivi / transformers / torch versions, the cache's structure (each layer's state dict with its
  tensors replaced by ``{"tensor": name}``) and the sha256 of every tensor;
* ``kivi_meta_sha256``: the sha256 of ``kivi_meta`` (a changed header byte is caught).

:func:`load_cache` reads the file as untrusted input (docs/python.md "Trust"): the structure
comes from the configuration, and every tensor's name, dtype and shape is derived from it and the
file's checked token counts before a byte is read or allocated (:mod:`kivi.cache.persist_plan`,
:mod:`kivi.cache.persist_checks`); the saved structure is never taken as a template. Each failure is a
:class:`PrefixFileError` (a ``ValueError``) with a one-line message naming what differs.
"""

from __future__ import annotations

import hashlib
import json
import os
from pathlib import Path
from typing import Any

import torch

from ..config import KiviConfig
from ..files import write_file
from .layer import KiviLayer
from .persist_checks import (
    PrefixFileError,
    _Reader,
    check_allocation,
    check_tensor_table,
    check_values,
    known_dims,
)
from .persist_header import (
    FORMAT,
    FORMAT_VERSION,
    PrefixHeader,
    check_config,
    check_fingerprint,
    check_layers,
    read_header,
)
from .persist_plan import plan_cache, state_dict


# ---------------------------------------------------------------------------------------------- save
def save_cache(cache: Any, path: str | os.PathLike, *, fingerprint: dict[str, Any],
               input_ids: torch.Tensor | None = None) -> Path:
    """Write ``cache`` (a :class:`~kivi.cache.kivi_cache.KiviCache`) to ``path`` (see the module docstring);
    returns the path.

    ``fingerprint``: a JSON-serialisable dict describing the model and tokenizer the cache was made
    with (:func:`kivi.prefix.model_fingerprint`); :func:`load_cache` refuses a different one.
    ``input_ids [B, T]``: the tokens the cache holds (``T`` = the cache's length), stored with it.
    The file is written by :func:`kivi.files.write_file` (a temporary file renamed over ``path``; a path that
    exists and is not a regular file is refused with :class:`kivi.files.NotRegularFileError`): a failed save
    leaves no partial file and never changes the cache. A failed write (a full disk, ...) raises ``OSError``
    (with the errno when the system gave one), whoever wrote the bytes.
    """
    from safetensors import SafetensorError
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

    def fill(tmp: str) -> None:
        try:
            save_file(tensors, tmp, metadata=header)
        except SafetensorError as e:  # its I/O errors (a full disk) are OSErrors like any other failed write
            raise write_error(e, path) from e

    write_file(path, fill)  # the one writer: atomic; refuses a device, FIFO, folder, ... at path
    return path


def write_error(error: BaseException, path: str | os.PathLike) -> OSError:
    """``error`` (safetensors' ``SafetensorError`` from a failed write) as an ``OSError`` naming ``path``,
    with the system's errno when its message carries one (``... (os error 28)`` -> ``ENOSPC``)."""
    import errno as errnos
    import re

    text = str(error).splitlines()[0] if str(error) else type(error).__name__
    m = re.search(r"os error (\d+)", text)
    if m:
        code = int(m.group(1))
        return OSError(code, os.strerror(code) if code in errnos.errorcode else text, str(path))
    return OSError(f"cannot write {str(path)!r}: {text}")


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


def _cpu(t: torch.Tensor) -> torch.Tensor:
    return t.detach().to("cpu").contiguous()


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


# ---------------------------------------------------------------------------------------------- load
def load_cache(path: str | os.PathLike, *, fingerprint: dict[str, Any], config: KiviConfig | None = None,
               windows: list[int | None] | None = None, device: str | torch.device = "cpu",
               kv_heads: int | None = None, head_dim: int | None = None,
               ) -> tuple[KiviConfig, list[KiviLayer], torch.Tensor | None]:
    """``(config, layers, input_ids or None)`` of the cache in a file written by :func:`save_cache`
    (:meth:`KiviCache.load <kivi.cache.kivi_cache.KiviCache.load>` builds the cache from them).

    The file is untrusted input. Checks in this order, each failure a :class:`PrefixFileError` before
    anything is built: the header (:func:`read_header`: format, version, size, the tensor table's byte
    ranges, the metadata checksum), ``fingerprint`` (:func:`check_fingerprint`), ``config`` when given
    (:func:`check_config`), the layers against the model's ``windows`` when given (:func:`check_layers`),
    the structure against the config and the schedule and every tensor's dtype and shape against what
    that structure needs (:func:`~kivi.cache.persist_plan.plan_cache`, built from the config's layers:
    plain, sliding, tiered, head-split; :func:`~kivi.cache.persist_checks.check_tensor_table`;
    ``kv_heads`` / ``head_dim``: the model's, else the fingerprint's, else the file's), the memory the
    cache allocates beyond the file's bytes (:func:`~kivi.cache.persist_checks.check_allocation`), then,
    tensor by tensor, its checksum and values (:func:`~kivi.cache.persist_checks.check_values`). The
    layers live on ``device``; the config is ``config`` when given (it may differ in
    ``attention_backend``), else the file's.
    """
    from safetensors import safe_open

    header = read_header(path)
    check_fingerprint(header, fingerprint)
    if config is not None:
        check_config(header, config)
    if windows is not None:
        check_layers(header, windows)
    cfg = config if config is not None else header.config
    plans, expected, tails, _ = plan_cache(header.path, header.meta, header.table, cfg,
                                           known_dims(fingerprint, kv_heads, head_dim))
    check_tensor_table(header.path, header.table, expected)
    check_allocation(header.path, tails, header.payload)
    sums = _Reader(header.path).get(header.meta, "tensor_sha256", "", "dict")
    if set(sums) != set(expected) or not all(isinstance(v, str) for v in sums.values()):
        odd = sorted(set(sums) ^ set(expected)) or sorted(k for k, v in sums.items() if not isinstance(v, str))
        raise PrefixFileError(f"{header.path}: metadata field tensor_sha256 does not list the file's tensors "
                              f"(e.g. {odd[0]!r})")
    vocab = fingerprint.get("vocab_size")
    vocab = vocab if isinstance(vocab, int) and not isinstance(vocab, bool) and vocab > 0 else None
    tensors: dict[str, torch.Tensor] = {}
    try:
        with safe_open(str(header.path), framework="pt") as f:
            for name in sorted(expected):
                t = f.get_tensor(name)
                if tensor_sha256(t) != sums[name]:
                    raise PrefixFileError(f"{header.path}: checksum mismatch in tensor {name}")
                check_values(header.path, name, t, vocab)
                tensors[name] = t
    except PrefixFileError:
        raise
    except Exception as e:  # safetensors' own errors on a damaged file
        raise PrefixFileError(f"{header.path}: cannot read tensors ({str(e).splitlines()[0]})") from None
    layers = []
    for i, plan in enumerate(plans):
        try:
            plan.layer.load_state_dict(state_dict(plan, f"layer{i}", tensors), device)
        except (KeyError, TypeError, ValueError) as e:  # the checks above leave none: a bug, named as such
            raise PrefixFileError(f"{header.path}: layer {i} does not load its checked state ({e})") from None
        layers.append(plan.layer)
    ids = tensors.get("input_ids")
    return cfg, layers, None if ids is None else ids.to(device)


__all__ = ["save_cache", "write_error", "load_cache", "read_header", "check_fingerprint", "check_config",
           "check_layers", "tensor_sha256", "PrefixFileError", "PrefixHeader", "FORMAT", "FORMAT_VERSION"]
