"""The planner predicts a ``quantize_after`` cache byte for byte: below, at and above N, during decode and at
a prefill, odd lengths, GQA, half precision, sinks, tiers, per-head widths, a batch, padding."""

from __future__ import annotations

import pytest
import torch

from kivi import KiviCache, KiviConfig
from kivi.memory import estimate_kv_memory
from tests.helpers import tiny_model

N = 100
SMALL = dict(group_size=16, residual_length=32, block_size=64)


def _run(model, cfg, prefill, totals, batch=1, mask=None):
    """Prefill then one-token steps; ``{total: cache.nbytes}`` at each of ``totals``."""
    cache = KiviCache.from_model(model, cfg)
    ids = torch.randint(1, 100, (batch, max(totals)), generator=torch.Generator().manual_seed(1))
    out = {}
    with torch.inference_mode():
        for s, e in [(0, prefill)] + [(t, t + 1) for t in range(prefill, max(totals))]:
            kw = {} if mask is None else {"attention_mask": mask[:, :e],
                                          "position_ids": (mask.long().cumsum(-1) - 1).clamp_min(0)[:, s:e]}
            model(ids[:, s:e], cache=cache, use_cache=True, **kw)
            if e in totals:
                out[e] = (cache.nbytes, cache.memory_breakdown())
    return out


CASES = [
    pytest.param(KiviConfig(**SMALL, quantize_after=N), 37, 1, torch.float32, id="k2v2"),
    pytest.param(
        KiviConfig(**SMALL, quantize_after=N, sink_tokens=3, k_bits=4), 37, 2, torch.float32, id="sink-batch2"
    ),
    pytest.param(KiviConfig(**SMALL, quantize_after=N), 37, 1, torch.bfloat16, id="bf16"),
    pytest.param(KiviConfig(**SMALL, quantize_after=N, quantize_value=False), 37, 1, torch.float16, id="fp-values"),
    pytest.param(KiviConfig(**SMALL, quantize_after=N, k_bits=4, v_bits=4, tiers=[(32, None), (48, 4), (None, 2)]),
                 37, 1, torch.float32, id="tiers"),
    pytest.param(KiviConfig(**SMALL, quantize_after=N, head_bits={1: {"k_bits": [4, 2], "v_bits": [2, 8]}}), 37, 1,
                 torch.float32, id="per-head"),
    pytest.param(KiviConfig(**SMALL, quantize_after=N, layer_specific_config={0: {"quantize_after": 0}}), 37, 1,
                 torch.float32, id="per-layer"),
    pytest.param(KiviConfig(**SMALL, quantize_after=N, sink_tokens=4), 150, 1, torch.float32, id="prefill-past-n"),
    pytest.param(KiviConfig(**SMALL, quantize_after=N), N, 1, torch.float32, id="prefill-at-n"),
    pytest.param(KiviConfig(quantize_after=N), 37, 1, torch.float32, id="default-R128"),  # N+1 < R + G: late store
]


@pytest.mark.parametrize("cfg,prefill,batch,dtype", CASES)
def test_planner_equals_cache_nbytes_below_at_and_above_n(cfg, prefill, batch, dtype):
    model = tiny_model(num_hidden_layers=2).to(dtype)  # GQA: 4 query heads, 2 kv heads
    totals = sorted({t for t in (prefill, 61, N, N + 1, N + 2, 133, 197, 301) if t >= prefill})
    got = _run(model, cfg, prefill, totals, batch)
    for t in totals:
        e = estimate_kv_memory(model, t, batch=batch, config=cfg, prefill=prefill)
        assert e.kivi_total_bytes == got[t][0], t
        if t <= N and cfg.quantize_value and not cfg.layer_specific_config:
            # below N: a full-precision cache, byte for byte (an unquantized side is block-allocated instead)
            assert e.kivi_total_bytes == e.fp_total_bytes


def test_planner_with_padding_counts_everything_but_the_marks():
    """Padding marks (a bool per padded position kept, ``padding_masks``) are the one thing the planner
    leaves out, with or without quantize_after."""
    model = tiny_model(num_hidden_layers=2)
    mask = torch.ones(2, 400, dtype=torch.long)
    mask[1, :9] = 0
    cfg = KiviConfig(**SMALL, quantize_after=N, sink_tokens=2)
    got = _run(model, cfg, 41, [41, N, N + 1, 199], batch=2, mask=mask)
    for t, (nbytes, parts) in got.items():
        e = estimate_kv_memory(model, t, batch=2, config=cfg, prefill=41)
        assert parts["padding_masks"] > 0
        assert e.kivi_total_bytes == nbytes - parts["padding_masks"], t


