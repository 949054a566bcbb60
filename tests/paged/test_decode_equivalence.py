"""The paged decode entry point (:func:`kivi.paged.decode.run_paged_decode`): every kernel against the torch
reference on one :class:`~kivi.paged.decode.PagedDecode`, the numba kernel (``"cpu"``) and the Triton kernel
(``"triton"``, under ``TRITON_INTERPRET=1`` on CPU tensors) each beside ``"reference"``.

Random pages in shuffled blocks of a pool full of junk bytes (a kernel that read a block the table does not name
would differ), counts of the real schedule (:func:`kivi.paged.counts.kernel_counts`: sinks still filling, windows
partly full, lengths that are not multiples of ``G`` or ``P``), 1 to 4 bits with 3-bit codes straddling bytes,
symmetric codes, GQA, float32 / float16 / bfloat16 queries, rows and page parameters, and the full-precision rows
laid out three ways:

* ``vllm``: the paged core's (both hosts' since the core is shared): ``k`` window rings of ``Pw`` rows
  ``[blocks, H, Pw, 2D]`` (keys in the first ``D`` channels, values in the last), a ring of ``k * Pw - S`` slots,
  the step's token written after the call, the counts also on the host (``host_counts``: a caller that vouches for
  its ids); the pages one layer of blocks three pages apart;
* ``lanes``: a rows pool of padded rows interleaved by (layer, side) lanes, a ring of ``R + G`` slots after the
  ``S`` sink slots, the step's token written to its slot before the call, the counts on the device only (the
  kernel checks the ids itself); the pages one layer of a block holding two;
* ``gathered``: float32 rows ``[N, slots, H, D]`` (the numba kernel and the reference only).
"""

from __future__ import annotations

import dataclasses
import random

import pytest
import torch

from kivi.attention.fused_cpu.paged import PagedLayout, RingRows
from kivi.cache.schedule import window_ring_slots
from kivi.config import KiviConfig
from kivi.optional import numba_available
from kivi.paged.counts import kernel_counts
from kivi.paged.decode import PagedDecode, run_paged_decode
from kivi.paged.ring import ring_slot, slot_rows
from kivi.quant.kv import PackedKV, dequantize_kv, quantize_side
from kivi.quant.page import page_fields

FORMATS = {  # name: (config, kv heads, query heads per kv head, head_dim, page size)
    "k2v2-G32": (KiviConfig(k_bits=2, v_bits=2, group_size=32, residual_length=32), 2, 3, 64, 64),
    "k4v2-G16-S4": (KiviConfig(k_bits=4, v_bits=2, group_size=16, residual_length=16, sink_tokens=4), 3, 1, 64, 32),
    "k3v3-G16-S2": (KiviConfig(k_bits=3, v_bits=3, group_size=16, residual_length=32, sink_tokens=2), 1, 4, 48, 32),
    "k4v4-sym-S1": (KiviConfig(k_bits=4, v_bits=4, group_size=16, residual_length=16, symmetric=True,
                               sink_tokens=1), 2, 2, 32, 48),
}
DTYPES = {"fp32": torch.float32, "fp16": torch.float16, "bf16": torch.bfloat16}
#: output bounds against the reference: the kernels attend in float32 (Triton's tl.dot in a 16-bit query's dtype)
TOL = {torch.float32: 2e-5, torch.float16: 5e-3, torch.bfloat16: 1e-2}
PW = 5  # vLLM window rows per ring block (odd: a ring's slots do not end on a power of two)


