import pytest
import torch

from kivi.cache.store import BlockStore, FpSegment
from kivi.quant.kv import quantize_kv


def _seg(t, axis="channel"):
    return quantize_kv(torch.randn(2, 3, t, 64), axis, 2, 32)


def test_long_append_is_one_exact_block_then_fixed_blocks():
    s = BlockStore(block_size=64)
    s.append(_seg(320))
    assert s.caps == [320] and s.length == 320
    s.append(_seg(32))
    s.append(_seg(32))
    s.append(_seg(32))
    assert s.caps == [320, 64, 64] and s.length == 416


def test_read_returns_what_was_written_across_blocks():
    s = BlockStore(block_size=64)
    x = torch.randn(1, 2, 200, 64)
    for a, b in ((0, 3), (3, 4), (4, 130), (130, 200)):
        s.append(FpSegment(x[:, :, a:b]))
    assert torch.equal(s.read().data, x)
    assert torch.equal(s.read(150).data, x[:, :, :150])
    starts = [t0 for t0, _ in s.iter_blocks()]
    assert starts[0] == 0 and starts == sorted(starts)


def test_append_writes_in_place_without_copying_old_blocks():
    s = BlockStore(block_size=64)
    s.append(FpSegment(torch.randn(1, 1, 10, 8)))
    first = s.blocks[0]["data"]
    ptr = first.data_ptr()
    for _ in range(20):
        s.append(FpSegment(torch.randn(1, 1, 1, 8)))
    assert s.blocks[0]["data"].data_ptr() == ptr


def test_truncate_and_evict():
    s = BlockStore(block_size=32)
    x = torch.randn(1, 1, 160, 4)
    for i in range(0, 160, 16):
        s.append(FpSegment(x[:, :, i : i + 16]))
    s.truncate(70)
    assert s.length == 70 and torch.equal(s.read().data, x[:, :, :70])
    s.evict(40)
    assert s.start == 40 and s.blocks[0] is None and s.blocks[1] is not None
    assert torch.equal(s.read().data, x[:, :, 40:70])


def test_append_in_place_fills_views_across_blocks_and_rolls_back_on_error():
    s = BlockStore(block_size=8)
    x = torch.randn(1, 2, 20, 4)
    s.append(FpSegment(x[:, :, :5]))
    calls = []

    def write(lo, hi, views):
        calls.append((lo, hi, views["data"].shape[2]))
        views["data"].copy_(x[:, :, 5 + lo : 5 + hi])

    s.append_in_place(6, write)  # 3 tokens finish block 0, 3 start block 1
    assert calls == [(0, 3, 3), (3, 6, 3)]
    assert torch.equal(s.read().data, x[:, :, :11]) and len(s.blocks) == 2

    def fail_second(lo, hi, views):
        if lo:
            raise ValueError("boom")
        views["data"].copy_(x[:, :, 11 + lo : 11 + hi])

    with pytest.raises(ValueError, match="boom"):
        s.append_in_place(12, fail_second)  # would span blocks 1, 2 and 3
    assert s.length == 11 and len(s.blocks) == 2 and torch.equal(s.read().data, x[:, :, :11])


def test_derived_memo_survives_in_block_appends_only():
    s = BlockStore(block_size=8)
    s.append(FpSegment(torch.randn(1, 1, 3, 4)))
    s.derived["reader"] = "memo"
    s.append(FpSegment(torch.randn(1, 1, 2, 4)))  # same block
    assert s.derived == {"reader": "memo"}
    for change in (lambda: s.append(FpSegment(torch.randn(1, 1, 4, 4))),  # new block
                   lambda: s.truncate(4), lambda: s.evict(2), lambda: s.map_tensors(lambda t: t.clone())):
        s.derived["reader"] = "memo"
        change()
        assert s.derived == {}


def test_deepcopy_of_a_used_cache_reads_its_own_blocks():
    """The fused kernel memoises raw block addresses in ``BlockStore.derived``; a deep copy must not
    keep them (it read the original's blocks: overwriting them changed the copy's logits by up to 3.6)."""
    import copy

    from kivi import KiviCache, KiviConfig, quantize_model
    from kivi.integration import generate_cache_key
    from tests.helpers import tiny_model

    model = tiny_model(weight_scale=2.0)
    cfg = KiviConfig(k_bits=2, v_bits=2, group_size=8, residual_length=8)
    quantize_model(model, cfg)
    cache = KiviCache.from_model(model, cfg)
    assert cache.attention_backend == "cpu"
    torch.manual_seed(0)
    ids = torch.randint(0, model.config.vocab_size, (1, 40))
    key = generate_cache_key(model)  # `cache=` where the forward takes it (`past_key_values=` deprecated in 5.25)
    with torch.no_grad():
        model(ids, **{key: cache})
        for t in range(5):  # decode steps: the fused kernel memoises its tables in the stores
            model(ids[:, t:t + 1], **{key: cache})
        assert any(layer.k.store.derived for layer in cache.layers)
        copied, twin = copy.deepcopy(cache), copy.deepcopy(cache)
        expected = model(ids[:, :1], **{key: twin}).logits
        for layer in cache.layers:  # scribble over the original's stored blocks
            for side in (layer.k, layer.v):
                for blk in side.store.blocks:
                    for t in (blk or {}).values():
                        t.fill_(3 if t.dtype == torch.uint8 else 7)
        got = model(ids[:, :1], **{key: copied}).logits
    torch.testing.assert_close(got, expected, rtol=0, atol=0)
