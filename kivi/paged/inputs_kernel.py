"""The numba side of :func:`kivi.paged.decode_call.paged_decode`: one layer's inputs of the batched paged decode kernel
in one compiled call (numba; imported on first use).

The torch form (:meth:`kivi.paged.geometry.RingPool.slot_ids` per side, the block-table rows, the query and new
rows gathered and converted: ~20 small tensor operations, ~100 us a layer on the 2-core development machine)
stays the reference (``compiled=False``); both give the same tensors (``tests/paged/test_decode_inputs.py``).
numba's cache of this file holds :func:`kivi.quant.numba_quant_kernel.as_f32` compiled in: touch this file after
an edit of that one.
"""

from __future__ import annotations

import numba
import numpy as np

from ..quant.numba_quant_kernel import as_f32


@numba.njit(cache=True)
def kernel_inputs(ring_table, index, tokens, base, step, kslots, vslots, pw, page_table, query, key, value,
                  out_kids, out_vids, out_pages, out_q, out_k, out_v):
    """For the kernel rows ``index [N]`` (their batch rows) whose query is input row ``tokens [N]``:

    * ``out_kids`` / ``out_vids`` int32 ``[N, C]``: the rows pool id of ring slot ``kslots`` / ``vslots [N, C]``
      (``block * pw + slot % pw``, pool block ``base[r] + ring_table[i, r] * step[r]`` of ring ``r = slot // pw``:
      :func:`kivi.paged.ring.slot_rows`, restated here as compiled code cannot call it);
    * ``out_pages`` int32 ``[N, W]``: ``page_table[index]``;
    * ``out_q`` / ``out_k`` / ``out_v`` float32: ``query`` / ``key`` / ``value [n, heads, D]`` at ``tokens``
      (float32, or int16 holding bfloat16 bits).
    """
    N, C = kslots.shape
    for j in range(N):
        i = index[j]
        for c in range(C):
            s = kslots[j, c]
            out_kids[j, c] = np.int32((base[s // pw] + np.int64(ring_table[i, s // pw]) * step[s // pw]) * pw + s % pw)
            s = vslots[j, c]
            out_vids[j, c] = np.int32((base[s // pw] + np.int64(ring_table[i, s // pw]) * step[s // pw]) * pw + s % pw)
        for c in range(page_table.shape[1]):
            out_pages[j, c] = page_table[i, c]
        t = tokens[j]
        for h in range(query.shape[1]):
            for d in range(query.shape[2]):
                out_q[j, h, d] = as_f32(query[t, h, d])
        for h in range(key.shape[1]):
            for d in range(key.shape[2]):
                out_k[j, h, d] = as_f32(key[t, h, d])
                out_v[j, h, d] = as_f32(value[t, h, d])


__all__ = ["kernel_inputs"]
