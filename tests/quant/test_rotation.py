"""kivi/quant/rotation.py and the rotated key format (``SideFormat.rotation``): the matrix is orthogonal, the
round trip is exact to float tolerance, a rotated segment dequantizes to the keys' own basis, and attention over
it equals attention with the rotated query over the rotated keys."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from kivi.quant.kv import dequantize_kv, quantize_kv, quantize_side
from kivi.quant.rotation import KEY_ROTATIONS, rotate, rotation_head_dim_problem, rotation_matrix, unrotate
from kivi.quant.side_format import SideFormat


def _keys(seed=0, shape=(2, 3, 64, 32)):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(shape, generator=g)
    x[..., 5] *= 20.0  # one outlier channel, as real keys have
    return x


def unrotated(seg):
    """The same codes read as if not rotated (what they hold: the rotated basis)."""
    return dataclasses.replace(seg, format=dataclasses.replace(seg.format, rotation="none"))


@pytest.mark.parametrize("d", [1, 2, 8, 64, 128])
def test_hadamard_is_orthogonal_with_signs(d):
    r = rotation_matrix("hadamard", d).double()
    torch.testing.assert_close(r @ r.T, torch.eye(d, dtype=torch.float64), atol=1e-6, rtol=0)
    if d >= 8:
        h = (r * d**0.5).round()
        assert set(h.unique().tolist()) == {-1.0, 1.0}  # a +-1 matrix scaled by 1/sqrt(d)
        assert not torch.equal(r, r.T)  # the sign diagonal is applied (a plain Sylvester H is symmetric)
    assert torch.equal(rotation_matrix("hadamard", d), r.float())  # fixed: the same matrix every call


def test_round_trip_and_none_is_identity():
    x = _keys()
    torch.testing.assert_close(unrotate(rotate(x, "hadamard"), "hadamard"), x, atol=1e-5, rtol=1e-5)
    assert rotate(x, "none") is x and unrotate(x, "none") is x
    q = torch.randn(2, 3, 1, 32)
    torch.testing.assert_close(rotate(q, "hadamard") @ rotate(x, "hadamard").transpose(-1, -2),
                               q @ x.transpose(-1, -2), atol=1e-4, rtol=1e-5)  # q.k = (qR).(kR)


@pytest.mark.parametrize("d", [0, 3, 48, 96])
def test_hadamard_needs_a_power_of_two(d):
    why = rotation_head_dim_problem("hadamard", d)
    assert why is not None and f"head_dim={d}" in why and "power of two" in why
    with pytest.raises(ValueError, match="power of two"):
        rotation_matrix("hadamard", d)
    assert rotation_head_dim_problem("none", d) is None


@pytest.mark.parametrize("bad", ["Hadamard", "random", None, 1])
def test_unknown_rotation_names_the_choices(bad):
    with pytest.raises(ValueError, match=r"rotation=.*choose one of \['none', 'hadamard'\]"):
        SideFormat("channel", 2, 32, rotation=bad)
    assert KEY_ROTATIONS == ("none", "hadamard")


def test_values_are_not_rotated():
    with pytest.raises(ValueError, match="for keys"):
        SideFormat("token", 2, 32, rotation="hadamard")


@pytest.mark.parametrize("clip", [False, True])
@pytest.mark.parametrize("residual_bits", [0, 2])
def test_rotated_segment_is_the_rotated_keys_quantized_and_rotated_back(clip, residual_bits):
    x = _keys()
    fmt = SideFormat("channel", 2, 16, clip=clip, residual_bits=residual_bits, rotation="hadamard")
    seg = quantize_side(x, fmt)
    assert seg.rotation == "hadamard"
    plain = quantize_kv(x @ rotation_matrix("hadamard", 32), "channel", 2, 16, clip=clip,
                        residual_bits=residual_bits, param_dtype=torch.float32)
    for name, t in plain.tensors().items():  # the stored bytes are plain KIVI of x R: same fields, same sizes
        assert torch.equal(seg.tensors()[name], t), name
    want = dequantize_kv(plain) @ rotation_matrix("hadamard", 32).T
    torch.testing.assert_close(dequantize_kv(seg), want, atol=1e-6, rtol=0)
    assert dequantize_kv(unrotated(seg)).sub(dequantize_kv(seg)).abs().max() > 0.1


def test_attention_over_rotated_keys_equals_rotated_query_attention():
    """softmax(q k^T) with k = dequantize_kv(rotated segment) equals softmax((qR)(k_hat R-basis)^T): rotating the
    dequantized keys back and rotating the query instead are the same attention."""
    x = _keys(seed=3)
    seg = quantize_side(x, SideFormat("channel", 2, 16, rotation="hadamard"))
    k_back = dequantize_kv(seg)  # the keys' own basis
    k_rot = dequantize_kv(unrotated(seg))  # what the codes hold: the R basis
    q = torch.randn(2, 3, 4, 32, generator=torch.Generator().manual_seed(4))
    a = torch.softmax(q @ k_back.transpose(-1, -2) / 32**0.5, -1)
    b = torch.softmax(rotate(q, "hadamard") @ k_rot.transpose(-1, -2) / 32**0.5, -1)
    torch.testing.assert_close(a, b, atol=1e-5, rtol=1e-5)


def test_rotation_spreads_an_outlier_channel():
    """What it is for: a channel 20x the others carries its magnitude to every channel after rotation."""
    x = _keys()
    per_channel = x.abs().amax(dim=(0, 1, 2))
    rotated = rotate(x, "hadamard").abs().amax(dim=(0, 1, 2))
    assert per_channel.max() / per_channel.median() > 5
    assert rotated.max() / rotated.median() < 2
