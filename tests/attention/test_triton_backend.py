"""The "triton" backend adapter (views -> kernel), run on CPU with TRITON_INTERPRET=1."""

import importlib.util

import pytest
import torch

from kivi.attention.reference import reference_attention
from kivi.backends import resolve_attention_backend
from kivi.cache.layer import KiviLayer
from kivi.cache.sliding import new_layer
from kivi.cache.store import BlockStore
from kivi.cache.view import materialize
from kivi.capabilities import reasons
from kivi.config import KiviConfig

pytestmark = pytest.mark.triton
needs_triton = pytest.mark.skipif(importlib.util.find_spec("triton") is None, reason="triton is not installed")
TOL = {torch.float32: 1e-4, torch.float16: 3e-3, torch.bfloat16: 2e-2}


def _decoded_layer(cfg, B, H, D, prefill, steps, dtype=torch.float32, seed=0, sliding_window=None):
    """A layer after a prefill of ``prefill`` tokens and ``steps`` decode steps; returns the last step's views."""
    g = torch.Generator().manual_seed(seed)
    n = prefill + steps
    k = (torch.randn(B, H, n, D, generator=g) * 1.5).to(dtype)
    k[..., 3] += 5.0  # an outlier channel
    v = torch.randn(B, H, n, D, generator=g).to(dtype)
    layer = new_layer(cfg, sliding_window)
    layer.append(k[:, :, :prefill], v[:, :, :prefill])
    for t in range(prefill, n - 1):
        layer.append(k[:, :, t : t + 1], v[:, :, t : t + 1])
    kv, vv = layer.append(k[:, :, -1:], v[:, :, -1:])
    return layer, kv, vv


def _close(got, ref, dtype):
    assert got.shape == ref.shape and got.dtype == ref.dtype
    err = (got.float() - ref.float()).abs().max().item()
    assert err <= TOL[dtype] * max(1.0, ref.float().abs().max().item()), err


@pytest.fixture
def no_concatenation(monkeypatch):
    """The kernel path must read blocks in place: BlockStore.read (which concatenates) is forbidden."""

    def forbidden(self, end=None):
        raise AssertionError("BlockStore.read called: stored blocks were concatenated")

    monkeypatch.setattr(BlockStore, "read", forbidden)


@needs_triton
@pytest.mark.parametrize("prefill,hq", [(150, 3), (77, 6)])
def test_decode_step_matches_reference(prefill, hq):
    from kivi.attention.triton_backend import triton_view_attention

    hkv = 3 if hq == 3 else 2
    _, kv, vv = _decoded_layer(KiviConfig(residual_length=32, group_size=32, block_size=64), 2, hkv, 64, prefill, 5)
    q = torch.randn(2, hq, 1, 64)
    mask = torch.ones(2, 1, 1, prefill + 5, dtype=torch.bool)
    mask[1, :, :, :9] = False  # left padding of row 1
    ref = reference_attention(q, kv, vv, scaling=0.125, attention_mask=mask)
    got = triton_view_attention(q, kv, vv, scaling=0.125, attention_mask=mask)
    assert (got - ref).abs().max() < 1e-4


FAST = [("high", torch.float32), ("balanced", torch.float16), ("balanced", torch.bfloat16)]
ALL = [(p, d) for p in ("high", "balanced") for d in (torch.float32, torch.float16, torch.bfloat16)]


@needs_triton
@pytest.mark.parametrize(
    "preset,dtype",
    FAST + [pytest.param(*c, marks=pytest.mark.slow) for c in ALL if c not in FAST],
    ids=lambda x: x if isinstance(x, str) else str(x).split(".")[-1],
)
def test_presets_with_sinks_and_several_blocks(preset, dtype, no_concatenation):
    """`high` / `balanced` (4 sink tokens, K4) after a 101-token prefill and 70 decode steps: a prefill
    block and two block_size blocks per side, read in place, against materialize + reference attention."""
    from kivi.attention.triton_backend import triton_view_attention

    cfg = KiviConfig.preset(preset, residual_length=16, group_size=16, block_size=32)
    layer, kv, vv = _decoded_layer(cfg, 2, 2, 32, 101, 70, dtype=dtype, seed=1)
    assert kv.sink is not None and kv.sink.shape[-2] == 4
    assert (
        sum(b is not None for b in layer.k.store.blocks) >= 3 and sum(b is not None for b in layer.v.store.blocks) >= 3
    )
    q = torch.randn(2, 6, 1, 32).to(dtype)  # GQA 3
    T = 171
    mask = torch.ones(2, 1, 1, T, dtype=torch.bool)
    mask[0, ..., :7] = False  # left padding over the sink and into the store
    ref = reference_attention(q, kv, vv, scaling=32**-0.5, attention_mask=mask)
    got = triton_view_attention(q, kv, vv, scaling=32**-0.5, attention_mask=mask, block_n=32)
    _close(got, ref, dtype)
    # the reference is what the views mean: sink exact, stored tokens dequantized, window exact
    assert materialize(kv).shape[-2] == T and torch.equal(materialize(kv)[:, :, :4], kv.sink)


