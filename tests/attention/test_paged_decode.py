"""The numba paged decode kernel (one call for a batch of requests reading a block pool): its two entries and two
forms of rows agree, a request reads only its own pages, the layout vector, refusals by name. Each kernel against
the torch reference, on the hosts' layouts: tests/paged/test_decode_equivalence.py. The helpers here (``_layout``,
``_batch``, ``_ring_form``) build inputs for tests/kernels too."""

from __future__ import annotations

import pytest
import torch

from kivi.optional import numba_available
from kivi.quant.kv import quantize_kv
from kivi.quant.packing import packed_size

pytestmark = pytest.mark.skipif(not numba_available(), reason="numba not installed")

from kivi.attention.fused_cpu.paged import PagedLayout, paged_decode_attention  # noqa: E402


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


# ------------------------------------------------------------------ rows read in place (RingRows)
from kivi.attention.fused_cpu.paged import RingRows  # noqa: E402
from kivi.paged.ring import ring_slot  # noqa: E402


def _ring_form(k_fp, v_fp, counts, w0, ring, dtype, seed=5):
    """The gathered rows of :func:`_batch` laid out as rings in a shuffled rows pool of ``dtype`` (head stride
    padded: a view of a larger buffer): ``(k RingRows, v RingRows, k_fp, v_fp)``, the gathered arrays rounded to
    ``dtype`` so both forms hold the same values. Window token at position ``t`` sits in column
    :func:`kivi.paged.ring.ring_slot` ``(t, ring, w0)``; the window's last row is the step's new token (passed
    apart)."""
    g = torch.Generator().manual_seed(seed)
    N, _, H, D = k_fp.shape
    k_fp, v_fp = k_fp.to(dtype).float(), v_fp.to(dtype).float()
    per_block = 7
    need = N * (w0 + ring)
    nb = -(-need // per_block) + 2
    out = []
    for s, fp in enumerate((k_fp, v_fp)):
        buf = torch.randn(nb, per_block, H + 1, D + 3, generator=g).to(dtype)  # junk where no row is placed
        rows = buf[:, :, :H, :D]
        ids = torch.randperm(nb * per_block, generator=g)[:need].view(N, w0 + ring).to(torch.int32)
        new = torch.empty(N, H, D)
        for i in range(N):
            sink, stored, window = counts[i, 3 * s: 3 * s + 3].tolist()
            for t in range(sink):
                r = int(ids[i, t])
                rows[r // per_block, r % per_block] = fp[i, t].to(dtype)
            for j in range(window - 1):
                r = int(ids[i, ring_slot(sink + stored + j, ring, w0)])
                rows[r // per_block, r % per_block] = fp[i, w0 + j].to(dtype)
            new[i] = fp[i, w0 + window - 1]
        out.append(RingRows(rows, ids, new))
    return out[0], out[1], k_fp, v_fp


RING_CASES = [  # (case index in CASES, rows dtype, ring slots beyond the longest window's older tokens)
    (0, torch.float32, 0), (1, torch.bfloat16, 1), (2, torch.float16, 0), (3, torch.bfloat16, 5),
    (4, torch.float16, 1), (5, torch.float32, 29),
]
RING_IDS = [f"{IDS[c]}-{str(d)[6:]}-ring+{r}" for c, d, r in RING_CASES]


@pytest.mark.parametrize("ci, dtype, extra", RING_CASES, ids=RING_IDS)
def test_entries_and_forms_of_rows_agree(ci, dtype, extra):
    """numba's two entries (the calling thread; numba's pool, split-K chunks) over both forms of rows (gathered;
    in place, a ring that wraps many times, 16-bit rows) give one output. Each against the torch reference, on the
    hosts' layouts: tests/paged/test_decode_equivalence.py."""
    H, gqa, D, P, G, kb, vb, pdt, sym = CASES[ci]
    lay = _layout(H, D, P, G, kb, vb, pdt, sym)
    lens, sinks, w0 = [1, 7, 77, 301, 45, 130], [0, 0, 2, 4, 4, 0], 4
    pool, table, counts, k_fp, v_fp = _batch(lay, lens, sinks, w0)
    ring = int(counts[:, [2, 5]].max()) - 1 + extra  # the tightest ring wraps every ring positions
    kr, vr, k_fp, v_fp = _ring_form(k_fp, v_fp, counts, w0, ring, dtype)
    q = torch.randn(len(lens), H * gqa, D, generator=torch.Generator().manual_seed(1))
    outs = [paged_decode_attention(q, pool, lay, table, counts, k, v, w0, scaling=0.3, threaded=threaded)
            for k, v in ((k_fp, v_fp), (kr, vr)) for threaded in (False, True)]
    for out in outs[1:]:  # split-K chunks sum in another order
        torch.testing.assert_close(out, outs[0], atol=2e-6, rtol=2e-6)


@pytest.mark.parametrize("bad, match", [
    (lambda a: a.update(k_fp=RingRows(a["k_fp"].rows, a["k_fp"].slots.long(), a["k_fp"].new)), "slots must be int32"),
    (lambda a: a["k_fp"].slots.__setitem__((0, 0), 10**6), "outside the rows pool"),
    (lambda a: a.update(v_fp=RingRows(a["v_fp"].rows.double(), a["v_fp"].slots, a["v_fp"].new)), "v_fp.rows must"),
    (lambda a: a.update(k_fp=RingRows(a["k_fp"].rows, a["k_fp"].slots[:, :30], a["k_fp"].new),
                        v_fp=RingRows(a["v_fp"].rows, a["v_fp"].slots[:, :30], a["v_fp"].new)), "do not fit the slot"),
    (lambda a: a.update(v_fp=a["k_fp"].new.new_zeros(2, 50, 3, 64)), "both be gathered tensors or both RingRows"),
    (lambda a: a.update(k_fp=RingRows(a["k_fp"].rows, a["k_fp"].slots, a["k_fp"].new[:, :2])), "k_fp.new must"),
], ids=["slots-dtype", "row-id", "rows-dtype", "ring-too-short", "mixed-forms", "new-shape"])
def test_bad_ring_rows_are_refused_by_name(bad, match):
    lay = _layout(3, 64, 64, 32, 2, 2, torch.float32, False)
    pool, table, counts, k_fp, v_fp = _batch(lay, [300, 90], [4, 4], 4)
    kr, vr, _, _ = _ring_form(k_fp, v_fp, counts, 4, 64, torch.float32)
    args = dict(q=torch.randn(2, 9, 64), pool=pool, layout=lay, block_table=table, counts=counts, k_fp=kr,
                v_fp=vr, w0=4)
    bad(args)
    with pytest.raises(ValueError, match=match):
        paged_decode_attention(**args)
