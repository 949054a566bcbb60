"""One layer's step over KIVI pages, for every paged host (:mod:`kivi.batching`, :mod:`kivi.vllm`): framework-free.

Per layer and side, a step over a batch of requests does for each request what one-sequence
:class:`kivi.cache.KiviLayer` does; a host only maps its own metadata (block tables, ring tables, slot ids) onto
these pieces:

1. what leaves the request's window in the step (:func:`exits`: :func:`kivi.cache.schedule.window_exits` on the
   counts of :func:`kivi.paged.counts.side_counts`);
2. the view attention reads (:func:`request_view`): sink rows exact, the pages as a
   :class:`~kivi.cache.store.BlockStore`, the window and the new tokens at full precision (:class:`Pending`), with
   the per-query boundary of a chunk (:func:`set_request_boundary`); :func:`request_side` builds it from the
   host's one row reader;
3. every request's leaving tokens (:class:`Leaving`), quantized once per side for the whole step
   (:func:`quantize_leaving`: the compiled value quantizer where it reproduces the torch reference);
4. :func:`commit`: every side quantized before anything is written (a refused value, NaN / Inf, raises and leaves
   pages and rows as they were), then the host's row writes (the new tokens that keep a full-precision row, to
   their slots, :mod:`kivi.paged.ring`), then the pages (:func:`page_index`, :func:`kivi.cache.pages.scatter_tokens`).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch

from ..cache.boundary import SideCounts, set_boundary
from ..cache.pages import scatter_tokens
from ..cache.schedule import prefill_exact_queries, window_exits
from ..cache.store import BlockStore
from ..cache.view import AttentionView
from ..quant.kv import PackedKV, quantize_side
from ..quant.numba_quant import quantize_tokens, tokens_quantizable
from ..quant.page import AXIS


def exits(cfg, side: str, past: int, q: int, sink: int, stored: int) -> tuple[int, int]:
    """``(take, move)`` of side ``side`` of a request holding ``past`` tokens (``sink`` in its sink, ``stored`` in
    its pages) in a step of ``q`` tokens: its first ``take`` pending tokens go to the sink, the next ``move`` to the
    pages (:func:`kivi.cache.schedule.window_exits`, as :meth:`kivi.cache.KiviLayer.append` moves them)."""
    return window_exits(AXIS[side], past + q - sink - stored, cfg.residual_length, cfg.group_size, sink,
                        cfg.sink_tokens, sink + stored, cfg.quantize_after)


def quantize_leaving(cfg, side: str, x: torch.Tensor, *, compiled: bool = True) -> PackedKV:
    """``x [H, T, D]`` (tokens leaving windows; ``T`` whole aligned key groups for keys) as the pages store them: one
    :class:`~kivi.quant.kv.PackedKV` ``[1, H, T, ...]``. Values on the CPU in one compiled pass where it reproduces
    the reference bit for bit (:func:`kivi.quant.numba_quant.tokens_quantizable`); ``compiled=False`` or anything
    else: :func:`kivi.quant.kv.quantize_side` (the reference). ``ValueError`` on NaN / Inf (finiteness checked).
    Key groups are aligned per request, so a request's tokens alone or in a batch's concatenation give the same
    codes."""
    fmt = cfg.side_format(side)
    if compiled and x.device.type == "cpu" and tokens_quantizable(fmt, x.dtype):
        return quantize_tokens(x.unsqueeze(0), fmt)
    return quantize_side(x.unsqueeze(0), fmt)


class Pending:
    """One request's side from its first token not in the sink or the pages on: ``rows [H, T, D]`` (its window,
    then the step's new tokens), of which ``[take, take + move)`` leave for the pages (:func:`exits`); quantized at
    most once (the per-query boundary of a chunk and the page write need the same segment)."""

    def __init__(self, cfg, side: str, rows: torch.Tensor, take: int, move: int) -> None:
        self.cfg, self.side, self.rows, self.take, self.move = cfg, side, rows, take, move
        self._seg: PackedKV | None = None

    def leaving(self) -> torch.Tensor:
        """The rows ``[H, move, D]`` that leave for the pages."""
        return self.rows[:, self.take: self.take + self.move]

    def quantize(self, lo: int, hi: int) -> PackedKV:
        """Pending tokens ``[lo, hi)`` as the pages store them (:func:`quantize_leaving`)."""
        if (lo, hi) != (self.take, self.take + self.move):
            return quantize_leaving(self.cfg, self.side, self.rows[:, lo:hi])
        if self._seg is None:
            self._seg = quantize_leaving(self.cfg, self.side, self.leaving())
        return self._seg


def set_request_boundary(view: AttentionView, cfg, side: str, pending: Pending, q: int, past: int, sink: int) -> None:
    """Per-query precision of a step of ``q`` tokens into a request holding ``past`` (``sink`` of them in the
    sink), as :class:`kivi.cache.KiviLayer` (:func:`kivi.cache.boundary.set_boundary`): query ``i`` reads the tokens
    one-token decoding would have moved out of the window by its step as they are once moved (sink tokens exact,
    stored tokens bit-identical to what the pages then hold). A request's first chunk (``past == 0``) is an exact
    prefill (no boundary)."""
    stored = view.split - sink
    counts = SideCounts(AXIS[side], cfg.residual_length, cfg.group_size, sink, cfg.sink_tokens, sink + stored,
                        cfg.quantize_after)
    set_boundary(view, counts, pending.rows.unsqueeze(0), q, prefill_exact_queries(past, q, None), pending.quantize)


def request_view(cfg, side: str, pending: Pending, store: BlockStore, sink_rows: torch.Tensor | None, q: int,
                 past: int, *, start: int = 0) -> AttentionView:
    """What attention reads of one request's side in a step of ``q`` tokens: ``sink_rows [H, sink, D]`` (or
    ``None``), the stored tokens ``store`` (``[sink, sink + stored)``: :func:`kivi.cache.pages.page_store`, the pages
    themselves), ``pending`` at full precision; with :func:`set_request_boundary`'s per-query precision.
    ``start``: the first position still stored (sliding-window layers whose first pages are gone)."""
    sink = 0 if sink_rows is None else sink_rows.shape[1]
    view = AttentionView(store, store.length, pending.rows.unsqueeze(0), quantized=True,
                         sink=None if sink_rows is None else sink_rows.unsqueeze(0), start=start)
    set_request_boundary(view, cfg, side, pending, q, past, sink)
    return view


def request_side(cfg, side: str, new: torch.Tensor, past: int, counts: tuple[int, int],
                 read: Callable[[int, int], torch.Tensor], store: BlockStore | None = None, *,
                 start: int = 0) -> tuple[Pending, torch.Tensor | None, AttentionView | None]:
    """One request's side in a step that is not a kernel row, the same for every host: ``new [H, q, D]`` (the
    step's new rows, in the dtype of the host's full-precision rows), ``past`` tokens before it, ``counts``
    ``(sink, stored)`` before it (:func:`kivi.paged.counts.side_counts`), ``read(lo, hi)`` the host's
    full-precision rows of positions ``[lo, hi)`` as ``[H, hi - lo, D]`` (its sink and window slots,
    :mod:`kivi.paged.ring`; a copy: the step writes after). Returns its :class:`Pending` (the window then the
    new rows, with :func:`exits`' take / move), its sink rows ``[H, sink, D]`` (``None``: no sink) and, given
    ``store`` (its pages, :func:`kivi.cache.pages.page_store`), the view attention reads
    (:func:`request_view`; ``start``: the first position still stored); ``None`` without."""
    sink, stored = counts
    split = sink + stored
    sink_rows = read(0, sink) if sink else None
    rows = new if past == split else torch.cat([read(split, past), new], dim=1)
    pending = Pending(cfg, side, rows, *exits(cfg, side, past, new.shape[1], sink, stored))
    view = None if store is None else request_view(cfg, side, pending, store, sink_rows, new.shape[1], past,
                                                   start=start)
    return pending, sink_rows, view


class Leaving:
    """One side's tokens leaving the windows in a step, in token order: ``parts`` (rows ``[H, n, D]``, or a
    :class:`Pending`'s leaving rows) and ``spans`` ``(table row, first store position, count)`` (a part may hold
    several requests' spans; a key span is whole aligned groups)."""

    def __init__(self, cfg, side: str) -> None:
        self.cfg, self.side = cfg, side
        self.parts: list[torch.Tensor | Pending] = []
        self.spans: list[tuple[int, int, int]] = []

    def add(self, part: torch.Tensor | Pending, spans: list[tuple[int, int, int]]) -> None:
        self.parts.append(part)
        self.spans += spans

    def quantize(self) -> PackedKV | None:
        """Every leaving token as the pages store them, ``[1, H, M, ...]`` in token order, in one
        :func:`quantize_leaving` call (a lone request's segment its :class:`Pending` already made); ``None``: none."""
        if not self.parts:
            return None
        if len(self.parts) == 1 and isinstance(self.parts[0], Pending):
            one = self.parts[0]
            return one.quantize(one.take, one.take + one.move)
        rows = [p.leaving() if isinstance(p, Pending) else p for p in self.parts]
        return quantize_leaving(self.cfg, self.side, torch.cat(rows, dim=1) if len(rows) > 1 else rows[0])


def page_index(table: torch.Tensor, spans: list[tuple[int, int, int]], page_size: int, tokens_per_row: set[int]
               ) -> dict[int, tuple[torch.Tensor, torch.Tensor]]:
    """``{tokens per row g: (blocks, rows)}`` (long, on ``table``'s device) of the page rows that spans of leaving
    tokens go to (:func:`kivi.cache.pages.scatter_tokens`'s ``index``): store position ``u`` of span row ``i`` is in
    block ``table[i, u // P]``, row ``(u % P) // g`` (one row per ``g`` tokens: spans of a side with ``g > 1`` are
    whole aligned groups of ``g``). ``table [N, W]``: block ids, the rows the spans name."""
    device = table.device
    rows_of, starts, counts = zip(*spans)
    c = torch.tensor(counts, dtype=torch.long, device=device)
    span = torch.repeat_interleave(torch.arange(len(counts), device=device), c)
    offset = torch.arange(span.numel(), device=device) - (torch.cumsum(c, 0) - c)[span]
    pos = torch.tensor(starts, dtype=torch.long, device=device)[span] + offset
    req = torch.tensor(rows_of, dtype=torch.long, device=device)[span]
    blocks = table[req, pos // page_size].long()
    return {g: (blocks[::g], (pos[::g] % page_size) // g) for g in sorted(tokens_per_row)}


@dataclass(frozen=True)
class Pages:
    """Where one side's leaving tokens go: the side's page fields (``views``: ``{field: [NB, H, rows, C]}``, and
    each field's tokens per row), the block tables ``table [N, W]`` whose rows the spans name, the page size."""

    views: dict[str, torch.Tensor]
    tokens_per_row: dict[str, int]
    table: torch.Tensor
    page_size: int


def commit(sides: Sequence[tuple[Leaving, Pages]], *row_writes: Callable[[], None]) -> None:
    """A step's writes, all or nothing: every side's leaving tokens quantized first (``ValueError`` on a refused
    value: nothing written), then the host's ``row_writes`` (its full-precision rows), then the pages (one indexed
    write per field)."""
    segs = [leaving.quantize() for leaving, _ in sides]
    for write in row_writes:
        write()
    for (leaving, pages), seg in zip(sides, segs):
        if seg is not None:
            index = page_index(pages.table, leaving.spans, pages.page_size, set(pages.tokens_per_row.values()))
            scatter_tokens(pages.views, seg, index, pages.tokens_per_row)


__all__ = ["exits", "quantize_leaving", "Pending", "set_request_boundary", "request_view", "request_side", "Leaving",
           "page_index", "Pages", "commit"]
