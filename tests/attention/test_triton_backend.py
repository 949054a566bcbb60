"""The "triton" backend adapter (views -> kernel), run on CPU with TRITON_INTERPRET=1."""

import importlib.util

import pytest
import torch

from kivi.backends import kernel_config_unsupported, resolve_attention_backend
from kivi.attention.reference import reference_attention
from kivi.cache.layer import KiviLayer
from kivi.config import KiviConfig

pytestmark = pytest.mark.triton
needs_triton = pytest.mark.skipif(importlib.util.find_spec("triton") is None, reason="triton is not installed")


@needs_triton
@pytest.mark.parametrize("prefill,hq", [(150, 3), (77, 6)])
def test_decode_step_matches_reference(prefill, hq):
    from kivi.attention.triton_backend import triton_view_attention

    torch.manual_seed(0)
    layer = KiviLayer(KiviConfig(residual_length=32, group_size=32, block_size=64))
    k, v = torch.randn(2, 3 if hq == 3 else 2, prefill + 5, 64), torch.randn(2, 3 if hq == 3 else 2, prefill + 5, 64)
    layer.append(k[:, :, :prefill], v[:, :, :prefill])
    for t in range(prefill, prefill + 4):
        layer.append(k[:, :, t : t + 1], v[:, :, t : t + 1])
    kv, vv = layer.append(k[:, :, -1:], v[:, :, -1:])
    q = torch.randn(2, hq, 1, 64)
    mask = torch.ones(2, 1, 1, prefill + 5, dtype=torch.bool)
    mask[1, :, :, :9] = False  # left padding of row 1
    ref = reference_attention(q, kv, vv, scaling=0.125, attention_mask=mask)
    got = triton_view_attention(q, kv, vv, scaling=0.125, attention_mask=mask)
    assert (got - ref).abs().max() < 1e-4


def test_resolution_rules():
    assert kernel_config_unsupported(KiviConfig()) is None
    assert "compensation" in kernel_config_unsupported(KiviConfig(residual_bits=4))
    assert "sink" in kernel_config_unsupported(KiviConfig(sink_tokens=1))
    assert "3-bit" in kernel_config_unsupported(KiviConfig(layer_specific_config={1: {"k_bits": 3}}))
    assert resolve_attention_backend("auto", "cpu") == "cpu"

    class Softcapped:
        attn_logit_softcapping = 50.0

    assert resolve_attention_backend("auto", "cpu", model_config=Softcapped()) == "reference"
    with pytest.raises(ValueError, match="softcapping"):
        resolve_attention_backend("cpu", "cpu", model_config=Softcapped())
    with pytest.raises(RuntimeError, match="triton"):
        resolve_attention_backend("triton", "cpu")


def test_multi_token_forward_with_a_boundary_runs_the_blocked_path():
    """Verify forwards / chunks (n > 1) carry a per-query boundary: the triton backend runs them on the
    blocked torch path (no triton needed for that), which reads it like the reference."""
    from kivi.attention.triton_backend import triton_view_attention

    torch.manual_seed(0)
    layer = KiviLayer(KiviConfig(residual_length=32, group_size=32, block_size=64))
    k, v = torch.randn(1, 2, 120, 64), torch.randn(1, 2, 120, 64)
    layer.append(k[:, :, :80], v[:, :, :80])
    kv, vv = layer.append(k[:, :, 80:], v[:, :, 80:])
    assert kv.per_query and vv.per_query
    q = torch.randn(1, 4, 40, 64)
    out = triton_view_attention(q, kv, vv, scaling=None, attention_mask=None)
    torch.testing.assert_close(out, reference_attention(q, kv, vv), atol=1e-4, rtol=1e-4)
