"""Where a request's full-precision rows live in KIVI pages: the one window-ring rule of every paged host.

A request keeps, per layer and side, its **sink** tokens and the tokens still in KIVI's full-precision window
as rows in **slots**: slots ``[0, S)`` hold positions ``[0, S)`` (``S`` sink slots: the sink, and the first
tokens before they leave the window; :func:`kivi.cache.schedule.sink_take` fills the sink first), and the
slots from ``S`` on are a **ring** of ``ring`` slots for every later position (:func:`ring_slot`:
``S + pos % ring``). A row is written once, when its token arrives, and never moves; tokens that leave the
window are read from their slot and never rewritten. Both hosts run the paged core's step
(:func:`kivi.paged.forward.paged_step`), which writes a step's rows after its reads, so the ring only needs the
window's ``R + G - 1`` slots (:func:`kivi.cache.schedule.window_ring_slots` is the smallest ring of a host that
writes before it reads); it gets every slot of the request's ``k`` window blocks, ``k * Pw - S``.

The paged decode kernel reads the rows through a slot table, one row id per slot, so its **column is the
slot**: window position ``t`` in column :func:`ring_slot` ``(t, ring, S)`` with ``ring = columns - S``
(:func:`kivi.attention.fused_cpu.paged.torch_paged_decode`, the numba kernel's ``_ring_stage`` and the Triton
kernel's ``_fp_tile`` follow this formula: compiled code cannot call Python).

Slots become rows by :func:`slot_rows`: slot ``s`` is in the request's row block ``blocks[s // per_block]`` at row
``s % per_block``; its row id is ``block * per_block + row`` (:func:`slot_place` gives the block's index and the
row). Pure torch / ints: no host framework.
"""

from __future__ import annotations

import torch


def ring_slot(pos, ring: int, sink: int = 0):
    """The slot of position ``pos`` (an int or an integer tensor): ``pos`` itself below ``sink`` (the sink
    slots), else ``sink + pos % ring``. ``ring``: the ring's slots (at least the tokens a step reads from it)."""
    if isinstance(pos, torch.Tensor):
        return torch.where(pos < sink, pos, sink + pos % ring)
    return pos if pos < sink else sink + pos % ring


def slot_place(slot, per_block: int):
    """``(block index, row)`` of slot ``slot`` (an int or an integer tensor) among a request's row blocks of
    ``per_block`` rows."""
    return slot // per_block, slot % per_block


def slot_rows(blocks: torch.Tensor, slots: torch.Tensor, per_block: int) -> torch.Tensor:
    """Row ids ``block * per_block + row`` (long, the shape of ``slots``) of slots ``slots`` of the requests
    whose row blocks are ``blocks`` (``[n]`` for one request, or ``[N, n]`` for ``slots [N, m]``)."""
    index, row = slot_place(slots.long(), per_block)
    block = blocks[index] if blocks.dim() == 1 else blocks.gather(1, index)
    return block.long() * per_block + row


__all__ = ["ring_slot", "slot_place", "slot_rows"]
