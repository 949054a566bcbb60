import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from kivi.quant.packing import pack_codes, packed_size, unpack_codes
from kivi.quant.primitives import SUPPORTED_BITS


@settings(max_examples=80, deadline=None)
@given(bits=st.sampled_from(SUPPORTED_BITS), n=st.integers(1, 200), lead=st.integers(1, 5), seed=st.integers(0, 999))
def test_pack_unpack_exact(bits, n, lead, seed):
    g = torch.Generator().manual_seed(seed)
    codes = torch.randint(0, 2**bits, (lead, 3, n), generator=g, dtype=torch.uint8)
    packed = pack_codes(codes, bits)
    assert packed.dtype == torch.uint8
    assert packed.shape == (lead, 3, packed_size(n, bits))
    assert torch.equal(unpack_codes(packed, bits, n), codes)


@pytest.mark.parametrize(
    "bits,n,expected", [(2, 64, 16), (4, 64, 32), (1, 64, 8), (3, 64, 24), (8, 64, 64), (2, 13, 4), (3, 13, 6)]
)
def test_packed_size(bits, n, expected):
    assert packed_size(n, bits) == expected


def test_documented_layout():
    c = torch.tensor([1, 2, 3, 0], dtype=torch.uint8)
    assert pack_codes(c, 2).tolist() == [0b00111001]  # code j at bits [2j, 2j+2)
    c4 = torch.tensor([0xA, 0x5], dtype=torch.uint8)
    assert pack_codes(c4, 4).tolist() == [0x5A]
    c3 = torch.arange(8, dtype=torch.uint8)  # 0..7, 3 bits each -> 24-bit little-endian word
    word = sum(v << (3 * j) for j, v in enumerate(range(8)))
    assert pack_codes(c3, 3).tolist() == [word & 0xFF, (word >> 8) & 0xFF, word >> 16]


def test_errors():
    with pytest.raises(ValueError, match="uint8"):
        pack_codes(torch.zeros(4, dtype=torch.int32), 2)
    with pytest.raises(ValueError, match="expected 16"):
        unpack_codes(torch.zeros(15, dtype=torch.uint8), 2, 64)