@needs_triton
def test_block_table_is_memoised_until_a_block_is_added(no_concatenation):
    from kivi.attention.triton_backend import triton_view_attention

    cfg = KiviConfig.preset("balanced", residual_length=16, group_size=16, block_size=32)
    g = torch.Generator().manual_seed(2)
    k, v = torch.randn(1, 1, 120, 32, generator=g), torch.randn(1, 1, 120, 32, generator=g)
    layer = KiviLayer(cfg)
    layer.append(k[:, :, :60], v[:, :, :60])
    tables, blocks = [], []
    for t in range(60, 120):
        kv, vv = layer.append(k[:, :, t : t + 1], v[:, :, t : t + 1])
        if t in (70, 71, 110):  # the interpreter is slow: two neighbouring steps, one a block later
            q = torch.randn(1, 2, 1, 32, generator=g)
            got = triton_view_attention(q, kv, vv, scaling=0.2, attention_mask=None, block_n=32)
            _close(got, reference_attention(q, kv, vv, scaling=0.2), torch.float32)
            tables.append(layer.v.store.derived.get("triton"))
            blocks.append(len(layer.v.store.blocks))
    assert blocks[0] == blocks[1] < blocks[2]
    assert tables[0] is tables[1]  # same blocks: the table is reused
    assert tables[2] is not tables[1]  # a block was added: rebuilt


@needs_triton
def test_unquantized_values_and_sliding_window(no_concatenation):
    from kivi.attention.triton_backend import triton_view_attention

    cfg = KiviConfig(residual_length=16, group_size=16, block_size=32, quantize_value=False)
    _, kv, vv = _decoded_layer(cfg, 1, 2, 32, 70, 20, seed=3)
    assert not vv.quantized
    q = torch.randn(1, 4, 1, 32)
    _close(triton_view_attention(q, kv, vv, scaling=0.2, attention_mask=None, block_n=16),
           reference_attention(q, kv, vv, scaling=0.2), torch.float32)
    # a sliding layer whose store has evicted its front: the views start after position 0
    cfg = KiviConfig(residual_length=16, group_size=16, block_size=32)
    _, kv, vv = _decoded_layer(cfg, 1, 2, 32, 70, 60, seed=4, sliding_window=64)
    assert kv.start > 0
    _close(triton_view_attention(q, kv, vv, scaling=0.2, attention_mask=None, block_n=16),
           reference_attention(q, kv, vv, scaling=0.2), torch.float32)


