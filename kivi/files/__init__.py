"""The files kivi writes and reads at paths a user names (docs/cli.md "Files kivi writes and reads").

* :mod:`kivi.files.write`: the one writer (:func:`write_file`, :func:`write_bytes`, :func:`write_text`):
  it replaces or creates a regular file atomically, and refuses anything else (a FIFO, a device, a folder,
  a socket) with one line naming what is there.
* :mod:`kivi.files.read`: the one bounded reader of text (:func:`read_text`): a file, ``-`` (stdin) or a
  FIFO, stopped at a byte bound with one line naming the option and the bound.
* :mod:`kivi.files.kinds`: what a path is (``"a FIFO (named pipe)"``), for both.

The lowest layer of the package: it imports nothing of kivi's, so every layer may use it.
"""

from __future__ import annotations

from .kinds import describe_mode
from .read import DEFAULT_MAX_TEXT_BYTES, TextReadError, read_text
from .write import MissingFolderError, NotRegularFileError, check_write_target, write_bytes, write_file, write_text

__all__ = ["DEFAULT_MAX_TEXT_BYTES", "MissingFolderError", "NotRegularFileError", "TextReadError",
           "check_write_target", "describe_mode", "read_text", "write_bytes", "write_file", "write_text"]
