"""Fused CPU decode attention (numba): one query token per sequence, straight from the packed codes.

Dispatch rule of the ``"cpu"`` backend (:func:`kivi.attention.interface.run_backend`): the fused
kernel runs when numba is importable, the query length is 1 and :func:`fused_decode_supported`
accepts the views and mask — quantized sides with 1, 2, 3, 4 or 8 bits (asymmetric, symmetric and
with error compensation; :data:`KERNEL_BITS`), full-precision sides, any GQA ratio, any batch, a mask
whose last row is a per-kv-position validity (boolean, or additive 0 / "min"). Everything else —
prefill and chunked queries (n > 1), value groups whose channel count is not a multiple of 4
(``group_size % 4 != 0``: values are read 4 channels at a time), per-head masks, additive masks
with other values — goes through :func:`kivi.attention.blocked.blocked_attention`. This is a
documented dispatch, not a silent fallback: :func:`fused_decode_available` says whether numba is
there, :func:`fused_decode_supported` whether a given call qualifies.

A layer with per-head widths (:class:`~kivi.cache.heads.HeadViews`) runs :func:`fused_decode_heads`:
every head group's pieces in one table (each row names the kv heads it holds) and one kernel call,
when every group qualifies on its own (:func:`fused_decode_heads_supported`); otherwise
:func:`kivi.attention.interface.head_groups_attention` runs the groups one by one.

One concept per module:

* :mod:`.dispatch` — the entry point :func:`fused_decode_attention`: does a call qualify, thread
  pool or calling thread (:data:`SERIAL_BELOW`), split-K chunk size; imports the kernel on first
  use (``import kivi`` and importing this package do not import numba);
* :mod:`.tables` — the kernel's inputs built on the host: a table of piece descriptors per side
  (addresses and strides of the store blocks, sink and fp tail; no copies), memoised per block in
  ``BlockStore.derived``, and the mask's validity row;
* :mod:`.kernel` — the numba kernel (split-K online softmax, codes unpacked token-major in 32-bit
  words — 3-bit runs of 8 codes in 3 bytes widened to one word each — 4-head passes for GQA),
  its entry points loaded from numba's on-disk cache on first use (a cold cache is filled by a child process
  first, so every process runs the same code: :func:`.kernel.load_entries`).

Computation is in float32 (``q``, and scales / offsets stored in another dtype, are converted on
every call — a cost that grows with the context for bf16/fp16 caches; codes stay uint8).
"""

from ...optional import numba_available as fused_decode_available
from .dispatch import (
    KERNEL_BITS,
    SERIAL_BELOW,
    SINGLE_SEQUENCE,
    fused_decode_attention,
    fused_decode_heads,
    fused_decode_heads_supported,
    fused_decode_supported,
    warmup,
)

__all__ = [
    "fused_decode_available",
    "fused_decode_supported",
    "fused_decode_attention",
    "fused_decode_heads",
    "fused_decode_heads_supported",
    "warmup",
    "SERIAL_BELOW",
    "SINGLE_SEQUENCE",
    "KERNEL_BITS",
]
