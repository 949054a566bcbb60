"""One attention layer's step over KIVI pages addressed by block and ring tables (framework-free torch; what the vLLM
plugin runs per layer, :mod:`kivi.vllm.backend`).

vLLM hands an attention layer, per step, the batch's new tokens and, per request, ``seq_len`` (tokens
after the step) and ``query_len`` (tokens of the step); nothing else about a request. kivi's schedule
depends on token counts only (:mod:`kivi.cache.schedule`), so ``past = seq_len - query_len`` and
``seq_len`` say where every token is (``side_tokens``): a side's sink ``[0, sink)`` (``sink <= S``) is full
precision in the request's window rings (slot ``p``), its stored tokens ``[sink, sink + stored)`` are in the
packed pages (store position ``p - sink``), ``[sink + stored, seq_len)`` are full precision: those before
the step in the rings' window part (at most ``R + G - 1`` of them, :func:`kivi.paged.ring.ring_slot`),
the step's own from its input. No per-request state is kept here, so preemption (recompute) and prefix hits
need nothing special.

The step's schedule, the same for every layer, is worked out once per step (:func:`kivi.paged.plan.step_plan`:
which rows the batched decode kernel serves, the ring slots its columns read, what leaves their windows, the
ring slots the step writes); :func:`paged_step` does, for one layer, the steps of :mod:`kivi.paged.step` (shared
with :mod:`kivi.batching`) over vLLM's block and ring tables:

1-2. builds, per request not served by the kernel, the :class:`~kivi.cache.view.AttentionView` kivi's own
   cache would hand attention (the sink rows, the pages as a :class:`~kivi.cache.store.BlockStore` aliasing
   the page memory, then the full-precision tokens), with kivi's per-query precision for a chunk into a
   request that holds tokens (:func:`kivi.paged.step.request_view`; a request's first chunk is an exact
   prefill);
3. quantizes what leaves the windows in this step for the pages (after the first tokens to leave filled the
   sink, :func:`kivi.paged.step.exits`: keys in whole groups of ``G`` once ``R`` newer remain,
   values beyond ``R``; sink tokens are never quantized and never move: their rows are already in their
   slots), every request's tokens in one call per side (groups never span requests: keys leave in whole
   aligned groups; :func:`kivi.paged.step.quantize_leaving`), both sides before writing either
   (:func:`kivi.paged.step.commit`), so a refused value (NaN) writes nothing; then writes them to their page
   rows, one indexed write per field;
4. attends: the decode rows with something stored in one call of kivi's batched paged decode kernel
   reading the pages through the block table and the full-precision rows in the rings where they are
   (:mod:`kivi.paged.decode_call`, where it applies: :func:`~kivi.paged.decode_call.decode_kernel`); every request's
   first chunk exactly, all of them in one call of the step's exact prefill (vLLM's CPU attention kernel in
   the plugin, :mod:`kivi.vllm.prefill`; torch SDPA request by request for reference, :func:`sdpa_prefill`);
   every other request on its own: with nothing stored yet exactly (torch SDPA, causal bottom-right), else
   through kivi's backend (:func:`kivi.attention.interface.run_backend`: ``"reference"`` dequantizes,
   ``"cpu"`` reads the packed pages: the fused numba kernel for one query token, the blocked path for a
   chunk);
5. writes the new tokens still in full precision after the step (positions below ``S``, and the last
   ``R + G - 1`` tokens) to the rings, after every read of the step (a ring slot is reused once its token
   has left the window): one indexed write per ring for all requests (:func:`write_rings`, slots from the
   plan).

In a step whose every request is a kernel row (no prefill or chunk: the steady state), 3 and 5 are one compiled
call instead (:func:`kivi.paged.write.write_step`, where :func:`~kivi.paged.write.decode_writer` says it reproduces
them: the same bytes in the pages and rings); ``compiled_writes=False`` keeps the torch writes (the reference).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from functools import partial

import torch
import torch.nn.functional as F

from ..attention.interface import run_backend
from ..cache.pages import page_store
from ..cache.view import exact_queries
from ..config import KiviConfig
from ..quant.page import SIDES
from .counts import side_counts
from .decode_call import DecodeKernel, decode_kernel, leaving_rows, paged_decode
from .geometry import KiviGeometry, block_field_views
from .plan import RingWrites, StepPlan, step_plan
from .ring import ring_slot, slot_place
from .step import Leaving, Pages, commit, request_side
from .write import write_step


@dataclass(frozen=True)
class StepBatch:
    """What vLLM says about one step's batch (CPU integers; tensors on the cache's device).

    ``query_start`` ``[R+1]`` and ``seq_lens`` ``[R]`` as lists; ``page_table`` ``[R, max_pages]`` (the layer's
    full-attention group) and ``ring_table`` ``[R, k]`` (the request's one block in each of the layer's ``k``
    window rings, vLLM's circular-buffer groups); ``plan``: the step's schedule
    (:func:`kivi.paged.plan.step_plan` of ``query_start`` / ``seq_lens`` / ``shared``, made once per step by the
    caller; ``None``: :func:`paged_step` makes it). Per request (``None``: 0 for every one): ``shared``, the prompt
    tokens it took from other requests' pages (transformers' prefix sharing: the sink and whole pages), and
    ``evicted``, its leading tokens whose pages a sliding window freed (whole pages; their page-table entries are
    never read).
    """

    query_start: list[int]
    seq_lens: list[int]
    page_table: torch.Tensor
    ring_table: torch.Tensor
    plan: StepPlan | None = None
    shared: list[int] | None = None
    evicted: list[int] | None = None


def _ring_read(rings: list[torch.Tensor], ring_table_row: torch.Tensor, head_dim: int, side: str, sink: int,
               lo: int, hi: int) -> torch.Tensor:
    """Rows ``[H, hi - lo, D]`` of one side at positions ``[lo, hi)`` from the rings (a copy, bit-exact as they
    arrived); ``sink``: the sink slots ``S``."""
    pos = torch.arange(lo, hi, device=ring_table_row.device)
    pw = rings[0].shape[2]
    ring, row = slot_place(ring_slot(pos, ring_table_row.shape[-1] * pw - sink, sink), pw)
    block = ring_table_row[ring].long()
    h = rings[0].shape[1]
    out = torch.empty(h, pos.numel(), head_dim, dtype=rings[0].dtype, device=rings[0].device)
    cols = slice(0, head_dim) if side == "k" else slice(head_dim, 2 * head_dim)
    for j, r in enumerate(rings):
        sel = (ring == j).nonzero().flatten()
        if sel.numel():
            out[:, sel] = r[block[sel], :, row[sel], cols].transpose(0, 1)
    return out


def window_mask(n: int, t: int, sliding_window: int | None, device: torch.device) -> torch.Tensor | None:
    """Bool ``[1, 1, n, t]`` (True: attend) for the ``n`` newest of ``t`` positions, aligned bottom-right:
    query ``i`` (position ``p = t - n + i``) sees keys ``k <= p`` and, with a sliding window ``W``,
    ``k > p - W`` (transformers' ``sliding_window_overlay``). ``None`` when plain causality is all there is
    to say and the callee applies it (``n == 1`` or ``n == t``, and no key out of the window)."""
    out_of_window = sliding_window is not None and t > sliding_window
    if not out_of_window and (n == 1 or n == t):
        return None
    ones = torch.ones(n, t, dtype=torch.bool, device=device)
    mask = ones.tril(t - n)
    if out_of_window:
        mask &= ~ones.tril(t - n - sliding_window)
    return mask[None, None]


def exact_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float,
                    sliding_window: int | None = None) -> torch.Tensor:
    """``q [1, Hq, n, D]`` (the last ``n`` of ``T`` positions) over ``k / v [1, H, T, D]``, causal bottom-right
    (and only the last ``sliding_window`` keys of each query, when given: :func:`window_mask`)."""
    n, t = q.shape[-2], k.shape[-2]
    mask = window_mask(n, t, sliding_window, q.device)
    return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, is_causal=mask is None and n == t and n > 1,
                                          scale=scale, enable_gqa=q.shape[1] != k.shape[1])


ExactPrefill = Callable[[torch.Tensor, torch.Tensor, torch.Tensor, list[tuple[int, int]], float, torch.Tensor], None]
"""``(query [n, Hq, D], key [n, H, D], value [n, H, D], spans, scale, out [n, Hq, D])``: for every span
``(lo, hi)`` of the step's rows (a request's first chunk: its whole prompt so far), rows ``[lo, hi)`` attend
causally to themselves; writes ``out[lo:hi]`` for every span and nothing else."""


def sdpa_prefill(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, spans: list[tuple[int, int]],
                 scale: float, out: torch.Tensor, sliding_window: int | None = None) -> None:
    """The reference :data:`ExactPrefill`: torch SDPA request by request (:func:`exact_attention`)."""
    for lo, hi in spans:
        q = query[lo:hi].transpose(0, 1).unsqueeze(0)
        k, v = (x[lo:hi].transpose(0, 1).unsqueeze(0).to(q.dtype) for x in (key, value))
        out[lo:hi] = exact_attention(q, k, v, scale, sliding_window)[0].transpose(0, 1).to(out.dtype)


def decode_rows(batch: StepBatch) -> list[int]:
    """Requests of the batch whose step is one query token (the batched paged decode kernel serves those with
    something stored: :func:`kivi.paged.decode_call.stores_any`)."""
    qs = batch.query_start
    return [i for i in range(len(batch.seq_lens)) if qs[i + 1] - qs[i] == 1]


def paged_step(cfg: KiviConfig, geo: KiviGeometry, backend: str, query: torch.Tensor, key: torch.Tensor,
               value: torch.Tensor, pages: torch.Tensor, rings: list[torch.Tensor], batch: StepBatch, scale: float,
               out: torch.Tensor, *, batched_decode: bool = True, prefill: ExactPrefill = sdpa_prefill,
               kernel: DecodeKernel | None = None, compiled_writes: bool = True,
               flags: list[torch.Tensor] | None = None, sliding_window: int | None = None) -> torch.Tensor:
    """One layer's step: ``query [n, Hq, D]``, ``key / value [n, H, D]`` (the batch's new tokens, request by
    request), ``pages`` the layer's vLLM cache, ``rings`` its ``k`` window rings' caches ``[NBw, H, Pw, 2D]``;
    writes ``[n, Hq, D]`` attention into ``out`` (returned). ``batched_decode``: decode rows through the
    batched paged decode kernel where it applies (:func:`kivi.paged.decode_call.decode_kernel`), else (or
    ``False``) request by request; ``kernel``: that kernel for these ``pages`` and ``rings``, which a caller
    that keeps them makes once (``None``: made here). Every request's first chunk (nothing before it: an
    exact prefill of its prompt so far) goes in one call of ``prefill`` (:data:`ExactPrefill`; the plugin
    passes vLLM's CPU attention kernel, :func:`kivi.vllm.prefill.vllm_cpu_prefill`, where the backend is
    ``"cpu"``). The step's schedule is ``batch.plan`` (:func:`kivi.paged.plan.step_plan`, made here when
    ``None``). What leaves the windows is quantized in one call per side for the whole step, and the rings
    and pages are written in one indexed write per ring / field (the groups of different requests never
    share a group: each request's keys leave in whole aligned groups). ``compiled_writes``: a step whose every
    request is a kernel row writes pages and rings in one compiled call where it applies
    (:mod:`kivi.paged.write`; ``False``: the torch writes, its reference). ``flags``: where the Triton writes
    append their finiteness flag instead of reading it back (:func:`kivi.paged.write.write_step`; the caller
    reads them, :func:`kivi.kernels.triton_paged_write.raise_if_nonfinite`); ``None``: read back at once.
    ``sliding_window``: the layer's (``None``: full attention): each query sees only the last ``sliding_window``
    positions (:func:`window_mask`), every request goes request by request, and ``prefill`` is the reference's."""
    P, S = geo.page_size, cfg.sink_tokens
    if S != geo.sink_tokens:
        raise ValueError(f"sink_tokens={S} but the geometry was built for {geo.sink_tokens}")
    if len(rings) * rings[0].shape[2] < geo.fp_slots:
        raise ValueError(f"{len(rings)} window rings of {rings[0].shape[2]} tokens cannot hold the "
                         f"{geo.fp_slots} full-precision tokens KIVI keeps ({S} sink + {geo.sliding_window - 1})")
    plan = batch.plan if batch.plan is not None else step_plan(cfg, geo, batch.query_start, batch.seq_lens,
                                                               batch.shared)
    if not plan.fits(geo):
        raise ValueError(f"the step's plan was made for {plan.slots} ring slots of {plan.window_tokens} per block and "
                         f"{plan.sink_tokens} sink tokens, this layer has {geo.window_rings * geo.window_tokens}, "
                         f"{geo.window_tokens} and {geo.sink_tokens}")
    if sliding_window is not None:  # the kernels read no window mask: every request goes request by request
        batched_decode, prefill = False, partial(sdpa_prefill, sliding_window=sliding_window)
    if not batched_decode or plan.kernel is None:
        kernel = None
    elif kernel is None:
        kernel = decode_kernel(cfg, geo, backend, pages, rings)
    if (kernel is not None and compiled_writes and not plan.others and kernel.writer is not None
            and kernel.writer.takes(key, value)):  # a decode-only step: one kernel call, one call of writes
        decoded = paged_decode(kernel, plan.kernel, batch.page_table, batch.ring_table, query, key, value, scale)
        write_step(kernel.writer, plan, batch.page_table, batch.ring_table, key, value, flags=flags)
        out[plan.kernel.tokens] = decoded.to(out.dtype)
        return out
    views = {side: block_field_views(pages, geo, side) for side in SIDES}
    meta = {side: dict(fmt=cfg.side_format(side), head_dim=geo.head_dim) for side in SIDES}
    per_request = plan.others if kernel is not None or plan.kernel is None else sorted(plan.others + plan.kernel.rows)
    jobs = []
    leaving = {side: Leaving(cfg, side) for side in SIDES}  # what leaves the windows in this step, per side
    for i in per_request:
        lo, hi = batch.query_start[i], batch.query_start[i + 1]
        q_len = hi - lo
        past = batch.seq_lens[i] - q_len
        page_ids, ring_ids = batch.page_table[i], batch.ring_table[i]
        shared, evicted = (batch.shared[i] if batch.shared else 0), (batch.evicted[i] if batch.evicted else 0)
        side_views = []
        for side, new in (("k", key[lo:hi]), ("v", value[lo:hi])):  # 1-2. the view kivi's cache would build
            sink, stored, _ = side_counts(cfg, side, past, shared)
            gone = min(evicted, stored)  # sliding layers (no sink): the first pages are freed
            store = page_store(views[side], page_ids[gone // P: -(-stored // P)].tolist(), sink, stored, P,
                               **meta[side], evicted=gone)
            read = partial(_ring_read, rings, ring_ids, geo.head_dim, side, S)
            pending, _, view = request_side(cfg, side, new.transpose(0, 1).to(rings[0].dtype).contiguous(), past,
                                            (sink, stored), read, store, start=gone)
            side_views.append(view)
            if pending.move:  # 3. what leaves the window for the pages in this step
                leaving[side].add(pending, [(i, stored, pending.move)])
        jobs.append((lo, hi, past, side_views))
    if kernel is not None:  # the kernel rows' leaving tokens: one indexed read per side, before any write
        for side, new in (("k", key), ("v", value)):
            gone = plan.kernel.leaving[side]
            if gone is not None:
                leaving[side].add(leaving_rows(kernel, plan.kernel, gone, batch.ring_table, side, new), gone.spans)
        decoded = paged_decode(kernel, plan.kernel, batch.page_table, batch.ring_table, query, key, value, scale)
    # every request's reads are done: every quantization, then the rings, then the pages
    pages = {side: Pages(views[side], {name: f.tokens_per_row for name, f in geo.side_fields(side).items()},
                         batch.page_table, P) for side in SIDES}
    ring_writes = [] if plan.writes is None else [
        lambda: write_rings(rings, batch.ring_table, key, value, plan.writes)]
    commit([(leaving[side], pages[side]) for side in SIDES], *ring_writes)
    if kernel is not None:  # 4. attention: the kernel rows in one call, the others request by request
        out[plan.kernel.tokens] = decoded.to(out.dtype)
    firsts = [(lo, hi) for lo, hi, past, _ in jobs if past == 0]
    if firsts:
        prefill(query, key, value, firsts, scale, out)
    for lo, hi, past, (kv, vv) in jobs:
        if past == 0:
            continue
        q = query[lo:hi].transpose(0, 1).unsqueeze(0)  # [1, Hq, q_len, D]
        if exact_queries(q.shape[-2], kv, vv) == q.shape[-2]:
            o = exact_attention(q, kv.fp.to(q.dtype), vv.fp.to(q.dtype), scale, sliding_window)
        else:
            t, mask = kv.split + kv.fp.shape[-2], None  # the request's tokens (the views start at kv.start)
            if sliding_window is not None and t > sliding_window:
                mask = window_mask(q.shape[-2], t, sliding_window, q.device)[..., kv.start:]
            o = run_backend(backend, q, kv, vv, scaling=scale, attention_mask=mask)
        out[lo:hi] = o[0].transpose(0, 1).to(out.dtype)
    return out


def write_rings(rings: list[torch.Tensor], ring_table: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                writes: RingWrites) -> None:
    """Write the step's tokens ``writes`` names (:class:`kivi.paged.plan.RingWrites`: request, ring slot, input row
    of ``key / value [n, H, D]``) to their rows: one indexed write per ring (keys in channels ``[0, D)``,
    values in ``[D, 2D)``)."""
    pw = rings[0].shape[2]
    kv = torch.cat([key[writes.src], value[writes.src]], dim=-1).to(rings[0].dtype)  # [M, H, 2D], ring by ring
    block = ring_table[writes.req].long()
    for ring, lo, hi in writes.bounds:
        rings[ring][block[lo:hi, ring], :, writes.slot[lo:hi] % pw] = kv[lo:hi]


__all__ = ["StepBatch", "ExactPrefill", "paged_step", "sdpa_prefill", "exact_attention", "window_mask", "decode_rows",
           "write_rings"]
