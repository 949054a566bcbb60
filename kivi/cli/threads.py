"""CPU threads for torch and kivi's numba kernels."""

from __future__ import annotations

import os
import sys


def machine_cores() -> int:
    """The CPU cores this process may run on (its affinity mask where the OS has one, else ``os.cpu_count()``):
    the thread count a command uses unless ``--threads`` says otherwise."""
    try:
        return max(1, len(os.sched_getaffinity(0)))
    except (AttributeError, OSError):
        return os.cpu_count() or 1


def set_cpu_threads(n: int) -> None:
    """``n`` CPU threads for torch and, when numba is loaded, for kivi's numba kernels.

    Call it after the kernels are compiled / loaded (``kivi.attention.fused_cpu.warmup()``): loading
    numba's OpenMP threading layer can reset torch's thread count to numba's (measured: after
    ``torch.set_num_threads(1)`` and the kernel load, ``torch.get_num_threads()`` was 2), and
    oversubscribed CPU threads make decoding several times slower.
    """
    import torch

    if "numba" in sys.modules:
        import numba

        numba.set_num_threads(max(1, min(n, numba.config.NUMBA_NUM_THREADS)))
    torch.set_num_threads(n)


def load_kernels_then_set_threads(n: int | None, *, kernels: bool) -> float | None:
    """Load kivi's CPU decode kernels (when ``kernels`` and numba is there), then give torch and numba ``n``
    threads (``None``: keep their defaults), in the order :func:`set_cpu_threads` needs; numba not loaded yet gets
    ``NUMBA_NUM_THREADS=n`` first, so threads started later (the server's generation thread) run its kernels
    with ``n`` threads too. Returns the seconds
    the load took, ``None`` when nothing was loaded. A server calls it before it starts its generation thread,
    so the load (or compilation) is not paid by the first request either."""
    seconds = None
    if n is not None and "numba" not in sys.modules:
        # numba's thread count is per thread (set_num_threads is the calling thread's) and a new thread starts
        # at NUMBA_NUM_THREADS: set before numba loads, it is what the generation thread's kernels get too
        os.environ["NUMBA_NUM_THREADS"] = str(n)
    if kernels:
        from ..attention.fused_cpu import fused_decode_available, warmup

        if fused_decode_available():
            seconds = warmup()
    if n is not None:
        set_cpu_threads(n)
    return seconds


__all__ = ["load_kernels_then_set_threads", "machine_cores", "set_cpu_threads"]
