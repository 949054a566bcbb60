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
import struct
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
    expected_tensors,
    known_dims,
    layer_dtype,
    parse_table,
    plan_side,
    tail_bytes,
)
from .store import BlockStore, FpSegment

FORMAT = "kivi-prefix"
FORMAT_VERSION = 1
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
            "dtype": None if layer.dtype is None else _dtype_name(layer.dtype), "k": sides["k"], "v": sides["v"]}


def _filled(store: BlockStore, j: int) -> int:
    """Tokens written into block ``j`` (the last block may be partly filled)."""
    return max(0, min(store.caps[j], store.length - store.starts[j]))


def _divisor(template: Any, field: str) -> int:
    return token_divisor(template.axis, template.group_size, field)


def _template_meta(template: Any) -> dict[str, Any] | None:
    if template is None:
        return None
    fields = {k: {"dtype": _dtype_name(t.dtype), "shape": [t.shape[0], t.shape[1], *t.shape[3:]]}
              for k, t in template.tensors().items()}
    if isinstance(template, FpSegment):
        return {"kind": "fp", "axis": template.axis, "group_size": template.group_size, "fields": fields}
    return {"kind": "packed", "bits": template.bits, "group_size": template.group_size, "axis": template.axis,
            "head_dim": template.head_dim, "residual_bits": template.residual_bits, "fields": fields}


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
    if not isinstance(md, dict) or md.get("kivi_format") != FORMAT:
        raise PrefixFileError(f"{path}: a safetensors file but not a kivi prefix file (no kivi_format={FORMAT!r} "
                              "in its metadata)")
    version = md.get("kivi_format_version", "")
    if not isinstance(version, str) or not version.isdigit() or int(version) > FORMAT_VERSION:
        raise PrefixFileError(f"{path}: kivi prefix format version {version!r}; this kivi reads versions up to "
                              f"{FORMAT_VERSION} (upgrade kivi)")
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
    r = _Reader(header.path)
    layers = r.get(r.get(header.meta, "cache", "", "dict"), "layers", "cache", "list")
    if len(layers) != len(windows):
        raise PrefixFileError(f"{header.path}: the prefix has {len(layers)} layers, the model has {len(windows)}")
    for i, (lm, window) in enumerate(zip(layers, windows)):
        saved = r.get(lm, "sliding_window", f"cache.layers[{i}]", "int?")
        if saved != window:
            raise PrefixFileError(f"{header.path}: layer {i} has sliding window {saved} in the file, "
                                  f"{window} in the model")


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
        dtype_name = r.get(lm, "dtype", where, "str?")
        if not initialized and (dtype_name is not None or seen):
            raise PrefixFileError(f"{path}: {where}: an uninitialized layer with dtype {dtype_name} and {seen} tokens")
        dtype = None if not initialized else layer_dtype(path, dtype_name, f"{where}.dtype")
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
