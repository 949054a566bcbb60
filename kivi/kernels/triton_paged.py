"""Paged decode attention over KIVI pages in Triton: the GPU form of the batched paged decode kernel.

:func:`triton_paged_decode` takes exactly the inputs of the numba kernel's
:func:`kivi.attention.fused_cpu.paged.paged_decode_attention` in its in-place form (a block pool, a
:class:`~kivi.attention.fused_cpu.paged.PagedLayout`, an ``int32 [N, max_pages]`` block table, ``int64 [N, 6]``
counts, the sink and window rows as :class:`~kivi.attention.fused_cpu.paged.RingRows`), so a caller that builds
them once, vLLM's metadata (``block_table_tensor``, ``seq_lens``) or kivi's continuous batching, gets either
kernel from the same tensors: :class:`kivi.paged.decode.PagedDecode` with ``backend="triton"``. One launch for
the whole batch (grid: request x kv head x token range, split-K with an online softmax, :mod:`._paged_kernels`),
then the split merge of the single-sequence kernel.

The plain torch reference beside it is :func:`kivi.attention.fused_cpu.paged.torch_paged_decode` (re-exported
here): each request's pages dequantized, sink + pages + window concatenated, softmax in float32. Tests compare
the two under ``TRITON_INTERPRET=1`` on CPU tensors (tests/paged/test_decode_equivalence.py).

Inputs are checked as the numba kernel checks them (:func:`kivi.attention.fused_cpu.paged.check_paged_inputs`:
shapes, then every request's counts, block ids and row ids against the pool) on host copies of the small tables:
on a GPU that is one copy of them per call, each a host synchronization. A caller that made the counts on the
host and vouches for its ids (the vLLM plugin: its step plan, vLLM's block tables) passes ``host_counts`` and
nothing is copied back.
"""

from __future__ import annotations

import torch

from ..attention.fused_cpu.paged import (
    PagedLayout,
    RingRows,
    check_paged_counts,
    check_paged_inputs,
    check_paged_shapes,
    on_host,
    torch_paged_decode,
)
from ._common import next_pow2, require_triton

_LOG2E = 1.4426950408889634


