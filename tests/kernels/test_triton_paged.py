"""The Triton paged decode kernel (kivi.kernels.triton_paged) under TRITON_INTERPRET=1 on CPU: what is its own —
splits and tiles, reading only the named blocks and rows, refusals by name, ``host_counts`` (nothing read back).
Its outputs against the torch reference and the numba kernel on the hosts' layouts, formats and dtypes:
tests/paged/test_decode_equivalence.py. Small shapes: the interpreter is slow."""

from __future__ import annotations

import pytest
import torch

from kivi.attention.fused_cpu.paged import RingRows, torch_paged_decode
from kivi.kernels.triton_paged import triton_paged_decode
from tests.attention.test_paged_decode import CASES, _batch, _layout, _ring_form

pytestmark = pytest.mark.triton

LENS, SINKS, W0 = [1, 7, 77, 301, 45, 130], [0, 0, 2, 4, 4, 0], 4


def _inputs(ci, rows_dtype, extra, seed=0):
    H, gqa, D, P, G, kb, vb, pdt, sym = CASES[ci]
    lay = _layout(H, D, P, G, kb, vb, pdt, sym)
    pool, table, counts, k_fp, v_fp = _batch(lay, LENS, SINKS, W0, seed=seed)
    ring = int(counts[:, [2, 5]].max()) - 1 + extra
    kr, vr, _, _ = _ring_form(k_fp, v_fp, counts, W0, ring, rows_dtype)
    return lay, pool, table, counts, kr, vr, H * gqa, D


@pytest.mark.parametrize("splits, block_n", [(1, 16), (2, 32), (7, 16)], ids=["1-split", "2-splits", "7-splits"])
def test_splits_and_tiles_do_not_change_the_result(splits, block_n):
    """Token ranges split across programs (some programs past a short request's end) merge to the same output."""
    lay, pool, table, counts, kr, vr, hq, D = _inputs(0, torch.float32, 3, seed=2)
    q = torch.randn(len(LENS), hq, D, generator=torch.Generator().manual_seed(3))
    ref = torch_paged_decode(q, pool, lay, table, counts, kr, vr, W0)
    out = triton_paged_decode(q, pool, lay, table, counts, kr, vr, W0, num_splits=splits, block_n=block_n)
    torch.testing.assert_close(out, ref, atol=2e-5, rtol=2e-5)


def test_only_the_named_blocks_and_rows_are_read():
    """NaN everywhere the inputs do not name (blocks of the pool no table row lists, rows of the pool no slot
    names): a kernel that read one would return NaN."""
    lay, pool, table, counts, kr, vr, hq, D = _inputs(0, torch.float32, 2, seed=6)
    P = lay.page_size
    used = set()
    for i in range(len(LENS)):
        pages = -(-int(max(counts[i, 1], counts[i, 4])) // P)
        used |= set(table[i, :pages].tolist())
    nb = pool.numel() // lay.block_bytes
    for b in set(range(nb)) - used:
        for side in ("k", "v"):
            lay.field(pool, side, "scale")[b] = float("nan")
    for rr in (kr, vr):
        named = set(rr.slots.flatten().tolist())
        per = rr.rows.shape[1]
        for r in set(range(rr.rows.shape[0] * per)) - named:
            rr.rows[r // per, r % per] = float("nan")
    q = torch.randn(len(LENS), hq, D, generator=torch.Generator().manual_seed(7))
    # the reference reads only the tokens each request holds; unwritten ring columns it never reads
    ref = torch_paged_decode(q, pool, lay, table, counts, kr, vr, W0)
    out = triton_paged_decode(q, pool, lay, table, counts, kr, vr, W0)
    assert not out.isnan().any()
    torch.testing.assert_close(out, ref, atol=2e-5, rtol=2e-5)


def test_bad_inputs_are_refused_naming_them():
    lay, pool, table, counts, kr, vr, hq, D = _inputs(0, torch.float32, 0)
    q = torch.randn(len(LENS), hq, D)
    bad = counts.clone()
    bad[2, 1] += 1  # stored keys no longer whole groups (the window one shorter: the same positions)
    bad[2, 2] -= 1
    with pytest.raises(ValueError, match="whole groups"):
        triton_paged_decode(q, pool, lay, table, bad, kr, vr, W0)
    wrong = table.clone()
    wrong[3, 0] = pool.numel() // lay.block_bytes  # one past the pool
    with pytest.raises(ValueError, match="outside the pool"):
        triton_paged_decode(q, pool, lay, wrong, counts, kr, vr, W0)
    gathered = torch.zeros(len(LENS), 8, lay.num_kv_heads, D)
    with pytest.raises(ValueError, match="RingRows"):
        triton_paged_decode(q, pool, lay, table, counts, gathered, gathered, W0)
    with pytest.raises(ValueError, match="k_fp.new"):
        triton_paged_decode(q, pool, lay, table, counts, RingRows(kr.rows, kr.slots, kr.new[:, :1]), vr, W0)


def test_host_counts_check_on_the_host_copy_and_read_nothing_back(monkeypatch):
    """``host_counts`` (the vLLM plugin's path): the same output; the counts are checked on the host copy (a bad
    one is refused, naming the rule); no tensor is copied to the host (``Tensor.cpu`` and ``on_host`` are never
    called: on a GPU each would be a synchronization per layer)."""
    import kivi.kernels.triton_paged as tp

    lay, pool, table, counts, kr, vr, hq, D = _inputs(0, torch.float32, 3, seed=5)
    q = torch.randn(len(LENS), hq, D, generator=torch.Generator().manual_seed(6))
    ref = triton_paged_decode(q, pool, lay, table, counts, kr, vr, W0, scaling=0.3)
    host = counts.clone()

    def refuse(*_a, **_k):
        raise AssertionError("a tensor was copied to the host")

    monkeypatch.setattr(torch.Tensor, "cpu", refuse)
    monkeypatch.setattr(tp, "on_host", refuse)
    out = triton_paged_decode(q, pool, lay, table, counts, kr, vr, W0, scaling=0.3, host_counts=host)
    torch.testing.assert_close(out, ref, atol=0, rtol=0)
    bad = host.clone()
    bad[2, 1] += 1
    bad[2, 2] -= 1
    with pytest.raises(ValueError, match="whole groups"):
        triton_paged_decode(q, pool, lay, table, counts, kr, vr, W0, host_counts=bad)
    with pytest.raises(ValueError, match="host copy of counts"):
        triton_paged_decode(q, pool, lay, table, counts, kr, vr, W0, host_counts=host[:2])
