"""Fused CPU decode attention (numba): one query token per sequence, straight from the packed codes.

Dispatch rule of the ``"cpu"`` backend (:func:`kivi.attention.interface.run_backend`): the fused
kernel runs when numba is importable (optional dependency, extra ``kivi[cpu]``), the query length is
1 and :func:`fused_decode_supported` accepts the views and mask — quantized sides with 1, 2, 4 or
8 bits (asymmetric, symmetric and with error compensation), full-precision sides, any GQA ratio,
any batch, a mask whose last row is a per-kv-position validity (boolean, or additive 0 / "min").
Everything else — prefill and chunked queries (n > 1), 3-bit codes, value groups smaller than a
byte's codes (``group_size % (8 // bits) != 0``), per-head masks, additive masks with other values — goes through :func:`kivi.attention.blocked.blocked_attention`. This is a
documented dispatch, not a silent fallback: :func:`fused_decode_available` says whether numba is
there, :func:`fused_decode_supported` whether a given call qualifies.

Algorithm, per ``(batch b, kv head h)`` and its ``g = Hq / Hkv`` query heads, over the tokens
``[start, end)`` of the views:

* the kv axis is cut into *segments* where both the key representation and the value
  representation come from one piece (a store block, quantized or not, or the fp tail; keys and
  values have different splits); each segment is one kernel call that updates a running
  ``(m, l, acc)`` online-softmax state per query head, so nothing is ever materialised;
* inside a segment, ``prange`` runs over ``(b, h, token chunk)`` tasks (split-K: both cores work
  even at batch 1 with few kv heads); every task keeps its own ``(m, l, acc)`` and a final
  ``prange`` over ``(b, h)`` merges them with log-sum-exp weights;
* keys (per-channel groups of ``G`` tokens, ``x = code * scale + base``, ``base`` = offset,
  offset + compensation, or ``-qmax * scale`` when symmetric): per group,
  ``q'_{i,d} = q_{i,d} * scale_d * scaling`` and ``c_i = scaling * sum_d q_{i,d} * base_d``; per
  token the ``D`` codes are unpacked once into a small float buffer and reused for all ``g`` query
  heads: ``s_i = c_i + sum_d q'_{i,d} * code_d``;
* values (per-token groups of ``G`` channels): ``acc_{i,d} += (p_i * scale_{t,grp}) * code_{t,d}``
  and the offsets are summed separately per group (``sum_t p_i * base_{t,grp}``) and added at the
  end of the chunk;
* masked positions get the score ``finfo(float32).min`` (exactly like the reference: a fully
  masked row attends uniformly instead of producing NaN); their values are skipped when ``p == 0``.

Computation is in float32 (``q``, scales and offsets are converted once per call; codes stay uint8).
Threads: numba's own pool (``NUMBA_NUM_THREADS`` / ``numba.set_num_threads``); the threading layer
defaults to ``workqueue`` unless ``NUMBA_THREADING_LAYER`` is set (the ``omp`` layer shares libgomp
with torch and measured 3-4x slower with 2 threads). Compile: ``@njit(parallel=True, fastmath=True, cache=True)`` with one explicit signature, so the
first call of a process either loads the on-disk cache or compiles once (seconds).
"""

from __future__ import annotations

import math

import numpy as np
import torch

from ..cache.layer import AttentionView
from ..quant.kv import PackedKV, compensation_values
from .reference import view_geometry

SUPPORTED_BITS = (1, 2, 4, 8)
NEG = float(torch.finfo(torch.float32).min)

_KERNEL = None
_AVAILABLE: bool | None = None


def fused_decode_available() -> bool:
    """True when numba can be imported (the fused decode kernel can run)."""
    global _AVAILABLE
    if _AVAILABLE is None:
        try:
            import numba  # noqa: F401

            _AVAILABLE = True
        except Exception:  # pragma: no cover - depends on the environment
            _AVAILABLE = False
    return _AVAILABLE


# --------------------------------------------------------------------------------------------- kernel
# The kernel is written as plain module-level Python and compiled lazily by :func:`_kernel`
# (``import kivi`` never imports numba). Module-level functions keep numba's on-disk cache valid
# across processes (closures would not be found again). ``prange`` / ``_unpack`` are bound to the
# numba objects before compilation.
prange = range
_NEG32 = np.float32(NEG)


