"""A decode step's writes of one layer in one compiled call: what leaves the windows to the pages, the new tokens
to the rings.

In a step whose every request is a row of the batched decode kernel (:class:`kivi.paged.plan.KernelRows`, no
prefill or chunk: the steady state of serving), :func:`kivi.paged.forward.paged_step` hands the layer's writes to
:func:`write_step`: one call of :func:`kivi.paged.write_kernel.decode_write`, which reads the leaving rows where
the rings keep them (or from the step's input), quantizes them with kivi's compiled quantizer
(:mod:`kivi.quant.numba_quant_kernel`: values per token, keys per channel in whole groups of ``G``), writes codes and
parameters to their page rows and the new tokens to their ring slots. The torch path it replaces (leaving rows,
one quantize call per side, page row indices, one indexed write per field and per ring: ~20 small tensor
operations a layer) stays beside it as the reference and for every other step; both leave the pages and rings
bit for bit the same (``tests/paged/test_write.py``, ``tests/paged/test_decode_call.py``).

:func:`decode_writer` is the one rule for where it applies: numba importable (the decode kernel applies), the
pages' parameters float32 or bfloat16, asymmetric codes, no compensation, finiteness checked, the rings in
float32 or bfloat16 (the step's input in the rings' dtype is checked per call, :meth:`DecodeWriter.takes`).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
import torch

from ..attention.fused_cpu.paged import PagedLayout
from ..capabilities import WRITE_DTYPES, WRITES, reasons
from ..config import KiviConfig
from ..quant.numba_quant import shrinks_array
from .geometry import RingPool
from .plan import StepPlan

#: dtypes of the rings (and the step's input) the compiled writes read: float32, and bfloat16 as its int16 bits.
ROW_DTYPES = WRITE_DTYPES
_EMPTY_LEAVE = np.zeros((0, 4), dtype=np.int64)
_EMPTY_WRITES = np.zeros((0, 3), dtype=np.int64)


def numpy_view(x: torch.Tensor) -> np.ndarray:
    """A numpy view of ``x`` (any strides; bfloat16 as its int16 bits)."""
    return (x.view(torch.int16) if x.dtype == torch.bfloat16 else x).numpy()


@dataclass(frozen=True)
class DecodeWriter:
    """One layer's pages and rings as :func:`kivi.paged.write_kernel.decode_write` reads and writes them (numpy
    views aliasing the caches, made once per layer): ``pool`` / ``lay`` (the pages, the layout vector),
    ``krows`` / ``vrows`` ``[blocks, Pw, H, D]`` and ``rbase`` / ``rstep`` (the rings,
    :class:`kivi.paged.geometry.RingPool`), ``dtype`` (the rings'), ``shrinks`` per side (the clipping grid or
    ``[1.0]``)."""

    pool: np.ndarray
    lay: np.ndarray
    krows: np.ndarray
    vrows: np.ndarray
    rbase: np.ndarray
    rstep: np.ndarray
    dtype: torch.dtype
    shrinks: dict[str, np.ndarray]

    def takes(self, key: torch.Tensor, value: torch.Tensor) -> bool:
        """Whether the step's input rows are in the rings' dtype (the compiled writes copy them bit for bit)."""
        return key.dtype == self.dtype and value.dtype == self.dtype


def _matches(fmts, layout: PagedLayout) -> bool:
    """Whether the side formats ``fmts`` (keys, values) are the ones ``layout``'s pages hold."""
    k, v = fmts
    return (k.bits, v.bits, k.group_size, v.group_size) == (layout.k_bits, layout.v_bits, *[layout.group_size] * 2)


def decode_writer(cfg: KiviConfig, pool: torch.Tensor, layout: PagedLayout, rings: RingPool,
                  host: str = "vllm") -> DecodeWriter | None:
    """The :class:`DecodeWriter` of a layer whose decode kernel reads ``pool`` / ``layout`` / ``rings``
    (:func:`kivi.paged.decode_call.decode_kernel`) on ``host``, or ``None`` where the compiled writes do not
    reproduce the torch path (the module docstring: the one rule; :mod:`kivi.capabilities`' ``W`` cells)."""
    fmts = {side: cfg.side_format(side) for side in ("k", "v")}
    dtype = rings.rows["k"].dtype
    if (reasons(cfg, host, "cpu", WRITES, param_dtype=layout.param_dtype, row_dtype=dtype)
            or not _matches(fmts.values(), layout)):
        return None
    return DecodeWriter(pool.numpy(), layout.vector(), numpy_view(rings.rows["k"]), numpy_view(rings.rows["v"]),
                        rings.base.numpy(), rings.step.numpy(), dtype,
                        {side: shrinks_array(f.clip) for side, f in fmts.items()})


@dataclass(frozen=True)
class TritonWriter:
    """One layer's pages and rings as :func:`kivi.kernels.triton_paged_write.triton_paged_write` writes them (the
    GPU form of :class:`DecodeWriter`): ``pool`` / ``layout`` (the pages), ``rings`` (the window rings' rows pool,
    :class:`kivi.paged.geometry.RingPool`)."""

    pool: torch.Tensor
    layout: PagedLayout
    rings: RingPool

    def takes(self, key: torch.Tensor, value: torch.Tensor) -> bool:
        """Whether the step's input rows are in the rings' dtype (the ring writes copy them bit for bit)."""
        dtype = self.rings.rows["k"].dtype
        return key.dtype == dtype and value.dtype == dtype


