"""A :class:`KiviCache` saved to a file and loaded back, bit for bit (a "saved quantized prefix").

The file is a safetensors file. Its tensors are the cache's state exactly as the cache holds it:
per layer and side (``k`` / ``v``), the filled rows of every stored block (``packed`` codes,
``scale``, ``offset`` zero-points, ``comp`` compensation codes, or ``data`` for an unquantized side),
the full-precision ``window`` (and its padding mask ``window_valid``) and the ``sink``; plus the
token ids the cache holds (``input_ids``) when the caller gives them. Nothing is re-quantized, so
the file is about :attr:`KiviCache.nbytes` (less the unused tail of the last block of each side).

Its safetensors header metadata holds (``__metadata__``):

* ``kivi_format`` = ``"kivi-prefix"`` and ``kivi_format_version`` (this module reads version 1);
* ``kivi_meta``: JSON with the :class:`KiviConfig`, the caller's model/tokenizer ``fingerprint``,
  the kivi / transformers / torch versions, the cache's structure (per layer: tokens seen, dtype,
  sliding window; per side: block starts and capacities, evicted blocks, store start and length,
  the segment template) and the sha256 of every tensor;
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
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from ..config import KiviConfig
from ..quant.kv import token_divisor
from .layer import KiviLayer
from .persist_checks import (
    PrefixFileError,
    SidePlan,
    TensorSpec,
    _Reader,
    cache_dims,
    check_allocation,
    check_tensor_table,
    check_values,
    dtype_name,
    expected_tensors,
    known_dims,
    layer_dtype,
    plan_side,
    tail_bytes,
    template_meta,
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
from .store import BlockStore


# ---------------------------------------------------------------------------------------------- save
def save_cache(cache: Any, path: str | os.PathLike, *, fingerprint: dict[str, Any],
               input_ids: torch.Tensor | None = None) -> Path:
    """Write ``cache`` (a :class:`~kivi.cache.cache.KiviCache`) to ``path`` (see the module docstring); returns the path.

    ``fingerprint``: a JSON-serialisable dict describing the model and tokenizer the cache was made
    with (:func:`kivi.prefix.model_fingerprint`); :func:`load_cache` refuses a different one.
    ``input_ids [B, T]``: the tokens the cache holds (``T`` = the cache's length), stored with it.
    The file is written to a temporary name and renamed: a failed save leaves no partial file and
    never changes the cache. A failed write (a full disk, ...) raises ``OSError`` (with the errno when the
    system gave one), whoever wrote the bytes.
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
    check_savable(cache.config)
    tensors: dict[str, torch.Tensor] = {}
    layers = []
    for i, layer in enumerate(cache.layers):
        if not isinstance(layer, KiviLayer):
            raise TypeError(f"layer {i} is a {type(layer).__name__}, not a KiviLayer; only KIVI layers can be saved")
        if layer.k.older or layer.v.older:
            raise ValueError(f"layer {i} has position tiers (tiers={[list(t) for t in layer.config.tiers]}): saving "
                             "a tiered cache as a prefix is not supported yet; save a prefix built without tiers")
        layers.append(_layer_meta(layer, f"layer{i}", tensors))
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
        try:
            save_file(tensors, tmp, metadata=header)
        except SafetensorError as e:  # its I/O errors (a full disk) are OSErrors like any other failed write
            raise write_error(e, path) from e
        umask = os.umask(0)
        os.umask(umask)
        os.chmod(tmp, 0o666 & ~umask)  # mkstemp's 0600 -> what open() would have given
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
    return path


def check_savable(config: KiviConfig) -> None:
    """Raise ``ValueError`` when a cache of ``config`` cannot be saved (per-head widths, position tiers), so a
    caller can refuse before the work that would produce it."""
    if getattr(config, "head_bits", None):
        raise ValueError("saving a cache with per-head widths (head_bits) is not supported; save one without "
                         "head_bits, or keep this cache in memory")
    tiered = ["all layers"] if config.tiers else [f"layer {i}" for i, v in sorted(config.layer_specific_config.items())
                                                  if v.get("tiers")]
    if tiered:
        raise ValueError(f"position tiers ({tiered[0]}): saving a tiered cache as a prefix is not supported yet; "
                         "save a prefix built without tiers")


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


def _layer_meta(layer: KiviLayer, name: str, tensors: dict[str, torch.Tensor]) -> dict[str, Any]:
    sides = {}
    for label, side in (("k", layer.k), ("v", layer.v)):
        for field, t in (("window", side.window), ("window_valid", side.window_valid), ("sink", side.sink),
                         ("stored_valid", side.stored_valid)):
            if t is not None:
                tensors[f"{name}.{label}.{field}"] = _cpu(t)
        store = side.store
        present = []
        for j, blk in enumerate(store.blocks):
            present.append(blk is not None)
            if blk is None:
                continue
            filled = _filled(store, j)
            for field, t in blk.items():
                rows = filled // _divisor(store.template, field)
                tensors[f"{name}.{label}.block{j}.{field}"] = _cpu(t[:, :, :rows])
        caps = list(store.caps)
        if caps:  # what a fresh append of the last block's tokens allocates (a crop may have left more)
            caps[-1] = max(store.block_size, _filled(store, len(caps) - 1))
        sides[label] = {
            "window": side.window is not None, "window_valid": side.window_valid is not None,
            "sink": side.sink is not None, "stored_valid": side.stored_valid is not None,
            "store": {"block_size": store.block_size, "length": store.length, "start": store.start,
                      "starts": list(store.starts), "caps": caps, "present": present,
                      "template": _template_meta(store.template)},
        }
    return {"seen": layer.seen, "initialized": bool(layer.is_initialized), "sliding_window": layer.sliding_window,
            "due": bool(layer._due),  # past recording: the window still holds tokens due to move (next forward/crop)
            "dtype": None if layer.dtype is None else dtype_name(layer.dtype), "k": sides["k"], "v": sides["v"]}


def _filled(store: BlockStore, j: int) -> int:
    """Tokens written into block ``j`` (the last block may be partly filled)."""
    return max(0, min(store.caps[j], store.length - store.starts[j]))


def _divisor(template: Any, field: str) -> int:
    return token_divisor(template.axis, template.group_size, field)


def _template_meta(template: Any) -> dict[str, Any] | None:
    return None if template is None else template_meta(template)


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


@dataclass
class LayerPlan:
    """One layer as the file describes it, checked (:func:`plan_cache`)."""

    layer: KiviLayer  # built empty with the layer's config and sliding window
    seen: int
    due: bool
    initialized: bool
    dtype: torch.dtype | None
    sides: dict[str, SidePlan]


def plan_cache(header: PrefixHeader, config: KiviConfig, dims: dict[str, int | None]
               ) -> tuple[list[LayerPlan], dict[str, TensorSpec], int]:
    """``(layers, expected tensors, tail bytes)``: the file's structure checked against ``config`` and the
    cache's schedule, every tensor it must hold derived from that (never from the file's table), and the
    bytes the built cache allocates beyond them. Raises :class:`PrefixFileError` on the first mismatch."""
    path, r = header.path, _Reader(header.path)
    cache = r.get(header.meta, "cache", "", "dict")
    seq = r.get(cache, "seq_length", "cache", "int")
    layers_meta = r.get(cache, "layers", "cache", "list")
    dims = cache_dims(header.table, dims, cache)
    expected: dict[str, TensorSpec] = {}
    if r.get(cache, "input_ids", "cache", "bool"):
        expected["input_ids"] = TensorSpec(torch.int64, (dims["batch"], seq))
    plans, tails = [], 0
    for i, lm in enumerate(layers_meta):
        where = f"cache.layers[{i}]"
        if not isinstance(lm, dict):
            raise PrefixFileError(f"{path}: metadata field {where}: found {type(lm).__name__}, expected a JSON object")
        seen = r.get(lm, "seen", where, "int")
        if seen != seq:
            raise PrefixFileError(f"{path}: {where}.seen: found {seen}, expected {seq} (cache.seq_length)")
        sliding = r.get(lm, "sliding_window", where, "int?")
        initialized, due = r.get(lm, "initialized", where, "bool"), r.get(lm, "due", where, "bool")
        saved_dtype = r.get(lm, "dtype", where, "str?")
        if not initialized and (saved_dtype is not None or seen):
            raise PrefixFileError(f"{path}: {where}: an uninitialized layer with dtype {saved_dtype} and {seen} tokens")
        dtype = None if not initialized else layer_dtype(path, saved_dtype, f"{where}.dtype")
        try:
            layer = KiviLayer(config.for_layer(i), sliding_window=sliding)
        except ValueError as e:
            raise PrefixFileError(f"{path}: {where}: {str(e).splitlines()[0]}") from None
        sides = {}
        for label, side in (("k", layer.k), ("v", layer.v)):
            sm = r.get(lm, label, where, "dict")
            sides[label] = plan = plan_side(path, r, sm, layer, side, seen, due, dtype, dims, header.table,
                                            f"layer{i}.{label}")
            expected.update(expected_tensors(f"layer{i}.{label}", plan, dtype, dims))
            tails += tail_bytes(plan, dims)
        plans.append(LayerPlan(layer, seen, due, initialized, dtype, sides))
    return plans, expected, tails


# ---------------------------------------------------------------------------------------------- load
def load_cache(path: str | os.PathLike, *, fingerprint: dict[str, Any], config: KiviConfig | None = None,
               windows: list[int | None] | None = None, device: str | torch.device = "cpu",
               kv_heads: int | None = None, head_dim: int | None = None,
               ) -> tuple[KiviConfig, list[KiviLayer], torch.Tensor | None]:
    """``(config, layers, input_ids or None)`` of the cache in a file written by :func:`save_cache`
    (:meth:`KiviCache.load <kivi.cache.cache.KiviCache.load>` builds the cache from them).

    The file is untrusted input. Checks in this order, each failure a :class:`PrefixFileError` before
    anything is built: the header (:func:`read_header`: format, version, size, the tensor table's byte
    ranges, the metadata checksum), ``fingerprint`` (:func:`check_fingerprint`), ``config`` when given
    (:func:`check_config`), the layers against the model's ``windows`` when given (:func:`check_layers`),
    the structure against the config and the schedule and every tensor's dtype and shape against what
    that structure needs (:func:`plan_cache`, :func:`~kivi.cache.persist_checks.check_tensor_table`;
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
    plans, expected, tails = plan_cache(header, cfg, known_dims(fingerprint, kv_heads, head_dim))
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
    dims = cache_dims(header.table, known_dims(fingerprint, kv_heads, head_dim), header.meta["cache"])
    layers = [_build_layer(p, f"layer{i}", tensors, device, dims) for i, p in enumerate(plans)]
    ids = tensors.get("input_ids")
    return cfg, layers, None if ids is None else ids.to(device)


def _build_layer(plan: LayerPlan, name: str, tensors: dict[str, torch.Tensor], device: str | torch.device,
                 dims: dict[str, int | None]) -> KiviLayer:
    layer = plan.layer
    layer.seen = plan.seen
    layer._due = plan.due
    layer.dtype = plan.dtype
    if plan.initialized:
        layer.device = torch.device(device)
        layer.is_initialized = True
    for label, side in (("k", layer.k), ("v", layer.v)):
        for field in ("window", "window_valid", "sink", "stored_valid"):
            t = tensors.get(f"{name}.{label}.{field}")
            if t is not None:
                setattr(side, field, t.to(device))
        side.store = _build_store(plan.sides[label], layer.config.block_size, f"{name}.{label}", tensors, device,
                                  dims)
    return layer


def _build_store(plan: SidePlan, block_size: int, name: str, tensors: dict[str, torch.Tensor],
                 device: str | torch.device, dims: dict[str, int | None]) -> BlockStore:
    """The side's block store from its checked plan: every size from the plan, the rows from the file."""
    store = BlockStore(block_size)
    if plan.template is not None:
        B, H = dims["batch"], dims["heads"]
        store.template = plan.template.with_tensors(**{
            k: torch.empty((B, H, 0, *t.shape[3:]), dtype=t.dtype, device=device)
            for k, t in plan.template.tensors().items()})
    store.length, store.start = plan.length, plan.start
    store.starts, store.caps = list(plan.starts), list(plan.caps)
    for j, (present, cap) in enumerate(zip(plan.present, plan.caps)):
        if not present:
            store.blocks.append(None)
            continue
        blk = {}
        for field, t in store.template.tensors().items():
            saved = tensors[f"{name}.block{j}.{field}"]
            rows = cap // _divisor(store.template, field)
            full = torch.zeros((*t.shape[:2], rows, *t.shape[3:]), dtype=t.dtype, device=device)
            full[:, :, : saved.shape[2]].copy_(saved)  # the unused tail of the block stays zero
            blk[field] = full
        store.blocks.append(blk)
    return store


__all__ = ["save_cache", "check_savable", "write_error", "load_cache", "read_header", "check_fingerprint", "check_config", "check_layers", "plan_cache",
           "tensor_sha256", "PrefixFileError", "PrefixHeader", "FORMAT", "FORMAT_VERSION"]
