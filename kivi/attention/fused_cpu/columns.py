"""The columns of a piece descriptor: one int64 row per piece of a side (built by :mod:`.tables`, read by
:mod:`.kernel`). Strides are in elements of the array they describe; addresses are ``data_ptr()`` values.

A module of its own, importing nothing, so that the process that compiles the kernel (:func:`.kernel.fill_entries`)
imports numba and these names only, not torch (:mod:`.tables` builds rows from tensors).
"""

_LO, _HI, _QUANT = 0, 1, 2  # kv positions [lo, hi) (relative to the view start); quantized?
_DATA, _DS0, _DS1, _DS2 = 3, 4, 5, 6  # codes (uint8) or full-precision data (float32): b, h, t strides
_SC, _SS0, _SS1, _SS2 = 7, 8, 9, 10  # float32 scale (quantized pieces)
_BS, _BS0, _BS1, _BS2 = 11, 12, 13, 14  # float32 base (quantized pieces)
_BITS = 15  # code width of a quantized piece (position tiers give a side pieces of several widths)
_H0, _H1 = 16, 17  # the layer's kv heads [h0, h1) the piece holds (per-head widths: one group's tensors)
NCOL = 18
