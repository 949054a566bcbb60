"""The decoding requests of a continuous batch as the paged decode kernel's inputs (one call per layer).

Per forward (:func:`decode_step`, at its first layer): which requests of the batch have one query token,
their block tables as one ``int32 [N, max_pages]`` tensor and their window-block row ids as one
``int32 [layers, 2, N, window_rows]`` tensor (row ``block * rows_per_block + row`` of
:func:`~kivi.batching.layout.window_view`). Per layer and side the kernel reads the rows in place through
that table (:class:`kivi.attention.fused_cpu.paged.RingRows`: sink in slots ``[0, S)``, the window a ring
from slot ``S``, the step's new token apart): no gather of the window rows. The counts come from the
requests' token counts before the layer moves anything (:func:`decode_counts`, the schedule's), so the kernel
sees what one-token decoding shows attention: the window at full precision, then the move. Per layer the cache
(:meth:`kivi.batching.paged_cache.KiviPagedCache.layer_forward`) puts them in the one kernel call of both paged
hosts, :class:`kivi.paged.decode.PagedDecode`, which ``"kivi_paged"`` runs.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ..paged.counts import kernel_counts


@dataclass(frozen=True)
class DecodeStep:
    """The requests of a forward with one query token: ``rows`` (their positions in the batch), ``table``
    (``int32 [N, max_pages]`` block tables, padded with 0) and ``slots`` (``int32 [layers, 2, N, window_rows]``:
    the row id of each full-precision row slot, padded with row 0 past a short request's slots)."""

    rows: tuple[int, ...]
    table: torch.Tensor
    slots: torch.Tensor


def decode_step(batch: list[tuple[str, int, int]], states: list, block_tables: dict[str, list[int]],
                layout) -> DecodeStep | None:
    """The :class:`DecodeStep` of ``batch`` (``(request id, past, query length)`` each; ``states`` the
    requests' :class:`~kivi.batching.allocator.RequestState`; ``layout`` the cache's
    :class:`~kivi.batching.layout.PageLayout`), or ``None`` when no request decodes."""
    rows = tuple(i for i, (_, _, q) in enumerate(batch) if q == 1)
    if not rows:
        return None
    tables = [block_tables.get(batch[i][0], []) for i in rows]
    width = max(1, max(len(t) for t in tables))
    table = torch.tensor([t + [0] * (width - len(t)) for t in tables], dtype=torch.int32)
    slots = torch.zeros(layout.num_layers, 2, len(rows), layout.window_rows, dtype=torch.int32)
    for k, i in enumerate(rows):
        ids = states[i].window_ids  # long [layers, 2, slots]: PageLayout.window_ids
        slots[:, :, k, : ids.shape[2]] = ids
    return DecodeStep(rows, table, slots)


def decode_counts(cfg, past: list[int], shared: list[int]) -> torch.Tensor:
    """int64 ``[N, 6]``: per request ``[k sink, k stored, k window + 1, v sink, v stored, v window + 1]``
    at a layer of config ``cfg`` (window + the new token) for requests holding ``past`` tokens (``shared`` of
    them taken from other requests' pages): :func:`kivi.paged.counts.kernel_counts`, before the layer moves
    anything."""
    return torch.tensor([kernel_counts(cfg, p, n) for p, n in zip(past, shared)], dtype=torch.int64)


__all__ = ["DecodeStep", "decode_step", "decode_counts"]