def triton_writer(cfg: KiviConfig, pool: torch.Tensor, layout: PagedLayout, rings: RingPool,
                  host: str = "vllm") -> TritonWriter | None:
    """The :class:`TritonWriter` of a layer whose decode kernel is the Triton one, or ``None`` where the Triton
    writes do not reproduce the torch path (asymmetric 1 / 2 / 4 / 8-bit codes without compensation or clipping,
    finiteness checked, :func:`kivi.kernels.triton_paged_write.writable`): the one rule, as :func:`decode_writer`
    is the numba writes'."""
    from ..kernels.triton_paged_write import writable

    if (reasons(cfg, host, "triton", WRITES) or not _matches([cfg.side_format(s) for s in ("k", "v")], layout)
            or writable(layout) is not None):
        return None
    return TritonWriter(pool, layout, rings)


def write_step(writer: DecodeWriter | TritonWriter, plan: StepPlan, page_table: torch.Tensor,
               ring_table: torch.Tensor, key: torch.Tensor, value: torch.Tensor, *,
               flags: list[torch.Tensor] | None = None) -> None:
    """The layer's writes of a step whose requests are all kernel rows (``plan.others`` empty): its leaving tokens
    to the pages, its new tokens to the rings, after every read of the step. ``key / value [n, H, D]``: the step's
    input in the rings' dtype (:meth:`DecodeWriter.takes`). ``ValueError`` with nothing written on a leaving value
    that is not finite (as the torch path). A :class:`TritonWriter` writes through the Triton kernels (the plan's
    tables copied to the device once), a :class:`DecodeWriter` in one numba call. ``flags``: a Triton writer
    appends its finiteness flag there (nothing written when set) and does not read it back: the caller raises
    for it later (:func:`kivi.kernels.triton_paged_write.raise_if_nonfinite`); ``None``: read back here."""
    if plan.kernel is None or plan.others:
        raise ValueError("write_step writes steps whose every request is a decode kernel row")
    if isinstance(writer, TritonWriter):
        from ..kernels.triton_paged_write import triton_paged_write

        leave = [_EMPTY_LEAVE if plan.kernel.leaving[side] is None else plan.kernel.leaving[side].table
                 for side in ("k", "v")]
        writes = _EMPTY_WRITES if plan.writes is None else plan.writes.table
        r = writer.rings
        flag = triton_paged_write(writer.pool, writer.layout, r.rows["k"], r.rows["v"], r.base, r.step, ring_table,
                                  page_table, key, value, *leave, writes, check=flags is None)
        if flags is not None:
            flags.append(flag)
        return
    from .write_kernel import decode_write

    leave = {side: _EMPTY_LEAVE if plan.kernel.leaving[side] is None else plan.kernel.leaving[side].table
             for side in ("k", "v")}
    writes = _EMPTY_WRITES if plan.writes is None else plan.writes.table
    rc = decode_write(writer.pool, writer.lay, writer.krows, writer.vrows, writer.rbase, writer.rstep,
                      ring_table.numpy(), page_table.numpy(), numpy_view(key), numpy_view(value), leave["k"],
                      leave["v"], writes, writer.shrinks["k"], writer.shrinks["v"])
    if rc == 1:
        raise ValueError(
            "x contains NaN or Inf; KV quantization needs finite values (pass check_finite=False to let a "
            "non-finite value poison its group instead)"
        )
    if rc == 3:
        raise ValueError("the compiled writes store float32 or bfloat16 page parameters; this layout's are float16 "
                         "(decode_writer gives such a layer no writer: its steps take the torch writes)")
    if rc:
        raise ValueError("the step's leaving keys are not whole aligned groups of one request (a plan error)")


@dataclass
class FiniteChecks:
    """One step's finiteness flags of the Triton page writes (:func:`kivi.kernels.triton_paged_write.
    triton_paged_write`, ``check=False``: a layer whose leaving rows are not finite writes nothing and sets its
    flag on the device), read back once per step instead of once per layer: when the last of the page group's
    ``layers`` has run (:meth:`layer_ran`), in one host synchronization; ``ValueError`` naming the first layer
    whose flag is set."""

    layers: int
    flags: list[torch.Tensor] = field(default_factory=list)
    names: list[str] = field(default_factory=list)
    ran: int = 0

    def layer_ran(self, name: str) -> None:
        """``name`` has run (its flags, if any, are the ones appended since the last call)."""
        self.names += [name] * (len(self.flags) - len(self.names))
        self.ran += 1
        if self.ran >= self.layers:
            self._read()

    def close(self) -> None:
        """Read back whatever flags are still unread: the safety net for a step in which fewer than ``layers``
        layers reported (:meth:`layer_ran`), so that no refused write goes unreported. The builder calls it on the
        previous step's checks before it makes the next step's; it does nothing (no host read) when every flag
        was read."""
        unreported = "a layer that did not report" + (f" (after {self.names[-1]})" if self.names else "")
        self.names += [unreported] * (len(self.flags) - len(self.names))
        self._read()

    def _read(self) -> None:
        from ..kernels.triton_paged_write import raise_if_nonfinite

        flags, names = self.flags, self.names
        self.flags, self.names = [], []
        raise_if_nonfinite(flags, names)


__all__ = ["DecodeWriter", "TritonWriter", "FiniteChecks", "decode_writer", "triton_writer", "write_step",
           "numpy_view", "ROW_DTYPES"]
