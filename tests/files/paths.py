"""Paths of every file type, made inside the test's own temporary folder (never a system file)."""

from __future__ import annotations

import os
import socket
import stat
import threading
from pathlib import Path

import pytest

#: A character device node equal to /dev/null's (1, 3) and a block device of an unassigned major (240, local/
#: experimental use): both are made in tmp_path; the writer must leave them as they are.
CHAR_DEV = os.makedev(1, 3)
BLOCK_DEV = os.makedev(240, 0)


def make(kind: str, path: Path) -> Path:
    """Create ``path`` as ``kind``; skips the test where the system does not allow it (mknod as non-root)."""
    if kind == "regular":
        path.write_bytes(b"old contents\n")
    elif kind == "directory":
        path.mkdir()
    elif kind == "fifo":
        os.mkfifo(path)
    elif kind in ("char", "block"):
        mode, dev = (stat.S_IFCHR, CHAR_DEV) if kind == "char" else (stat.S_IFBLK, BLOCK_DEV)
        try:
            os.mknod(path, 0o600 | mode, dev)
        except (PermissionError, OSError) as e:
            pytest.skip(f"mknod not permitted here: {e}")
    elif kind == "socket":
        s, cwd = socket.socket(socket.AF_UNIX), os.getcwd()
        try:
            os.chdir(path.parent)  # a relative name: a long tmp_path would not fit in sun_path (108 bytes)
            s.bind(path.name)
        finally:
            os.chdir(cwd)
            s.close()
    else:
        raise ValueError(kind)
    return path


def snapshot(path: Path) -> tuple:
    """What must not change when kivi refuses to write ``path``: its type, device numbers, contents."""
    st = os.lstat(path)
    body = path.read_bytes() if stat.S_ISREG(st.st_mode) else None
    link = os.readlink(path) if stat.S_ISLNK(st.st_mode) else None
    return stat.S_IFMT(st.st_mode), st.st_rdev, st.st_ino, body, link


def leftovers(folder: Path) -> list[str]:
    """Temporary files of the writer left in ``folder``."""
    return sorted(p.name for p in folder.iterdir() if p.name.endswith(".tmp"))


class Endless:
    """A binary stream that never ends (an endless pipe on stdin), counting what was read from it."""

    def __init__(self, byte: bytes = b"a"):
        self.byte, self.given = byte, 0

    def read(self, n: int = -1) -> bytes:
        assert n is not None and n >= 0, "an unbounded read of an endless stream"
        self.given += n
        return self.byte * n


def feed_fifo(path: Path, data: bytes | None) -> threading.Thread:
    """A thread writing ``data`` (``None``: forever) into the FIFO at ``path`` until the reader leaves."""

    def run():
        try:
            with open(path, "wb") as f:
                if data is not None:
                    f.write(data)
                    return
                block = b"z" * 65536
                while True:
                    f.write(block)
        except BrokenPipeError:
            pass

    t = threading.Thread(target=run, daemon=True)
    t.start()
    return t
