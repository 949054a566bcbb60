"""The paged decode kernel's per-request input checks in one compiled call (numba; imported on first use).

:func:`kivi.attention.fused_cpu.paged.paged_decode_attention` runs once per layer and step; its numpy checks of
the counts, the block table and the slot tables (:func:`kivi.attention.fused_cpu.paged._check_values`, the
reference) are ~25 small array operations, 100-150 us a call on the 2-core development machine, about a tenth
of a 1-2K-token batch's kernel. :func:`values_ok` answers whether they pass in one pass over the same arrays;
only a refused input runs the numpy checks, which raise with their message.
"""

from __future__ import annotations

import numba


@numba.njit(cache=True)
def values_ok(c, table, kslots, vslots, k_rows, v_rows, ring, fp_slots, w0, P, G, nb):
    """Whether ``_check_values`` accepts: counts ``c [N, 6]`` non-negative, as many key as value positions and at
    least one, stored keys whole groups of ``G``, their pages inside ``table [N, max_pages]`` and naming blocks
    ``[0, nb)``; sink / window rows inside the slot tables ``kslots`` / ``vslots [N, w0 + ring]`` (``ring``:
    in-place rows, whose ids lie in ``[0, k_rows)`` / ``[0, v_rows)``) or inside ``fp_slots`` gathered slots."""
    N = c.shape[0]
    if ring and kslots.shape[1] != vslots.shape[1]:
        return False
    slots = kslots.shape[1]
    for i in range(N):
        for j in range(6):
            if c[i, j] < 0:
                return False
        total = c[i, 0] + c[i, 1] + c[i, 2]
        if total != c[i, 3] + c[i, 4] + c[i, 5] or total == 0:
            return False
        pages = (max(c[i, 1], c[i, 4]) + P - 1) // P
        if pages > table.shape[1]:
            return False
        if c[i, 0] > w0 or c[i, 3] > w0:
            return False
        if ring:
            if c[i, 2] < 1 or c[i, 5] < 1 or c[i, 2] - 1 > slots - w0 or c[i, 5] - 1 > slots - w0:
                return False
        elif w0 + c[i, 2] > fp_slots or w0 + c[i, 5] > fp_slots:
            return False
        if c[i, 1] % G:
            return False
        for j in range(pages):
            if table[i, j] < 0 or table[i, j] >= nb:
                return False
    return not ring or (_ids_inside(kslots, k_rows) and _ids_inside(vslots, v_rows))


@numba.njit(cache=True)
def _ids_inside(x, n):
    """Whether every row id of ``x`` lies in ``[0, n)``."""
    for i in range(x.shape[0]):
        for j in range(x.shape[1]):
            if x[i, j] < 0 or x[i, j] >= n:
                return False
    return True


__all__ = ["values_ok"]
