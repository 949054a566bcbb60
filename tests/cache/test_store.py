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