def _unpack_py(row, bits, nb, out):
    """Codes of one token (the ``nb`` packed bytes ``row``) -> float32 ``out[: nb * (8 // bits)]``.

    Natural channel order (code ``k`` of byte ``j`` is channel ``j * per + k``). The common widths
    have their own branch so ``per`` is a compile-time constant (straight-line, SLP-vectorised).
    """
    if bits == 2:
        for j in range(nb):
            v = np.int32(row[j])
            out[4 * j] = np.float32(v & 3)
            out[4 * j + 1] = np.float32((v >> 2) & 3)
            out[4 * j + 2] = np.float32((v >> 4) & 3)
            out[4 * j + 3] = np.float32((v >> 6) & 3)
    elif bits == 4:
        for j in range(nb):
            v = np.int32(row[j])
            out[2 * j] = np.float32(v & 15)
            out[2 * j + 1] = np.float32((v >> 4) & 15)
    elif bits == 8:
        for j in range(nb):
            out[j] = np.float32(row[j])
    else:
        per = 8 // bits
        mask = (1 << bits) - 1
        for j in range(nb):
            v = np.int32(row[j])
            for k in range(per):
                out[j * per + k] = np.float32((v >> (bits * k)) & mask)


_unpack = _unpack_py

_SIGNATURE = (
    "void(float32[:,:,:], "  # q [B, Hq, D]
    # keys: quantized?, codes (flat bytes) + strides (b, h, t), scale, base, fp data, token offset, bits, G
    "int64, uint8[::1], int64, int64, int64, float32[:,:,:,:], float32[:,:,:,:], float32[:,:,:,:], int64, int64, int64, "
    # values: the same
    "int64, uint8[::1], int64, int64, int64, float32[:,:,:,:], float32[:,:,:,:], float32[:,:,:,:], int64, int64, int64, "
    # ntok, has_mask, valid [B, kv_len], first kv position of the segment, scaling, chunk, state m, l, acc
    "int64, int64, boolean[:,:], int64, float32, int64, float32[:,:], float32[:,:], float32[:,:,:])"
)


