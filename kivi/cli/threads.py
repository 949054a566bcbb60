"""CPU threads for torch and kivi's numba kernels."""

from __future__ import annotations

import sys


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


__all__ = ["set_cpu_threads"]
