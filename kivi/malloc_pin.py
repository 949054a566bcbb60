"""CPU allocator setting that lets freed temporaries go back to the OS.

glibc raises its mmap threshold dynamically after large frees, so the float32 temporaries of
quantization end up on the heap between the cache's small, long-lived blocks; the process then
holds several times the cache's size (measured: RSS grew ~4x faster than ``cache.nbytes`` while
filling a cache in chunks of 1024 tokens). Pinning the threshold at 128 KiB keeps large
temporaries in mmap'ed memory, returned on free (measured: RSS grows like ``cache.nbytes``).

This is a process-wide setting, so ``import kivi`` does not apply it: the ``kivi`` CLI's long runs and the
benchmarks call :func:`reduce_fragmentation`; call it yourself in a long-running CPU process whose caches grow.
Not for a server over a paged pool made when it starts (``kivi serve``, transformers' continuous batching):
nothing long-lived lands between its temporaries, and pinned, each step's temporaries are fresh mappings
faulted in page by page (measured: a float decode step 150 ms against 85 ms, docs/serving.md).
"""

from __future__ import annotations

import ctypes
import ctypes.util
import sys

_M_MMAP_THRESHOLD = -3


def reduce_fragmentation(threshold_bytes: int = 128 * 1024) -> bool:
    """Pin glibc's mmap threshold (Linux/glibc only); returns whether it was applied."""
    if not sys.platform.startswith("linux"):
        return False
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
        return bool(libc.mallopt(_M_MMAP_THRESHOLD, int(threshold_bytes)))
    except (OSError, AttributeError):
        return False
