"""A decode step's writes of one layer over KIVI pages in Triton: the GPU form of the compiled writes.

:func:`triton_paged_write` takes the arguments of :func:`kivi.paged.write_kernel.decode_write` (numba, the CPU
form) as tensors on one device: the layer's block pool and :class:`~kivi.attention.fused_cpu.paged.PagedLayout`,
its window rings as one rows pool per side (``krows`` / ``vrows`` ``[blocks, Pw, H, D]``, pool block
``rbase[r] + ring_table[i, r] * rstep[r]``), the block table, the step's input rows, and the step's tables:
``kleave`` / ``vleave`` int64 ``[M, 4]`` (the tokens leaving the windows for the pages, ``(request, ring slot or
-1, input row or -1, store position)``, keys in whole aligned groups of ``G``) and ``writes`` int64 ``[W, 3]``
(``(request, ring slot, input row)``). Four launches (:mod:`._paged_write_kernels`), the tables copied to the
device in one: nothing is written when a leaving value is not finite, decided on the device (a flag the first
launch sets and the others read); the caller reads the flag back at once (``ValueError``, as the torch writes)
or, with ``check=False``, when it chooses (the vLLM plugin: once per step, not once per layer).

Asymmetric codes of 1 / 2 / 4 / 8 bits without compensation or clipping (:func:`writable`); the reference is the
torch writes of :func:`kivi.paged.forward.paged_step` (``tests/paged/test_write_triton.py`` compares the bytes).
"""

from __future__ import annotations

import numpy as np
import torch

from ..attention.fused_cpu.paged import PagedLayout
from ._common import WORD_BITS, next_pow2, param_kind, require_triton

NONFINITE = ("x contains NaN or Inf; KV quantization needs finite values (pass check_finite=False to let a "
             "non-finite value poison its group instead)")


def writable(layout: PagedLayout) -> str | None:
    """Why :func:`triton_paged_write` cannot write ``layout``'s pages, or ``None``."""
    if layout.k_offset is None or layout.v_offset is None:
        return "symmetric codes"
    if layout.k_bits not in WORD_BITS or layout.v_bits not in WORD_BITS:
        return f"k_bits={layout.k_bits}, v_bits={layout.v_bits} (the kernels pack {list(WORD_BITS)})"
    if layout.head_dim % layout.group_size or layout.page_size % layout.group_size:
        return f"group_size={layout.group_size} does not divide head_dim={layout.head_dim} / P={layout.page_size}"
    item = layout.param_dtype.itemsize
    offsets = (layout.block_bytes, layout.k_scale, layout.k_offset, layout.v_scale, layout.v_offset)
    if any(o % item for o in offsets):
        return f"parameters not aligned to their {layout.param_dtype}"
    block_d = max(16, next_pow2(layout.head_dim))
    for bits, row in ((layout.k_bits, layout.k_row_bytes), (layout.v_bits, layout.v_row_bytes)):
        if row > block_d * bits // 8:
            return f"code rows of {row} bytes (the kernels write {block_d * bits // 8})"
    return None


def _groups_whole(kleave: np.ndarray, G: int) -> bool:
    """Whether the leaving keys are whole groups of ``G`` consecutive store positions of one request, aligned."""
    if kleave.shape[0] % G:
        return False
    g = kleave.reshape(-1, G, 4)
    first = g[:, :1]
    return bool((first[..., 3] % G == 0).all() and (g[..., 0] == first[..., 0]).all()
                and (g[..., 3] - first[..., 3] == np.arange(G)).all())