@needs_triton
def test_what_the_kernel_cannot_read_is_routed_or_refused(monkeypatch):
    """Float and per-head masks go to the blocked path (explicit rule: decode_route), never to the kernel;
    a format the kernel does not implement raises naming it."""
    import kivi.kernels.triton_attention as ta
    from kivi.attention.triton_backend import decode_route, triton_view_attention

    cfg = KiviConfig.preset("high", residual_length=16, group_size=16, block_size=32)
    _, kv, vv = _decoded_layer(cfg, 2, 2, 32, 50, 3, seed=5)
    q = torch.randn(2, 4, 1, 32)
    T = 53
    fmask = torch.zeros(2, 1, 1, T)
    fmask[0, ..., :5] = torch.finfo(torch.float32).min
    fmask[1, ..., 10] = -2.5  # a bias, not a validity: the kernel cannot express it
    hmask = torch.ones(2, 4, 1, T, dtype=torch.bool)
    hmask[:, 1, :, :20] = False
    assert decode_route(q, fmask) and decode_route(q, hmask) and decode_route(torch.randn(2, 4, 3, 32), None)
    assert decode_route(q, torch.ones(1, 1, 1, T, dtype=torch.bool)) is None

    def kernel_must_not_run(*a, **k):
        raise AssertionError("the Triton kernel ran on a forward it cannot read")

    monkeypatch.setattr(ta, "decode_attention_sides", kernel_must_not_run)
    for mask in (fmask, hmask):
        torch.testing.assert_close(triton_view_attention(q, kv, vv, scaling=0.2, attention_mask=mask),
                                   reference_attention(q, kv, vv, scaling=0.2, attention_mask=mask),
                                   atol=1e-4, rtol=1e-4)
    monkeypatch.undo()
    comp = KiviConfig(residual_length=16, group_size=16, block_size=32, residual_bits=2)
    _, kv, vv = _decoded_layer(comp, 2, 2, 32, 50, 3, seed=6)
    with pytest.raises(NotImplementedError, match="compensation"):
        triton_view_attention(q, kv, vv, scaling=0.2, attention_mask=None)


@needs_triton
def test_batch_one_mask_broadcasts():
    from kivi.attention.triton_backend import triton_view_attention

    cfg = KiviConfig.preset("balanced", residual_length=16, group_size=16, block_size=32)
    _, kv, vv = _decoded_layer(cfg, 2, 1, 32, 40, 2, seed=7)
    q = torch.randn(2, 2, 1, 32)
    mask = torch.ones(1, 1, 1, 42, dtype=torch.bool)
    mask[..., 30:33] = False
    _close(triton_view_attention(q, kv, vv, scaling=0.2, attention_mask=mask, block_n=16),
           reference_attention(q, kv, vv, scaling=0.2, attention_mask=mask), torch.float32)


def kernel_config_unsupported(cfg):
    """The first format feature of ``cfg`` the Triton backend refuses (kivi.capabilities), or ``None``."""
    why = [r for r in reasons(cfg, "generate", "triton") if r.kind == "format"]
    return why[0].detail if why else None


def test_resolution_rules():
    assert kernel_config_unsupported(KiviConfig()) is None
    assert "compensation" in kernel_config_unsupported(KiviConfig(residual_bits=4))
    assert kernel_config_unsupported(KiviConfig(sink_tokens=1)) is None  # sinks are read in place now
    for preset in ("high", "balanced", "extreme"):
        assert kernel_config_unsupported(KiviConfig.preset(preset)) is None
    assert "symmetric" in kernel_config_unsupported(KiviConfig(symmetric=True))
    assert resolve_attention_backend("auto", "cpu") == "cpu"

    class Softcapped:
        attn_logit_softcapping = 50.0

    assert resolve_attention_backend("auto", "cpu", model_config=Softcapped()) == "reference"
    with pytest.raises(ValueError, match="softcapping"):
        resolve_attention_backend("cpu", "cpu", model_config=Softcapped())
    with pytest.raises(RuntimeError, match="triton"):
        resolve_attention_backend("triton", "cpu")


def test_three_bit_configs_resolve_to_triton():
    """The kernel reads 3-bit codes: 3-bit configs (both sides, one side, one layer) resolve to "triton";
    what it still does not implement is refused, naming it and the backends that read it."""
    if not importlib.util.find_spec("triton"):
        pytest.skip("triton is not installed")
    for cfg in (KiviConfig(k_bits=3, v_bits=3), KiviConfig(k_bits=3, v_bits=2, sink_tokens=4),
                KiviConfig(layer_specific_config={1: {"k_bits": 3, "v_bits": 3}})):
        assert kernel_config_unsupported(cfg) is None
        assert resolve_attention_backend("triton", "cuda", config=cfg) == "triton"
        assert resolve_attention_backend("auto", "cuda", config=cfg) == "triton"
    sym3 = KiviConfig(k_bits=3, v_bits=3, symmetric=True)
    assert resolve_attention_backend("auto", "cuda", config=sym3) == "cpu"
    with pytest.raises(ValueError, match=r"^attention_backend='triton' does not implement symmetric quantization; "
                                         r"use 'cpu' or 'reference'$"):
        resolve_attention_backend("triton", "cuda", config=sym3)
    with pytest.raises(ValueError, match=r"does not implement error compensation \(residual_bits > 0\)"):
        resolve_attention_backend("triton", "cuda", config=KiviConfig(k_bits=3, residual_bits=2))


