"""kivi.kernels.triton_paged_inputs: a step's decode rows' inputs in one Triton launch equal the torch forms
(:meth:`kivi.paged.geometry.RingPool.slot_ids`, the block-table rows, the gathered rows), value for value, under
``TRITON_INTERPRET=1`` on CPU tensors: random tables, odd widths, strided rows, three dtypes, no rows."""

from __future__ import annotations

import pytest
import torch

from kivi.kernels.triton_paged_inputs import triton_paged_inputs

pytestmark = pytest.mark.triton


@pytest.fixture(autouse=True)
def _interpreter():
    from tests.helpers import triton_skip_reason

    reason = triton_skip_reason()
    if reason:
        pytest.skip(reason)


def _case(N, C, W, B, k, pw, hq, h, D, dtype, seed):
    g = torch.Generator().manual_seed(seed)
    ring_table = torch.randint(0, 50, (B, k), generator=g, dtype=torch.int32)
    base, step = torch.randint(0, 9, (k,), generator=g), torch.randint(1, 4, (k,), generator=g)
    index = torch.randperm(B, generator=g)[:N]
    n = B + 3
    tokens = torch.randperm(n, generator=g)[:N]
    slots = [torch.randint(0, k * pw, (N, C), generator=g) for _ in range(2)]
    page_table = torch.randint(0, 1000, (B, W), generator=g, dtype=torch.int32)
    query, key, value = (torch.randn(n, heads, 2 * D + 1, generator=g).to(dtype)[..., 1: D + 1]
                         for heads in (hq, h, h))  # strided heads, contiguous channels
    return ring_table, index, tokens, base, step, *slots, pw, page_table, query, key, value


def _torch_form(ring_table, index, tokens, base, step, kslots, vslots, pw, page_table, query, key, value):
    blocks = base + ring_table[index].long() * step
    ids = [(blocks.gather(1, s // pw) * pw + s % pw).to(torch.int32) for s in (kslots, vslots)]
    return (*ids, page_table[index].to(torch.int32), query[tokens], key[tokens], value[tokens])


@pytest.mark.parametrize("N, C, W, k, pw, hq, h, D, dtype", [
    (5, 7, 3, 2, 4, 6, 2, 16, torch.float32),
    (3, 19, 1, 3, 8, 9, 3, 8, torch.bfloat16),
    (1, 1, 5, 1, 16, 4, 4, 32, torch.float16),
], ids=["fp32", "bf16-gqa3", "fp16-one-row"])
def test_inputs_equal_the_torch_form(N, C, W, k, pw, hq, h, D, dtype):
    args = _case(N, C, W, 8, k, pw, hq, h, D, dtype, seed=N + C)
    got = triton_paged_inputs(*args)
    want = _torch_form(*args)
    for name, a, b in zip(("kids", "vids", "pages", "q", "k", "v"), got, want):
        assert a.dtype == b.dtype and a.shape == b.shape and torch.equal(a, b), name
        assert a.is_contiguous(), name


def test_no_rows_and_misfits():
    args = list(_case(2, 3, 2, 6, 2, 4, 4, 2, 16, torch.float32, seed=1))
    empty = args.copy()
    empty[1], empty[2] = args[1][:0], args[2][:0]
    empty[5], empty[6] = args[5][:0], args[6][:0]
    assert [t.shape[0] for t in triton_paged_inputs(*empty)] == [0] * 6
    bad = args.copy()
    bad[6] = args[6][:, :2]
    with pytest.raises(ValueError, match="same 2 decode rows"):
        triton_paged_inputs(*bad)
    bad = args.copy()
    bad[10] = args[10][:, :1]
    with pytest.raises(ValueError, match="rows of one step"):
        triton_paged_inputs(*bad)
