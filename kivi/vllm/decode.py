"""A step's decode rows through kivi's batched paged decode kernel: one call per layer (framework-free torch).

:func:`decode_kernel` is the one rule for whether a layer's decode rows go through
:func:`kivi.attention.fused_cpu.paged.paged_decode_attention` or request by request through
:func:`kivi.attention.interface.run_backend` (:func:`kivi.vllm.paged.paged_step`'s other path): the kernel
runs for the ``"cpu"`` backend with numba importable, on pages whose fields it reads (no compensation codes,
widths and group sizes it reads: :meth:`kivi.vllm.geometry.KiviGeometry.kernel_layout`) in a cache whose
storage holds its blocks' strides (:func:`kivi.vllm.geometry.block_pool`). ``"reference"`` always
goes request by request (it is the ground truth the kernel is tested against).

:func:`stores_any` says which decode rows it serves (something stored or in the sink on either side; a
request whose tokens are all still in the full-precision window attends exactly, as kivi's own cache does).
:func:`gather_decode` reads, before the step writes anything, each such request's full-precision rows
into the kernel's gathered ``fp`` layout ``[N, S + slots, H, D]`` in the rings' dtype: its sink rows in
columns ``[0, sink)`` (sink token ``p`` in column ``p``, ``sink <= S``), then from ``w0 = S`` the earlier
window tokens from its rings and the step's new token: the same rows the per-request path reads and
quantizes what leaves the window from; :func:`paged_decode` runs the kernel on them.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ..attention.fused_cpu.paged import PagedLayout, paged_decode_attention
from ..cache.schedule import side_tokens
from ..config import KiviConfig
from ..optional import numba_available
from ..quant.page import AXIS, SIDES
from .geometry import KiviGeometry, block_pool, ring_slot


@dataclass(frozen=True)
class DecodeKernel:
    """A layer's cache as the paged decode kernel reads it: ``pool`` (flat uint8, aliasing the cache) and
    ``layout`` (where the page fields sit in each block)."""

    pool: torch.Tensor
    layout: PagedLayout


@dataclass(frozen=True)
class DecodeInputs:
    """The kernel rows of one step and layer: ``rows`` (batch rows), ``tokens`` (long ``[N]``: each row's
    query in the step's input), ``counts`` (int64 ``[N, 6]``: ``[k sink, k stored, k window + 1, v sink,
    v stored, v window + 1]``), ``table`` (int32 ``[N, max_pages]``), ``fp`` (per side ``[N, w0 + slots, H, D]``
    in the rings' dtype, views of one gathered copy: the sink rows in columns ``[0, sink)``, from ``w0`` the
    window's rows, then the new token; columns past a row's counts are zero) and ``w0`` (the sink slots ``S``)."""

    rows: list[int]
    tokens: torch.Tensor
    counts: torch.Tensor
    table: torch.Tensor
    fp: dict[str, torch.Tensor]
    w0: int = 0


def decode_kernel(cfg: KiviConfig, geo: KiviGeometry, backend: str, pages: torch.Tensor) -> DecodeKernel | None:
    """The batched paged decode kernel over ``pages`` (one layer's vLLM cache), or ``None`` where it does not
    apply and decode rows go request by request (see the module docstring: the one rule)."""
    if backend != "cpu" or pages.device.type != "cpu" or not numba_available():
        return None
    pool = block_pool(pages, geo)
    if pool is None:
        return None
    layout = geo.kernel_layout(cfg, pool[1], pool[2])
    return None if layout is None else DecodeKernel(pool[0], layout)


def stores_any(cfg: KiviConfig, past: int) -> bool:
    """Whether a request holding ``past`` tokens has a token out of its window (stored, or in the sink) on
    either side: a decode row of such a request goes to the kernel, one without attends exactly (as kivi's own
    cache does)."""
    R, G, S = cfg.residual_length, cfg.group_size, cfg.sink_tokens
    return any(sum(side_tokens(AXIS[side], past, R, G, S)[:2]) for side in SIDES)


def gather_decode(cfg: KiviConfig, rows: list[int], query_start: list[int], seq_lens: list[int],
                  page_table: torch.Tensor, ring_table: torch.Tensor, rings: list[torch.Tensor], key: torch.Tensor,
                  value: torch.Tensor) -> DecodeInputs:
    """The kernel's inputs for ``rows`` (decode rows, :func:`stores_any`), read before the step writes the rings;
    ``key / value [n, H, D]`` the step's new tokens, ``rings`` ``[NBw, H, Pw, 2D]`` each."""
    R, G, S = cfg.residual_length, cfg.group_size, cfg.sink_tokens
    device = key.device
    idx = torch.tensor(rows, dtype=torch.long, device=device)
    seq = torch.tensor([seq_lens[i] for i in rows], dtype=torch.long, device=device)
    tokens = torch.tensor([query_start[i] for i in rows], dtype=torch.long, device=device)
    held = {side: torch.tensor([side_tokens(AXIS[side], s - 1, R, G, S)[:2] for s in seq.tolist()], dtype=torch.long,
                               device=device) for side in SIDES}  # [N, 2]: sink, stored
    sink = {side: held[side][:, 0] for side in SIDES}
    stored = {side: held[side][:, 1] for side in SIDES}
    count = {side: seq - sink[side] - stored[side] for side in SIDES}  # window + the new token
    slots = S + int(max(count["k"].max(), count["v"].max()))
    rtab = ring_table[idx].long()  # [N, k]
    n, d = len(rows), key.shape[-1]
    _, h, pw, c = rings[0].shape
    ring = len(rings) * pw
    # each request's k ring blocks in slot order (slot s = ring * Pw + row), as rows [N * k * Pw, H, 2D], then
    # one zero row: a side's rows are then one index_select of whole rows (slots past a row's count read the
    # zero row)
    flat = torch.empty(n * ring + 1, h, c, dtype=rings[0].dtype, device=device)
    by_request = flat[:-1].view(n, ring, h, c)
    for r, cache in enumerate(rings):
        by_request[:, r * pw:(r + 1) * pw] = cache.index_select(0, rtab[:, r]).transpose(1, 2)
    flat[-1] = 0
    j = torch.arange(slots, device=device)
    req = torch.arange(n, device=device)
    fp = {}
    w = j[: slots - S]  # columns [S, slots): the window's rows
    for side, new in (("k", key), ("v", value)):
        # column S + w: window position sink + stored + w (the new token is not in the rings yet: its column is
        # filled from the input); column j < S: sink position j, at slot j
        pos = (sink[side] + stored[side])[:, None] + w[None, :]  # [N, slots - S]
        at = torch.where(w[None, :] < count[side][:, None] - 1, req[:, None] * ring + ring_slot(pos, ring, S), n * ring)
        if S:
            at = torch.cat([torch.where(j[None, :S] < sink[side][:, None], req[:, None] * ring + j[None, :S], n * ring),
                            at], dim=1)  # [N, slots]
        cols = slice(0, d) if side == "k" else slice(d, 2 * d)
        rows_fp = flat.index_select(0, at.flatten()).view(n, slots, h, c)[..., cols]  # [N, slots, H, D]
        rows_fp[req, S + count[side] - 1] = new[tokens].to(rows_fp.dtype)
        fp[side] = rows_fp
    counts = torch.stack([sink["k"], stored["k"], count["k"], sink["v"], stored["v"], count["v"]], dim=1).cpu()
    return DecodeInputs(rows, tokens, counts, page_table[idx].to(torch.int32).cpu(), fp, S)


def paged_decode(kernel: DecodeKernel, inputs: DecodeInputs, query: torch.Tensor, scale: float) -> torch.Tensor:
    """Attention of the rows' queries (``query [n, Hq, D]`` of the step) over their pages and rows: one kernel
    call, ``[N, Hq, D]`` in ``query.dtype``."""
    return paged_decode_attention(query[inputs.tokens], kernel.pool, kernel.layout, inputs.table, inputs.counts,
                                  inputs.fp["k"].float(), inputs.fp["v"].float(), inputs.w0, scaling=scale)


__all__ = ["DecodeKernel", "DecodeInputs", "decode_kernel", "stores_any", "gather_decode", "paged_decode"]
