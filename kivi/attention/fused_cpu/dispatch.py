"""Entry point of the fused CPU decode: does a call qualify, threads or not, split-K chunks.

:func:`fused_decode_supported` is the dispatch rule of the ``"cpu"`` backend (see the package
docstring); :func:`fused_decode_attention` builds the kernel's inputs (:mod:`.tables`) and calls one
of its two entry points (:mod:`.kernel`, imported here on first use: importing this module does not
import numba).

Threads: both entry points run the same split-K tasks, ``prange`` on numba's pool or serially on
the calling thread; :func:`fused_decode_attention` takes the serial one below :data:`SERIAL_BELOW`
``batch x kv heads x kv positions`` or as told by ``threaded=``. ``NUMBA_NUM_THREADS``
/ ``numba.set_num_threads`` size the pool and ``NUMBA_THREADING_LAYER`` picks it (numba's default
order: tbb, omp, workqueue). Between torch matmuls (as in a decoder) the ``omp`` pool beats the
calling thread from 3K units and the ``workqueue`` pool never does (docs/results.md). With other
processes busy on the cores, ``omp``'s spinning threads can lose; set the variable then.

Python threads (e.g. one ``generate()`` per thread, one ``KiviCache`` each): numba's ``tbb`` and
``omp`` layers accept parallel calls from several threads at once, ``workqueue`` does not (it aborts
the process: "Concurrent access has been detected", exit 134) and numba falls back to it where tbb
and omp are missing. So :func:`_run_threaded`, the one place the threaded entry is called from,
serialises it with a lock until the first call has told which layer numba chose
(``numba.threading_layer()``, known only after a parallel launch), and for good if that layer is not
in :data:`THREAD_SAFE_LAYERS`; calls on tbb / omp then run unlocked. The serial entry and the value
quantizer (:mod:`kivi.quant.numba_quant`) use no thread pool and never lock.
"""

from __future__ import annotations

import sys
import threading
from typing import TYPE_CHECKING

import numpy as np
import torch

from ...capabilities import KERNEL_BITS, kernel_reasons
from ...optional import numba_available
from ...quant.numba_quant import warmup as _warmup_quantizer
from ..reference import view_geometry
from .tables import heads_table, side_table, valid_row

if TYPE_CHECKING:
    from ...cache.heads import HeadViews
    from ...cache.view import AttentionView

_ALL_VALID = np.ones((1, 1), dtype=np.bool_)  # the kernel's mask argument when there is no mask

# Code widths the kernel reads (:data:`kivi.capabilities.KERNEL_BITS`): 1, 2, 4, 8 bits as codes packed in bytes,
# 3 bits as runs of 8 codes in 3 bytes (:func:`.kernel._row_layout`). What it cannot read: the ``"torch"`` cells of
# :data:`kivi.capabilities.TABLE` for host ``"generate"``, backend ``"cpu"``.


_ready: set[str] = set()  # entry points loaded (kernel.load_entries) in this process
_checked = False  # numba's cache files of the kernel have been checked (numba_cache.set_aside_unreadable)
_load_lock = threading.Lock()

#: The entry points of one decode step of single sequences (``kivi generate``, ``kivi demo``, ``generate()``):
#: :func:`decode_entry` picks one of them per call.
SINGLE_SEQUENCE = ("decode_threaded", "decode_serial")


def _kernel_module():
    """The :mod:`.kernel` module (imports numba; loads no entry point)."""
    from . import kernel

    return kernel


def _kernel(*names: str):
    """The :mod:`.kernel` module, the entry points ``names`` ready (every entry when none is named).

    Only the entries a call needs are loaded, each on first use. They always run as numba's on-disk cache gives
    them back: where the cache lacks some of ``names`` (the first use after installing or changing kivi) a child
    process compiles those, and only those, into the cache first (:func:`_fill_cache`; entries named together share
    one compile of their callees), so that this process's results equal every later process's bit for bit (why:
    :func:`.kernel.load_entries`; an entry's saved code does not depend on which entries were filled with it,
    :func:`.kernel.fill_entries`). Before the first load, cache files that do not
    read back are set aside with one warning (:func:`kivi.numba_cache.set_aside_unreadable`) and compiled again.

    Loading the threaded entry starts numba's OpenMP layer, which sets the shared OpenMP thread count
    to numba's, so torch's thread count (``torch.set_num_threads``) is put back as it was: more CPU
    threads than the caller asked for oversubscribe the cores and slow decoding several times.
    """
    kernel = sys.modules.get(f"{__package__}.kernel")
    if kernel is not None and names and _ready.issuperset(names):
        return kernel
    kernel = _kernel_module()
    want = names or tuple(entry.__name__ for entry, _ in kernel.ENTRIES)
    with _load_lock:
        todo = [n for n in want if n not in _ready]
        if todo:
            threads = torch.get_num_threads()
            _check_cache_files(kernel)
            missing = _cache_missing(kernel, todo)
            if missing:
                _fill_cache(kernel, missing)
            kernel.load_entries(todo)
            if torch.get_num_threads() != threads:
                torch.set_num_threads(threads)
            _ready.update(todo)
    return kernel


