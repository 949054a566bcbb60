"""The paged decode kernel (one call for a batch of requests reading a block pool) against its torch reference."""

from __future__ import annotations

import pytest
import torch

from kivi.optional import numba_available
from kivi.quant.kv import quantize_kv
from kivi.quant.packing import packed_size

pytestmark = pytest.mark.skipif(not numba_available(), reason="numba not installed")

from kivi.attention.fused_cpu.paged import PagedLayout, paged_decode_attention, torch_paged_decode  # noqa: E402


def _layout(H, D, P, G, kb, vb, pdt, symmetric) -> PagedLayout:
    """A block of one layer's fields laid out one after the other (16-byte aligned), as kivi's pages do."""
    off, at = {}, 0
    sizes = {"k_packed": H * P * packed_size(D, kb), "v_packed": H * P * packed_size(D, vb),
             "k_scale": H * (P // G) * D * pdt.itemsize, "v_scale": H * P * (D // G) * pdt.itemsize}
    sizes["k_offset"], sizes["v_offset"] = sizes["k_scale"], sizes["v_scale"]
    for name in ("k_packed", "k_scale", "k_offset", "v_packed", "v_scale", "v_offset"):
        if symmetric and name.endswith("offset"):
            off[name] = None
            continue
        at = -(-at // 16) * 16
        off[name] = at
        at += sizes[name]
    return PagedLayout(block_bytes=-(-at // 128) * 128, page_size=P, group_size=G, num_kv_heads=H, head_dim=D,
                       k_bits=kb, v_bits=vb, param_dtype=pdt, k_row_bytes=packed_size(D, kb),
                       v_row_bytes=packed_size(D, vb), **off)


def _batch(lay: PagedLayout, lens, sinks, w0, seed=0, slots=None):
    """Random pages and fp rows for requests of ``lens`` tokens: ``(pool, block_table, counts, k_fp, v_fp)``.

    Keys keep a partly full window (``t % G`` plus up to G more tokens), values fewer; every request's pages sit in
    shuffled blocks of the pool (block ids not in request order)."""
    g = torch.Generator().manual_seed(seed)
    H, D, P, G = lay.num_kv_heads, lay.head_dim, lay.page_size, lay.group_size
    counts, tables = [], []
    for t, s in zip(lens, sinks):
        rest = t - s
        k_stored = max(0, (rest - G - int(torch.randint(0, G, (1,), generator=g))) // G * G)
        v_stored = max(0, rest - int(torch.randint(1, G + 1, (1,), generator=g)))
        counts.append([s, k_stored, rest - k_stored, s, v_stored, rest - v_stored])
    pages = [-(-max(c[1], c[4]) // P) for c in counts]
    nb = sum(pages) + 3
    perm = torch.randperm(nb, generator=g)
    pool = torch.zeros(nb * lay.block_bytes, dtype=torch.uint8)
    slots = slots or w0 + max(max(c[2], c[5]) for c in counts)
    k_fp = torch.randn(len(lens), slots, H, D, generator=g)
    v_fp = torch.randn(len(lens), slots, H, D, generator=g)
    used = 0
    for c, n in zip(counts, pages):
        blocks = perm[used: used + n]
        used += n
        tables.append(blocks.tolist())
        for side, stored, bits, axis in (("k", c[1], lay.k_bits, "channel"), ("v", c[4], lay.v_bits, "token")):
            x = torch.randn(1, H, stored, D, generator=g) * 2 + 0.5
            for j in range(-(-stored // P)):
                part = x[:, :, j * P: (j + 1) * P]
                seg = quantize_kv(part, axis, bits, G, symmetric=lay.k_offset is None, param_dtype=lay.param_dtype)
                for name, t in seg.tensors().items():
                    view = lay.field(pool, side, name)[int(blocks[j])]  # [H, rows, C]
                    view[:, : t.shape[2]] = t[0]
    width = max(pages + [1])
    table = torch.full((len(lens), width), -7, dtype=torch.int32)  # unused columns hold junk
    for i, t in enumerate(tables):
        table[i, : len(t)] = torch.tensor(t, dtype=torch.int32)
    return pool, table, torch.tensor(counts, dtype=torch.int64), k_fp, v_fp


CASES = [  # (H, gqa, D, P, G, k_bits, v_bits, param dtype, symmetric)
    (3, 3, 64, 64, 32, 2, 2, torch.float32, False),
    (2, 1, 64, 32, 32, 4, 2, torch.float32, False),
    (1, 3, 48, 32, 16, 3, 3, torch.float32, False),
    (2, 3, 48, 48, 16, 2, 4, torch.bfloat16, False),
    (3, 1, 64, 64, 32, 2, 2, torch.float16, False),
    (2, 3, 64, 32, 32, 4, 4, torch.float32, True),
]
IDS = ["k2v2-gqa3", "k4v2-mha", "d48-3bit", "bf16-params", "fp16-params", "symmetric"]


@pytest.mark.parametrize("case", CASES, ids=IDS)
@pytest.mark.parametrize("threaded", [False, True], ids=["serial", "threads"])
def test_paged_decode_matches_torch_reference(case, threaded):
    H, gqa, D, P, G, kb, vb, pdt, sym = case
    lay = _layout(H, D, P, G, kb, vb, pdt, sym)
    lens, sinks, w0 = [1, 7, 77, 301, 45, 130], [0, 0, 2, 4, 4, 0], 4
    pool, table, counts, k_fp, v_fp = _batch(lay, lens, sinks, w0)
    q = torch.randn(len(lens), H * gqa, D, generator=torch.Generator().manual_seed(1)).to(
        torch.float32 if pdt == torch.float32 else pdt)
    ref = torch_paged_decode(q, pool, lay, table, counts, k_fp, v_fp, w0, scaling=0.3)
    out = paged_decode_attention(q, pool, lay, table, counts, k_fp, v_fp, w0, scaling=0.3, threaded=threaded)
    assert out.dtype == q.dtype and out.shape == ref.shape
    tol = 2e-5 if q.dtype == torch.float32 else 1e-2
    torch.testing.assert_close(out.float(), ref.float(), atol=tol, rtol=tol)


@pytest.mark.parametrize("n", [1, 2, 5])
def test_each_request_reads_only_its_own_pages(n):
    """A batch of ``n`` equals each request run alone (no request reads another's pages or rows)."""
    lay = _layout(3, 64, 64, 32, 2, 2, torch.float32, False)
    lens = [33, 700, 129, 64, 1000][:n]
    pool, table, counts, k_fp, v_fp = _batch(lay, lens, [4] * n, 4, seed=3)
    q = torch.randn(n, 9, 64)
    out = paged_decode_attention(q, pool, lay, table, counts, k_fp, v_fp, 4, threaded=True)
    for i in range(n):
        one = paged_decode_attention(q[i: i + 1], pool, lay, table[i: i + 1], counts[i: i + 1], k_fp[i: i + 1],
                                     v_fp[i: i + 1], 4, threaded=False)
        torch.testing.assert_close(out[i: i + 1], one, atol=2e-6, rtol=2e-6)


def test_layout_vector_columns_are_the_kernels():
    from kivi.attention.fused_cpu import kernel

    lay = _layout(2, 64, 32, 32, 2, 4, torch.bfloat16, True)
    v = lay.vector()
    assert v.shape == (kernel.PAGED_NCOL,)
    assert v[kernel._PL_BLOCK] == lay.block_bytes and v[kernel._PL_P] == 32 and v[kernel._PL_G] == 32
    assert (v[kernel._PL_KBITS], v[kernel._PL_VBITS]) == (2, 4)
    assert (v[kernel._PL_KROW], v[kernel._PL_VROW]) == (16, 32)
    assert (v[kernel._PL_KPACK], v[kernel._PL_KSC], v[kernel._PL_KOFF]) == (lay.k_packed, lay.k_scale, -1)
    assert (v[kernel._PL_VPACK], v[kernel._PL_VSC], v[kernel._PL_VOFF]) == (lay.v_packed, lay.v_scale, -1)
    assert v[kernel._PL_PDT] == 1


@pytest.mark.parametrize("bad, match", [
    (lambda a: a.update(block_table=a["block_table"].long()), "block_table must be int32"),
    (lambda a: a.update(counts=a["counts"] + torch.tensor([0, 0, 0, 0, 0, 1])), "as many key as value"),
    (lambda a: a.update(k_fp=a["k_fp"].double()), "k_fp must be float32"),
    (lambda a: a["block_table"].__setitem__((0, 0), 10**6), "outside the pool"),
    (lambda a: a.update(w0=1), "do not fit the fp slots"),
    (lambda a: a.update(q=a["q"][:, :, :32]), "does not fit"),
], ids=["table-dtype", "counts", "fp-dtype", "block-id", "w0", "head-dim"])
def test_bad_inputs_are_refused_by_name(bad, match):
    lay = _layout(3, 64, 64, 32, 2, 2, torch.float32, False)
    pool, table, counts, k_fp, v_fp = _batch(lay, [300, 90], [4, 4], 4)
    args = dict(q=torch.randn(2, 9, 64), pool=pool, layout=lay, block_table=table, counts=counts, k_fp=k_fp,
                v_fp=v_fp, w0=4)
    bad(args)
    with pytest.raises(ValueError, match=match):
        paged_decode_attention(**args)