def test_long_context_pays_for_the_full_precision_prefix_once():
    """At 32K the policy costs only the block reserve of the crossing; at N it is an FP cache."""
    spec = dict(num_layers=30, num_kv_heads=3, head_dim=64, dtype="float16", num_heads=9)
    from kivi.memory import ModelSpec
    plain = estimate_kv_memory(ModelSpec(**spec), "32k", config=KiviConfig.preset("balanced"), prefill=512)
    gated = estimate_kv_memory(ModelSpec(**spec), "32k", config=KiviConfig.preset("balanced", quantize_after=4096),
                               prefill=512)
    at_n = estimate_kv_memory(ModelSpec(**spec), 4096, config=KiviConfig.preset("balanced", quantize_after=4096),
                              prefill=512)
    assert at_n.kivi_total_bytes == at_n.fp_total_bytes
    assert 0 <= gated.kivi_total_bytes - plain.kivi_total_bytes < 0.01 * plain.kivi_total_bytes


def test_planner_refuses_sliding_layers():
    from kivi.memory import ModelSpec
    spec = ModelSpec(num_layers=2, num_kv_heads=2, head_dim=64, dtype="float16", num_heads=4,
                     layer_types=["sliding_attention", "full_attention"], sliding_window=256)
    with pytest.raises(ValueError, match=r"quantize_after is not supported on sliding-window layers \(layers \[0\]"):
        estimate_kv_memory(spec, 1024, config=KiviConfig(quantize_after=512))
    ok = KiviConfig(quantize_after=512, layer_specific_config={0: {"quantize_after": 0}})
    assert estimate_kv_memory(spec, 1024, config=ok).kivi_total_bytes > 0


# --------------------------------------------------------------------------- budgets


def _tiny_spec():
    from kivi.memory import ModelSpec
    return ModelSpec(num_layers=2, num_kv_heads=2, head_dim=32, dtype="float16", num_heads=4)


@pytest.mark.parametrize("cfg", [
    KiviConfig(**SMALL, quantize_after=150),
    KiviConfig(**SMALL, quantize_after=150, sink_tokens=4, layer_specific_config={1: {"quantize_after": 90}}),
], ids=["one-n", "per-layer-n"])
def test_cache_need_is_the_peak_over_every_length(cfg):
    """The cache is largest just before it quantizes (a full-precision cache of N tokens), not at the end."""
    from kivi.memory.budget import cache_need
    spec = _tiny_spec()
    brute = max(estimate_kv_memory(spec, t, config=cfg, prefill=min(20, t)).kivi_total_bytes for t in range(1, 301))
    assert cache_need(spec, cfg, 300, prefill=20) == brute
    if not cfg.layer_specific_config:  # one N: the peak is the full-precision cache of N tokens
        assert brute > estimate_kv_memory(spec, 300, config=cfg, prefill=20).kivi_total_bytes


def test_full_precision_first_takes_the_most_fp_tokens_the_budget_holds():
    from kivi.memory.budget import config_for_budget, full_precision_tokens
    spec = _tiny_spec()
    fp_tok = 2 * 2 * 2 * 32 * 2  # layers x sides x kv heads x head_dim x fp16, batch 2 below
    plain = config_for_budget(spec, 700 * fp_tok, 1024, 2)
    pick = config_for_budget(spec, 700 * fp_tok, 1024, 2, full_precision_first=True)
    assert full_precision_tokens(spec, 700 * fp_tok, 2) == 350
    assert pick.name == plain.name and pick.config.quantize_after == 350
    assert plain.need_bytes <= pick.need_bytes <= 700 * fp_tok
    # the budget is the plain pick's own need: whatever N it takes, the peak stays within it
    tight = config_for_budget(spec, plain.need_bytes, 1024, 2, full_precision_first=True)
    assert tight.name == plain.name and tight.need_bytes <= plain.need_bytes


def test_largest_context_and_batch_count_the_full_precision_phase():
    """With quantize_after = N the cache is largest at N tokens: a device that cannot hold N full-precision
    tokens fits no context past them, however small the KIVI cache is later; batch likewise."""
    from kivi.memory import ModelSpec
    spec = ModelSpec(num_layers=4, num_kv_heads=2, head_dim=64, dtype="float16", num_heads=8)
    dev = 2 * 4 * 2 * 64 * 2 * 3000  # 3000 full-precision tokens
    plain = estimate_kv_memory(spec, 8192, device_memory=dev)
    assert plain.fp_max_context == 3000 and plain.kivi_max_context > 8192
    late = estimate_kv_memory(spec, 8192, device_memory=dev, config=KiviConfig(quantize_after=4000))
    assert late.kivi_max_context == 3000  # 3001..4000 tokens are full precision: they do not fit
    assert late.kivi_max_batch == 0
    early = estimate_kv_memory(spec, 8192, device_memory=dev, config=KiviConfig(quantize_after=2000))
    assert early.kivi_max_context == plain.kivi_max_context
    assert early.kivi_max_batch == 1  # the 2000-token full-precision peak fits once, not twice
