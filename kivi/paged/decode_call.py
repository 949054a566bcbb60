"""A step's decode rows through kivi's batched paged decode kernel: one call per layer (framework-free torch).

:func:`decode_kernel` is the one rule for whether a layer's decode rows go through the batched paged decode kernel
(:func:`kivi.paged.decode.run_paged_decode`) or request by request through
:func:`kivi.attention.interface.run_backend` (:func:`kivi.paged.forward.paged_step`'s other path): the kernel
runs for the ``"cpu"`` backend with numba importable (the numba kernel, on CPU pages) and for the ``"triton"``
backend (its GPU form, :func:`kivi.kernels.triton_paged.triton_paged_decode`, on the same inputs: CUDA pages,
or CPU pages under ``TRITON_INTERPRET=1``), on pages whose fields it reads (no compensation codes, widths and
group sizes it reads: :meth:`kivi.paged.geometry.KiviGeometry.kernel_layout`) in a cache whose storage holds its
blocks' strides (:func:`kivi.paged.geometry.block_pool`), with window rings that share one storage
(:func:`kivi.paged.geometry.ring_pool`, as vLLM allocates them). ``"reference"`` always goes request by request
(it is the ground truth the kernels are tested against). ``"triton"`` is the plugin's opt-in GPU path
(:mod:`kivi.vllm.select`; never run on a GPU, docs/vllm.md "On a GPU").

The kernel reads the full-precision rows where the rings keep them (the in-place form,
:class:`kivi.attention.fused_cpu.paged.RingRows`): no copy of a window is made. Which slot each of a row's
kernel columns reads is the step's plan (:class:`kivi.paged.plan.KernelRows`, the same for every layer);
:func:`decode_call` turns slots into this layer's row ids, the kernel call both hosts build
(:class:`kivi.paged.decode.PagedDecode`), and :func:`paged_decode` runs it. The step's new tokens come
from its input (the rings are written after every read of the step). :func:`leaving_rows` reads the rows
that leave the kernel rows' windows in the step, for the pages.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ..attention.fused_cpu.paged import PagedLayout, RingRows
from ..capabilities import kernel_reasons
from ..config import KiviConfig
from ..optional import numba_problem, triton_available
from .decode import PagedDecode, run_paged_decode
from .geometry import KiviGeometry, RingPool, block_pool, ring_pool
from .plan import KernelLeaving, KernelRows, stores_any
from .write import ROW_DTYPES, DecodeWriter, TritonWriter, decode_writer, numpy_view, triton_writer


@dataclass(frozen=True)
class DecodeKernel:
    """A layer's cache as the paged decode kernel reads it: ``pool`` (flat uint8, aliasing the cache),
    ``layout`` (where the page fields sit in each block) and ``rings`` (its window rings' rows in place);
    ``writer``: the same caches for a decode step's compiled writes (:func:`kivi.paged.write.decode_writer`,
    ``None`` where they do not apply: the torch writes); ``backend``: the kernel that reads them
    (:data:`kivi.paged.decode.PAGED_BACKENDS`: ``"cpu"`` numba, ``"triton"`` its GPU form)."""

    pool: torch.Tensor
    layout: PagedLayout
    rings: RingPool
    writer: DecodeWriter | TritonWriter | None = None
    backend: str = "cpu"


def decode_kernel(cfg: KiviConfig, geo: KiviGeometry, backend: str, pages: torch.Tensor,
                  rings: list[torch.Tensor], host: str = "vllm") -> DecodeKernel | None:
    """The batched paged decode kernel over ``pages`` (one layer's cache on ``host``, :mod:`kivi.capabilities`) and
    its window ``rings``, or ``None`` where it does not apply and decode rows go request by request (see the module
    docstring: the one rule)."""
    if kernel_reasons(cfg, host, backend, numba=numba_problem() or "", triton=triton_available(),
                      device=pages.device.type, param_dtype=geo.side_fields("k")["scale"].dtype):
        return None
    pool, ring = block_pool(pages, geo), ring_pool(rings, geo)
    if pool is None or ring is None:
        return None
    layout = geo.kernel_layout(cfg, pool[1], pool[2])
    if backend == "triton":
        return DecodeKernel(pool[0], layout, ring, triton_writer(cfg, pool[0], layout, ring, host), "triton")
    return DecodeKernel(pool[0], layout, ring, decode_writer(cfg, pool[0], layout, ring, host), "cpu")


def decode_call(kernel: DecodeKernel, rows: KernelRows, page_table: torch.Tensor, ring_table: torch.Tensor,
                query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, *,
                compiled: bool = True) -> tuple[PagedDecode, torch.Tensor]:
    """The kernel rows' :class:`~kivi.paged.decode.PagedDecode` (``kernel``'s pages and rings, this step's
    block-table rows, ring slot tables and counts, ``kernel.backend``) and their queries, built from vLLM's
    metadata and the step's input (``query [n, Hq, D]``, ``key / value [n, H, D]``). ``compiled``: the row ids,
    block-table rows and query / new rows made in one compiled call (:func:`kivi.paged.inputs_kernel.kernel_inputs`,
    float32) where the input is float32 or bfloat16 on the CPU for the numba kernel, in one Triton launch for the
    Triton kernel (:func:`kivi.kernels.triton_paged_inputs.triton_paged_inputs`); ``False``: with torch
    operations, their reference (the same values). The plan's counts stay on the host as ``host_counts``
    (vLLM's block tables vouched for: the Triton kernel reads nothing back from the device)."""
    idx, r = rows.index, kernel.rings
    host = torch.from_numpy(rows.host_counts)
    numba_inputs = kernel.backend == "cpu" and all(
        x.device.type == "cpu" and x.dtype in ROW_DTYPES for x in (query, key, value))
    if compiled and kernel.backend == "triton":  # the GPU path: its inputs in one Triton launch
        from ..kernels.triton_paged_inputs import triton_paged_inputs

        kids, vids, pages, q, k, v = triton_paged_inputs(ring_table, idx, rows.tokens, r.base, r.step,
                                                         rows.slots["k"], rows.slots["v"], r.rows["k"].shape[1],
                                                         page_table, query, key, value)
        fp = [RingRows(r.rows["k"], kids, k), RingRows(r.rows["v"], vids, v)]
        counts = rows.counts
    elif compiled and numba_inputs:
        from .inputs_kernel import kernel_inputs

        N, C = rows.slots["k"].shape
        ids = [torch.empty(N, C, dtype=torch.int32) for _ in range(2)]
        pages = torch.empty(N, page_table.shape[1], dtype=torch.int32)
        q = torch.empty(N, *query.shape[1:])
        k, v = torch.empty(N, *key.shape[1:]), torch.empty(N, *value.shape[1:])
        kernel_inputs(ring_table.numpy(), idx.numpy(), rows.tokens.numpy(), r.base.numpy(), r.step.numpy(),
                      rows.slots["k"].numpy(), rows.slots["v"].numpy(), r.rows["k"].shape[1], page_table.numpy(),
                      numpy_view(query), numpy_view(key), numpy_view(value), ids[0].numpy(), ids[1].numpy(),
                      pages.numpy(), q.numpy(), k.numpy(), v.numpy())
        fp = [RingRows(r.rows["k"], ids[0], k), RingRows(r.rows["v"], ids[1], v)]
        counts = rows.counts
    else:
        rtab = ring_table[idx]
        fp = [RingRows(r.rows[side], r.slot_ids(rtab, rows.slots[side]).to(torch.int32), new[rows.tokens])
              for side, new in (("k", key), ("v", value))]
        q, pages, counts = query[rows.tokens], page_table[idx].to(torch.int32), rows.counts.to(query.device)
    return PagedDecode(kernel.pool, kernel.layout, pages, counts, *fp, rows.w0, kernel.backend, host), q


def paged_decode(kernel: DecodeKernel, rows: KernelRows, page_table: torch.Tensor, ring_table: torch.Tensor,
                 query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, scale: float, *,
                 compiled: bool = True) -> torch.Tensor:
    """Attention of the kernel rows' queries (``query [n, Hq, D]``, ``key / value [n, H, D]``: the step's input)
    over their pages and full-precision rows: one kernel call (:func:`kivi.paged.decode.run_paged_decode` of
    :func:`decode_call`'s bundle), ``[N, Hq, D]`` in ``query.dtype``. Reads before the step writes the rings."""
    call, q = decode_call(kernel, rows, page_table, ring_table, query, key, value, compiled=compiled)
    return run_paged_decode(call, q, scaling=scale).to(query.dtype)


def leaving_rows(kernel: DecodeKernel, rows: KernelRows, leaving: KernelLeaving, ring_table: torch.Tensor,
                 side: str, new: torch.Tensor) -> torch.Tensor:
    """The rows ``[H, M, D]`` (the rings' dtype) of ``side`` leaving the kernel rows' windows in the step, in
    token order: from the rings, the step's own token from ``new [n, H, D]`` (its input)."""
    ids = kernel.rings.slot_ids(ring_table[leaving.req], leaving.slot[:, None])[:, 0]
    pool = kernel.rings.rows[side]
    pw = pool.shape[1]
    out = pool[ids // pw, ids % pw]  # [M, H, D]
    if leaving.any_new:
        out[leaving.new] = new[rows.tokens[leaving.row[leaving.new]]].to(out.dtype)
    return out.transpose(0, 1)


__all__ = ["DecodeKernel", "decode_kernel", "stores_any", "decode_call", "paged_decode", "leaving_rows"]
