"""tune's search space (kivi/eval/candidates.py): sinks, tiers, per-head mixes within their budgets."""

from __future__ import annotations

import pytest
import torch

from kivi import KiviConfig
from kivi.eval.candidates import (
    candidate_grid,
    candidate_name,
    has_tiers,
    head_bases,
    head_candidates,
    tier_candidates,
    tiers_comparable,
    uniform_candidates,
)
from kivi.eval.head_profile import bits_per_element, head_profile
from kivi.memory.sources import model_spec
from tests.helpers import tiny_model

MODEL = dict(hidden_size=192, head_dim=32, num_attention_heads=6, num_key_value_heads=3, num_hidden_layers=2)
BASES = [KiviConfig(k_bits=2, v_bits=2, group_size=8, residual_length=16, sink_tokens=2),
         KiviConfig(k_bits=4, v_bits=2, group_size=8, residual_length=16, sink_tokens=2)]


@pytest.fixture(scope="module")
def profiled():
    model = tiny_model(**MODEL, weight_scale=2.0)
    windows = torch.randint(1, 128, (1, 96), generator=torch.Generator().manual_seed(0))
    return model, head_profile(model, windows, BASES[0], bits=(2, 4), prefix=40, progress=False)


def test_grid_has_both_sink_counts_and_tiers_only_on_request():
    grid = candidate_grid()
    assert {c.sink_tokens for c in grid} == {0, 4}
    pairs = {(c.k_bits, c.v_bits, c.group_size) for c in grid}
    assert all((kb, vb, g, s) in {(c.k_bits, c.v_bits, c.group_size, c.sink_tokens) for c in grid}
               for kb, vb, g in pairs for s in (0, 4))
    assert not any(has_tiers(c) for c in grid)
    tiered = candidate_grid(tiers=True)
    assert len(tiered) == len(grid) + len(tier_candidates()) and all(has_tiers(c) for c in tier_candidates())
    assert len(uniform_candidates(sinks=(4,))) == len(grid) // 2


def test_tiers_comparable_only_when_bits_are_counted_within_the_windows():
    assert tiers_comparable(None, 1024) and tiers_comparable(1024, 1024) and tiers_comparable(512, 1024)
    assert not tiers_comparable(32768, 1024)


def test_head_candidates_stay_within_their_budgets(profiled):
    model, prof = profiled
    spec = model_spec(model)
    cands = head_candidates(prof, spec, BASES, steps=(0.125, 0.25, 0.5), budgets=[2.0, 1e9], context=4096)
    assert cands, "a budget above the base widens some head-sides"
    seen = set()
    for c in cands:
        base = BASES[0] if c.k_bits == 2 else BASES[1]
        have, bits = bits_per_element(spec, base, 4096), bits_per_element(spec, c, 4096)
        assert have < bits  # something was widened, and it cost bits
        assert c.group_size == 8 and c.sink_tokens == 2 and c.residual_length == 16
        if base is BASES[1]:  # keys are already 4 bits: only values are widened
            assert all(set(sides) == {"v_bits"} for sides in c.head_bits.values())
        seen.add(repr(c.to_dict()))
    assert len(seen) == len(cands)  # no duplicates
    # each candidate is the greedy choice at one budget: base + step, or an asked-for budget above the base
    k2 = [c for c in cands if c.k_bits == 2]
    bits = [bits_per_element(spec, c, 4096) for c in k2]
    assert bits == sorted(bits)
    assert max(bits) > bits_per_element(spec, BASES[0], 4096) + 0.5  # the 1e9 budget widened more than +0.5


def test_head_bases_and_names():
    b = head_bases(64)
    assert [(c.k_bits, c.v_bits, c.group_size, c.sink_tokens) for c in b] == [
        (2, 2, 64, 4),
        (3, 2, 64, 4),
        (3, 3, 64, 4),
        (4, 2, 64, 4),
    ]
    c = KiviConfig(k_bits=2, v_bits=2, head_bits={0: {"k_bits": [4, 2, 4]}, 1: {"v_bits": [2, 2, 4]}})
    assert candidate_name(c).endswith("(3 head-sides widened)")
    assert candidate_name(BASES[0]) == BASES[0].describe()