def _check_cache_files(kernel) -> None:
    """Once per process: set aside the kernel's unreadable cache files (:mod:`kivi.numba_cache`), so that they are
    compiled again instead of failing every decode. Where this numba's cache internals differ, a warning."""
    global _checked
    if _checked:
        return
    from ...numba_cache import set_aside_unreadable

    try:
        set_aside_unreadable(kernel.DISPATCHERS, "kivi's decode kernel")
    except AttributeError as e:
        _internals_warning(e)
    _checked = True


def _internals_warning(e: Exception) -> None:
    import warnings

    import numba

    warnings.warn(f"kivi: cannot read numba {numba.__version__}'s cache index ({e}); the decode kernel is "
                  "compiled or loaded in this process, and a process that compiles it can differ from one that "
                  "loads it in the last float32 bit", RuntimeWarning, stacklevel=4)


def _cache_missing(kernel, names) -> list[str]:
    """:func:`.kernel.cache_missing` of ``names``; where this numba's cache internals are not the ones it reads, a
    warning and ``[]``: the process then compiles or loads the entries itself, as before the child fill existed."""
    try:
        return kernel.cache_missing(names)
    except AttributeError as e:
        _internals_warning(e)
        return []


_FILL_CODE = """\
import sys, types
from pathlib import Path
root = Path.cwd()
for name in ("kivi", "kivi.quant", "kivi.attention", "{package}"):
    package = types.ModuleType(name)
    package.__path__ = [str(root.joinpath(*name.split(".")))]
    sys.modules[name] = package
from {package} import kernel
kernel.fill_entries({names!r})
"""


def fill_code(names) -> str:
    """The code a child process runs, in the folder that holds ``kivi/``, to fill numba's cache with the entries
    ``names`` (``None``: all): :func:`.kernel.fill_entries`. The packages above :mod:`.kernel` are made empty (their
    ``__init__`` imports torch and transformers: 4-5 s of CPU on a 2-core VM); the kernel file is the same one."""
    return _FILL_CODE.format(package=__package__, names=None if names is None else list(names))


def _fill_cache(kernel, names) -> None:
    """Compile the kernel's entry points ``names`` in a child process, which saves them to numba's on-disk cache.

    The child imports the same ``kivi``: it starts in the package root, which also leads ``PYTHONPATH``, so a
    ``kivi`` folder in this process's working directory cannot stand in. It gets this process's environment
    (``NUMBA_CACHE_DIR`` included). Takes as long as compiling here (tens of seconds per entry on a small
    machine, once per install). If the child fails or the cache still lacks an entry, this warns and the
    caller compiles in this process: correct results, whose last float32 bit can differ from a cached
    kernel's.
    """
    import logging
    import os
    import subprocess
    import time
    import warnings
    from pathlib import Path

    log = logging.getLogger(__name__)
    names = list(names)
    root = str(Path(kernel.__file__).resolve().parents[3])
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(p for p in (root, os.environ.get("PYTHONPATH")) if p))
    code = fill_code(names)
    log.info("compiling kivi's numba decode kernel into numba's cache (%s), once per install", ", ".join(names))
    t0 = time.perf_counter()
    if not sys.executable:
        failure = "no Python executable to start (sys.executable is empty)"
    else:
        done = subprocess.run([sys.executable, "-c", code], cwd=root, env=env, capture_output=True, text=True)
        failure = f"exit code {done.returncode}: {done.stderr[-2000:]}" if done.returncode else ""
    missing = kernel.cache_missing(names)
    if failure or missing:
        warnings.warn(f"kivi: compiling the numba decode kernel in a child process did not fill numba's cache "
                      f"({failure or 'still missing: ' + ', '.join(missing)}); compiling in this process instead "
                      "(results correct, the last float32 bit can differ from a cached kernel's)", RuntimeWarning,
                      stacklevel=3)
    else:
        log.info("compiled in %.0f s", time.perf_counter() - t0)


