"""The converted-copy cache of GGUF models: where a copy lives, its content key, writing, listing, clearing.

GGUF files are dequantized by transformers on every load, which is slow (~16-30 s for SmolLM2).
:func:`kivi.models.load_model` therefore keeps a converted copy (safetensors, config and tokenizer
written with ``save_pretrained``) on the first load and reads it on later loads, in well under a second.
A copy lives at :func:`converted_cache_path`, keyed by the SHA-256 of the GGUF file's content
(:func:`gguf_sha256`, remembered per path, size and mtime in ``models/hash-index.json``). A copy is
written in a temporary folder and renamed into place, its marker file last: a failed or interrupted
write (a full disk) leaves the cache as it was. The marker records the manifest of the copy's files
(:mod:`kivi.models.copy_manifest`), checked before every load (:func:`copy_problem`): a damaged copy is a
miss, converted again over it, never loaded; and every GGUF file the copy was loaded for (``sources``):
it is stale only when none of them has its content any more.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import shutil
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ..files import write_text
from .aliases import KNOWN_ALIASES, alias_gguf_path
from .copy_manifest import file_sha256, files_problem, record_files

logger = logging.getLogger(__name__)

#: Written last inside a converted copy: a folder without it is never trusted.
CONVERTED_MARKER = "kivi-converted.json"


def kivi_cache_dir() -> Path:
    """The root of kivi's user cache: ``$KIVI_CACHE_DIR``, else ``$XDG_CACHE_HOME/kivi``, else ``~/.cache/kivi``."""
    if os.environ.get("KIVI_CACHE_DIR"):
        return Path(os.environ["KIVI_CACHE_DIR"]).expanduser()
    xdg = os.environ.get("XDG_CACHE_HOME")
    base = Path(xdg).expanduser() if xdg else Path.home() / ".cache"
    return base / "kivi"


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


_file_sha256 = file_sha256  # the one name gguf_sha256 calls (a test counts the hashing)


