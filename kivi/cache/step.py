"""One forward's step over one side of a layer: the one code path for every layer, head-split or not.

A layer's side is one :class:`~kivi.cache.side.SideState` per head group (one for a plain layer), all
sharing the schedule (residual length, group size, sink; only widths differ), so they agree on every
token count. The step builds the pending tensor (window + new tokens) once for the whole layer, gives
every group its view, moves what is due group by group (each at its width), and keeps what stays as
one tensor whose head slices are the groups' windows (:class:`SharedWindow`): a decode step writes
the layer's window once, whatever the number of groups.
"""

from __future__ import annotations

import weakref
from typing import Sequence

import torch

from .side import SideState
from .view import AttentionView


class SharedWindow:
    """The window of one side of a layer as one ``[B, H, W, D]`` tensor over its head groups.

    :meth:`set` hands every group its head slice and remembers the slices it handed out; :meth:`get`
    returns the tensor while every group still holds exactly its slice (a crop, batch edit or rollback
    replaces a group's window: then the groups' windows are concatenated again). It holds weak references
    only: the groups' windows are what keeps the tensor alive, so a replaced window frees its memory."""

    def __init__(self, heads: Sequence[slice | None]):
        self.heads = tuple(heads)
        self._full = None  # weakref to the [B, H, W, D] tensor
        self._slices: tuple = ()  # weakrefs to the slices handed out

    def get(self, sides: Sequence[SideState]) -> torch.Tensor | None:
        windows = [s.window for s in sides]
        if len(windows) == 1 or windows[0] is None:
            return windows[0]
        full = None if self._full is None else self._full()
        if full is not None and all(w is h() for w, h in zip(windows, self._slices)):
            return full
        return torch.cat(windows, dim=1)

    def set(self, sides: Sequence[SideState], window: torch.Tensor | None, valid: torch.Tensor | None) -> None:
        slices = tuple(None if window is None else _heads(window, h) for h in self.heads)
        for side, w in zip(sides, slices):
            side.set_window(w, valid)
        if window is None or len(slices) == 1:
            self._full, self._slices = None, ()
        else:
            self._full, self._slices = weakref.ref(window), tuple(weakref.ref(w) for w in slices)


def _heads(x: torch.Tensor, heads: slice | None) -> torch.Tensor:
    return x if heads is None else x[:, heads]


def append_side(sides: Sequence[SideState], shared: SharedWindow, x: torch.Tensor, valid: torch.Tensor | None,
                n: int, *, record: bool, exact: int) -> list[AttentionView]:
    """Append ``x [B, H, n, D]`` to one side of a layer (``sides``: its head groups, ``shared.heads``: their
    heads); return every group's view (the pre-move state). ``record`` (past recording): the window keeps
    every pending token, exact, until the next crop / forward moves what is due (:func:`flush_sides`).
    ``exact``: the forward's first queries that read every token at full precision."""
    if not sides[0].quantize:
        return [s.append_unquantized(_heads(x, h)) for s, h in zip(sides, shared.heads)]
    window = shared.get(sides)
    pending = x if window is None else torch.cat([window, x], dim=-2)
    pvalid = sides[0].pending_valid(valid, n)  # the groups share their padding marks
    views = [s.view(_heads(pending, h), n, pvalid, exact) for s, h in zip(sides, shared.heads)]
    if record:
        shared.set(sides, pending if pending is not x else x.clone(),
                   None if pvalid is None or bool(pvalid.all()) else pvalid)
    else:
        flush_sides(sides, shared, pending, pvalid, fresh=pending is not x)
    return views


def flush_sides(sides: Sequence[SideState], shared: SharedWindow, pending: torch.Tensor,
                pvalid: torch.Tensor | None, *, fresh: bool) -> None:
    """Move what the schedule makes due from ``pending`` (window + new tokens, or the window a recorded
    forward left) into every group's sink and storage; the rest becomes the window. ``fresh``: ``pending``
    is a new tensor nothing else holds (then it can be the window as is)."""
    total = pending.shape[-2]
    take, move = sides[0].exits(total)  # one schedule for every group
    for s, h in zip(sides, shared.heads):
        s.flush(_heads(pending, h), pvalid, take, move)
    out = take + move
    if out == total:
        rest = None
    elif out or not fresh:  # exact copies that pin neither the caller's tensor nor what left
        rest = pending[:, :, out:].clone()
    else:
        rest = pending
    rest_valid = None
    if pvalid is not None and rest is not None and not bool(pvalid[:, out:].all()):
        rest_valid = pvalid[:, out:].clone()
    shared.set(sides, rest, rest_valid)


__all__ = ["SharedWindow", "append_side", "flush_sides"]