def warmup(entries=None) -> float:
    """Compile (or load) the decode kernel's entry points ``entries`` (names, e.g. :data:`SINGLE_SEQUENCE` or
    :func:`decode_entries`'; ``None``: all) and the value quantizer now; returns the seconds it took. The quantizer
    (~3 s of CPU cold) compiles on a thread while a cold kernel compiles in its child: on two cores, at once."""
    import time
    from concurrent.futures import ThreadPoolExecutor

    t0 = time.perf_counter()
    with ThreadPoolExecutor(1, thread_name_prefix="kivi-quantizer-warmup") as pool:
        quantizer = pool.submit(_warmup_quantizer)
        _kernel(*(entries or ()))
        quantizer.result()  # its error, if any, raised here
    return time.perf_counter() - t0


def _np(t: torch.Tensor):
    return t.detach().numpy()


def fused_decode_supported(q: torch.Tensor, k_view: AttentionView, v_view: AttentionView,
                           attention_mask: torch.Tensor | None = None, *, formats_checked: bool = False) -> bool:
    """Whether :func:`fused_decode_attention` handles this call (numba present, n == 1, formats).

    One query reads every token at one precision: a per-query region (``region``) exists only for
    ``n > 1`` (:func:`kivi.cache.schedule.query_boundaries`), so it never reaches the kernel; a view
    that carries one anyway is refused here rather than read at the wrong precision.
    ``formats_checked``: the stored formats are known to be ones the kernel reads (decided once for the
    cache's config: :attr:`kivi.backends.CpuBackend.kernel_reads_layouts`), so they are not scanned.
    """
    return (_query_supported(q, attention_mask) and _views_supported(k_view, v_view, formats_checked)
            and q.shape[1] % k_view.fp.shape[1] == 0)


def _query_supported(q: torch.Tensor, attention_mask: torch.Tensor | None) -> bool:
    """The query and mask part of :func:`fused_decode_supported` (numba present, one CPU query token, a mask
    the kernel can read)."""
    if not numba_available() or q.dim() != 4 or q.shape[2] != 1 or q.device.type != "cpu":
        return False
    if attention_mask is not None:
        if attention_mask.dim() != 4 or attention_mask.shape[1] != 1:
            return False
        if attention_mask.dtype != torch.bool:
            row = attention_mask[:, 0, -1]
            keep = row > torch.finfo(row.dtype).min / 2
            if bool((row[keep] != 0).any()):
                return False
    return True


def _views_supported(k_view: AttentionView, v_view: AttentionView, formats_checked: bool = False) -> bool:
    """The views part of :func:`fused_decode_supported`: no per-query region, formats the kernel reads."""
    if k_view.per_query or v_view.per_query:
        return False
    if formats_checked:
        return True
    for view in (k_view, v_view):
        for store in (view.store.stores if view.tiered else (view.store,)):  # position tiers: every width
            if view.quantized and store.template is not None:
                if kernel_reasons(None, "generate", "cpu", formats=[store.template]):
                    return False
    return True


#: Below this many ``batch x kv heads x kv positions`` a call runs on the calling thread only: smaller
#: calls do not pay for waking numba's pool (serial / threaded is ~1.0 at 1.5K units and 1.15 from 3K on
#: a 2-core CPU, omp pool, SmolLM2 shapes; ``studies/fused_threads.py`` in the git tag studies-archive,
#: ``studies-archive:results/attention/bench_fused_threads.txt``).
SERIAL_BELOW = 3072


def _use_threads(batch: int, hkv: int, kv_len: int) -> bool:
    """Whether a call of this size goes to numba's thread pool (see :data:`SERIAL_BELOW`)."""
    return batch * hkv * kv_len >= SERIAL_BELOW


def decode_entry(batch: int, hkv: int, kv_len: int, threaded: bool | None = None) -> str:
    """The entry point (of :data:`SINGLE_SEQUENCE`) a single-sequence decode call of this size runs:
    ``threaded=None`` chooses by size (:data:`SERIAL_BELOW`)."""
    if threaded is None:
        threaded = _use_threads(batch, hkv, kv_len)
    return "decode_threaded" if threaded else "decode_serial"


