"""SideFormat (kivi/quant/side_format.py): built by the config, quantized through, counted in bytes."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from kivi import KiviCache, KiviConfig
from kivi.config import PRESETS
from kivi.quant.kv import quantize_kv, quantize_side
from kivi.quant.side_format import AXIS, SIDES, SideFormat

DTYPES = [torch.float32, torch.float16, torch.bfloat16]
DTYPE_IDS = ["fp32", "fp16", "bf16"]

# --------------------------------------------------------------------------- built by the config


def test_default_config_gives_kivi_formats():
    cfg = KiviConfig()
    assert cfg.side_format("k") == SideFormat("channel", 2, 32)
    assert cfg.side_format("v") == SideFormat("token", 2, 32)
    assert cfg.side_format("k").side == "k" and cfg.side_format("v").side == "v"


@pytest.mark.parametrize("name", sorted(PRESETS))
def test_presets(name):
    cfg = KiviConfig.preset(name)
    for side in SIDES:
        fmt = cfg.side_format(side)
        assert fmt.bits == PRESETS[name][f"{side}_bits"] and fmt.axis == AXIS[side]
        assert fmt.group_size == cfg.group_size and not fmt.symmetric and fmt.residual_bits == 0


def test_every_field_comes_from_the_config():
    cfg = KiviConfig(k_bits=3, v_bits=8, group_size=16, residual_length=32, block_size=64, residual_bits=2,
                     scale_dtype="float32", check_finite=False, clip="values")
    assert cfg.side_format("k") == SideFormat("channel", 3, 16, residual_bits=2, clip=False,
                                              scale_dtype=torch.float32, check_finite=False)
    assert cfg.side_format("v") == SideFormat("token", 8, 16, residual_bits=2, clip=True,
                                              scale_dtype=torch.float32, check_finite=False)
    assert KiviConfig(symmetric=True).side_format("v").symmetric
    assert KiviConfig(clip="keys").side_format("k").clip and not KiviConfig(clip="keys").side_format("v").clip


def test_per_layer_overrides():
    cfg = KiviConfig(layer_specific_config={1: {"k_bits": 4, "group_size": 16, "residual_length": 32,
                                                "symmetric": True}, 2: {"clip": True}})
    assert cfg.side_format("k", 0) == cfg.side_format("k") == SideFormat("channel", 2, 32)
    assert cfg.side_format("k", 1) == SideFormat("channel", 4, 16, symmetric=True)
    assert cfg.side_format("v", 1) == SideFormat("token", 2, 16, symmetric=True)
    assert cfg.side_format("k", 2).clip and cfg.side_format("v", 2).clip
    assert cfg.side_format("k", 7) == cfg.side_format("k")  # a layer without overrides


def test_per_head_widths():
    cfg = KiviConfig(layer_specific_config={1: {"v_bits": 4}}, head_bits={1: {"k_bits": [4, 2, 8]}})
    assert [cfg.side_format("k", 1, h).bits for h in range(3)] == [4, 2, 8]
    assert [cfg.side_format("v", 1, h).bits for h in range(3)] == [4, 4, 4]  # the layer's own width
    assert cfg.side_format("k", 1).bits == 2  # the layer without a head: its config's width
    assert cfg.side_format("k", 0, 2).bits == 2  # a layer without per-head widths
    with pytest.raises(ValueError, match=r"head=3 is not a kv head of layer 1 .*0\.\.2"):
        cfg.side_format("k", 1, 3)
    with pytest.raises(ValueError, match="head=0 needs layer"):
        cfg.side_format("k", None, 0)


def test_bad_side_and_bad_format():
    with pytest.raises(ValueError, match=r"side='keys' must be one of \['k', 'v'\]"):
        KiviConfig().side_format("keys")
    with pytest.raises(ValueError, match="axis='tokens'"):
        SideFormat("tokens", 2, 32)
    with pytest.raises(ValueError, match=r"bits=5 is not supported; allowed values are \[1, 2, 3, 4, 8\]"):
        SideFormat("token", 5, 32)
    with pytest.raises(ValueError, match="symmetric"):
        SideFormat("token", 1, 32, symmetric=True)
    with pytest.raises(ValueError, match="group_size=0"):
        SideFormat("token", 2, 0)


@pytest.mark.parametrize("scale_dtype,model,want", [
    ("auto", torch.bfloat16, torch.bfloat16), ("auto", torch.float32, torch.float32),
    ("float32", torch.float16, torch.float32), ("float16", torch.bfloat16, torch.float16),
])
def test_parameter_dtype_rule(scale_dtype, model, want):
    for side in SIDES:
        assert KiviConfig(scale_dtype=scale_dtype).side_format(side).param_dtype(model) == want


def test_the_cache_stores_the_configs_formats():
    """Every side of every layer (and head group) of a KiviCache holds the format the config names for it."""
    cfg = KiviConfig(group_size=8, residual_length=8, block_size=16,
                     layer_specific_config={1: {"k_bits": 4, "clip": True}}, head_bits={2: {"v_bits": [8, 8, 2]}})
    cache = KiviCache(cfg)
    g = torch.Generator().manual_seed(0)
    for i in range(3):
        cache.update(torch.randn(1, 3, 20, 16, generator=g), torch.randn(1, 3, 20, 16, generator=g), i)
    for i, layer in enumerate(cache.layers):
        for part in layer.parts:
            lo = 0 if part.heads is None else part.heads.start
            assert part.k.format == cfg.side_format("k", i, lo) and part.v.format == cfg.side_format("v", i, lo)
    assert [p.v.format.bits for p in cache.layers[2].parts] == [8, 2]


# --------------------------------------------------------------------------- quantized through the format


def _loose(x: torch.Tensor, cfg: KiviConfig, side: str, valid=None):
    """The loose-argument call every cache spelled out before the format existed."""
    return quantize_kv(x, AXIS[side], cfg.k_bits if side == "k" else cfg.v_bits, cfg.group_size,
                       symmetric=cfg.symmetric, residual_bits=cfg.residual_bits, valid=valid,
                       param_dtype=x.dtype if cfg.scale_dtype == "auto" else getattr(torch, cfg.scale_dtype),
                       check_finite=cfg.check_finite, clip=cfg.clips(AXIS[side]))


def _same(a, b) -> None:
    assert (a.bits, a.group_size, a.axis, a.head_dim, a.residual_bits) == (b.bits, b.group_size, b.axis, b.head_dim,
                                                                          b.residual_bits)
    assert a.tensors().keys() == b.tensors().keys()
    for name, t in a.tensors().items():
        assert t.dtype == b.tensors()[name].dtype and torch.equal(t, b.tensors()[name]), name


CONFIGS = [
    dict(k_bits=2, v_bits=2),
    dict(k_bits=3, v_bits=1),
    dict(k_bits=4, v_bits=8, symmetric=True),
    dict(k_bits=2, v_bits=4, residual_bits=2),
    dict(k_bits=2, v_bits=3, clip=True),
    dict(k_bits=4, v_bits=2, scale_dtype="float32", clip="values"),
    dict(k_bits=8, v_bits=2, scale_dtype="float16", check_finite=False),
]


@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS)
@pytest.mark.parametrize("kw", CONFIGS, ids=["k2v2", "k3v1", "sym", "comp", "clip", "sd32-clipv", "sd16"])
def test_quantize_side_equals_the_loose_call(kw, dtype):
    """Odd shapes (3 heads, 24 channels, 13 value tokens), constant groups, padding marks: bit for bit."""
    cfg = KiviConfig(group_size=8, residual_length=8, block_size=16, **kw)
    g = torch.Generator().manual_seed(1)
    for side, tokens in (("k", 40), ("v", 13)):
        x = (torch.randn(2, 3, tokens, 24, generator=g) * 3).to(dtype)
        if side == "k":
            x[:, 1, 8:16] = 0.75  # a constant key group (every channel of head 1, tokens 8..15)
        else:
            x[:, :, 5, 8:16] = -2.0  # a constant value group
        fmt = cfg.side_format(side)
        _same(quantize_side(x, fmt), _loose(x, cfg, side))
    valid = torch.ones(2, 40, dtype=torch.bool)
    valid[1, :11] = False
    x = torch.randn(2, 3, 40, 24, generator=g).to(dtype)
    _same(quantize_side(x, cfg.side_format("k"), valid=valid), _loose(x, cfg, "k", valid=valid))


def test_the_format_carries_check_finite():
    x = torch.zeros(1, 1, 8, 8)
    x[0, 0, 3, 3] = float("nan")
    with pytest.raises(ValueError, match="NaN or Inf"):
        quantize_side(x, SideFormat("token", 2, 8))
    quantize_side(x, SideFormat("token", 2, 8, check_finite=False))  # asked not to check: no error


# --------------------------------------------------------------------------- bytes


@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS)
@pytest.mark.parametrize("kw", CONFIGS, ids=["k2v2", "k3v1", "sym", "comp", "clip", "sd32-clipv", "sd16"])
def test_bytes_from_the_format_equal_a_real_segment(kw, dtype):
    cfg = KiviConfig(group_size=8, residual_length=8, block_size=16, **kw)
    x = torch.randn(1, 3, 48, 24).to(dtype)
    for side in SIDES:
        fmt = cfg.side_format(side)
        seg = quantize_side(x, fmt)
        per = fmt.token_bytes(24, dtype)
        assert seg.nbytes == 3 * 48 * fmt.token_nbytes(24, dtype)
        assert seg.packed.nbytes == 3 * 48 * per["codes"]
        assert sum(seg.tensors()[n].nbytes for n in ("scale", "offset") if n in seg.tensors()) == \
            3 * 48 * per["scales_zero_points"]
        assert (seg.comp.nbytes if seg.comp is not None else 0) == 3 * 48 * per["compensation"]


def test_bytes_of_a_narrower_width():
    """``replace(fmt, bits=...)``: the format of a tier or head of another width, counted the same way."""
    fmt = KiviConfig().side_format("v")
    two, four = fmt.token_nbytes(64, torch.float16), dataclasses.replace(fmt, bits=4).token_nbytes(64, torch.float16)
    assert four - two == 64 * 2 / 8  # 2 more bits on each of 64 channels