@needs_triton
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_three_bit_cache_decode_matches_reference(dtype, no_concatenation):
    """A 3-bit layer (4 sink tokens, head_dim 40: 15 bytes a row) written by the cache's torch quantizer,
    after an odd prefill and decode steps: the kernel reads its blocks in place like the reference."""
    from kivi.attention.triton_backend import triton_view_attention

    cfg = KiviConfig(k_bits=3, v_bits=3, sink_tokens=4, residual_length=16, group_size=8, block_size=32)
    layer, kv, vv = _decoded_layer(cfg, 2, 2, 40, 83, 9, dtype=dtype, seed=12)
    assert kv.store.template.bits == 3 and vv.store.template.bits == 3
    assert sum(b is not None for b in layer.k.store.blocks) >= 2
    q = torch.randn(2, 6, 1, 40).to(dtype)
    mask = torch.ones(2, 1, 1, 92, dtype=torch.bool)
    mask[1, ..., :6] = False
    got = triton_view_attention(q, kv, vv, scaling=40**-0.5, attention_mask=mask, block_n=32)
    _close(got, reference_attention(q, kv, vv, scaling=40**-0.5, attention_mask=mask), dtype)


@needs_triton
def test_three_bit_head_widths_decode_through_the_kernel(monkeypatch):
    """Per-head widths with 3-bit head groups (K3V3, K2V3, K3V4 + 2 sinks) in a tiny GQA model: every decode
    step runs the kernel once per head group, logits equal a reference cache's."""
    import kivi.kernels.triton_attention as ta
    from kivi import KiviCache, quantize_model
    from tests.helpers import tiny_model

    calls = []
    real = ta.decode_attention_sides
    monkeypatch.setattr(ta, "decode_attention_sides", lambda *a, **k: calls.append(1) or real(*a, **k))
    heads = {0: {"k_bits": [3, 2, 3], "v_bits": [3, 3, 4]}}
    cfg = KiviConfig(group_size=8, residual_length=16, block_size=16, sink_tokens=2, head_bits=heads,
                     attention_backend="cpu")
    model = quantize_model(tiny_model("llama", hidden_size=192, head_dim=32, num_attention_heads=6,
                                      num_key_value_heads=3, num_hidden_layers=1, weight_scale=2.0), cfg)
    ids = torch.randint(0, model.config.vocab_size, (2, 53), generator=torch.Generator().manual_seed(0))
    logits = {}
    with torch.no_grad():
        for b in ("triton", "reference"):
            cache = KiviCache.from_model_config(model.config, cfg, attention_backend=b)
            out = [model(input_ids=ids[:, :50], cache=cache, use_cache=True).logits[:, -1]]
            out += [
                model(input_ids=ids[:, t : t + 1], cache=cache, use_cache=True).logits[:, -1] for t in range(50, 53)
            ]
            logits[b] = torch.stack(out)
    assert [(g.k_bits, g.v_bits) for g in cache.layers[0].groups] == [(3, 3), (2, 3), (3, 4)]
    assert len(calls) == 3 * 3  # three decode steps x three head groups
    torch.testing.assert_close(logits["triton"], logits["reference"], atol=2e-4, rtol=2e-4)


def test_multi_token_forward_with_a_boundary_runs_the_blocked_path():
    """Verify forwards / chunks (n > 1) carry a per-query boundary: the triton backend runs them on the
    blocked torch path (no triton needed for that), which reads it like the reference."""
    from kivi.attention.triton_backend import triton_view_attention

    torch.manual_seed(0)
    layer = KiviLayer(KiviConfig(residual_length=32, group_size=32, block_size=64, sink_tokens=4))
    k, v = torch.randn(1, 2, 120, 64), torch.randn(1, 2, 120, 64)
    layer.append(k[:, :, :80], v[:, :, :80])
    kv, vv = layer.append(k[:, :, 80:], v[:, :, 80:])
    assert kv.per_query and vv.per_query
    q = torch.randn(1, 4, 40, 64)
    out = triton_view_attention(q, kv, vv, scaling=None, attention_mask=None)
    torch.testing.assert_close(out, reference_attention(q, kv, vv), atol=1e-4, rtol=1e-4)


