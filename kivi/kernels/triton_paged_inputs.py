"""A step's decode rows' inputs of the batched paged decode kernel in one Triton launch: the GPU form of
:func:`kivi.paged.inputs_kernel.kernel_inputs` (numba, the CPU form).

:func:`triton_paged_inputs` makes, on the device and in one launch (:mod:`._paged_inputs_kernels`), what the vLLM
plugin's torch form (:func:`kivi.paged.decode_call.paged_decode` with ``compiled=False``: ring slot ids per side, the
block-table rows, the query and new rows gathered; about twenty small operations a layer) makes: the same
tensors, value for value (``tests/kernels/test_triton_paged_inputs.py``).
"""

from __future__ import annotations

import torch

from ._common import next_pow2, require_triton


def _rows(x: torch.Tensor) -> torch.Tensor:
    return x if x.stride(-1) == 1 else x.contiguous()


def triton_paged_inputs(ring_table: torch.Tensor, index: torch.Tensor, tokens: torch.Tensor, base: torch.Tensor,
                        step: torch.Tensor, kslots: torch.Tensor, vslots: torch.Tensor, pw: int,
                        page_table: torch.Tensor, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor
                        ) -> tuple[torch.Tensor, ...]:
    """For the decode rows ``index [N]`` (their batch rows, long) whose query is input row ``tokens [N]``:

    * ``kids`` / ``vids`` int32 ``[N, C]``: the rows pool ids of ring slots ``kslots`` / ``vslots`` (long
      ``[N, C]``) through ``ring_table [B, k]`` and the pool's ``base`` / ``step`` (long ``[k]``), ``pw`` rows a
      block (:meth:`kivi.paged.geometry.RingPool.slot_ids`);
    * ``pages`` int32 ``[N, W]``: ``page_table[index]`` (``page_table [B, W]``);
    * ``q`` / ``k`` / ``v``: ``query [n, Hq, D]`` / ``key`` / ``value [n, H, D]`` at ``tokens``, contiguous, in
      their dtype.

    Everything on one device (CUDA, or CPU under ``TRITON_INTERPRET=1``); ``ValueError`` naming a misfit."""
    device = query.device
    N, C = kslots.shape
    if tuple(vslots.shape) != (N, C) or tuple(index.shape) != (N,) or tuple(tokens.shape) != (N,):
        raise ValueError(f"index {tuple(index.shape)}, tokens {tuple(tokens.shape)}, kslots {tuple(kslots.shape)} "
                         f"and vslots {tuple(vslots.shape)} must describe the same {N} decode rows")
    for name, t in (("ring_table", ring_table), ("index", index), ("tokens", tokens), ("base", base),
                    ("step", step), ("kslots", kslots), ("vslots", vslots), ("page_table", page_table),
                    ("key", key), ("value", value)):
        if t.device != device:
            raise ValueError(f"{name} is on {t.device}, query on {device}: every input must be on one device")
    if key.shape != value.shape or query.shape[2] != key.shape[2] or query.shape[0] != key.shape[0]:
        raise ValueError(f"query {tuple(query.shape)}, key {tuple(key.shape)} and value {tuple(value.shape)} must "
                         "be [n, heads, D] rows of one step")
    require_triton(device)
    from . import _paged_inputs_kernels as K

    _, hq, D = query.shape
    H = key.shape[1]
    WP = page_table.shape[1]
    kids = torch.empty(N, C, dtype=torch.int32, device=device)
    vids = torch.empty_like(kids)
    pages = torch.empty(N, WP, dtype=torch.int32, device=device)
    q = torch.empty(N, hq, D, dtype=query.dtype, device=device)
    k = torch.empty(N, H, D, dtype=key.dtype, device=device)
    v = torch.empty(N, H, D, dtype=value.dtype, device=device)
    if N == 0:
        return kids, vids, pages, q, k, v
    query, key, value = _rows(query), _rows(key), _rows(value)
    rt = ring_table if ring_table.stride(-1) == 1 else ring_table.contiguous()
    pt = page_table if page_table.stride(-1) == 1 else page_table.contiguous()
    K.decode_inputs_kernel[(N,)](
        index.contiguous(), tokens.contiguous(), rt, rt.stride(0), base.contiguous(), step.contiguous(),
        kslots.contiguous(), vslots.contiguous(), C, pw, pt, pt.stride(0), WP,
        query, query.stride(0), query.stride(1), key, key.stride(0), key.stride(1), value, value.stride(0),
        value.stride(1), hq, H, kids, vids, pages, q, k, v,
        D=D, BLOCK_C=next_pow2(max(C, 1)), BLOCK_W=next_pow2(max(WP, 1)), BLOCK_Q=next_pow2(hq * D),
        BLOCK_KV=next_pow2(H * D))
    return kids, vids, pages, q, k, v


__all__ = ["triton_paged_inputs"]
