"""Append-only block storage for quantized keys or values of one layer.

Storage is a list of preallocated blocks. Appending writes in place into the last block and
allocates a new block when it is full, so nothing already stored is ever copied. A new block holds
``block_size`` tokens, or exactly the segment being appended when that is longer (a long prefill
becomes one block of its own size, with no unused tail). A block holds, for every tensor field of
the segment type (:class:`~kivi.quant.kv.PackedKV` or :class:`FpSegment`), the rows of its tokens
(keys' per-group parameters: one row per ``G`` tokens).

Blocks that a sliding-window layer no longer needs can be dropped from the front (``evict``);
``start`` is then the first token still held.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable, Iterator, Protocol

import torch

from ..quant.kv import PackedKV, token_divisor
from ..quant.side_format import VALUE_AXIS, SideFormat
from .schedule import new_block_tokens, saved_capacity


@dataclass
class FpSegment:
    """``T`` tokens kept in full precision: ``data [B, H, T, D]`` (a side that is not quantized)."""

    data: torch.Tensor
    axis: str = VALUE_AXIS
    group_size: int = 1

    @property
    def num_tokens(self) -> int:
        return self.data.shape[-2]

    def tensors(self) -> dict[str, torch.Tensor]:
        return {"data": self.data}

    def with_tensors(self, **tensors: torch.Tensor) -> "FpSegment":
        return FpSegment(tensors.get("data", self.data), self.axis, self.group_size)


Segment = PackedKV | FpSegment
#: The dtypes a saved segment may name (by their torch names without the ``torch.`` prefix).
DTYPES = {name: getattr(torch, name) for name in (
    "float32", "float16", "bfloat16", "float64", "uint8", "int8", "int16", "int32", "int64", "bool")}


class Storage(Protocol):
    """What a side of a layer keeps its stored tokens ``[start, length)`` in: a :class:`BlockStore`, or a
    :class:`~kivi.cache.tiers.TieredStore` (position tiers are a storage layout). The layer's side reads and
    writes storage through these methods only."""

    start: int
    length: int
    #: Whether :meth:`BlockStore.append_in_place` may write quantized tokens straight into the storage.
    writes_in_place: bool

    def append(self, seg: Segment) -> None: ...
    def iter_blocks(self, end: int | None = None) -> Iterator[tuple[int, Segment]]: ...
    def read_range(self, a: int, b: int) -> Segment: ...
    def truncate(self, new_length: int) -> None: ...
    def check_truncate(self, new_length: int) -> None: ...
    def evict(self, before: int) -> None: ...
    def restart(self, position: int) -> None: ...
    def snapshot(self) -> Any: ...
    def tier_stores(self) -> tuple["BlockStore", ...]: ...
    def checkpoint(self) -> tuple: ...
    def rollback(self, checkpoint: tuple) -> None: ...
    def map_tensors(self, fn: Callable[[torch.Tensor], torch.Tensor]) -> None: ...
    def nbytes_by_field(self) -> dict[str, int]: ...
    def state_dict(self) -> dict[str, Any]: ...
    def load_state_dict(self, state: dict[str, Any], device: str | torch.device = "cpu") -> None: ...


@dataclass
class BlockStore:
    """Quantized tokens ``[start, length)`` of one side (keys or values) of one layer."""

    block_size: int
    template: Segment | None = None  # shapes / metadata of the stored segments (first append)
    blocks: list[dict[str, torch.Tensor] | None] = field(default_factory=list)
    starts: list[int] = field(default_factory=list)  # first token of each block
    caps: list[int] = field(default_factory=list)  # tokens each block can hold
    length: int = 0  # tokens appended so far (absolute index of the next token)
    start: int = 0  # first token still stored (after evictions)
    #: Memo for readers that derive data from the blocks (e.g. the fused kernel's descriptor tables),
    #: keyed by reader. Cleared whenever a block is added, dropped or replaced; appends that write
    #: into an existing block keep it, so memoised data must not assume a block's contents are final.
    derived: dict = field(default_factory=dict, repr=False, compare=False)

    def __deepcopy__(self, memo: dict) -> "BlockStore":
        """A copy with its own blocks and an empty ``derived``: memoised readers' data (e.g. the fused
        kernel's tables of raw block addresses) points at *this* store's tensors, so a copy that kept
        it would read the original's blocks."""
        import copy

        new = BlockStore.__new__(BlockStore)
        memo[id(self)] = new
        for name, value in self.__dict__.items():
            setattr(new, name, {} if name == "derived" else copy.deepcopy(value, memo))
        return new

    writes_in_place = True

    # ------------------------------------------------------------------ writing
    def _divisor(self, name: str) -> int:
        assert self.template is not None
        return token_divisor(self.template.axis, self.template.group_size, name)

    def _new_block(self, tokens: int) -> None:
        assert self.template is not None
        blk = {}
        for name, t in self.template.tensors().items():
            rows = tokens // self._divisor(name)
            blk[name] = torch.empty((*t.shape[:2], rows, *t.shape[3:]), dtype=t.dtype, device=t.device)
        self.blocks.append(blk)
        self.starts.append(self.length)
        self.caps.append(tokens)
        self.derived.clear()

    def append(self, seg: Segment) -> None:
        """Write ``seg`` (its tokens become ``[length, length + seg.num_tokens)``)."""
        if seg.num_tokens == 0:
            return
        if self.template is None:
            # Zero-token tensors of their own: a slice (v[:, :, :0]) would keep the whole first segment alive.
            self.template = seg.with_tensors(**{k: _no_tokens(v) for k, v in seg.tensors().items()})
        tensors = seg.tensors()

        def copy(lo: int, hi: int, views: dict[str, torch.Tensor]) -> None:
            for name, dst in views.items():
                d = self._divisor(name)
                dst.copy_(tensors[name][:, :, lo // d : hi // d])

        self.append_in_place(seg.num_tokens, copy)

    def append_in_place(self, n: int, write: Callable[[int, int, dict[str, torch.Tensor]], None]) -> None:
        """Append ``n`` tokens by letting ``write(lo, hi, views)`` fill the storage of tokens ``[lo, hi)`` of them.

        ``views`` maps every tensor field of the template to the block rows those tokens occupy
        (in-place views; ``write`` must fill them all). Called once per block the tokens span. The
        template (first :meth:`append`) must exist: it gives the fields, shapes and dtypes.
        """
        if self.template is None:
            raise ValueError("append_in_place needs a template: the first segment goes through append()")
        length, nblocks = self.length, len(self.blocks)
        done = 0
        try:
            while done < n:
                if not self.blocks or self.starts[-1] + self.caps[-1] <= self.length:
                    self._new_block(new_block_tokens(n - done, self.block_size))
                blk = self.blocks[-1]
                off = self.length - self.starts[-1]
                m = min(self.caps[-1] - off, n - done)
                views = {}
                for name, t in blk.items():
                    d = self._divisor(name)
                    views[name] = t[:, :, off // d : (off + m) // d]
                write(done, done + m, views)
                done += m
                self.length += m
        except BaseException:
            # All or nothing: a failed write (e.g. non-finite input) leaves the store as it was.
            self.length = length
            del self.blocks[nblocks:], self.starts[nblocks:], self.caps[nblocks:]
            self.derived.clear()
            raise

    # ------------------------------------------------------------------ checkpoints
    def checkpoint(self) -> tuple:
        """What :meth:`rollback` needs to undo every change made after this call.

        References to the blocks (shallow copies of the block lists): appends never write a row
        below ``length``, and evictions, truncations and :meth:`map_tensors` drop or replace whole
        blocks, so holding the old ones is enough to restore them.
        """
        return self.length, self.start, list(self.blocks), list(self.starts), list(self.caps), self.template

    def rollback(self, checkpoint: tuple) -> None:
        """Undo every append, eviction, truncation and tensor map made since ``checkpoint``."""
        self.length, self.start, blocks, starts, caps, self.template = checkpoint
        self.blocks[:], self.starts[:], self.caps[:] = blocks, starts, caps
        self.derived.clear()

    def skip(self, n: int) -> None:
        """Advance an empty store (``start == length``) past ``n`` positions it never holds (tokens that
        went straight on to an older position tier); blocks that end before the new start are freed."""
        if self.start != self.length:
            raise ValueError(f"skip({n}) needs an empty store; it holds tokens [{self.start}, {self.length})")
        if n:
            self.length += n
            self.evict(self.length)

    def restart(self, position: int) -> None:
        """Drop every block and start empty at ``position`` (the sink's end: nothing is stored before it)."""
        self.blocks, self.starts, self.caps = [], [], []
        self.template = None
        self.start = self.length = position
        self.derived = {}

    def snapshot(self) -> "BlockStore":
        """What a view of this forward reads: the store itself (its rows below ``length`` never change)."""
        return self

    def tier_stores(self) -> tuple["BlockStore", ...]:
        """The block stores of this storage, oldest tier first: just this one."""
        return (self,)

    def frozen(self) -> "BlockStore":
        """A read-only snapshot of the tokens ``[start, length)`` held now: shares the block tensors
        (no copy), unaffected by later evictions or appends of this store (rows below ``length``
        are never rewritten by either)."""
        snap = BlockStore(self.block_size)
        snap.blocks, snap.starts, snap.caps = list(self.blocks), list(self.starts), list(self.caps)
        snap.start, snap.length, snap.template = self.start, self.length, self.template
        # The readers' memo is shared: it is keyed by block index, and an index holds the same block
        # in both (appends add blocks at the end; whatever replaces or drops blocks clears the memo).
        snap.derived = self.derived
        return snap

    # ------------------------------------------------------------------ reading
    def iter_blocks(self, end: int | None = None) -> Iterator[tuple[int, Segment]]:
        """Yield ``(first_token, segment)`` for the stored tokens ``[start, end)``, one block at a time.

        Segments are views (no copy) into the blocks.
        """
        end = self.length if end is None else end
        if self.template is None or end <= self.start:
            return
        for blk, b0, cap in zip(self.blocks, self.starts, self.caps):
            if blk is None or b0 + cap <= self.start:
                continue
            if b0 >= end:
                break
            lo = max(self.start, b0) - b0
            hi = min(end, b0 + cap) - b0
            views = {name: t[:, :, lo // self._divisor(name) : hi // self._divisor(name)] for name, t in blk.items()}
            yield b0 + lo, self.template.with_tensors(**views)

    def read(self, end: int | None = None) -> Segment | None:
        """Tokens ``[start, end)`` as one (copied) segment, or ``None`` when empty."""
        parts = [seg for _, seg in self.iter_blocks(end)]
        if not parts:
            return None
        if len(parts) == 1:
            return parts[0]
        names = parts[0].tensors().keys()
        return parts[0].with_tensors(**{k: torch.cat([p.tensors()[k] for p in parts], dim=2) for k in names})

    def read_range(self, a: int, b: int) -> Segment:
        """Tokens ``[a, b)`` as one segment (views where they lie in one block; key bounds on group boundaries)."""
        parts = [token_slice(seg, max(a, t0) - t0, min(b, t0 + seg.num_tokens) - t0)
                 for t0, seg in self.iter_blocks(b) if t0 + seg.num_tokens > a]
        if len(parts) == 1:
            return parts[0]
        names = parts[0].tensors().keys()
        return parts[0].with_tensors(**{k: torch.cat([p.tensors()[k] for p in parts], dim=2) for k in names})

    # ------------------------------------------------------------------ editing
    def truncate(self, new_length: int) -> None:
        """Forget tokens ``[new_length, length)``; blocks past the end are freed."""
        if new_length >= self.length:
            return
        if new_length < self.start:
            raise ValueError(f"cannot truncate to {new_length} tokens: tokens before {self.start} were evicted")
        origin = self.starts[0] if self.starts else self.start  # groups are aligned on the first block
        if self.template is not None and (new_length - origin) % self._divisor("scale"):
            raise ValueError(f"truncation to {new_length} would split a quantization group")
        self.length = new_length
        keep = sum(1 for b0 in self.starts if b0 < new_length)
        del self.blocks[keep:], self.starts[keep:], self.caps[keep:]
        self.derived.clear()

    def check_truncate(self, new_length: int) -> None:
        """Raise unless :meth:`truncate` can keep exactly the tokens before ``new_length``."""
        if new_length < self.start:
            raise ValueError(f"cannot truncate to {new_length} tokens: tokens before {self.start} were evicted")

    def evict(self, before: int) -> None:
        """Stop exposing tokens ``< before`` and free the blocks that hold only such tokens."""
        before = min(before, self.length)
        self.start = max(self.start, before)
        self.derived.clear()
        for i, (b0, cap) in enumerate(zip(self.starts, self.caps)):
            if self.blocks[i] is not None and b0 + cap <= self.start:
                self.blocks[i] = None

    def map_tensors(self, fn: Callable[[torch.Tensor], torch.Tensor]) -> None:
        """Apply ``fn`` (e.g. a batch ``index_select``) to every stored tensor."""
        self.derived.clear()
        for i, blk in enumerate(self.blocks):
            if blk is not None:
                self.blocks[i] = {k: fn(v) for k, v in blk.items()}
        if self.template is not None:
            self.template = self.template.with_tensors(
                **{k: _no_tokens(fn(v)) for k, v in self.template.tensors().items()}
            )

    # ------------------------------------------------------------------ accounting
    def nbytes_by_field(self) -> dict[str, int]:
        out: dict[str, int] = {}
        for blk in self.blocks:
            if blk is None:
                continue
            for k, v in blk.items():
                out[k] = out.get(k, 0) + v.numel() * v.element_size()
        return out

    @property
    def nbytes(self) -> int:
        return sum(self.nbytes_by_field().values())

    # ------------------------------------------------------------------ saving
    def saved_rows(self, j: int) -> tuple[int, int]:
        """Tokens ``[lo, hi)`` of block ``j``, relative to its first position, that :meth:`state_dict` keeps:
        the ones still held (rows before ``start`` were evicted or skipped and are never read again)."""
        b0 = self.starts[j]
        return max(self.start, b0) - b0, max(0, min(self.caps[j], self.length - b0))

    def state_dict(self) -> dict[str, Any]:
        """The store as plain values and tensors: per block the rows of the tokens it still holds
        (:meth:`saved_rows`; ``None`` for a freed block), and the last block's capacity as a fresh append of
        its tokens gives it (:func:`~kivi.cache.schedule.saved_capacity`: a crop may have left more)."""
        blocks, caps = [], list(self.caps)
        for j, blk in enumerate(self.blocks):
            lo, hi = self.saved_rows(j)
            blocks.append(None if blk is None else
                          {k: t[:, :, lo // self._divisor(k): hi // self._divisor(k)] for k, t in blk.items()})
        if caps and self.blocks[-1] is not None:
            caps[-1] = saved_capacity(self.length - self.starts[-1], self.block_size)
        return {"block_size": self.block_size, "length": self.length, "start": self.start,
                "starts": list(self.starts), "caps": caps, "template": segment_meta(self.template),
                "blocks": blocks}

    def load_state_dict(self, state: dict[str, Any], device: str | torch.device = "cpu") -> None:
        """Put back a :meth:`state_dict` (tensors moved to ``device``); ``ValueError`` naming a tensor whose
        shape or dtype is not the one the template and block layout give."""
        self.block_size, self.length, self.start = state["block_size"], state["length"], state["start"]
        self.starts, self.caps = list(state["starts"]), list(state["caps"])
        self.template = segment_from_meta(state["template"], device)
        self.blocks, self.derived = [], {}
        for j, (saved, cap) in enumerate(zip(state["blocks"], self.caps)):
            if saved is None:
                self.blocks.append(None)
                continue
            lo, hi = self.saved_rows(j)
            blk = {}
            for name, t in self.template.tensors().items():
                d = self._divisor(name)
                got = saved.get(name)
                want = (*t.shape[:2], hi // d - lo // d, *t.shape[3:])
                if got is None or tuple(got.shape) != want or got.dtype != t.dtype:
                    what = "missing" if got is None else f"{tuple(got.shape)} {got.dtype}"
                    raise ValueError(f"block {j} field {name!r}: {what}, the layout says {want} {t.dtype}")
                full = torch.zeros((*t.shape[:2], cap // d, *t.shape[3:]), dtype=t.dtype, device=device)
                full[:, :, lo // d: hi // d].copy_(got)  # rows not held (before start, the unused tail) stay zero
                blk[name] = full
            self.blocks.append(blk)


def segment_meta(template: Segment | None) -> dict[str, Any] | None:
    """A segment type's metadata (kind, widths, field dtypes and shapes without the token axis), JSON-able."""
    if template is None:
        return None
    fields = {k: {"dtype": str(t.dtype).removeprefix("torch."), "shape": [t.shape[0], t.shape[1], *t.shape[3:]]}
              for k, t in template.tensors().items()}
    if isinstance(template, FpSegment):
        return {"kind": "fp", "axis": template.axis, "group_size": template.group_size, "fields": fields}
    meta = {"kind": "packed", "bits": template.bits, "group_size": template.group_size, "axis": template.axis,
            "head_dim": template.head_dim, "residual_bits": template.residual_bits, "fields": fields}
    if template.rotation != "none":  # only a rotated segment names it: unrotated metadata is unchanged
        meta["rotation"] = template.rotation
    return meta


def segment_from_meta(meta: dict[str, Any] | None, device: str | torch.device = "cpu") -> Segment | None:
    """The zero-token template :func:`segment_meta` describes."""
    if meta is None:
        return None
    for f in meta["fields"].values():
        if f["dtype"] not in DTYPES:
            raise ValueError(f"segment dtype {f['dtype']!r} is not one kivi stores (allowed: {', '.join(DTYPES)})")
    empty = {k: torch.empty((f["shape"][0], f["shape"][1], 0, *f["shape"][2:]), dtype=DTYPES[f["dtype"]],
                            device=device) for k, f in meta["fields"].items()}
    if meta["kind"] == "fp":
        return FpSegment(empty["data"], meta["axis"], meta["group_size"])
    fmt = SideFormat(meta["axis"], meta["bits"], meta["group_size"], symmetric="offset" not in empty,
                     residual_bits=meta["residual_bits"], rotation=meta.get("rotation", "none"))
    return PackedKV(packed=empty["packed"], scale=empty["scale"], offset=empty.get("offset"), comp=empty.get("comp"),
                    format=fmt, head_dim=meta["head_dim"])


def token_slice(seg: Segment, a: int, b: int) -> Segment:
    """Tokens ``[a, b)`` of a segment (views; key bounds on group boundaries)."""
    if a == 0 and b == seg.num_tokens:
        return seg
    return seg.with_tensors(**{k: v[:, :, a // token_divisor(seg.axis, seg.group_size, k):
                                      b // token_divisor(seg.axis, seg.group_size, k)]
                               for k, v in seg.tensors().items()})


def _no_tokens(t: torch.Tensor) -> torch.Tensor:
    """A new ``[B, H, 0, ...]`` tensor with ``t``'s batch/head/trailing shape, dtype and device (no storage)."""
    return torch.empty((*t.shape[:2], 0, *t.shape[3:]), dtype=t.dtype, device=t.device)
