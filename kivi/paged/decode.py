"""One call of the batched paged decode kernel, for every host and every kernel: :class:`PagedDecode` and
:func:`run_paged_decode`.

Both paged hosts (:mod:`kivi.batching`, :mod:`kivi.vllm`) read KIVI pages with one kernel call per layer for all
their decoding requests, built by the paged core's step (:func:`kivi.paged.decode_call.decode_call`: the host's block
tables, the step plan's :class:`kivi.paged.plan.KernelRows`): one :class:`PagedDecode`, the same fields whichever
kernel runs:

* the pages: ``pool`` (flat uint8 block pool) and its :class:`~kivi.attention.fused_cpu.paged.PagedLayout`;
* ``block_table`` (``int32 [N, max_pages]``): request ``i``'s store positions ``[jP, (j+1)P)`` in block
  ``block_table[i, j]``;
* the full-precision rows per side, ``k_fp`` / ``v_fp``: a :class:`~kivi.attention.fused_cpu.paged.RingRows`
  (the rows pool, the ring slot table of row ids, the step's new rows; slot ``c`` holds position ``t`` where
  :func:`kivi.paged.ring.ring_slot` ``(t, slots - w0, w0) == c``) or gathered float32 rows (``"cpu"`` and
  ``"reference"`` only), ``w0`` the sink slots;
* ``counts`` (``int64 [N, 6]``): :func:`kivi.paged.counts.kernel_counts` of each request;
* ``backend``: the kernel that runs (:data:`PAGED_BACKENDS`).

:func:`run_paged_decode` runs the named kernel: ``"cpu"`` the numba kernel
(:func:`kivi.attention.fused_cpu.paged.paged_decode_attention`), ``"triton"`` its GPU form
(:func:`kivi.kernels.triton_paged.triton_paged_decode`, CUDA tensors or CPU ones under ``TRITON_INTERPRET=1``),
``"reference"`` the plain torch reference beside both (:func:`kivi.attention.fused_cpu.paged.torch_paged_decode`:
pages dequantized, softmax in float32), which tests/paged/test_decode_equivalence.py compares them to. A backend is
named, never fallen into.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ..attention.fused_cpu.paged import PagedLayout, RingRows, paged_decode_attention, torch_paged_decode

#: the kernels a :class:`PagedDecode` may name (:func:`run_paged_decode`), as kivi's backends are named
PAGED_BACKENDS = ("cpu", "triton", "reference")


@dataclass(frozen=True)
class PagedDecode:
    """The inputs of one paged decode kernel call but the query (the module docstring); ``host_counts``: ``counts``
    on the host, from a caller whose block and slot ids are vouched for (vLLM's block tables): the ``"triton"``
    kernel then checks the counts on it and reads nothing back from the device (``None``: every value checked on
    host copies). ``ValueError`` on a backend not in :data:`PAGED_BACKENDS`."""

    pool: torch.Tensor
    layout: PagedLayout
    block_table: torch.Tensor
    counts: torch.Tensor
    k_fp: RingRows | torch.Tensor
    v_fp: RingRows | torch.Tensor
    w0: int
    backend: str = "cpu"
    host_counts: torch.Tensor | None = None

    def __post_init__(self) -> None:
        if self.backend not in PAGED_BACKENDS:
            raise ValueError(f"backend={self.backend!r} must be one of {list(PAGED_BACKENDS)}")


def run_paged_decode(call: PagedDecode, q: torch.Tensor, *, scaling: float | None = None) -> torch.Tensor:
    """Decode attention of ``q [N, Hq, D]`` (one token per request of ``call``) by the kernel ``call.backend``
    names: ``[N, Hq, D]`` in ``q.dtype``; ``ValueError`` naming an input that does not fit."""
    args = (q, call.pool, call.layout, call.block_table, call.counts, call.k_fp, call.v_fp, call.w0)
    if call.backend == "reference":
        return torch_paged_decode(*args, scaling=scaling)
    if call.backend == "triton":
        from ..kernels.triton_paged import triton_paged_decode

        return triton_paged_decode(*args, scaling=scaling, host_counts=call.host_counts)
    return paged_decode_attention(*args, scaling=scaling)


__all__ = ["PAGED_BACKENDS", "PagedDecode", "run_paged_decode"]