@needs_triton
def test_one_query_view_with_a_boundary_is_refused():
    from kivi.attention.triton_backend import triton_view_attention

    torch.manual_seed(0)
    layer = KiviLayer(KiviConfig(residual_length=32, group_size=32, block_size=64))
    k, v = torch.randn(1, 2, 120, 64), torch.randn(1, 2, 120, 64)
    layer.append(k[:, :, :80], v[:, :, :80])
    kv, vv = layer.append(k[:, :, 80:], v[:, :, 80:])
    with pytest.raises(ValueError, match="per-query boundary"):
        triton_view_attention(torch.randn(1, 4, 1, 64), kv, vv, scaling=None, attention_mask=None)


@needs_triton
@pytest.mark.slow  # ~25 s: ten kernel calls in the interpreter
@pytest.mark.parametrize("model_type", ["llama", "mistral"])
def test_model_decode_through_the_kernel(model_type):
    """A tiny GQA model (2 layers; mistral: a sliding layer that evicts) with the `balanced` preset: prefill,
    then decode steps whose attention runs the Triton kernel (sinks, prefill block + block_size blocks),
    logits against the same model reading a reference cache."""
    from kivi import KiviCache, quantize_model
    from tests.helpers import tiny_model

    kw = dict(hidden_size=192, head_dim=32, num_attention_heads=6, num_hidden_layers=2)
    if model_type == "mistral":
        kw["sliding_window"] = 16
    cfg = KiviConfig.preset("balanced", group_size=8, residual_length=16, block_size=16, attention_backend="cpu")
    model = quantize_model(tiny_model(model_type, weight_scale=2.0, **kw), cfg)
    ids = torch.randint(0, model.config.vocab_size, (2, 70), generator=torch.Generator().manual_seed(0))
    caches = {b: KiviCache.from_model_config(model.config, cfg, attention_backend=b) for b in ("triton", "reference")}
    logits = {}
    with torch.no_grad():
        for b, cache in caches.items():
            out = [model(input_ids=ids[:, :50], cache=cache, use_cache=True).logits[:, -1]]
            for t in range(50, 70, 4):  # a decode step, then 3 more tokens
                out.append(model(input_ids=ids[:, t : t + 1], cache=cache, use_cache=True).logits[:, -1])
                model(input_ids=ids[:, t + 1 : t + 4], cache=cache, use_cache=True)
            logits[b] = torch.stack(out)
    layer = caches["triton"].layers[0]
    assert len([blk for blk in layer.k.store.blocks if blk is not None]) >= 2
    if model_type == "mistral":
        assert layer.k.store.start > 0  # the sliding layer evicted its front
    torch.testing.assert_close(logits["triton"], logits["reference"], atol=2e-4, rtol=2e-4)


@needs_triton
def test_decode_steps_across_quantize_after_match_reference(no_concatenation):
    """quantize_after: steps before N (nothing stored), the crossing (one exact-size block written at once,
    then 64-token blocks) and after it, read in place by the kernel, equal the reference."""
    from kivi.attention.triton_backend import triton_view_attention

    cfg = KiviConfig(k_bits=4, v_bits=2, sink_tokens=3, residual_length=32, group_size=32, block_size=64,
                     quantize_after=150)
    g = torch.Generator().manual_seed(3)
    n = 230
    k, v = torch.randn(1, 2, n, 64, generator=g), torch.randn(1, 2, n, 64, generator=g)
    q = torch.randn(1, 4, n, 64, generator=g)
    layer = KiviLayer(cfg)
    layer.append(k[:, :, :140], v[:, :, :140])
    for t in range(140, n):
        kv, vv = layer.append(k[:, :, t:t + 1], v[:, :, t:t + 1])
        if t in (145, 150, 151, 152, 200, n - 1):
            got = triton_view_attention(q[:, :, t:t + 1], kv, vv, scaling=None, attention_mask=None)
            _close(got, reference_attention(q[:, :, t:t + 1], kv, vv), torch.float32)
    assert len(layer.k.store.blocks) >= 2  # the crossing's block, then decode blocks
