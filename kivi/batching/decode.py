"""The decoding requests of a continuous batch as the paged decode kernel's inputs (one call per layer).

Per forward (:func:`decode_step`, at its first layer): which requests of the batch have one query token,
their block tables as one ``int32 [N, max_pages]`` tensor and their window-row slots as one index
tensor. Per layer and side (:func:`gather_rows`): every such request's full-precision rows — sink, window
and the step's new token — in one gather, ``[N, window_rows + 1, H, D]``, laid out as the kernel reads
them (sink in slots ``[0, sink)``, window from slot ``w0 = sink_tokens``, the new token after it). The
counts come from the requests' states before the layer moves anything (:func:`decode_counts`), so the
kernel sees what one-token decoding shows attention: the window at full precision, then the move.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class DecodeStep:
    """The requests of a forward with one query token: ``rows`` (their positions in the batch), ``table``
    (``int32 [N, max_pages]`` block tables, padded with 0) and ``window_index`` (long
    ``[N, layers, 2, window_rows, 2]``: (block, row) of each full-precision row slot)."""

    rows: tuple[int, ...]
    table: torch.Tensor
    window_index: torch.Tensor  # padded to the longest request's slots


def decode_step(
    batch: list[tuple[str, int, int]], states: list, block_tables: dict[str, list[int]]
) -> DecodeStep | None:
    """The :class:`DecodeStep` of ``batch`` (``(request id, past, query length)`` each; ``states`` the
    requests' :class:`~kivi.batching.allocator.RequestState`), or ``None`` when no request decodes."""
    rows = tuple(i for i, (_, _, q) in enumerate(batch) if q == 1)
    if not rows:
        return None
    tables = [block_tables.get(batch[i][0], []) for i in rows]
    width = max(1, max(len(t) for t in tables))
    table = torch.tensor([t + [0] * (width - len(t)) for t in tables], dtype=torch.int32)
    index = [states[i].window_index for i in rows]
    slots = max(x.shape[2] for x in index)
    # requests may hold different numbers of row slots: pad with (block 0, row 0), a valid row no count reaches
    index = [x if x.shape[2] == slots else torch.nn.functional.pad(x, (0, 0, 0, slots - x.shape[2])) for x in index]
    return DecodeStep(rows, table, torch.stack(index))


def gather_rows(window_rows: torch.Tensor, index: torch.Tensor, new: torch.Tensor, windows: torch.Tensor,
                w0: int) -> torch.Tensor:
    """``[N, slots + 1, H, D]`` (``window_rows``' dtype): the rows at ``index`` (long ``[N, slots, 2]`` of
    ``window_rows [blocks, rows, H, D]``) and each request's new token ``new [N, H, D]`` in slot
    ``w0 + windows[i]`` (right after its window)."""
    n, slots = index.shape[:2]
    out = torch.empty(n, slots + 1, *window_rows.shape[2:], dtype=window_rows.dtype)
    out[:, :slots] = window_rows[index[..., 0], index[..., 1]]
    out[torch.arange(n), w0 + windows] = new.to(out.dtype)
    return out


def decode_counts(layer: int, past: list[int], states: list) -> torch.Tensor:
    """int64 ``[N, 6]``: per request ``[k sink, k stored, k window + 1, v sink, v stored, v window + 1]``
    at ``layer`` (window + the new token), from the states before the layer moves anything."""
    rows = []
    for p, st in zip(past, states):
        row = []
        for s in range(2):
            sink, stored = st.sink[layer][s], st.stored[layer][s]
            row += [sink, stored, p - sink - stored + 1]
        rows.append(row)
    return torch.tensor(rows, dtype=torch.int64)


__all__ = ["DecodeStep", "decode_step", "gather_rows", "decode_counts"]
