"""The manifest of a converted copy: every file's size and SHA-256, recorded when the copy is written and
checked before the copy is loaded.

:func:`record_files` lists what a finished conversion wrote; :func:`files_problem` says why a folder no
longer holds exactly that. The check on every load is cheap: every file's size, and the SHA-256 of every
file up to :data:`CHEAP_HASH_BYTES` (config, generation config, tokenizer). A larger file (the weights) has
its content hashed only by ``full=True`` (``kivi cache verify``): SmolLM2's 538 MB ``model.safetensors``
hashes in 0.5-0.85 s against 0.63 s for the whole load of the copy (shared 2-core VM, page cache warm;
``kivi.models.copy_manifest.file_sha256(path)``), so hashing it on every load would double the load.
"""

from __future__ import annotations

import hashlib
import os
from pathlib import Path
from typing import Any

#: Files up to this many bytes are hashed on every load (SmolLM2's 3.5 MB tokenizer.json takes a few ms).
CHEAP_HASH_BYTES = 16 * 2**20


def file_sha256(path: str | os.PathLike, chunk: int = 1 << 20) -> str:
    """SHA-256 (hex) of a file's content, read in ``chunk``-byte blocks."""
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        while block := f.read(chunk):
            digest.update(block)
    return digest.hexdigest()


def _walk(folder: Path, skip: tuple[str, ...]) -> dict[str, Path]:
    """Every entry under ``folder`` but folders, by its ``/``-separated relative name (names starting with one of
    ``skip`` left out)."""
    found = {}
    for dirpath, dirnames, files in os.walk(folder):
        for name in files + [d for d in dirnames if os.path.islink(os.path.join(dirpath, d))]:
            rel = Path(dirpath, name).relative_to(folder).as_posix()
            if not rel.startswith(skip):
                found[rel] = Path(dirpath, name)
    return found


def record_files(folder: Path, skip: tuple[str, ...] = ()) -> dict[str, dict[str, Any]]:
    """``{relative name: {"size", "sha256"}}`` of every file under ``folder`` (names starting with ``skip``
    left out)."""
    return {rel: {"size": path.stat().st_size, "sha256": file_sha256(path)}
            for rel, path in sorted(_walk(folder, skip).items())}


def files_problem(folder: Path, files: Any, *, full: bool = False, skip: tuple[str, ...] = ()) -> str | None:
    """Why ``folder`` does not hold exactly the ``files`` recorded by :func:`record_files`, or ``None``.

    Always: each recorded file is a regular file of its recorded size, no other file is there, and files up to
    :data:`CHEAP_HASH_BYTES` have their recorded SHA-256. ``full``: every file's SHA-256 is checked.
    """
    if not isinstance(files, dict) or not files:
        return "it has no manifest of its files (written by an older kivi, or edited)"
    present = _walk(folder, skip)
    extra = sorted(set(present) - set(files))
    if extra:
        return f"{extra[0]} is not one of the files the conversion wrote"
    for rel, want in sorted(files.items()):
        if not isinstance(want, dict) or not isinstance(want.get("size"), int) or not isinstance(want.get("sha256"),
                                                                                                 str):
            return f"its manifest entry for {rel!r} is damaged"
        path = present.get(rel)
        if path is None:
            return f"{rel} is missing"
        if path.is_symlink() or not path.is_file():
            return f"{rel} is not a regular file"
        size = path.stat().st_size
        if size != want["size"]:
            return f"{rel} has {size:,} bytes, {want['size']:,} were written (truncated or replaced)"
        if (full or size <= CHEAP_HASH_BYTES) and file_sha256(path) != want["sha256"]:
            return f"{rel}'s content differs from what was written (SHA-256 mismatch)"
    return None


__all__ = ["CHEAP_HASH_BYTES", "file_sha256", "files_problem", "record_files"]
