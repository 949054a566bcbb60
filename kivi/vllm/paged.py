"""One attention layer's step over KIVI pages addressed by vLLM's block tables (framework-free torch).

vLLM hands an attention layer, per step, the batch's new tokens and, per request, ``seq_len`` (tokens
after the step) and ``query_len`` (tokens of the step); nothing else about a request. kivi's schedule
depends on token counts only (:mod:`kivi.cache.schedule`), so ``past = seq_len - query_len`` and
``seq_len`` say where every token is: a side's tokens ``[0, stored)`` are in the packed pages
(``side_tokens``), ``[stored, seq_len)`` are full precision: those before the step in the request's window
rings (token ``p`` at slot ``p mod (k * Pw)``, at most ``R + G - 1`` of them), the step's own from its input. No
per-request state is kept here, so preemption (recompute) and prefix hits need nothing special.

:func:`paged_step` does, for one layer:

1-2. builds, per request, the :class:`~kivi.cache.view.AttentionView` kivi's own cache would hand
   attention (pages as a :class:`~kivi.cache.store.BlockStore` aliasing the page memory, then the
   full-precision tokens), with kivi's per-query precision for a chunk into a request that holds tokens
   (:func:`kivi.cache.schedule.query_boundaries`; a request's first chunk is an exact prefill);
3. quantizes what leaves the window in this step (keys in whole groups of ``G`` once ``R`` newer remain,
   values beyond ``R``) -- both sides before writing either, so a refused value (NaN) writes nothing to
   the pages -- and writes it to its page rows;
4. attends: the decode rows with something stored in one call of kivi's batched paged decode kernel
   reading the pages through the block table (:mod:`kivi.vllm.decode`, where it applies:
   :func:`~kivi.vllm.decode.decode_kernel`); every other request on its own: with nothing stored yet
   exactly (torch SDPA, causal bottom-right), else through kivi's backend
   (:func:`kivi.attention.interface.run_backend`: ``"reference"`` dequantizes, ``"cpu"`` reads the packed
   pages: the fused numba kernel for one query token, the blocked path for a chunk);
5. writes the new tokens still in the window after the step (the last ``R + G - 1`` tokens) to the rings,
   after every read of the step (a ring slot is reused once its token has left the window).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from ..attention.interface import run_backend
from ..cache.boundary import SideCounts, set_boundary
from ..cache.pages import page_store, scatter_tokens, store_rows
from ..cache.schedule import prefill_exact_queries, side_tokens
from ..cache.view import AttentionView, exact_queries
from ..config import KiviConfig
from ..quant.kv import quantize_side
from ..quant.page import AXIS, SIDES
from .decode import decode_kernel, gather_decode, paged_decode, stores_any
from .geometry import KiviGeometry, block_field_views, ring_slots


@dataclass(frozen=True)
class StepBatch:
    """What vLLM says about one step's batch (CPU integers; tensors on the cache's device).

    ``query_start`` ``[R+1]`` and ``seq_lens`` ``[R]`` as lists; ``page_table`` ``[R, max_pages]`` (the layer's
    full-attention group) and ``ring_table`` ``[R, k]`` (the request's one block in each of the layer's ``k``
    window rings, vLLM's circular-buffer groups).
    """

    query_start: list[int]
    seq_lens: list[int]
    page_table: torch.Tensor
    ring_table: torch.Tensor


def _ring_read(rings: list[torch.Tensor], pos: torch.Tensor, ring_table_row: torch.Tensor, head_dim: int,
               side: str) -> torch.Tensor:
    """Rows ``[H, len(pos), D]`` of one side at ``pos`` from the rings (a copy)."""
    pw = rings[0].shape[2]
    ring, block, row = ring_slots(pos, ring_table_row, pw)
    h = rings[0].shape[1]
    out = torch.empty(h, pos.numel(), head_dim, dtype=rings[0].dtype, device=rings[0].device)
    cols = slice(0, head_dim) if side == "k" else slice(head_dim, 2 * head_dim)
    for j, r in enumerate(rings):
        sel = (ring == j).nonzero().flatten()
        if sel.numel():
            out[:, sel] = r[block[sel], :, row[sel], cols].transpose(0, 1)
    return out


def _ring_write(rings: list[torch.Tensor], pos: torch.Tensor, ring_table_row: torch.Tensor, k_rows: torch.Tensor,
                v_rows: torch.Tensor) -> None:
    """Write keys / values ``[len(pos), H, D]`` of positions ``pos`` to their ring slots."""
    pw, d = rings[0].shape[2], k_rows.shape[-1]
    ring, block, row = ring_slots(pos, ring_table_row, pw)
    for j, r in enumerate(rings):
        sel = (ring == j).nonzero().flatten()
        if sel.numel():
            r[block[sel], :, row[sel], :d] = k_rows[sel].to(r.dtype)
            r[block[sel], :, row[sel], d:] = v_rows[sel].to(r.dtype)


def _quantize(cfg: KiviConfig, side: str, x: torch.Tensor):
    """``x [H, T, D]`` leaving the window (T a multiple of G for keys) as the pages store it."""
    return quantize_side(x.unsqueeze(0), cfg.side_format(side))


def exact_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float) -> torch.Tensor:
    """``q [1, Hq, n, D]`` (the last ``n`` of ``T`` positions) over ``k / v [1, H, T, D]``, causal bottom-right."""
    n, t = q.shape[-2], k.shape[-2]
    mask = None if n == t else torch.ones(n, t, dtype=torch.bool, device=q.device).tril(t - n)
    return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, is_causal=n == t and n > 1, scale=scale,
                                          enable_gqa=q.shape[1] != k.shape[1])


def decode_rows(batch: StepBatch) -> list[int]:
    """Requests of the batch whose step is one query token (the batched paged decode kernel serves those with
    something stored: :func:`kivi.vllm.decode.stores_any`)."""
    qs = batch.query_start
    return [i for i in range(len(batch.seq_lens)) if qs[i + 1] - qs[i] == 1]


def paged_step(cfg: KiviConfig, geo: KiviGeometry, backend: str, query: torch.Tensor, key: torch.Tensor,
               value: torch.Tensor, pages: torch.Tensor, rings: list[torch.Tensor], batch: StepBatch, scale: float,
               out: torch.Tensor, *, batched_decode: bool = True) -> torch.Tensor:
    """One layer's step: ``query [n, Hq, D]``, ``key / value [n, H, D]`` (the batch's new tokens, request by
    request), ``pages`` the layer's vLLM cache, ``rings`` its ``k`` window rings' caches ``[NBw, H, Pw, 2D]``;
    writes ``[n, Hq, D]`` attention into ``out`` (returned). ``batched_decode``: decode rows through the
    batched paged decode kernel where it applies (:func:`kivi.vllm.decode.decode_kernel`), else (or
    ``False``) request by request."""
    P = geo.page_size
    if len(rings) * rings[0].shape[2] < geo.sliding_window - 1:
        raise ValueError(f"{len(rings)} window rings of {rings[0].shape[2]} tokens cannot hold the "
                         f"{geo.sliding_window - 1} full-precision tokens KIVI keeps")
    views = {side: block_field_views(pages, geo, side) for side in SIDES}
    meta = {side: dict(bits=cfg.k_bits if side == "k" else cfg.v_bits, group_size=cfg.group_size, axis=AXIS[side],
                       head_dim=geo.head_dim, residual_bits=cfg.residual_bits) for side in SIDES}
    R, G = cfg.residual_length, cfg.group_size
    kernel = decode_kernel(cfg, geo, backend, pages) if batched_decode else None
    rows = [] if kernel is None else [i for i in decode_rows(batch) if stores_any(cfg, batch.seq_lens[i] - 1)]
    decode = None if not rows else gather_decode(cfg, rows, batch.query_start, batch.seq_lens, batch.page_table,
                                                 batch.ring_table, rings, key, value)
    in_kernel = {i: j for j, i in enumerate(rows)}
    jobs, writes, ring_writes = [], [], []
    for i, seq in enumerate(batch.seq_lens):
        lo, hi = batch.query_start[i], batch.query_start[i + 1]
        q_len = hi - lo
        if q_len == 0:
            continue
        past = seq - q_len
        page_ids, ring_ids = batch.page_table[i], batch.ring_table[i]
        side_views = []
        for side, new in (("k", key[lo:hi]), ("v", value[lo:hi])):  # 1-2. the view kivi's cache would build
            axis = AXIS[side]
            stored = side_tokens(axis, past, R, G)[1]
            after = side_tokens(axis, seq, R, G)[1]
            if i in in_kernel:  # the kernel reads the pages and these rows (gathered above, before any write)
                fp = decode.window(in_kernel[i], side)  # [H, seq - stored, D]
            else:
                old = _ring_read(rings, torch.arange(stored, past, device=key.device), ring_ids, geo.head_dim, side)
                fp = torch.cat([old, new.transpose(0, 1).to(old.dtype)], dim=1)  # [H, seq - stored, D]
                table = page_ids[: -(-stored // P)].tolist()
                store = page_store(views[side], table, 0, stored, P, **meta[side])
                view = AttentionView(store, stored, fp.unsqueeze(0), quantized=True)
                _set_boundary(view, cfg, side, fp, past - stored, q_len, past)
                side_views.append(view)
            if after > stored:  # 3. what leaves the window in this step
                writes.append((side, _quantize(cfg, side, fp[:, : after - stored]), page_ids.tolist(), stored,
                               after - stored))
        if i not in in_kernel:
            jobs.append((lo, hi, side_views))
        keep = max(past, seq - (geo.sliding_window - 1))  # new tokens still in the window after the step
        ring_writes.append((torch.arange(keep, seq, device=key.device), ring_ids, key[lo + keep - past:hi],
                            value[lo + keep - past:hi]))
    for pos, ring_ids, k_rows, v_rows in ring_writes:  # every request's reads are done: now the rings
        _ring_write(rings, pos, ring_ids, k_rows, v_rows)
    for side, seg, table, start, count in writes:  # every quantization succeeded: now write
        index = {1: _rows(table, start, count, P, 1, pages.device)}
        if side == "k":
            index[G] = _rows(table, start, count, P, G, pages.device)
        per_row = {name: f.tokens_per_row for name, f in geo.side_fields(side).items()}
        scatter_tokens(views[side], seg, index, per_row)
    if decode is not None:  # 4. attention: the kernel rows in one call, the others request by request
        out[decode.tokens] = paged_decode(kernel, decode, query, scale).to(out.dtype)
    for lo, hi, (kv, vv) in jobs:
        q = query[lo:hi].transpose(0, 1).unsqueeze(0)  # [1, Hq, q_len, D]
        if exact_queries(q.shape[-2], kv, vv) == q.shape[-2]:
            o = exact_attention(q, kv.fp.to(q.dtype), vv.fp.to(q.dtype), scale)
        else:
            o = run_backend(backend, q, kv, vv, scaling=scale, attention_mask=None)
        out[lo:hi] = o[0].transpose(0, 1).to(out.dtype)
    return out


def _rows(table: list[int], start: int, count: int, page_size: int, per_row: int, device) -> tuple[torch.Tensor, ...]:
    blocks, rows = store_rows(table, start, count, page_size, per_row)
    return torch.tensor(blocks, dtype=torch.long, device=device), torch.tensor(rows, dtype=torch.long, device=device)


def _set_boundary(view: AttentionView, cfg: KiviConfig, side: str, pending: torch.Tensor, window: int, q_len: int,
                  past: int) -> None:
    """Per-query precision of a chunk of ``q_len`` tokens into a request holding ``past`` (as
    :class:`kivi.cache.KiviLayer`, :func:`kivi.cache.boundary.set_boundary`): query ``i`` reads the tokens
    one-token decoding would have moved out of the window by its step as they are once moved (bit-identical
    to what the pages then hold). A request's first chunk (``past == 0``) is an exact prefill.
    ``pending [H, window + q_len, D]``."""
    counts = SideCounts(AXIS[side], cfg.residual_length, cfg.group_size, 0, 0)  # no sink
    set_boundary(view, counts, pending.unsqueeze(0), q_len, prefill_exact_queries(past, q_len, None),
                 lambda lo, hi: _quantize(cfg, side, pending[:, lo:hi]))


__all__ = ["StepBatch", "paged_step", "exact_attention", "decode_rows", "ring_slots"]
