"""The one reader of text a user points kivi at (prompt files, stdin, evaluation texts, JSON configs and
profiles): never more than a bound of bytes.

A file, ``-`` (standard input), a FIFO or a device is read in chunks; past ``max_bytes`` the read stops and
:class:`TextReadError` names the option and the bound (a regular file larger than the bound is refused
from its size, before a byte is read). The bound is a fixed, generous default
(:data:`DEFAULT_MAX_TEXT_BYTES`, 64 MiB) that commands may let the user raise (``--max-text-bytes``):
English text takes about 4 bytes a token, so 64 MiB is more than even a 10-million-token context can hold
(~40 MiB), and far below what exhausts memory (an endless ``/dev/zero`` or pipe stops there). A FIFO
without a writer blocks in ``open`` until one appears, as ``cat`` does.

The text is strict UTF-8 and its line endings are normalised to ``\\n`` (as Python's text mode does).
"""

from __future__ import annotations

import os
import stat
import sys
from pathlib import Path
from typing import BinaryIO

from .kinds import describe_mode

#: Bytes read from one text input unless the caller gives another bound (see the module docstring).
DEFAULT_MAX_TEXT_BYTES = 64 * 2**20

_CHUNK = 2**20


class TextReadError(ValueError):
    """A text input that cannot be used: missing, not text, not UTF-8, or longer than its bound. The message
    is one line naming the option and the path."""


def read_text(source: str | os.PathLike, *, option: str, max_bytes: int = DEFAULT_MAX_TEXT_BYTES,
              raise_bound: str | None = None, stdin: BinaryIO | None = None) -> str:
    """The UTF-8 text of ``source`` (a path, or ``"-"``: ``stdin``, default ``sys.stdin.buffer``), read
    with at most ``max_bytes`` bytes. ``option`` names the input in errors (``"--prompt-file"``);
    ``raise_bound`` names the option that raises the bound (``"--max-text-bytes"``), when there is one.

    Raises :class:`TextReadError` (a ``ValueError``) with one line for every failure; a missing file is
    ``FileNotFoundError`` (both are one line, exit 2, on the command line)."""
    if max_bytes < 0:
        raise ValueError(f"max_bytes={max_bytes} must be >= 0")
    name = os.fsdecode(source)
    if name == "-":
        label = f"{option} - (standard input)"
        stream = stdin if stdin is not None else (sys.stdin.buffer if sys.stdin is not None else None)
        data = bytearray() if stream is None else _read_bounded(stream, max_bytes, label, raise_bound)
        return _decode(data, label)
    path = Path(name).expanduser()
    label = f"{option} {name!r}"
    try:
        kind = os.stat(path).st_mode
    except FileNotFoundError:
        raise FileNotFoundError(f"{label} does not exist") from None
    except OSError as e:
        raise TextReadError(f"cannot read {label}: {e.strerror or e}") from None
    if stat.S_ISDIR(kind) or stat.S_ISSOCK(kind):
        raise TextReadError(f"cannot read {label}: it is {describe_mode(kind)}, not a text file")
    if stat.S_ISREG(kind) and os.stat(path).st_size > max_bytes:
        raise TextReadError(_too_long(label, max_bytes, raise_bound))
    try:
        with open(path, "rb") as f:
            data = _read_bounded(f, max_bytes, label, raise_bound)
    except OSError as e:
        raise TextReadError(f"cannot read {label}: {e.strerror or e}") from None
    return _decode(data, label)


def _read_bounded(stream: BinaryIO, max_bytes: int, label: str, raise_bound: str | None) -> bytearray:
    buf = bytearray()
    while True:
        chunk = stream.read(min(_CHUNK, max_bytes + 1 - len(buf)))
        if not chunk:
            return buf  # decoded as it is: no second copy of up to max_bytes
        buf += chunk
        if len(buf) > max_bytes:
            raise TextReadError(_too_long(label, max_bytes, raise_bound))


def _too_long(label: str, max_bytes: int, raise_bound: str | None) -> str:
    how = f"raise the bound with {raise_bound}" if raise_bound else "give a shorter text"
    return (f"{label} holds more than {max_bytes:,} bytes ({max_bytes / 2**20:g} MiB), the most kivi reads from "
            f"one text input; {how}")


def _decode(data: bytes | bytearray, label: str) -> str:
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError as e:
        raise TextReadError(f"{label} is not UTF-8 text (byte 0x{data[e.start]:02x} at offset {e.start})") from None
    return text.replace("\r\n", "\n").replace("\r", "\n")


__all__ = ["DEFAULT_MAX_TEXT_BYTES", "TextReadError", "read_text"]
