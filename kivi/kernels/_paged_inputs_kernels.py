"""Triton kernel of the batched paged decode kernel's inputs for a step's decode rows (imported lazily: imports
triton).

:func:`decode_inputs_kernel` (grid ``(N,)``, one program per decode row) is the GPU form of
:func:`kivi.paged.inputs_kernel.kernel_inputs` (numba): the rows pool ids of the row's ring slots on both sides,
its block-table row, and its query and new key / value rows gathered from the step's input (in their dtype: the
decode kernel converts them as it reads).
"""

from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def _slot_ids(slots_ptr, out_ptr, j, i, C, rt_ptr, rt_s0, base_ptr, step_ptr, PW, BLOCK_C: tl.constexpr):
    """``out[j, c] = (base[r] + ring_table[i, r] * step[r]) * PW + s % PW`` for ``s = slots[j, c]``, ``r = s // PW``
    (:meth:`kivi.paged.geometry.RingPool.slot_ids`: :func:`kivi.paged.ring.slot_rows`, the one
    rule restated), as int32."""
    c = tl.arange(0, BLOCK_C)
    cm = c < C
    s = tl.load(slots_ptr + j * C + c, mask=cm, other=0)
    r = s // PW
    blk = tl.load(base_ptr + r, mask=cm, other=0) + tl.load(rt_ptr + i * rt_s0 + r, mask=cm, other=0).to(tl.int64) \
        * tl.load(step_ptr + r, mask=cm, other=0)
    tl.store(out_ptr + j * C + c, (blk * PW + s % PW).to(tl.int32), mask=cm)


@triton.jit
def _row(src_ptr, s0, s1, t, out_ptr, j, HEADS, D: tl.constexpr, BLOCK_E: tl.constexpr):
    """``out[j] = src[t]`` for ``src [n, HEADS, D]`` (channels contiguous) into a contiguous ``out [N, HEADS, D]``."""
    e = tl.arange(0, BLOCK_E)
    em = e < HEADS * D
    x = tl.load(src_ptr + t * s0 + (e // D) * s1 + e % D, mask=em)
    tl.store(out_ptr + j * HEADS * D + e, x, mask=em)


@triton.jit
def decode_inputs_kernel(index_ptr, tokens_ptr, rt_ptr, rt_s0, base_ptr, step_ptr, ks_ptr, vs_ptr, C, PW,
                         pt_ptr, pt_s0, WP, q_ptr, q_s0, q_s1, k_ptr, k_s0, k_s1, v_ptr, v_s0, v_s1, HQ, H,
                         out_kids, out_vids, out_pages, out_q, out_k, out_v,
                         D: tl.constexpr, BLOCK_C: tl.constexpr, BLOCK_W: tl.constexpr, BLOCK_Q: tl.constexpr,
                         BLOCK_KV: tl.constexpr):
    """Decode row ``j`` (batch row ``index[j]``, query ``tokens[j]`` of the step's input): its slot ids ``[C]`` per
    side, its block-table row ``[WP]`` (int32) and its query / key / value rows."""
    j = tl.program_id(0).to(tl.int64)
    i = tl.load(index_ptr + j).to(tl.int64)
    t = tl.load(tokens_ptr + j).to(tl.int64)
    _slot_ids(ks_ptr, out_kids, j, i, C, rt_ptr, rt_s0, base_ptr, step_ptr, PW, BLOCK_C)
    _slot_ids(vs_ptr, out_vids, j, i, C, rt_ptr, rt_s0, base_ptr, step_ptr, PW, BLOCK_C)
    w = tl.arange(0, BLOCK_W)
    wm = w < WP
    tl.store(out_pages + j * WP + w, tl.load(pt_ptr + i * pt_s0 + w, mask=wm, other=0).to(tl.int32), mask=wm)
    _row(q_ptr, q_s0, q_s1, t, out_q, j, HQ, D, BLOCK_Q)
    _row(k_ptr, k_s0, k_s1, t, out_k, j, H, D, BLOCK_KV)
    _row(v_ptr, v_s0, v_s1, t, out_v, j, H, D, BLOCK_KV)
