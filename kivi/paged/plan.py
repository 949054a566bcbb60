"""A paged step's schedule (vLLM's), the same for every layer: which rows the batched decode kernel serves, where their
full-precision rows are, what leaves their windows, and which ring slots the step writes (framework-free torch).

kivi's schedule depends on token counts only (:mod:`kivi.cache.schedule`), and vLLM hands every layer of a
step the same ``query_start`` / ``seq_lens``: so this Python work is done once per step
(:func:`step_plan`; the plugin's metadata builder makes it, :class:`kivi.vllm.backend.KiviMetadataBuilder`)
and each layer only maps ring slots to its own blocks with a few tensor ops
(:meth:`kivi.paged.geometry.RingPool.slot_ids`). A request's full-precision rows live in slots
(:func:`kivi.paged.ring.ring_slot`, a ring of ``k * Pw - S``); nothing here depends on block ids.

* :class:`KernelRows` (``None`` when no decode row has anything stored): the decode rows of
  :func:`kivi.paged.decode_call.stores_any`, the kernel's ``counts``, and per side the slot each column of the
  kernel's in-place slot table reads (:class:`kivi.attention.fused_cpu.paged.RingRows`: column ``c`` is slot
  ``c``, the kernel and the rings following one rule, :func:`kivi.paged.ring.ring_slot`), and what leaves those
  rows' windows in the step (:class:`KernelLeaving`);
* ``others``: every other request with tokens in the step (prefills, chunks, decode rows with nothing
  stored), which :func:`kivi.paged.forward.paged_step` serves request by request;
* :class:`RingWrites`: the step's tokens still in full precision after it, their slots in ring order.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import numpy as np
import torch

from ..config import KiviConfig
from ..quant.page import SIDES
from .counts import kernel_counts, side_counts
from .geometry import KiviGeometry
from .ring import ring_slot
from .step import exits


@dataclass(frozen=True)
class KernelLeaving:
    """One side's tokens leaving the kernel rows' windows, in token order: ``row`` (long ``[M]``: the kernel
    row), ``req`` (long ``[M]``: its batch row), ``slot`` (long ``[M]``: the token's ring slot), ``new`` (bool
    ``[M]``: the step's own token, read from the input: it is not in the rings yet; ``any_new``: whether any is)
    and ``spans`` ``(request, first store position, count)``; ``table`` (int64 ``[M, 4]``: ``(request, ring slot or
    -1, input row or -1, store position)`` per token, a new token's from the input) is the same for the compiled
    writes (:mod:`kivi.paged.write`)."""

    row: torch.Tensor
    req: torch.Tensor
    slot: torch.Tensor
    new: torch.Tensor
    any_new: bool
    spans: list[tuple[int, int, int]]
    table: np.ndarray


@dataclass(frozen=True)
class KernelRows:
    """The step's decode rows the batched kernel serves: ``rows`` (batch rows), ``tokens`` (long ``[N]``: each
    row's query in the step's input), ``counts`` (int64 ``[N, 6]``: ``[k sink, k stored, k window + 1, v sink,
    v stored, v window + 1]``), ``slots`` (per side long ``[N, k * Pw]``: the slot each kernel column reads,
    the column itself), ``leaving`` (per side, ``None`` when nothing leaves), ``w0`` (the sink columns ``S``),
    ``index`` and
    ``host_counts`` (``counts`` as a host array: it stays on the host when the plan moves to the step's device, so
    a kernel on that device checks and sizes its launch without reading ``counts`` back)."""

    rows: list[int]
    tokens: torch.Tensor
    counts: torch.Tensor
    slots: dict[str, torch.Tensor]
    leaving: dict[str, KernelLeaving | None]
    w0: int
    index: torch.Tensor  # ``rows`` as long ``[N]`` (rows of the block tables)
    host_counts: np.ndarray


@dataclass(frozen=True)
class RingWrites:
    """Tokens to write to the rings after the step's reads: request ``req``, ring slot ``slot`` and input row
    ``src`` (long ``[M]`` each), sorted by ring (``slot // Pw``); ``bounds`` ``(ring, first, end)`` per ring
    written; ``table`` (int64 ``[M, 3]``: the columns ``req, slot, src``) for the compiled writes."""

    req: torch.Tensor
    slot: torch.Tensor
    src: torch.Tensor
    bounds: list[tuple[int, int, int]]
    table: np.ndarray


@dataclass(frozen=True)
class StepPlan:
    """One step's layer-independent schedule (the module docstring); ``slots`` / ``window_tokens`` /
    ``sink_tokens``: the ring geometry it was made for (``k * Pw``, ``Pw``, ``S``)."""

    kernel: KernelRows | None
    others: list[int]
    writes: RingWrites | None
    slots: int
    window_tokens: int
    sink_tokens: int

    def to(self, device: torch.device | str) -> StepPlan:
        """The same plan with every tensor on ``device`` (the step's, where it is not the CPU: the plan is made on
        the host, and a layer's index arithmetic mixes it with its block tables); host arrays stay."""
        return _to(self, torch.device(device))

    def fits(self, geo: KiviGeometry) -> bool:
        return (self.slots, self.window_tokens, self.sink_tokens) == (
            geo.window_rings * geo.window_tokens, geo.window_tokens, geo.sink_tokens)


def _to(x, device: torch.device):
    if isinstance(x, torch.Tensor):
        return x.to(device)
    if dataclasses.is_dataclass(x):
        return dataclasses.replace(x, **{f.name: _to(getattr(x, f.name), device) for f in dataclasses.fields(x)})
    if isinstance(x, dict):
        return {k: _to(v, device) for k, v in x.items()}
    return x


def stores_any(cfg: KiviConfig, past: int, shared: int = 0) -> bool:
    """Whether a request holding ``past`` tokens has a token out of its window (stored, or in the sink) on
    either side: a decode row of such a request goes to the kernel, one without attends exactly (as kivi's own
    cache does)."""
    return any(sum(side_counts(cfg, side, past, shared)[:2]) for side in SIDES)


def step_plan(cfg: KiviConfig, geo: KiviGeometry, query_start: list[int], seq_lens: list[int],
              shared: list[int] | None = None) -> StepPlan:
    """The :class:`StepPlan` of a step of ``seq_lens`` requests whose tokens are rows ``[query_start[i],
    query_start[i + 1])`` of its input; ``shared``: per request, the prompt tokens it took from other requests'
    pages (:func:`kivi.paged.counts.side_counts`; ``None``: none)."""
    S = cfg.sink_tokens
    slots, pw = geo.window_rings * geo.window_tokens, geo.window_tokens
    rows, others, writes = [], [], []
    counts, leaving = [], {side: [] for side in SIDES}  # leaving: (kernel row, position, count, request, stored)
    for i, seq in enumerate(seq_lens):
        lo, hi = query_start[i], query_start[i + 1]
        q_len = hi - lo
        if q_len == 0:
            continue
        past = seq - q_len
        # the new tokens in full precision after the step: positions below S (sink, or not yet left the window),
        # then those still in the window (among the last R + G - 1)
        for first, end in ((past, min(seq, S)), (max(past, S, seq - (geo.sliding_window - 1)), seq)):
            writes += [(ring_slot(p, slots - S, S), i, lo + p - past) for p in range(first, end)]
        taken = shared[i] if shared else 0
        if q_len != 1 or not stores_any(cfg, past, taken):
            others.append(i)
            continue
        row = kernel_counts(cfg, past, taken)
        for s, side in enumerate(SIDES):
            sink, stored = row[3 * s: 3 * s + 2]
            take, move = exits(cfg, side, past, 1, sink, stored)  # kivi.paged.step's one rule
            if move:
                leaving[side].append((len(rows), sink + stored + take, move, i, stored))
        rows.append(i)
        counts.append(row)
    kernel = None
    if rows:
        c = torch.tensor(counts, dtype=torch.long)
        index = torch.tensor(rows, dtype=torch.long)
        cols = torch.arange(slots).expand(len(rows), slots)  # the kernel's column is the slot (kivi.paged.ring)
        table = {side: cols for side in SIDES}
        out = {}
        for side in SIDES:
            if not leaving[side]:
                out[side] = None
                continue
            j, pos, new, spans, reqs, src, store = [], [], [], [], [], [], []
            for k_row, first, move, i, stored in leaving[side]:
                j += [k_row] * move
                pos += range(first, first + move)
                new += [p == seq_lens[i] - 1 for p in range(first, first + move)]
                spans.append((i, stored, move))
                reqs += [i] * move
                src += [query_start[i] if p == seq_lens[i] - 1 else -1 for p in range(first, first + move)]
                store += range(stored, stored + move)
            j = torch.tensor(j, dtype=torch.long)
            slot = ring_slot(torch.tensor(pos, dtype=torch.long), slots - S, S)
            new_t = torch.tensor(new)
            tab = np.stack([reqs, slot.masked_fill(new_t, -1).numpy(), src, store], axis=1).astype(np.int64)
            out[side] = KernelLeaving(j, index[j], slot, new_t, any(new), spans, tab)
        kernel = KernelRows(rows, torch.tensor([query_start[i] for i in rows], dtype=torch.long), c, table, out, S,
                            index, c.numpy().copy())
    ring_writes = None
    if writes:
        writes.sort(key=lambda w: w[0] // pw)  # stable: token order inside a ring
        slot, req, src = torch.tensor(writes, dtype=torch.long).unbind(1)
        ring = (slot // pw).tolist()
        bounds, first = [], 0
        for at in range(1, len(ring) + 1):
            if at == len(ring) or ring[at] != ring[first]:
                bounds.append((ring[first], first, at))
                first = at
        ring_writes = RingWrites(req, slot, src, bounds, np.stack([req.numpy(), slot.numpy(), src.numpy()], axis=1))
    return StepPlan(kernel, others, ring_writes, slots, pw, S)


__all__ = ["StepPlan", "KernelRows", "KernelLeaving", "RingWrites", "step_plan", "stores_any"]