def triton_paged_write(pool: torch.Tensor, layout: PagedLayout, krows: torch.Tensor, vrows: torch.Tensor,
                       rbase: torch.Tensor, rstep: torch.Tensor, ring_table: torch.Tensor, page_table: torch.Tensor,
                       knew: torch.Tensor, vnew: torch.Tensor, kleave: np.ndarray, vleave: np.ndarray,
                       writes: np.ndarray, *, check: bool = True) -> torch.Tensor:
    """One layer's writes of a decode step (the module docstring). The three tables are host int64 numpy
    arrays (the step's plan keeps them there; one copy to the device); everything else on the pool's device.
    ``ValueError`` on key groups that are not whole and on a layout :func:`writable` refuses.

    Returns the flag: int64 ``[1]`` on the device, 1 when a leaving value was not finite and nothing was
    written, else 0. ``check``: read it now (one host synchronization) and raise ``ValueError`` when it is set;
    ``False``: no host read here (:func:`raise_if_nonfinite` reads flags later)."""
    why = writable(layout)
    if why is not None:
        raise ValueError(f"triton_paged_write cannot write these pages: {why}")
    G = layout.group_size
    if not _groups_whole(kleave, G):
        raise ValueError("the step's leaving keys are not whole aligned groups of one request (a plan error)")
    if knew.dtype != krows.dtype or vnew.dtype != vrows.dtype:
        raise ValueError(f"the step's rows ({knew.dtype}, {vnew.dtype}) must be in the rings' dtype {krows.dtype}")
    device = pool.device
    require_triton(device)
    from . import _paged_write_kernels as K

    H, D = knew.shape[1], knew.shape[2]
    Mk, Mv, W = kleave.shape[0], vleave.shape[0], writes.shape[0]
    if krows.stride(-1) != 1 or krows.stride() != vrows.stride():
        raise ValueError("the rings' rows must share strides, channels contiguous")
    knew, vnew = (x if x.stride(-1) == 1 and x.stride() == knew.stride() else x.contiguous() for x in (knew, vnew))
    if knew.stride() != vnew.stride():
        knew, vnew = knew.contiguous(), vnew.contiguous()
    host = np.concatenate([kleave.reshape(-1), vleave.reshape(-1), writes.reshape(-1), np.zeros(1, np.int64)])
    tables = torch.from_numpy(host).to(device)
    kl, vl, wr = tables[: 4 * Mk], tables[4 * Mk: 4 * (Mk + Mv)], tables[4 * (Mk + Mv): -1]
    flag = tables[-1:]  # zero: set by the gather launches, read by the writing ones
    block_d = max(16, next_pow2(D))
    pw = krows.shape[1]
    r_sb, r_sr, r_sh, _ = krows.stride()
    rt = ring_table if ring_table.stride(-1) == 1 else ring_table.contiguous()
    pt = page_table if page_table.stride(-1) == 1 else page_table.contiguous()
    ring_args = (rt, rt.stride(0), rbase, rstep, pw)
    x = torch.empty(Mk + Mv, H, D, dtype=torch.float32, device=device)
    for lo, m, rows, new, tab in ((0, Mk, krows, knew, kl), (Mk, Mv, vrows, vnew, vl)):
        if m:
            K.gather_rows_kernel[(m, H)](tab, x[lo:], rows, r_sb, r_sr, r_sh, new, new.stride(0), new.stride(1),
                                         *ring_args, H, flag, D=D, BLOCK_D=block_d)
    kind = param_kind(layout.param_dtype)
    par = pool.view(layout.param_dtype)
    common = dict(D=D, BLOCK_D=block_d, G=G, PARAM_KIND=kind, P=layout.page_size, BLOCK_BYTES=layout.block_bytes,
                  PAR_ITEM=layout.param_dtype.itemsize)
    if Mk:
        K.write_key_groups_kernel[(Mk // G, H)](
            x, kl, pt, pt.stride(0), pool, par, H, flag, G_P2=next_pow2(G), BITS=layout.k_bits, CODES=layout.k_packed,
            SCALE=layout.k_scale, OFFSET=layout.k_offset, ROW_BYTES=layout.k_row_bytes, **common)
    if Mv:
        K.write_values_kernel[(Mv, H)](
            x[Mk:], vl, pt, pt.stride(0), pool, par, H, flag, NG=D // G, BITS=layout.v_bits, CODES=layout.v_packed,
            SCALE=layout.v_scale, OFFSET=layout.v_offset, ROW_BYTES=layout.v_row_bytes, **common)
    if W:
        K.write_rings_kernel[(W, H)](wr, krows, vrows, r_sb, r_sr, r_sh, knew, vnew, knew.stride(0), knew.stride(1),
                                     *ring_args, flag, D=D, BLOCK_D=block_d)
    if check:
        raise_if_nonfinite([flag])
    return flag


def raise_if_nonfinite(flags: list[torch.Tensor], names: list[str] | None = None) -> None:
    """Read the flags of :func:`triton_paged_write` calls back (one host synchronization for all) and raise
    ``ValueError`` when one is set, naming its writer (``names[i]``, e.g. the layer) where given. Does nothing
    for no flags."""
    if not flags:
        return
    bad = torch.cat(flags).tolist()
    for i, b in enumerate(bad):
        if b:
            where = f" (in {names[i]}, whose pages and rings were left as they were)" if names else ""
            raise ValueError(NONFINITE + where)


__all__ = ["triton_paged_write", "raise_if_nonfinite", "writable", "NONFINITE"]
