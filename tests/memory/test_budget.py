"""kivi.memory.budget: the best-quality config whose cache fits a byte budget, byte-exact vs KiviCache.nbytes."""

from __future__ import annotations

import pytest
import torch

from kivi.cache.kivi_cache import KiviCache
from kivi.config import KiviConfig
from kivi.memory import model_spec
from kivi.memory.budget import QUALITY_LADDER, BudgetError, cache_need, config_for_budget, default_candidates
from tests.helpers import tiny_model


@pytest.fixture(scope="module")
def model():
    return tiny_model(head_dim=64, hidden_size=256, num_attention_heads=4, num_key_value_heads=2)


def _real_nbytes(model, cfg: KiviConfig, prefill: int, total: int) -> dict[int, int]:
    """``{length: KiviCache.nbytes}`` of a real cache after one prefill and one-token decode steps."""
    cache = KiviCache.from_model_config(model.config, cfg)
    text = model.config
    L, H, D = text.num_hidden_layers, text.num_key_value_heads, text.head_dim
    g = torch.Generator().manual_seed(0)
    out = {}
    spans = [(0, prefill)] + [(t, t + 1) for t in range(prefill, total)]
    for a, b in spans:
        for li in range(L):
            cache.update(torch.randn(1, H, b - a, D, generator=g), torch.randn(1, H, b - a, D, generator=g), li)
        out[b] = cache.nbytes
    return out


@pytest.mark.parametrize("name", [n for n, _, _ in QUALITY_LADDER])
@pytest.mark.parametrize("context", [200, 261])  # 261: not a multiple of the group size
def test_need_is_the_real_peak(model, name, context):
    cfg = dict(default_candidates())[name]
    prefill = 100  # the last group_size lengths are all decode steps
    real = _real_nbytes(model, cfg, prefill, context)
    g = cfg.group_size
    peak = max(real[t] for t in range(context - g + 1, context + 1))
    spec = model_spec(model)
    assert cache_need(spec, cfg, context, prefill=prefill) == peak
    # ... and no earlier length needed more (the peak rule of the module doc)
    assert max(real.values()) == peak


def test_pick_walks_the_ladder_byte_exactly(model):
    spec = model_spec(model)
    ctx, prefill = 261, 100
    needs = [cache_need(spec, c, ctx, prefill=prefill) for _, c in default_candidates()]
    names = [n for n, _ in default_candidates()]
    for _i, need in enumerate(needs):
        p = config_for_budget(spec, need, ctx, prefill=prefill)
        first = next(j for j, n in enumerate(needs) if n <= need)  # best quality that fits exactly this budget
        assert p.name == names[first] and p.need_bytes == needs[first]
        real = _real_nbytes(model, p.config, prefill, ctx)
        assert max(real[t] for t in range(ctx - p.config.group_size + 1, ctx + 1)) == p.need_bytes <= need
    # one byte less than the best candidate's need: the next one down
    p = config_for_budget(spec, needs[0] - 1, ctx, prefill=prefill)
    assert p.name != names[0] and p.need_bytes <= needs[0] - 1


def test_nothing_fits_is_one_line_naming_budget_and_smallest_need(model):
    spec = model_spec(model)
    smallest = min(cache_need(spec, c, 4096) for _, c in default_candidates())
    with pytest.raises(BudgetError) as e:
        config_for_budget(spec, "1MiB", "4k")
    msg = str(e.value)
    assert "\n" not in msg and "1.00 MiB (1,048,576 B)" in msg and f"({smallest:,} B)" in msg and "K2V2 G64" in msg


def test_batch_scales_the_need_and_bad_arguments(model):
    spec = model_spec(model)
    one = config_for_budget(spec, "1GiB", 1024)
    four = config_for_budget(spec, "1GiB", 1024, batch=4)
    assert four.need_bytes == 4 * one.need_bytes and four.name == one.name == "high"
    assert one.fp_fits and one.fp_bytes == 2 * 2 * 2 * 64 * 4 * 1024
    with pytest.raises(ValueError, match="batch=0"):
        config_for_budget(spec, "1GiB", 1024, batch=0)
    with pytest.raises(ValueError, match="memory size"):
        config_for_budget(spec, "lots", 1024)
    with pytest.raises(ValueError, match="candidates is empty"):
        config_for_budget(spec, "1GiB", 1024, candidates=[])


def test_invalid_candidates_are_skipped_with_the_reason():
    spec = model_spec(tiny_model())  # head_dim 32: group_size 64 cannot group values
    p = config_for_budget(spec, "1GiB", 512)
    bad = [c for c in p.considered if "invalid" in c]
    assert [c["name"] for c in bad] == ["K2V2 G64"] and "group_size" in bad[0]["invalid"]


def test_ladder_reads_the_presets_from_the_config():
    """The presets on the ladder are KiviConfig's preset table itself, not a copy of its fields."""
    from kivi.config import PRESETS

    rungs = {name: fields for name, fields, _ in QUALITY_LADDER}
    for name in ("high", "balanced", "extreme"):
        assert rungs[name] is PRESETS[name]
