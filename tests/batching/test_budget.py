"""What a byte budget admits: window blocks sized by each request's length, and what the blocks report."""

from __future__ import annotations

import pytest
import torch
from transformers.generation.configuration_utils import ContinuousBatchingConfig

from kivi import KiviConfig, quantize_model
from kivi.batching import block_usage, build_layout, generate_batch
from kivi.batching.allocator import EVICTED
from kivi.batching.paged_cache import KiviPagedCache
from tests.helpers import tiny_model

CFG = KiviConfig(k_bits=2, v_bits=2, group_size=16, residual_length=32)
PAGE = 64
CB = dict(page_size=PAGE, max_batch_tokens=512)


def _prompts(n: int, length: int) -> list[list[int]]:
    g = torch.Generator().manual_seed(0)
    return [torch.randint(1, 128, (length,), generator=g).tolist() for _ in range(n)]


@pytest.fixture
def forwards(monkeypatch):
    """Per forward of the paged cache (its layer 0): its ``(request, past, query)`` and the block usage then."""
    seen = []
    start = KiviPagedCache._start_forward

    def spy(self):
        start(self)
        seen.append((list(self._batch), block_usage(self), self.free_block_count()))

    monkeypatch.setattr(KiviPagedCache, "_start_forward", spy)
    return seen


def _layout():
    return build_layout(tiny_model().config, CFG, PAGE, torch.float32)


def test_a_budget_that_fits_four_short_requests_runs_them_together(forwards):
    """4 requests of 5 + 5 tokens: each needs one page and the window blocks of 10 tokens, not those of a
    full window (S + R + G - 1 = 47 slots), so a budget of 4 such requests runs all 4 in every forward."""
    lay = _layout()
    per_request = lay.request_blocks(10)
    assert per_request < lay.token_blocks(10) + lay.window_blocks  # a full window would not fit 4
    inputs = _prompts(4, 5)
    out = generate_batch(tiny_model(), inputs, CFG, cache_memory=4 * per_request * lay.block_bytes,
                         max_new_tokens=5, **CB)
    assert max(len(batch) for batch, _, _ in forwards) == 4
    assert len(forwards) == 5  # one prefill and 4 decode steps, all requests together
    for _, usage, free in forwards:  # what is held is what the pool is missing
        assert usage.total == 4 * per_request and usage.held + free == usage.total, usage
        assert usage.window == 4 * lay.request_window_blocks(10) and usage.requests == 4
    for x, o in zip(inputs, out.values()):
        ref = quantize_model(tiny_model(), CFG).generate(torch.tensor([x]), max_new_tokens=5, do_sample=False)
        assert o.generated_tokens == ref[0, len(x):].tolist()


def test_a_budget_that_fits_one_request_still_finishes_all(forwards):
    """4 requests of 5 + 60 tokens in the blocks of one: short requests start together, their windows grow
    (a window block every ``window_tokens`` tokens), and the scheduler frees and re-prefills
    (transformers' soft reset) the ones that no longer fit; every request finishes, never above the budget."""
    lay = _layout()
    blocks = lay.request_blocks(65)
    assert 2 * lay.request_blocks(6) <= blocks  # two fit at the start, one at full length
    out = generate_batch(tiny_model(), _prompts(4, 5), CFG, cache_memory=blocks * lay.block_bytes,
                         max_new_tokens=60, **CB)
    assert [len(o.generated_tokens) for o in out.values()] == [60] * 4
    assert all(o.error is None for o in out.values())
    assert max(len(batch) for batch, _, _ in forwards) >= 2
    prefills = [rid for batch, _, _ in forwards for rid, past, _ in batch if past == 0]
    assert len(prefills) > len(set(prefills)) == 4  # some request was freed and prefilled again
    for _, usage, free in forwards:
        assert usage.held + free == usage.total == blocks, usage


def test_window_blocks_grow_with_the_request_and_rows_never_move():
    """A request takes the window blocks its tokens reach (position t is in slot t below the sink S, in slot
    S + t % ring after it: kivi.paged.ring), up to a full window's; a position's slot and so its block and row do
    not depend on how many blocks the request holds. Without and with a sink."""
    for cfg in (CFG, KiviConfig(k_bits=2, v_bits=2, group_size=16, residual_length=32, sink_tokens=5)):
        _check_window_blocks(build_layout(tiny_model().config, cfg, PAGE, torch.float32))


def _check_window_blocks(lay):
    from kivi.paged.ring import ring_slot, slot_place

    geo, pw = lay.geometries[0], lay.window_tokens
    counts = [lay.request_window_blocks(t) for t in range(0, 200)]
    assert counts == sorted(counts) and counts[-1] == lay.window_blocks == geo.window_rings
    assert lay.request_window_blocks(1) == 1 < lay.window_blocks
    assert lay.window_blocks * pw >= geo.fp_slots > (lay.window_blocks - 1) * pw
    ring = lay.window_blocks * pw - geo.sink_tokens
    for t in range(0, 200):
        block, _ = slot_place(ring_slot(t, ring, geo.sink_tokens), pw)
        assert block < lay.request_window_blocks(t + 1)  # held once the request holds t + 1 tokens


def test_block_usage_counts_windows_shared_pages_once_and_no_evicted_page():
    lay = _layout()
    cb = ContinuousBatchingConfig(page_size=PAGE, max_batch_tokens=512)
    cache = KiviPagedCache(tiny_model().config, cb, "cpu", layout=lay, cache_memory=40 * lay.block_bytes)
    alloc = cache.allocator

    class Req:
        def __init__(self, rid):
            self.request_id, self.position_offset = rid, 0

        def current_len(self):
            return 0

    for rid, n in (("a", 150), ("b", 10)):
        assert cache.can_store_request_tokens(Req(rid), n)
    usage = block_usage(cache)
    assert usage.pages == lay.token_blocks(150) + lay.token_blocks(10)
    assert usage.window == lay.request_window_blocks(150) + lay.request_window_blocks(10)
    assert usage.held + cache.free_block_count() == usage.total == 40 and usage.requests == 2
    alloc.block_table["b"] = alloc.block_table["b"] + [alloc.block_table["a"][0]]  # a page shared by both
    alloc.block_table["a"][1] = EVICTED  # a page a sliding window freed
    assert block_usage(cache).pages == usage.pages - 1
