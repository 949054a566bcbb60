"""The one writer of files at paths a user names: prefix files, result JSON, configs, CSV rows, plots.

The rule (docs/cli.md "Files kivi writes and reads"):

* a PATH that does not exist is created; its folder must exist (kivi creates no folders:
  :class:`MissingFolderError`);
* a regular file at PATH is replaced atomically: the bytes go to a temporary file in the same folder
  (``.NAME.<random>.tmp``), are flushed to disk (``fsync``) and renamed over PATH (``os.replace``); the
  replaced file's permission bits are kept (a new file gets ``0666 & ~umask``, as ``open`` gives);
* anything else at PATH is refused, never replaced (:class:`NotRegularFileError`, naming what it is): a
  directory, a FIFO, a character or block device (``/dev/null`` stays a device), a socket;
* a symlink is followed when it leads to a regular file: that file is replaced atomically and the link
  stays a link to it. A symlink to anything else, a dangling symlink and a symlink loop are refused;
* the temporary file never outlives the call: a failed write, an exception or a Ctrl-C removes it.

PATH is checked once before the bytes are produced and once more just before the rename (a file type that
changed meanwhile is refused); between that check and the rename the folder's owner could still swap the
entry, which no rename on Linux can exclude without ``renameat2``.
"""

from __future__ import annotations

import os
import secrets
import stat
from pathlib import Path
from typing import Callable

from .kinds import describe_mode


class NotRegularFileError(OSError):
    """PATH exists and is not a regular file (nor a symlink to one): kivi does not replace it.

    An ``OSError`` with the whole one-line message as its text (``strerror`` is ``None``)."""


class MissingFolderError(FileNotFoundError):
    """The folder PATH would be written in does not exist (or is not a folder); kivi creates no folders."""


def check_write_target(path: str | os.PathLike) -> Path:
    """The regular file a write to ``path`` creates or replaces (a symlink to a regular file: its target);
    raises :class:`NotRegularFileError`, :class:`MissingFolderError` or ``ValueError`` (an empty path)
    when kivi would not write there (the module docstring's rule). Writes nothing."""
    text = os.fsdecode(path)
    if not text.strip():
        raise ValueError("the path is empty; give a file name")
    p = Path(text).expanduser()
    try:
        st = os.lstat(p)
    except (FileNotFoundError, NotADirectoryError):
        st = None
    if st is not None and stat.S_ISLNK(st.st_mode):
        try:
            target = Path(os.path.realpath(p, strict=True))
        except FileNotFoundError:
            raise NotRegularFileError(f"{text!r} is a symlink to a missing file ({os.readlink(p)!r}); kivi follows "
                                      "symlinks only to existing regular files") from None
        except OSError as e:  # ELOOP
            raise NotRegularFileError(f"{text!r} is a symlink that cannot be followed ({e.strerror or e})") from None
        kind = os.stat(target).st_mode
        if not stat.S_ISREG(kind):
            raise NotRegularFileError(f"{text!r} is a symlink to {describe_mode(kind)} ({str(target)!r}), not to a "
                                      "regular file; kivi does not replace it")
        return target
    if st is not None:
        if not stat.S_ISREG(st.st_mode):
            raise NotRegularFileError(f"{text!r} is {describe_mode(st.st_mode)}, not a regular file; kivi does not "
                                      "replace it")
        return p
    folder = p.parent
    if not folder.is_dir():
        what = "does not exist" if not os.path.lexists(folder) else "is not a folder"
        raise MissingFolderError(f"{text!r}: the folder {str(folder)!r} {what} (kivi creates no folders)")
    return p


def write_file(path: str | os.PathLike, fill: Callable[[str], object]) -> Path:
    """Write the file at ``path`` by the rule of this module: ``fill(temp_path)`` writes the bytes to a
    temporary file (by name, e.g. safetensors' ``save_file`` or matplotlib's ``savefig``), which then
    replaces or creates the target atomically. Returns the file written (a symlink's target).

    Raises what :func:`check_write_target` raises, and whatever ``fill`` or the system raise (a full disk:
    ``OSError``); in every case, a Ctrl-C included, the temporary file is removed and ``path`` is unchanged."""
    target = check_write_target(path)
    folder = target.parent
    try:
        old = os.stat(target)
    except FileNotFoundError:
        old = None
    tmp: Path | None = None
    try:
        for _ in range(100):
            tmp = folder / f".{target.name}.{secrets.token_hex(8)}.tmp"  # named first: the finally removes it
            try:
                os.close(os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, 0o600))
                break
            except FileExistsError:  # not ours: never removed
                tmp = None
        else:  # pragma: no cover - 100 collisions of 64 random bits
            raise FileExistsError(f"cannot create a temporary file in {str(folder)!r}")
        fill(str(tmp))
        _fsync(tmp)
        _copy_owner_and_mode(tmp, old)
        if check_write_target(path) != target:  # the path changed meanwhile (a new symlink): do not guess
            raise NotRegularFileError(f"{os.fsdecode(path)!r} changed while it was being written; nothing was replaced")
        os.replace(tmp, target)
        tmp = None
    finally:
        if tmp is not None:
            tmp.unlink(missing_ok=True)
    _fsync_folder(folder)
    return target


def write_bytes(path: str | os.PathLike, data: bytes) -> Path:
    """``data`` written to ``path`` by :func:`write_file`'s rule."""

    def fill(tmp: str) -> None:
        with open(tmp, "wb") as f:
            f.write(data)

    return write_file(path, fill)


def write_text(path: str | os.PathLike, text: str, *, encoding: str = "utf-8") -> Path:
    """``text`` (UTF-8) written to ``path`` by :func:`write_file`'s rule."""
    return write_bytes(path, text.encode(encoding))


def _fsync(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _fsync_folder(folder: Path) -> None:
    """Make the rename durable; best effort (some file systems refuse to fsync a folder)."""
    try:
        fd = os.open(folder, os.O_RDONLY | os.O_CLOEXEC)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


def _copy_owner_and_mode(tmp: Path, old: os.stat_result | None) -> None:
    """The temporary file (``0600``) gets the replaced file's mode and, where allowed, its owner; a new file
    gets ``0666 & ~umask``."""
    if old is None:
        umask = os.umask(0)
        os.umask(umask)
        os.chmod(tmp, 0o666 & ~umask)
        return
    if (old.st_uid, old.st_gid) != (os.geteuid(), os.getegid()):
        try:
            os.chown(tmp, old.st_uid, old.st_gid)
        except OSError:
            pass
    os.chmod(tmp, stat.S_IMODE(old.st_mode))


__all__ = ["MissingFolderError", "NotRegularFileError", "check_write_target", "write_bytes", "write_file",
           "write_text"]
