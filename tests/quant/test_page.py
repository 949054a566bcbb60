"""The page format's one home (kivi/quant/page.py): a field of every block through ``field_view`` (what pages hold:
tests/test_capabilities.py)."""

from __future__ import annotations

import pytest
import torch

from kivi.config import KiviConfig
from kivi.quant.page import field_view, page_fields


@pytest.mark.parametrize("lead", [0, 48])  # the memory may start inside a larger buffer
def test_field_view_is_each_blocks_bytes(lead):
    """Element ``[b]`` of a field's view is the field's bytes at ``b * stride + offset`` of the memory, read
    independently here by slicing; writes through the view land there (no copy)."""
    cfg = KiviConfig(k_bits=2, v_bits=4, group_size=8, residual_length=16)
    fields, end = page_fields(cfg, 2, 16, 16, torch.bfloat16)
    stride, nb = -(-end // 128) * 128 + 64, 3
    buf = torch.randint(0, 256, (lead + nb * stride,), dtype=torch.uint8)
    memory = buf[lead:]
    for f in fields:
        view = field_view(memory, f.shape, f.dtype, f.offset, stride)
        assert tuple(view.shape) == (nb, *f.shape) and view.dtype == f.dtype
        for b in range(nb):
            at = b * stride + f.offset
            want = memory[at: at + f.nbytes].view(f.dtype).view(f.shape)
            assert torch.equal(view[b].view(torch.uint8), want.view(torch.uint8))
    f = fields[1]
    field_view(memory, f.shape, f.dtype, f.offset, stride)[2].fill_(1.5)
    at = 2 * stride + f.offset
    assert (memory[at: at + f.nbytes].view(f.dtype) == 1.5).all()
    with pytest.raises(ValueError, match="multiple of 2 bytes"):
        field_view(memory, f.shape, f.dtype, f.offset + 1, stride)