def _pasts(cfg: KiviConfig, seed: int) -> list[int]:
    """Tokens each request holds before its new one: one with nothing out of its window yet, one whose sink may
    still fill, then longer ones (odd lengths, windows partly full, rings wrapped many times)."""
    rng = random.Random(seed)
    G, R = cfg.group_size, cfg.residual_length
    return [rng.randint(0, 3), rng.randint(G // 2, R + G), *(rng.randint(R + G, 230) for _ in range(3))]


def _pages(cfg, H, D, P, dtype, host, counts, x, g):
    """A pool of junk bytes and one layer's ``PagedLayout`` as ``host`` lays them out, every request's stored
    tokens of ``x`` (per side ``[N][H, tokens, D]``) quantized page by page into shuffled blocks; the block table
    (unused columns junk)."""
    fields, end = page_fields(cfg, H, D, P, dtype)
    page = -(-end // 64) * 64
    block, base = (2 * page, page) if host == "lanes" else (3 * page, 0)
    layout = PagedLayout.of_page(fields, cfg, block_bytes=block, base=base)
    pages = [-(-max(c[1], c[4]) // P) for c in counts]
    nb = sum(pages) + 3
    pool = torch.randint(0, 256, (nb * block,), dtype=torch.uint8, generator=g)
    perm = torch.randperm(nb, generator=g).tolist()
    table = torch.full((len(counts), max(pages + [1]) + 1), -7, dtype=torch.int32)
    for i, (c, n) in enumerate(zip(counts, pages)):
        blocks, perm = perm[:n], perm[n:]
        table[i, :n] = torch.tensor(blocks, dtype=torch.int32)
        for s, side in enumerate("kv"):
            sink, stored = c[3 * s], c[3 * s + 1]
            seg_x = x[s][i][:, sink: sink + stored]
            for j, b in enumerate(blocks):
                part = seg_x[:, j * P: (j + 1) * P]
                if not part.shape[1]:
                    continue
                seg = quantize_side(part.unsqueeze(0), cfg.side_format(side))
                for name, t in seg.tensors().items():
                    layout.field(pool, side, name)[b][:, : t.shape[2]] = t[0]
    return pool, layout, table


def _rows(cfg, H, D, dtype, host, counts, x, g):
    """Both sides' full-precision rows as ``host`` keeps them (the module docstring): ``(k_fp, v_fp)``."""
    N, S = len(counts), cfg.sink_tokens
    if host == "gathered":
        width = S + max(max(c[2], c[5]) for c in counts)
        out = []
        for s in range(2):
            fp = torch.randn(N, width, H, D, generator=g)  # junk where no row is placed
            for i, c in enumerate(counts):
                sink, stored, window = c[3 * s: 3 * s + 3]
                fp[i, :sink] = x[s][i][:, :sink].transpose(0, 1).float()
                fp[i, S: S + window] = x[s][i][:, sink + stored:].transpose(0, 1).float()
            out.append(fp)
        return out
    if host == "lanes":
        ring, lanes, per_block = window_ring_slots(cfg.residual_length, cfg.group_size), 4, 12
        per_req = -(-(S + ring) * lanes // per_block)
        buf = torch.randn(N * per_req + 2, per_block, H + 1, D + 3, generator=g).to(dtype)
        pools = [buf[:, :, :H, :D]] * 2  # one rows pool, a lane per (layer, side)
        blocks = torch.randperm(buf.shape[0], generator=g)[: N * per_req].view(N, per_req)
        lane_slots = torch.arange(S + ring).expand(N, -1) * lanes  # slot s: rows s * lanes + lane
        slots = [slot_rows(blocks, lane_slots + 2 + s, per_block).to(torch.int32) for s in range(2)]  # layer 1's lanes
    else:
        k = -(-(S + window_ring_slots(cfg.residual_length, cfg.group_size) - 1) // PW)
        ring = k * PW - S
        buf = torch.randn(3 * N * k, H, PW, 2 * D, generator=g).to(dtype)
        pools = [buf.permute(0, 2, 1, 3)[..., :D], buf.permute(0, 2, 1, 3)[..., D:]]
        ring_table = torch.randperm(buf.shape[0], generator=g)[: N * k].view(N, k)
        slots = [slot_rows(ring_table, torch.arange(k * PW).expand(N, -1), PW).to(torch.int32)] * 2
    out = []
    for s in range(2):
        rows, ids = pools[s], slots[s].long()
        per = rows.shape[1]
        new = torch.empty(N, H, D, dtype=dtype)
        for i, c in enumerate(counts):
            sink, stored, window = c[3 * s: 3 * s + 3]
            first, past = sink + stored, sink + stored + window - 1
            cols = [*range(sink), *(ring_slot(t, ring, S) for t in range(first, past))]
            toks = [*range(sink), *range(first, past)]
            if host == "lanes":  # the step's token in its slot before the call (never read from there)
                cols.append(ring_slot(past, ring, S))
                toks.append(past)
            r = ids[i, cols]
            rows[r // per, r % per] = x[s][i][:, toks].transpose(0, 1)
            new[i] = x[s][i][:, past]
        out.append(RingRows(rows, slots[s], new))
    return out


def _call(fmt: str, dtype: torch.dtype, host: str, backend: str, seed: int = 0) -> tuple[PagedDecode, torch.Tensor]:
    cfg, H, gqa, D, P = FORMATS[fmt]
    g = torch.Generator().manual_seed(seed)
    counts = [kernel_counts(cfg, p) for p in _pasts(cfg, seed)]
    # every request's tokens (the new one last), keys with channel offsets as real keys have
    x = [[(torch.randn(H, c[0] + c[1] + c[2], D, generator=g) * 2 + 0.5 * s).to(dtype) for c in counts]
         for s in range(2)]
    pool, layout, table = _pages(cfg, H, D, P, dtype, host, counts, x, g)
    k_fp, v_fp = _rows(cfg, H, D, dtype, host, counts, x, g)
    c = torch.tensor(counts, dtype=torch.int64)
    call = PagedDecode(pool, layout, table, c, k_fp, v_fp, cfg.sink_tokens, backend,
                       c.clone() if host == "vllm" else None)
    return call, torch.randn(len(counts), H * gqa, D, generator=g).to(dtype)


def _skip_without(backend: str) -> None:
    """Skip where ``backend``'s kernel cannot run here (the reference always can)."""
    from tests.helpers import triton_skip_reason

    reason = triton_skip_reason() if backend == "triton" else None if numba_available() else "numba not installed"
    if reason:
        pytest.skip(reason)


KERNELS = [pytest.param("cpu", host, id=f"cpu-{host}") for host in ("lanes", "vllm", "gathered")] + [
    pytest.param("triton", host, id=f"triton-{host}", marks=pytest.mark.triton) for host in ("lanes", "vllm")]


@pytest.mark.parametrize("dtype", list(DTYPES.values()), ids=list(DTYPES))
@pytest.mark.parametrize("fmt", list(FORMATS))
@pytest.mark.parametrize("backend, host", KERNELS)
def test_kernel_equals_the_reference(backend, host, fmt, dtype):
    _skip_without(backend)
    seed = list(FORMATS).index(fmt) * 7 + list(DTYPES.values()).index(dtype)
    call, q = _call(fmt, dtype, host, backend, seed=seed)
    out = run_paged_decode(call, q, scaling=0.3)
    ref = run_paged_decode(dataclasses.replace(call, backend="reference"), q, scaling=0.3)
    assert out.dtype == ref.dtype == q.dtype and out.shape == ref.shape == q.shape
    assert not ref.isnan().any()
    torch.testing.assert_close(out.float(), ref.float(), atol=TOL[dtype], rtol=TOL[dtype])


@pytest.mark.parametrize("backend", ["cpu", pytest.param("triton", marks=pytest.mark.triton)])
def test_all_constant_groups_dequantize_exactly(backend):
    """Pages whose groups hold one value each (scale 0): every stored token dequantizes to that value, and each
    kernel attends over it as the reference does."""
    _skip_without(backend)
    call, q = _call("k4v2-G16-S4", torch.float32, "vllm", backend, seed=11)
    for side in "kv":
        call.layout.field(call.pool, side, "scale").zero_()
        call.layout.field(call.pool, side, "offset").fill_(0.75)
    ref = run_paged_decode(dataclasses.replace(call, backend="reference"), q)
    torch.testing.assert_close(run_paged_decode(call, q), ref, atol=2e-5, rtol=2e-5)


def test_the_reference_attends_over_the_dequantized_tokens():
    """The reference itself, on one request: softmax attention over sink, the pages dequantized and the window."""
    cfg, H, gqa, D, P = FORMATS["k4v2-G16-S4"]
    call, q = _call("k4v2-G16-S4", torch.float32, "gathered", "reference", seed=3)
    i = 4
    one = PagedDecode(call.pool, call.layout, call.block_table[i: i + 1], call.counts[i: i + 1],
                      call.k_fp[i: i + 1], call.v_fp[i: i + 1], call.w0, "reference")
    sides = []
    for s, (side, fp) in enumerate((("k", call.k_fp), ("v", call.v_fp))):
        sink, stored, window = call.counts[i, 3 * s: 3 * s + 3].tolist()
        parts = [fp[i, :sink].transpose(0, 1)]
        for j in range(-(-stored // P)):
            b = int(call.block_table[i, j])
            t = {name: call.layout.field(call.pool, side, name)[b: b + 1] for name in ("packed", "scale", "offset")}
            seg = PackedKV(packed=t["packed"], scale=t["scale"], offset=t["offset"], comp=None,
                           format=cfg.side_format(side), head_dim=D)
            parts.append(dequantize_kv(seg, torch.float32)[0, :, : min(P, stored - j * P)])
        parts.append(fp[i, call.w0: call.w0 + window].transpose(0, 1))
        sides.append(torch.cat(parts, dim=1))  # [H, T, D]
    k, v = sides
    p = torch.softmax(torch.einsum("hgd,htd->hgt", q[i].view(H, gqa, D), k) * 0.3, dim=-1)
    want = torch.einsum("hgt,htd->hgd", p, v).reshape(H * gqa, D)
    torch.testing.assert_close(run_paged_decode(one, q[i: i + 1], scaling=0.3)[0], want, atol=1e-5, rtol=1e-5)


def test_a_backend_is_named_never_fallen_into():
    call, _ = _call("k2v2-G32", torch.float32, "lanes", "reference")
    with pytest.raises(ValueError, match="backend='numba' must be one of"):
        dataclasses.replace(call, backend="numba")