def decode_entries(batch: int, hkv: int, kv_lens: tuple[int, int], threaded: bool | None = None) -> tuple[str, ...]:
    """The entry points single-sequence decode calls of ``batch x hkv`` with kv lengths from ``kv_lens[0]`` to
    ``kv_lens[1]`` run (:func:`decode_entry` of both ends: its choice is a threshold on the size), in
    :data:`SINGLE_SEQUENCE` order: what :func:`warmup` needs to load for such a run and no more."""
    ends = {decode_entry(batch, hkv, n, threaded) for n in kv_lens}
    return tuple(name for name in SINGLE_SEQUENCE if name in ends)


def _chunk_tokens(ntok: int, tasks_bh: int, threads: int, sub: int | None = None) -> int:
    """Tokens per split-K task: at least 2 tasks per thread, a task count divisible by ``threads``.

    numba's ``prange`` (omp layer) hands each thread an equal contiguous share of the tasks, so a
    task count that does not divide evenly leaves a thread idle at the end: 9 tasks on 2 threads
    (batch 1, 3 kv heads, the earlier "4 per thread" rule) ran 5 + 4, 11% longer than 6 tasks
    (3 + 3). Chunks are multiples of 64 tokens (whole key groups of 32 or 64 tokens) and at least
    one step of the kernel (:data:`.kernel.SUB` tokens).
    """
    SUB = _kernel_module().SUB if sub is None else sub  # the caller's kernel module gives it: one lookup per call
    tasks_bh = max(tasks_bh, 1)
    want = max(1, -(-2 * threads // tasks_bh))
    for extra in range(threads):  # smallest count >= want whose total divides evenly
        if (tasks_bh * (want + extra)) % threads == 0:
            want += extra
            break
    chunk = max(SUB, -(-ntok // want))
    return -(-chunk // 64) * 64


#: numba threading layers that take parallel calls from several Python threads at once (numba's
#: documentation: tbb and omp are thread-safe, workqueue is not).
THREAD_SAFE_LAYERS = frozenset({"tbb", "omp"})
_pool_lock = threading.Lock()
_pool_thread_safe: bool | None = None  # None until a first threaded call has started numba's pool


def _run_threaded(entry, args: tuple) -> None:
    """Call the threaded entry ``entry(*args)``, under a lock unless numba's layer is thread-safe.

    The layer is chosen at numba's first parallel launch, so the first call runs locked and then
    records whether the layer is in :data:`THREAD_SAFE_LAYERS`.
    """
    global _pool_thread_safe
    if _pool_thread_safe:
        entry(*args)
        return
    with _pool_lock:
        entry(*args)
        if _pool_thread_safe is None:
            import numba  # loaded with the kernel

            _pool_thread_safe = numba.threading_layer() in THREAD_SAFE_LAYERS


def fused_decode_attention(
    q: torch.Tensor,
    k_view: AttentionView,
    v_view: AttentionView,
    *,
    scaling: float | None = None,
    attention_mask: torch.Tensor | None = None,
    threaded: bool | None = None,
) -> torch.Tensor:
    """Decode attention of ``q [B, Hq, 1, D]`` over a KIVI layer's views; ``[B, Hq, 1, Dv]`` in ``q.dtype``.

    Same semantics as :func:`kivi.attention.reference.reference_attention` for one query token.
    ``threaded``: run on numba's thread pool (split-K tasks) or on the calling thread only;
    ``None`` chooses threads when ``B * Hkv * kv_len >= SERIAL_BELOW``.
    """
    if q.shape[2] != 1:
        raise ValueError(f"fused_decode_attention takes one query token per sequence, got {q.shape[2]}")
    start, kv_len, hkv, dv = view_geometry(q, k_view, v_view)
    keep: list = []
    kd, kbits, kG = side_table(k_view, start, keep)
    vd, vbits, vG = side_table(v_view, start, keep)
    return _decode(q, (kd, kbits, kG), (vd, vbits, vG), kv_len, hkv, dv, keep, scaling=scaling,
                   attention_mask=attention_mask, threaded=threaded)


def fused_decode_heads_supported(q: torch.Tensor, k_views: HeadViews, v_views: HeadViews,
                                 attention_mask: torch.Tensor | None = None, *, formats_checked: bool = False) -> bool:
    """Whether :func:`fused_decode_heads` handles this call: every head group's views qualify for
    :func:`fused_decode_supported` (with that group's query heads) and the groups share a group size
    (``formats_checked``: as for :func:`fused_decode_supported`; one layer's groups share its group size)."""
    hkv = k_views.groups[-1].stop
    if q.dim() != 4 or q.shape[1] % hkv or not _query_supported(q, attention_mask):
        return False
    # each group's query heads, (stop - start) * Hq / Hkv, are a multiple of its kv heads
    if not all(_views_supported(kv, vv, formats_checked) for kv, vv in zip(k_views.views, v_views.views)):
        return False
    if formats_checked:
        return True
    sizes = {view.store.template.group_size for side in (k_views, v_views) for view in side.views
             if view.quantized and not view.tiered and view.store.template is not None}
    return len(sizes) <= 1


def fused_decode_heads(
    q: torch.Tensor,
    k_views: HeadViews,
    v_views: HeadViews,
    *,
    scaling: float | None = None,
    attention_mask: torch.Tensor | None = None,
    threaded: bool | None = None,
) -> torch.Tensor:
    """:func:`fused_decode_attention` over a layer with per-head widths, all head groups in one kernel call.

    ``q [B, Hq, 1, D]``; ``k_views`` / ``v_views``: the layer's :class:`~kivi.cache.heads.HeadViews`
    (kv heads ``groups[i]`` in ``views[i]``, each group with its own widths). Query head ``j`` reads kv head
    ``j // (Hq / Hkv)`` as in a plain layer. The result equals running every group on its own query heads
    (:func:`kivi.attention.interface.head_groups_attention`, the reference of this path) and concatenating:
    bit for bit on the calling thread (``threaded=False``: same tasks, same arithmetic); with threads the
    split-K chunks are sized for the whole layer, so the last bits can differ.
    """
    if q.shape[2] != 1:
        raise ValueError(f"fused_decode_heads takes one query token per sequence, got {q.shape[2]}")
    hkv = k_views.groups[-1].stop
    if q.shape[1] % hkv:
        raise ValueError(f"{q.shape[1]} query heads are not a multiple of {hkv} kv heads")
    g = q.shape[1] // hkv
    geo = {view_geometry(q[:, grp.start * g : grp.stop * g], kv, vv)[:2] + (vv.fp.shape[-1],)
           for grp, kv, vv in zip(k_views.groups, k_views.views, v_views.views)}
    if len(geo) != 1:
        raise ValueError(f"head groups of one layer cover different kv positions / value widths: {sorted(geo)}")
    start, kv_len, dv = geo.pop()
    keep: list = []
    kside = heads_table(k_views.views, k_views.groups, start, keep)
    vside = heads_table(v_views.views, v_views.groups, start, keep)
    return _decode(q, kside, vside, kv_len, hkv, dv, keep, scaling=scaling, attention_mask=attention_mask,
                   threaded=threaded)


def _decode(q, kside, vside, kv_len: int, hkv: int, dv: int, keep: list, *, scaling, attention_mask,
            threaded) -> torch.Tensor:
    """Run the kernel over the key / value tables ``(descriptors, widest bits, group size)``."""
    B, hq, _, d = q.shape
    if kv_len == 0:
        raise ValueError("fused_decode_attention: empty cache view")
    scaling = d**-0.5 if scaling is None else scaling
    name = decode_entry(B, hkv, kv_len, threaded)
    threaded = name == "decode_threaded"
    kernel = _kernel(name)
    valid = valid_row(attention_mask, B, kv_len)
    has_mask = valid is not None
    valid_np = _np(valid) if has_mask else _ALL_VALID
    (kd, kbits, kG), (vd, vbits, vG) = kside, vside
    prm = np.array([kbits, kG, vbits, vG], dtype=np.int64)
    q32 = _np(q.reshape(B, hq, d).float().contiguous())  # a view when q is contiguous float32
    out = torch.empty(B, hq, 1, dv)
    if threaded:
        import numba  # loaded with the kernel

        chunk = _chunk_tokens(kv_len, B * hkv, numba.get_num_threads(), kernel.SUB)
    else:
        chunk = kv_len
    args = (q32, kd, vd, prm, valid_np, int(has_mask), np.float32(scaling), hkv, kv_len, chunk,
            out.numpy().reshape(B, hq, dv))
    if threaded:
        _run_threaded(getattr(kernel, name), args)
    else:
        getattr(kernel, name)(*args)
    return out if q.dtype == torch.float32 else out.to(q.dtype)


__all__ = ["fused_decode_supported", "fused_decode_attention", "fused_decode_heads", "fused_decode_heads_supported",
           "warmup", "decode_entry", "decode_entries",
           "SINGLE_SEQUENCE", "SERIAL_BELOW", "THREAD_SAFE_LAYERS", "KERNEL_BITS"]