def _splits(device: torch.device, programs: int, tiles: int) -> int:
    if device.type == "cuda":
        sms = torch.cuda.get_device_properties(device).multi_processor_count
        want = min(64, -(-4 * sms // max(1, programs)))
    else:  # interpreter: more than one split, so the merge is exercised
        want = 3
    return max(1, min(tiles, want))


def triton_paged_decode(q: torch.Tensor, pool: torch.Tensor, layout: PagedLayout, block_table: torch.Tensor,
                        counts: torch.Tensor, k_fp: RingRows, v_fp: RingRows, w0: int, *,
                        scaling: float | None = None, num_splits: int | None = None, block_n: int | None = None,
                        num_warps: int = 4, host_counts: torch.Tensor | None = None) -> torch.Tensor:
    """Decode attention of ``q [N, Hq, D]`` (one token per request) over the requests' KIVI pages; ``[N, Hq, D]``
    in ``q.dtype``. The inputs of :func:`kivi.attention.fused_cpu.paged.paged_decode_attention` (rows in place:
    :class:`RingRows`), all on one device (CUDA, or CPU under ``TRITON_INTERPRET=1``); ``ValueError`` naming an
    input that does not fit. ``num_splits``, ``block_n``, ``num_warps``: tuning knobs.

    ``host_counts``: a host copy of ``counts``, from a caller that vouches for the block and slot ids it passes
    (vLLM's block tables): the counts are checked on it, the ids are not read back, and nothing is copied from
    the device (no host synchronization). ``None``: ``block_table``, ``counts`` and the slot tables are copied to
    the host and every value is checked (:func:`kivi.attention.fused_cpu.paged.check_paged_inputs`)."""
    if not (isinstance(k_fp, RingRows) and isinstance(v_fp, RingRows)):
        raise ValueError("triton_paged_decode reads the sink and window rows in place: k_fp and v_fp must be "
                         f"RingRows, got {type(k_fp).__name__} and {type(v_fp).__name__}")
    device = q.device
    for name, t in (("pool", pool), ("block_table", block_table), ("counts", counts), ("k_fp.rows", k_fp.rows),
                    ("k_fp.slots", k_fp.slots), ("k_fp.new", k_fp.new), ("v_fp.rows", v_fp.rows),
                    ("v_fp.slots", v_fp.slots), ("v_fp.new", v_fp.new)):
        if t.device != device:
            raise ValueError(f"{name} is on {t.device}, q on {device}: every input must be on one device")
    if host_counts is None:
        host_counts = counts.cpu()
        check_paged_inputs(q, pool, layout, block_table.cpu(), host_counts, on_host(k_fp), on_host(v_fp), w0)
    else:
        if host_counts.device.type != "cpu" or tuple(host_counts.shape) != tuple(counts.shape):
            raise ValueError(f"host_counts must be a host copy of counts {tuple(counts.shape)}, got "
                             f"{tuple(host_counts.shape)} on {host_counts.device}")
        check_paged_shapes(q, pool, layout, block_table, counts, k_fp, v_fp, w0)
        check_paged_counts(layout, block_table.shape[1], host_counts.numpy(), k_fp, v_fp, w0)
    item = layout.param_dtype.itemsize
    offsets = [layout.k_scale, layout.v_scale] + [o for o in (layout.k_offset, layout.v_offset) if o is not None]
    if layout.block_bytes % item or any(o % item for o in offsets):
        raise ValueError(f"page parameters must be aligned to their {layout.param_dtype} ({item} bytes): block of "
                         f"{layout.block_bytes} bytes, offsets {offsets}")
    if q.dtype not in (torch.float32, torch.float16, torch.bfloat16):
        raise ValueError(f"q must be float32, float16 or bfloat16, got {q.dtype}")
    require_triton(device)
    import triton.language as tl

    from . import _attention_kernels as A
    from . import _paged_kernels as K

    N, hq, D = q.shape
    H = layout.num_kv_heads
    qg = hq // H
    qg_p2 = max(16, next_pow2(qg))
    block_d = max(16, next_pow2(D))
    scaling = D**-0.5 if scaling is None else scaling
    if block_n is None:
        block_n = 64 if device.type == "cuda" else 32
    longest = int(host_counts.numpy()[:, :3].sum(1).max())  # on the host: no tensor read back
    tiles = -(-longest // block_n)
    splits = max(1, min(num_splits or _splits(device, N * H, tiles), tiles))
    tok_per_split = -(-tiles // splits) * block_n
    splits = -(-longest // tok_per_split)

    q3 = q if q.stride(-1) == 1 else q.contiguous()
    table = block_table.contiguous()
    cnt = counts.contiguous()
    ks, vs = k_fp.slots.contiguous(), v_fp.slots.contiguous()
    kn, vn = (f.new if f.new.stride(-1) == 1 else f.new.contiguous() for f in (k_fp, v_fp))
    m = torch.empty(N * H * splits * qg_p2, dtype=torch.float32, device=device)
    l = torch.empty_like(m)  # noqa: E741 (the online softmax's running sum, as in the kernel)
    acc = torch.empty(N * H * splits * qg_p2, block_d, dtype=torch.float32, device=device)
    dot_t = {torch.float16: tl.float16, torch.bfloat16: tl.bfloat16, torch.float32: tl.float32}[q.dtype]
    if device.type == "cpu" and q.dtype == torch.bfloat16:
        dot_t = tl.float32  # the interpreter's bf16 tl.dot multiplies the raw uint16 bits (triton 3.9)
    precision = "ieee" if dot_t == tl.float32 else "tf32"
    sym = layout.k_offset is None

    def rows_args(f: RingRows, slots: torch.Tensor, new: torch.Tensor) -> tuple:
        sb, sr, sh, _ = f.rows.stride()
        return (f.rows, sb, sr, sh, f.rows.shape[1], slots, slots.stride(0), new, new.stride(0), new.stride(1))

    K.paged_split_kernel[(N * H, splits)](
        q3, q3.stride(0), q3.stride(1),
        pool, pool.view(layout.param_dtype), table, table.stride(0), cnt,
        *rows_args(k_fp, ks, kn), *rows_args(v_fp, vs, vn),
        int(w0), ks.shape[1] - int(w0),
        m, l, acc,
        float(scaling) * _LOG2E, tok_per_split, splits,
        HKV=H, QG=qg, QG_P2=qg_p2, D=D, BLOCK_D=block_d, BLOCK_N=block_n, P=layout.page_size,
        G=layout.group_size, PAR_ITEM=item, HAS_OFFSET=not sym, BLOCK_BYTES=layout.block_bytes,
        K_CODES=layout.k_packed, K_SCALE=layout.k_scale, K_OFFSET=0 if sym else layout.k_offset,
        K_ROW_BYTES=layout.k_row_bytes, K_BITS=layout.k_bits,
        V_CODES=layout.v_packed, V_SCALE=layout.v_scale, V_OFFSET=0 if sym else layout.v_offset,
        V_ROW_BYTES=layout.v_row_bytes, V_BITS=layout.v_bits,
        dot_t=dot_t, PRECISION=precision, num_warps=num_warps,
    )
    out = torch.empty(N, hq, D, dtype=q.dtype, device=device)
    A.decode_reduce_kernel[(N * hq,)](
        m, l, acc, out, out.stride(0), out.stride(1),
        splits, HQ=hq, QG=qg, QG_P2=qg_p2, D=D, BLOCK_D=block_d, S_P2=max(2, next_pow2(splits)),
    )
    return out


__all__ = ["triton_paged_decode", "torch_paged_decode"]