def _segment_py(q, kq, kflat, ks0, ks1, ks2, ksc, kbs, kfp, koff, kbits, kG,
                vq, vflat, vs0, vs1, vs2, vsc, vbs, vfp, voff, vbits, vG,
                ntok, has_mask, valid, vstart, scaling, chunk, m, l, acc):
    """One segment of tokens (one key piece x one value piece): update the state ``(m, l, acc)``."""
    B, Hq, D = q.shape
    Dv = acc.shape[2]
    Hkv = ksc.shape[1] if kq else kfp.shape[1]
    g = Hq // Hkv
    kper = 8 // kbits if kq else 1
    knb = (D + kper - 1) // kper
    knpos = knb * kper
    vper = 8 // vbits if vq else 1
    vnb = (Dv + vper - 1) // vper
    vnpos = vnb * vper
    nvg = Dv // vG if vq else 1
    nch = (ntok + chunk - 1) // chunk
    ntask = B * Hkv * nch
    pm = np.empty((ntask, g), dtype=np.float32)
    pl = np.empty((ntask, g), dtype=np.float32)
    pacc = np.empty((ntask, g, Dv), dtype=np.float32)
    for task in prange(ntask):
        bh = task // nch
        c = task - bh * nch
        b = bh // Hkv
        h = bh - b * Hkv
        t0 = c * chunk
        t1 = min(ntok, t0 + chunk)
        n = t1 - t0
        s = np.empty((g, n), dtype=np.float32)
        cod = np.zeros(max(knpos, vnpos), dtype=np.float32)
        qp = np.zeros((g, D), dtype=np.float32)
        qs = np.zeros((g, D), dtype=np.float32)
        cst = np.zeros(g, dtype=np.float32)
        for i in range(g):
            for d in range(D):
                qp[i, d] = q[b, h * g + i, d] * scaling
        # ---------------------------------------------------------------- scores
        if kq:
            grp_prev = -1
            kbase = b * ks0 + h * ks1
            for t in range(t0, t1):
                kt = koff + t
                grp = kt // kG
                if grp != grp_prev:
                    grp_prev = grp
                    scr = ksc[b, h, grp]
                    bsr = kbs[b, h, grp]
                    for i in range(g):
                        acc_c = np.float32(0.0)
                        for d in range(D):
                            qs[i, d] = qp[i, d] * scr[d]
                            acc_c += qp[i, d] * bsr[d]
                        cst[i] = acc_c
                o = kbase + kt * ks2
                _unpack(kflat[o : o + knb], kbits, knb, cod)
                for i in range(g):
                    sc = np.float32(0.0)
                    for d in range(D):
                        sc += qs[i, d] * cod[d]
                    s[i, t - t0] = sc + cst[i]
        else:
            for t in range(t0, t1):
                kt = koff + t
                kr = kfp[b, h, kt]
                for i in range(g):
                    sc = np.float32(0.0)
                    for d in range(D):
                        sc += qp[i, d] * kr[d]
                    s[i, t - t0] = sc
        if has_mask:
            for t in range(t0, t1):
                if not valid[b, vstart + t]:
                    for i in range(g):
                        s[i, t - t0] = _NEG32
        # ---------------------------------------------------------------- local softmax
        for i in range(g):
            mx = _NEG32
            for j in range(n):
                mx = max(mx, s[i, j])
            sm = np.float32(0.0)
            for j in range(n):
                pe = np.exp(s[i, j] - mx)
                s[i, j] = pe
                sm += pe
            pm[task, i] = mx
            pl[task, i] = sm
        # ---------------------------------------------------------------- values
        # acc_{i,d} = sum_t (p_{i,t} scale_{t,grp}) code_{t,d} + sum_t p_{i,t} base_{t,grp}
        la = np.zeros((g, Dv), dtype=np.float32)
        lo = np.zeros((g, nvg), dtype=np.float32)
        if vq:
            vbase = b * vs0 + h * vs1
            for t in range(t0, t1):
                vt = voff + t
                o = vbase + vt * vs2
                _unpack(vflat[o : o + vnb], vbits, vnb, cod)
                scr = vsc[b, h, vt]
                bsr = vbs[b, h, vt]
                for i in range(g):
                    pe = s[i, t - t0]
                    if pe == 0.0:
                        continue
                    for gg in range(nvg):
                        w = pe * scr[gg]
                        lo[i, gg] += pe * bsr[gg]
                        # slices + range(vG) from 0: a loop with a runtime start does not vectorise
                        lr = la[i, gg * vG : gg * vG + vG]
                        cr = cod[gg * vG : gg * vG + vG]
                        for d in range(vG):
                            lr[d] += w * cr[d]
            for i in range(g):
                for d in range(Dv):
                    pacc[task, i, d] = la[i, d] + lo[i, d // vG]
        else:
            for t in range(t0, t1):
                vt = voff + t
                vr = vfp[b, h, vt]
                for i in range(g):
                    pe = s[i, t - t0]
                    if pe == 0.0:
                        continue
                    for d in range(Dv):
                        la[i, d] += pe * vr[d]
            for i in range(g):
                for d in range(Dv):
                    pacc[task, i, d] = la[i, d]
    # -------------------------------------------------------------------- merge (log-sum-exp)
    for bh in prange(B * Hkv):
        b = bh // Hkv
        h = bh - b * Hkv
        for i in range(g):
            hq = h * g + i
            mo = m[b, hq]
            mx = mo
            for c in range(nch):
                mx = max(mx, pm[bh * nch + c, i])
            alpha = np.exp(mo - mx)
            tot = l[b, hq] * alpha
            for d in range(Dv):
                acc[b, hq, d] *= alpha
            for c in range(nch):
                w = np.exp(pm[bh * nch + c, i] - mx)
                tot += w * pl[bh * nch + c, i]
                for d in range(Dv):
                    acc[b, hq, d] += w * pacc[bh * nch + c, i, d]
            m[b, hq] = mx
            l[b, hq] = tot


def _build_kernel():
    """Compile (or load from numba's cache) the segment kernel. Imports numba lazily."""
    global prange, _unpack
    import os

    import numba

    if "NUMBA_THREADING_LAYER" not in os.environ:
        # numba's "omp" layer shares libgomp with torch; measured 3-4x slower with 2 threads on a
        # loaded 2-core machine (threads spin against torch's pool). "workqueue" has no such clash.
        numba.config.THREADING_LAYER = "workqueue"

    prange = numba.prange
    _unpack = numba.njit(inline="always", cache=True)(_unpack_py)
    return numba.njit(_SIGNATURE, parallel=True, fastmath=True, cache=True)(_segment_py)


def _kernel():
    global _KERNEL
    if _KERNEL is None:
        _KERNEL = _build_kernel()
    return _KERNEL


def warmup() -> float:
    """Compile (or load) the kernel now; returns the seconds it took."""
    import time

    t0 = time.perf_counter()
    _kernel()
    return time.perf_counter() - t0


# --------------------------------------------------------------------------------------------- host side
def _np(t: torch.Tensor):
    return t.detach().numpy()


def _f32(t: torch.Tensor):
    return _np(t if t.dtype == torch.float32 else t.float())


def _base(seg: PackedKV) -> torch.Tensor:
    """float32 additive term per group (``scale``'s shape): offset (+ compensation), or symmetric."""
    if seg.offset is None:
        base = seg.scale.float() * -(2 ** (seg.bits - 1) - 1)
    else:
        base = seg.offset.float()
    comp = compensation_values(seg)
    return base if comp is None else base + comp


def _flat_codes(packed: torch.Tensor):
    """``(flat uint8 array, stride_b, stride_h, stride_t)``: a 1-D view of the bytes ``packed`` spans.

    The store's segments are token slices of contiguous blocks (inner axis contiguous); a flat
    view lets the kernel use unit-stride loads (which vectorise) without copying anything.
    """
    if packed.stride(-1) != 1:
        packed = packed.contiguous()
    span = 1 + sum((n - 1) * st for n, st in zip(packed.shape, packed.stride()))
    flat = torch.as_strided(packed, (span,), (1,), packed.storage_offset())
    return (_np(flat), *packed.stride()[:3])


def _pieces(view: AttentionView) -> list[tuple[int, int, bool, tuple]]:
    """``(first, end, quantized, arrays)`` covering the view's tokens in order."""
    out = [] if view.sink is None else [(0, view.sink.shape[-2], False, (_f32(view.sink),))]
    for t0, seg in view.store.iter_blocks(view.split):
        n = seg.num_tokens
        if n == 0:
            continue
        if view.quantized:
            arrays = (*_flat_codes(seg.packed), _f32(seg.scale), _np(_base(seg)), seg.bits, seg.group_size)
            out.append((t0, t0 + n, True, arrays))
        else:
            out.append((t0, t0 + n, False, (_f32(seg.data),)))
    nfp = view.fp.shape[-2]
    if nfp:
        out.append((view.split, view.split + nfp, False, (_f32(view.fp),)))
    return out


def _valid_row(attention_mask: torch.Tensor | None, batch: int, kv_len: int) -> torch.Tensor | None:
    """``[B, kv_len]`` bool from the last query row of a 4-D mask, ``None`` if all valid.

    Raises ``ValueError`` for a mask the kernel cannot express (callers check first).
    """
    if attention_mask is None:
        return None
    if attention_mask.dim() != 4 or attention_mask.shape[1] != 1 or attention_mask.shape[-1] < kv_len:
        raise ValueError(f"mask of shape {tuple(attention_mask.shape)} is not a per-kv-position validity")
    row = attention_mask[:, 0, -1, :kv_len]
    if row.dtype != torch.bool:
        lowest = torch.finfo(row.dtype).min / 2
        keep = row > lowest
        if bool((row[keep] != 0).any()):
            raise ValueError("additive mask with values other than 0 and -inf/min")
        row = keep
    row = row.expand(batch, kv_len)
    if bool(row.all()):
        return None
    return row.contiguous()


def fused_decode_supported(q: torch.Tensor, k_view: AttentionView, v_view: AttentionView,
                           attention_mask: torch.Tensor | None = None) -> bool:
    """Whether :func:`fused_decode_attention` handles this call (numba present, n == 1, formats)."""
    if not fused_decode_available() or q.dim() != 4 or q.shape[2] != 1 or q.device.type != "cpu":
        return False
    for view in (k_view, v_view):
        if view.quantized and view.store.template is not None:
            t = view.store.template
            if t.bits not in SUPPORTED_BITS:
                return False
            if t.axis == "token" and t.group_size % (8 // t.bits):
                return False  # a byte's codes would straddle two value groups
    if q.shape[1] % k_view.fp.shape[1]:
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


def _chunk_tokens(ntok: int, tasks_bh: int, threads: int, group: int) -> int:
    """Tokens per task: enough tasks for every thread (x4 for balance), at least 256 tokens."""
    want = max(1, -(-4 * threads // max(tasks_bh, 1)))
    chunk = max(256, -(-ntok // want))
    return -(-chunk // group) * group


def fused_decode_attention(
    q: torch.Tensor,
    k_view: AttentionView,
    v_view: AttentionView,
    *,
    scaling: float | None = None,
    attention_mask: torch.Tensor | None = None,
) -> torch.Tensor:
    """Decode attention of ``q [B, Hq, 1, D]`` over a KIVI layer's views; ``[B, Hq, 1, Dv]`` in ``q.dtype``.

    Same semantics as :func:`kivi.attention.reference.reference_attention` for one query token.
    """
    import numba
    import numpy as np

    B, hq, n, d = q.shape
    if n != 1:
        raise ValueError(f"fused_decode_attention takes one query token per sequence, got {n}")
    start, kv_len, hkv, dv = view_geometry(q, k_view, v_view)
    scaling = d**-0.5 if scaling is None else scaling
    kernel = _kernel()
    valid = _valid_row(attention_mask, B, kv_len)
    has_mask = valid is not None
    valid_np = _np(valid) if has_mask else np.ones((1, 1), dtype=np.bool_)

    q32 = _np(q[:, :, 0].float().contiguous())
    m = np.full((B, hq), NEG, dtype=np.float32)
    l = np.zeros((B, hq), dtype=np.float32)
    acc = np.zeros((B, hq, dv), dtype=np.float32)
    du8 = np.zeros(1, dtype=np.uint8)
    df32 = np.zeros((1, 1, 1, 1), dtype=np.float32)
    threads = numba.get_num_threads()

    kp, vp = _pieces(k_view), _pieces(v_view)
    vi = 0
    for ka, kb, kquant, karr in kp:
        for va, vb, vquant, varr in vp[vi:]:
            lo, hi = max(ka, va), min(kb, vb)
            if va >= kb:
                break
            if lo >= hi:
                continue
            if kquant:
                kpk, ks0, ks1, ks2, ksc, kbs, kbits, kG = karr
                kfp = df32
            else:
                kpk, ks0, ks1, ks2, ksc, kbs, kbits, kG, kfp = du8, 0, 0, 0, df32, df32, 8, 1, karr[0]
            if vquant:
                vpk, vs0, vs1, vs2, vsc, vbs, vbits, vG = varr
                vfp = df32
            else:
                vpk, vs0, vs1, vs2, vsc, vbs, vbits, vG, vfp = du8, 0, 0, 0, df32, df32, 8, 1, varr[0]
            ntok = hi - lo
            chunk = _chunk_tokens(ntok, B * hkv, threads, kG if kquant else 1)
            kernel(q32, int(kquant), kpk, ks0, ks1, ks2, ksc, kbs, kfp, lo - ka, kbits, kG,
                   int(vquant), vpk, vs0, vs1, vs2, vsc, vbs, vfp, lo - va, vbits, vG,
                   ntok, int(has_mask), valid_np, lo - start, np.float32(scaling), chunk, m, l, acc)
        while vi < len(vp) and vp[vi][1] <= kb:
            vi += 1
    if kv_len == 0 or not math.isfinite(float(l.min(initial=1.0))):
        raise ValueError("fused_decode_attention: empty cache view")
    out = torch.from_numpy(acc / l[:, :, None])
    return out.view(B, hq, 1, dv).to(q.dtype)


__all__ = ["fused_decode_available", "fused_decode_supported", "fused_decode_attention", "warmup", "SUPPORTED_BITS"]
