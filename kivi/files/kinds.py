"""What a path is, in words (``os.stat`` mode -> ``"a FIFO (named pipe)"``)."""

from __future__ import annotations

import stat

_KINDS = (
    (stat.S_ISREG, "a regular file"),
    (stat.S_ISDIR, "a folder (directory)"),
    (stat.S_ISFIFO, "a FIFO (named pipe)"),
    (stat.S_ISCHR, "a character device"),
    (stat.S_ISBLK, "a block device"),
    (stat.S_ISSOCK, "a socket"),
    (stat.S_ISLNK, "a symlink"),
)


def describe_mode(mode: int) -> str:
    """``st_mode`` of :func:`os.stat` / :func:`os.lstat` as words with an article: ``"a character device"``."""
    for test, words in _KINDS:
        if test(mode):
            return words
    return f"a special file (mode {stat.S_IFMT(mode):#o})"


__all__ = ["describe_mode"]
