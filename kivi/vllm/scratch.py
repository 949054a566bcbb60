"""A step's exact-prefill rows addressed as a scratch paged cache (framework-free torch).

vLLM's attention kernels (the CPU one, :mod:`kivi.vllm.prefill`; the Triton one on a GPU,
:mod:`kivi.vllm.triton_prefill`) read keys and values through a block table from paged storage. The plugin's
own pages hold packed KIVI data, so a step's first chunks (every span's rows, :data:`kivi.paged.forward.ExactPrefill`)
are written to a scratch paged cache of their own, each request from a fresh block. :func:`scratch_pages` is
that layout, once for both kernels: the rows of the step's input, their scratch slots, the block table and
the query offsets. Tensors are made on the device from host lists of a few numbers per request: nothing is
read back from the device.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class ScratchPages:
    """``n`` spans (requests) of ``T`` rows in all, laid out in scratch blocks of ``block`` tokens.

    ``first``, ``last``: the spans' first and last row (``last`` exclusive) of the step's input;
    ``rows``: long ``[T]``, the input row of every scratch row in span order, or ``None`` when the spans are
    adjacent (then the rows are ``[first, last)``); ``slots``: long ``[T]``, the scratch slot
    (``block id * block + offset``) of every row; ``table``: int32 ``[n, max_blocks]``, request ``i``'s blocks
    (``0`` past its own, never read for rows: the kernels stop at ``seq_lens``); ``query_start``: int32 ``[n + 1]``,
    the offsets of the spans in the gathered rows; ``seq_lens``: int32 ``[n]``; ``num_blocks``, ``max_len``: ints.
    """

    block: int
    first: int
    last: int
    rows: torch.Tensor | None
    slots: torch.Tensor
    table: torch.Tensor
    query_start: torch.Tensor
    seq_lens: torch.Tensor
    num_blocks: int
    max_len: int

    def take(self, x: torch.Tensor) -> torch.Tensor:
        """The spans' rows of ``x [rows of the step, ...]``, in span order (a view when they are adjacent)."""
        return x[self.first:self.last] if self.rows is None else x[self.rows]

    def put(self, out: torch.Tensor, rows: torch.Tensor) -> None:
        """Writes ``rows`` (``take``'s order) into the spans' rows of ``out``, converted to its dtype."""
        if self.rows is None:
            out[self.first:self.last] = rows.to(out.dtype)
        else:
            out[self.rows] = rows.to(out.dtype)


def scratch_pages(spans: list[tuple[int, int]], block: int, device: torch.device | str,
                  spare: int = 0) -> ScratchPages:
    """The scratch layout of ``spans`` (non-empty, increasing, non-overlapping ``(lo, hi)`` row ranges of the
    step's input) in blocks of ``block`` tokens on ``device``; ``spare`` zero columns of the table past the
    widest request's blocks (for a kernel that reads a whole tile's block ids, past a request's last block)."""
    if not spans or block < 1:
        raise ValueError(f"scratch_pages: spans={spans!r}, block={block}: needs at least one span and block >= 1")
    lens = [hi - lo for lo, hi in spans]
    if min(lens) < 1 or any(spans[i][1] > spans[i + 1][0] for i in range(len(spans) - 1)):
        raise ValueError(f"scratch_pages: spans={spans!r}: each must hold a row and they must not overlap or "
                         "go backwards")
    blocks = [-(-n // block) for n in lens]
    starts = [0]
    block0 = [0]
    for n, m in zip(lens, blocks):
        starts.append(starts[-1] + n)
        block0.append(block0[-1] + m)
    total = starts[-1]
    adjacent = all(spans[i][1] == spans[i + 1][0] for i in range(len(spans) - 1))

    def per_row(values: list[int]) -> torch.Tensor:  # values[i] + (row's offset in the gathered rows), per row
        counts = torch.tensor(lens, device=device)
        base = torch.tensor(values, device=device)
        return torch.arange(total, device=device) + torch.repeat_interleave(base, counts, output_size=total)

    rows = None if adjacent else per_row([lo - s for (lo, _), s in zip(spans, starts[:-1])])
    slots = per_row([b * block - s for b, s in zip(block0[:-1], starts[:-1])])
    width = max(blocks) + spare
    j = torch.arange(width, dtype=torch.int32, device=device)
    first_block = torch.tensor(block0[:-1], dtype=torch.int32, device=device)[:, None]
    owned = j[None, :] < torch.tensor(blocks, dtype=torch.int32, device=device)[:, None]
    table = torch.where(owned, first_block + j[None, :], torch.zeros((), dtype=torch.int32, device=device))
    return ScratchPages(
        block=block, first=spans[0][0], last=spans[-1][1], rows=rows, slots=slots, table=table,
        query_start=torch.tensor(starts, dtype=torch.int32, device=device),
        seq_lens=torch.tensor(lens, dtype=torch.int32, device=device), num_blocks=block0[-1], max_len=max(lens))


__all__ = ["ScratchPages", "scratch_pages"]
