"""Paged decode attention: one query token for each of ``N`` requests whose KIVI pages sit in a block pool.

One kernel call per layer for a whole batch, the way vLLM's paged attention reads its cache: the caller
gives the pool (flat uint8 memory, ``num_blocks x block_bytes``), a block table ``int32 [N, max_pages]``
(request ``i``'s store positions ``[jP, (j+1)P)`` are in block ``block_table[i, j]``), per-request counts
and the full-precision rows. No request ids, no transformers: kivi's continuous batching
(:mod:`kivi.batching`) and a vLLM plugin (``seq_lens`` / ``block_table_tensor`` of its metadata) build the
same inputs.

Kv positions of request ``i`` (per side, ``counts[i] = [k sink, k stored, k window, v sink, v stored,
v window]``; both sides cover the same ``sink + stored + window`` positions):

* ``[0, sink)``: full-precision rows ``fp[i, 0:sink]`` (:class:`PagedLayout`'s sinks);
* ``[sink, sink + stored)``: quantized, store position ``u = t - sink`` in page ``u // P`` of the block
  table, row ``u % P`` (keys in groups of ``G`` tokens per channel, values in groups of ``G`` channels);
* ``[sink + stored, sink + stored + window)``: full-precision rows ``fp[i, w0 : w0 + window]`` (the
  window, and the step's new token last).

``fp`` is ``[N, slots, H, D]`` float32 per side; the slot of the window's first row ``w0`` is one
argument (kivi's window blocks put the window after the configured sink slots).

:func:`paged_decode_attention` checks the inputs and runs the numba kernel (:mod:`.kernel`,
``paged_decode_*``: split-K over ``(request, kv head, chunk)`` tasks on numba's pool, each task running
the single-sequence kernel's inner loops on its request's pieces, then one merge).
:func:`torch_paged_decode` is the plain torch reference beside it: it dequantizes each request's pages
and attends.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from ...quant.kv import PackedKV, dequantize_kv

#: dtype codes of the pages' scales / offsets in the layout vector (the kernel converts 16-bit ones)
PARAM_DTYPES = {torch.float32: 0, torch.bfloat16: 1, torch.float16: 2}


@dataclass(frozen=True)
class PagedLayout:
    """Where one layer's quantized fields sit inside a block of the pool (byte offsets, one home:
    :meth:`kivi.batching.layout.PageLayout.kernel_layout` derives this from its page fields).

    Per kv head the fields are contiguous: key codes ``[H, P, k_row_bytes]``, key scale / offset
    ``[H, P // G, D]``; value codes ``[H, P, v_row_bytes]``, value scale / offset ``[H, P, D // G]``, all
    parameters in ``param_dtype``. ``k_offset`` / ``v_offset`` ``None``: symmetric codes (base
    ``-(2**(bits-1) - 1) * scale``). No compensation codes.
    """

    block_bytes: int
    page_size: int
    group_size: int
    num_kv_heads: int
    head_dim: int
    k_bits: int
    v_bits: int
    param_dtype: torch.dtype
    k_row_bytes: int
    v_row_bytes: int
    k_packed: int
    k_scale: int
    k_offset: int | None
    v_packed: int
    v_scale: int
    v_offset: int | None

    def vector(self) -> np.ndarray:
        """The kernel's layout vector (columns ``kernel._PL_*``)."""
        return np.array([self.block_bytes, self.page_size, self.group_size, self.k_bits, self.v_bits,
                         self.k_row_bytes, self.v_row_bytes, self.k_packed, self.k_scale,
                         -1 if self.k_offset is None else self.k_offset, self.v_packed, self.v_scale,
                         -1 if self.v_offset is None else self.v_offset, PARAM_DTYPES[self.param_dtype]],
                        dtype=np.int64)

    def unsupported(self) -> str | None:
        """Why the kernel cannot read this layout, or ``None``."""
        from .dispatch import KERNEL_BITS

        if self.param_dtype not in PARAM_DTYPES:
            return f"scales in {self.param_dtype} (the kernel reads {sorted(map(str, PARAM_DTYPES))})"
        if self.k_bits not in KERNEL_BITS or self.v_bits not in KERNEL_BITS:
            return f"k_bits={self.k_bits}, v_bits={self.v_bits} (the kernel reads {KERNEL_BITS})"
        if self.group_size % 4:
            return f"group_size={self.group_size} (value channels are read 4 at a time)"
        if (self.k_offset is None) != (self.v_offset is None):
            return "one side symmetric and the other not"
        return None

    def field(self, pool: torch.Tensor, side: str, name: str) -> torch.Tensor:
        """``[num_blocks, H, rows, C]`` view of field ``name`` (``packed``, ``scale``, ``offset``) of ``side``."""
        H, P, G, D = self.num_kv_heads, self.page_size, self.group_size, self.head_dim
        if name == "packed":
            off, dtype = (self.k_packed, self.k_row_bytes) if side == "k" else (self.v_packed, self.v_row_bytes)
            shape, dtype = (H, P, dtype), torch.uint8
        else:
            off = getattr(self, f"{side}_{name}")
            shape, dtype = ((H, P // G, D) if side == "k" else (H, P, D // G)), self.param_dtype
        item = dtype.itemsize
        nb = pool.numel() // self.block_bytes
        flat = pool.view(dtype)
        return flat.as_strided((nb, *shape), (self.block_bytes // item, shape[1] * shape[2], shape[2], 1), off // item)


def _check(q, pool, layout, block_table, counts, k_fp, v_fp, w0) -> None:
    why = layout.unsupported()
    if why is not None:
        raise ValueError(f"paged decode: unsupported layout: {why}")
    N, hq, D = q.shape
    H = layout.num_kv_heads
    if D != layout.head_dim or hq % H:
        raise ValueError(f"q of shape {tuple(q.shape)} does not fit {H} kv heads of head_dim {layout.head_dim}")
    if pool.dtype != torch.uint8 or pool.dim() != 1 or pool.numel() % layout.block_bytes:
        raise ValueError(f"pool must be flat uint8 of whole blocks of {layout.block_bytes} bytes, got "
                         f"{pool.dtype} {tuple(pool.shape)}")
    if block_table.dtype != torch.int32 or block_table.dim() != 2 or block_table.shape[0] != N:
        raise ValueError(
            f"block_table must be int32 [{N}, max_pages], got {block_table.dtype} {tuple(block_table.shape)}"
        )
    if counts.dtype != torch.int64 or tuple(counts.shape) != (N, 6):
        raise ValueError(f"counts must be int64 [{N}, 6], got {counts.dtype} {tuple(counts.shape)}")
    for name, fp in (("k_fp", k_fp), ("v_fp", v_fp)):
        if fp.dtype != torch.float32 or fp.dim() != 4 or fp.shape[0] != N or tuple(fp.shape[2:]) != (H, D):
            raise ValueError(f"{name} must be float32 [{N}, slots, {H}, {D}], got {fp.dtype} {tuple(fp.shape)}")
    # the per-request checks on numpy views (a handful of microseconds, once per layer)
    c, table = counts.numpy(), block_table.numpy()
    if (c < 0).any():
        raise ValueError("counts must be non-negative")
    total = c[:, :3].sum(1)
    if (total != c[:, 3:].sum(1)).any() or (total == 0).any():
        raise ValueError(f"every request needs as many key as value positions, at least one: {c.tolist()}")
    pages = (np.maximum(c[:, 1], c[:, 4]) + layout.page_size - 1) // layout.page_size
    if (pages > table.shape[1]).any():
        raise ValueError(f"stored tokens need more pages than block_table's {table.shape[1]} columns")
    if (c[:, [0, 3]] > w0).any() or (w0 + c[:, [2, 5]] > min(k_fp.shape[1], v_fp.shape[1])).any():
        raise ValueError(f"sink / window rows do not fit the fp slots (w0={w0}, slots={k_fp.shape[1]})")
    if (c[:, 1] % layout.group_size).any():
        raise ValueError(f"stored keys must be whole groups of {layout.group_size}: {c[:, 1].tolist()}")
    ids = table[np.arange(table.shape[1])[None, :] < pages[:, None]]
    nb = pool.numel() // layout.block_bytes
    if ids.size and (ids.min() < 0 or ids.max() >= nb):
        raise ValueError(f"block_table names blocks outside the pool's {nb}")


def paged_decode_attention(q: torch.Tensor, pool: torch.Tensor, layout: PagedLayout, block_table: torch.Tensor,
                           counts: torch.Tensor, k_fp: torch.Tensor, v_fp: torch.Tensor, w0: int, *,
                           scaling: float | None = None, threaded: bool | None = None) -> torch.Tensor:
    """Decode attention of ``q [N, Hq, D]`` (one token per request) over the requests' pages; ``[N, Hq, D]``
    in ``q.dtype``. Inputs as in the module docstring; ``ValueError`` naming an input that does not fit.
    ``threaded``: numba's pool or the calling thread (``None``: by size, :data:`.dispatch.SERIAL_BELOW`)."""
    from .dispatch import _chunk_tokens, _kernel, _run_threaded, _use_threads

    _check(q, pool, layout, block_table, counts, k_fp, v_fp, w0)
    N, hq, D = q.shape
    H = layout.num_kv_heads
    scaling = D**-0.5 if scaling is None else scaling
    lens = counts.numpy()[:, :3].sum(1)
    total = int(lens.sum())
    if threaded is None:
        threaded = _use_threads(1, H, total)
    kernel = _kernel()
    out = torch.empty(N, hq, D)
    if threaded:
        import numba  # loaded with the kernel

        chunk = _chunk_tokens(int(lens.max()), N * H, numba.get_num_threads())
    else:
        chunk = int(lens.max())
    args = (q.float().contiguous().numpy(), pool.numpy(), layout.vector(), block_table.contiguous().numpy(),
            counts.contiguous().numpy(), k_fp.contiguous().numpy(), v_fp.contiguous().numpy(), int(w0),
            np.float32(scaling), H, chunk, out.numpy())
    if threaded:
        _run_threaded(kernel.paged_decode_threaded, args)
    else:
        kernel.paged_decode_serial(*args)
    return out if q.dtype == torch.float32 else out.to(q.dtype)


def torch_paged_decode(q: torch.Tensor, pool: torch.Tensor, layout: PagedLayout, block_table: torch.Tensor,
                       counts: torch.Tensor, k_fp: torch.Tensor, v_fp: torch.Tensor, w0: int, *,
                       scaling: float | None = None) -> torch.Tensor:
    """Plain torch reference of :func:`paged_decode_attention`: each request's pages dequantized
    (:func:`kivi.quant.kv.dequantize_kv`), sink + pages + window concatenated, softmax attention in float32."""
    _check(q, pool, layout, block_table, counts, k_fp, v_fp, w0)
    N, hq, D = q.shape
    H, P = layout.num_kv_heads, layout.page_size
    g = hq // H
    scaling = D**-0.5 if scaling is None else scaling
    out = torch.empty(N, hq, D)
    for i in range(N):
        sides = []
        for s, (side, fp, bits) in enumerate((("k", k_fp, layout.k_bits), ("v", v_fp, layout.v_bits))):
            sink, stored, window = counts[i, 3 * s: 3 * s + 3].tolist()
            parts = [fp[i, :sink].transpose(0, 1)]  # [H, sink, D]
            if stored:
                blocks = block_table[i, : -(-stored // P)].long()
                fields = {}
                for name in ("packed", "scale", "offset"):
                    if name == "offset" and getattr(layout, f"{side}_offset") is None:
                        continue
                    t = layout.field(pool, side, name).index_select(0, blocks)  # [n, H, rows, C]
                    fields[name] = t.transpose(0, 1).reshape(1, H, -1, t.shape[-1])
                seg = PackedKV(packed=fields["packed"], scale=fields["scale"], offset=fields.get("offset"), comp=None,
                               bits=bits, group_size=layout.group_size, axis="channel" if side == "k" else "token",
                               head_dim=D)
                parts.append(dequantize_kv(seg, torch.float32)[0, :, :stored])
            parts.append(fp[i, w0: w0 + window].transpose(0, 1))
            sides.append(torch.cat(parts, dim=1))  # [H, T, D]
        k, v = sides
        qi = q[i].float().view(H, g, D)
        p = torch.softmax(torch.einsum("hgd,htd->hgt", qi, k) * scaling, dim=-1)
        out[i] = torch.einsum("hgt,htd->hgd", p, v).reshape(hq, D)
    return out if q.dtype == torch.float32 else out.to(q.dtype)


__all__ = ["PagedLayout", "PARAM_DTYPES", "paged_decode_attention", "torch_paged_decode"]