def _read_index(models_dir: Path) -> dict[str, Any]:
    try:
        data = json.loads((models_dir / _HASH_INDEX).read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return {}  # missing or damaged: rebuilt as files are hashed
    return data if isinstance(data, dict) else {}


def _write_json_atomic(path: Path, data: Any) -> None:
    """Write ``data`` as JSON at ``path`` through kivi's one writer (atomic; a FIFO, device or folder there is
    refused, not replaced); the cache creates its own folders."""
    path.parent.mkdir(parents=True, exist_ok=True)
    write_text(path, json.dumps(data, indent=2) + "\n")


def gguf_sha256(path: str | os.PathLike, cache_dir: str | os.PathLike | None = None) -> str:
    """SHA-256 (hex) of a file's content, remembered per ``(path, size, mtime)`` in the cache's
    ``models/hash-index.json``: a file is hashed once, not on every load (SmolLM2's 98 MB took 1.6 s on the
    shared 2-core VM, load ~10: ``kivi.models.conversion_cache._file_sha256(alias_gguf_path("smollm2"))``)."""
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


# --------------------------------------------------------------------------- a copy: marker, check, reuse, write


def is_converted(folder: Path) -> bool:
    """Whether ``folder`` is a finished conversion (its marker, written last, and a ``config.json``); whether its
    files are still those written is :func:`copy_problem`'s question."""
    return (folder / CONVERTED_MARKER).is_file() and (folder / "config.json").is_file()


def mark_used(folder: Path) -> None:
    """Record a load of a converted copy: the marker file's modification time is its last use."""
    with contextlib.suppress(OSError):
        os.utime(folder / CONVERTED_MARKER)


def read_marker(folder: Path) -> dict[str, Any]:
    """What a converted copy records about its sources and files (``{}`` when the marker is missing or damaged)."""
    try:
        info = json.loads((folder / CONVERTED_MARKER).read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return {}
    return info if isinstance(info, dict) else {}


#: Names in a copy's folder that its manifest does not list: the marker and its atomic rewrites' temp files.
_NOT_IN_MANIFEST = (CONVERTED_MARKER, f".{CONVERTED_MARKER}.")


def copy_problem(folder: Path, *, full: bool = False) -> str | None:
    """Why ``folder`` must not be loaded as a converted copy, or ``None``: no marker, or files other than those its
    manifest records (sizes and the small files' SHA-256 always; every file's SHA-256 with ``full``,
    :func:`kivi.models.copy_manifest.files_problem`)."""
    if not is_converted(folder):
        return "unfinished conversion (no marker)"
    return files_problem(folder, read_marker(folder).get("files"), full=full, skip=_NOT_IN_MANIFEST)


def sources_of(info: dict[str, Any]) -> list[str]:
    """Every GGUF file a copy was loaded for (``sources``; a copy from an older kivi records one ``source``)."""
    sources = info.get("sources")
    if isinstance(sources, list):
        return [s for s in sources if isinstance(s, str)]
    source = info.get("source")
    return [source] if isinstance(source, str) else []


def reuse_converted(gguf: Path, target: Path) -> bool:
    """Whether ``target`` (``converted_cache_path(gguf, ...)``) holds a copy to load: finished and its files as
    written (:func:`copy_problem`, cheap). A damaged copy is a miss, with one warning: the caller converts
    again and :func:`write_converted` replaces it. A copy that will be loaded is marked used, and ``gguf`` is
    added to its ``sources`` (staleness follows every file that uses it)."""
    if not target.is_dir():
        return False
    problem = copy_problem(target)
    if problem is not None:
        if is_converted(target):  # an unfinished folder is a conversion's leftover, not news
            logger.warning("the converted copy %s is damaged (%s): converting again over it", target, problem)
        return False
    info = read_marker(target)
    if str(gguf) in sources_of(info):
        mark_used(target)
    else:  # another file with this content: record it (a rewrite of the marker is a use too)
        info["sources"] = [*sources_of(info), str(gguf)]
        info["source"] = str(gguf)  # the latest, for older kivi versions that read one source
        try:
            _write_json_atomic(target / CONVERTED_MARKER, info)
        except OSError as error:  # a read-only cache: this source is not recorded
            logger.debug("could not record %s as a source of %s: %s", gguf, target, error)
    return True


def write_converted(model: Any, tokenizer: Any, target: Path, source: Path, sha256: str | None = None) -> None:
    """Write ``model`` and ``tokenizer`` to ``target`` atomically: a temporary folder, its marker (the sources, and
    the manifest of every file: size and SHA-256) written last, then renamed over ``target`` (a damaged copy there
    is replaced). On any error the temporary folder is removed: no partial copy is left."""
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{target.name}.tmp-", dir=target.parent))
    try:
        model.save_pretrained(tmp)
        tokenizer.save_pretrained(tmp)
        stat = source.stat()
        info = {"source": str(source), "sources": [str(source)], "size": stat.st_size, "mtime_ns": stat.st_mtime_ns,
                "sha256": sha256, "files": record_files(tmp, skip=_NOT_IN_MANIFEST)}
        _write_json_atomic(tmp / CONVERTED_MARKER, info)  # last: a folder without it is never trusted
        _rename_over(tmp, target)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def _rename_over(tmp: Path, target: Path) -> None:
    """Rename the folder ``tmp`` to ``target``; a folder already there (damaged, or another process's copy of the
    same content) is moved aside first and removed after."""
    try:
        os.rename(tmp, target)
        return
    except OSError:
        if not target.exists():
            raise
    aside = Path(tempfile.mkdtemp(prefix=f".{target.name}.old-", dir=target.parent))
    try:
        os.rename(target, aside / target.name)
        os.rename(tmp, target)
    finally:
        shutil.rmtree(aside, ignore_errors=True)


# --------------------------------------------------------------------------- the converted-copy cache: list, clear


#: A temporary conversion folder older than this is left over from a crash (not a running conversion).
STALE_TEMP_SECONDS = 3600


@dataclass(frozen=True)
class ConvertedCopy:
    """One folder under ``<cache root>/models``: a converted copy, or an unfinished conversion."""

    key: str  # the folder's name (what ``kivi cache clear KEY`` takes)
    path: Path
    nbytes: int  # bytes of its files
    source: str | None  # the GGUF file it was last loaded for
    sha256: str | None  # content hash of that GGUF (None: made before copies were keyed by content)
    last_used: float  # POSIX time of its last load (creation for unfinished folders)
    stale: str | None  # why no load would use it any more, or None
    sources: tuple[str, ...] = ()  # every GGUF file it was loaded for (in use while one of them has its content)
    damaged: str | None = None  # why its files are not those written (copy_problem, cheap check), or None

    def to_dict(self) -> dict[str, Any]:
        return {"key": self.key, "path": str(self.path), "bytes": self.nbytes, "source": self.source,
                "sources": list(self.sources), "sha256": self.sha256, "last_used": self.last_used,
                "stale": self.stale, "damaged": self.damaged}


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
    if not is_converted(folder):
        age = time.time() - folder.stat().st_mtime
        if folder.name.startswith(".") and age < STALE_TEMP_SECONDS:
            return None  # maybe a conversion running right now
        return "unfinished conversion (no marker)"
    sources = sources_of(info)
    if not sources:
        return "its marker names no source"
    why = []
    for source in sources:  # in use while any source still has the content it was converted from
        path = Path(source)
        if not path.is_file():
            why.append(f"{source!r} is gone")
            continue
        if info.get("sha256") is None:  # made before copies were keyed by content: size and mtime
            stat = path.stat()
            if (info.get("size"), info.get("mtime_ns")) == (stat.st_size, stat.st_mtime_ns):
                return None
            why.append(f"{source!r} changed since (made before copies were keyed by content)")
        elif gguf_sha256(source, cache_dir) == info["sha256"]:
            return None
        else:
            why.append(f"{source!r}'s content changed since")
    return ("its source " if len(why) == 1 else "every source is gone or changed: ") + "; ".join(why)


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
        marker = folder / CONVERTED_MARKER
        try:
            last = (marker if marker.is_file() else folder).stat().st_mtime
        except OSError:
            continue  # removed meanwhile
        source, sha = info.get("source"), info.get("sha256")
        stale = _staleness(folder, info, cache_dir)
        out.append(ConvertedCopy(
            key=folder.name, path=folder, nbytes=_folder_bytes(folder),
            source=source if isinstance(source, str) else None, sha256=sha if isinstance(sha, str) else None,
            last_used=last, stale=stale, sources=tuple(sources_of(info)),
            damaged=copy_problem(folder) if is_converted(folder) else None))
    return sorted(out, key=lambda c: -c.last_used)


def verify_converted(keys: list[str] | None = None,
                     cache_dir: str | os.PathLike | None = None) -> list[tuple[ConvertedCopy, str | None]]:
    """``(copy, problem or None)`` for the finished copies named in ``keys`` (all when ``None``; an unknown key
    raises ``ValueError``), every file's SHA-256 checked against the manifest (``copy_problem(full=True)``)."""
    copies = [c for c in list_converted(cache_dir) if is_converted(c.path)]
    by_key = {c.key: c for c in copies}
    unknown = [k for k in keys or [] if k not in by_key]
    if unknown:
        raise ValueError(f"no converted copy {unknown[0]!r} in {_models_dir(cache_dir)} "
                         f"(known: {', '.join(sorted(by_key)) or 'none'})")
    chosen = [by_key[k] for k in keys] if keys else copies
    return [(c, copy_problem(c.path, full=True)) for c in chosen]


def remove_converted(keys: list[str] | None = None, *, all: bool = False, stale: bool = False,
                     cache_dir: str | os.PathLike | None = None) -> list[ConvertedCopy]:
    """Delete converted copies: those named in ``keys`` (folder names; an unknown key raises
    ``ValueError`` before anything is deleted), every one (``all``), or the stale and the damaged ones
    (``stale``: :attr:`ConvertedCopy.stale` or :attr:`ConvertedCopy.damaged`). Returns what was deleted."""
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
            chosen += [c for c in copies if (c.stale or c.damaged) and c not in chosen]
    for c in chosen:
        shutil.rmtree(c.path)
    return chosen


__all__ = ["CONVERTED_MARKER", "ConvertedCopy", "KEY_DIGITS", "STALE_TEMP_SECONDS", "converted_cache_path",
           "copy_problem", "disk_bytes", "gguf_content_key", "gguf_sha256", "is_converted", "kivi_cache_dir",
           "list_converted", "mark_used", "read_marker", "remove_converted", "reuse_converted", "sources_of",
           "verify_converted", "write_converted"]
