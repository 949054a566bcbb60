"""Speculative decoding on a KIVI cache is lossless: greedy assisted generation (a draft model) and
prompt-lookup decoding give exactly the tokens of plain greedy decoding with the same KIVI config.

The verify forward of k + 1 tokens gives each query the precision one-token decoding would give it
(kivi.cache.schedule.query_boundaries), crop after it is exact (past recording, KiviLayer), and the
first forward, which transformers makes of the prompt and the first candidates, is exact for the
prompt's queries only (KiviCache.set_prompt_length, set by quantize_model's generate).
"""

from __future__ import annotations

import pytest
import torch

from kivi import KiviCache, KiviConfig, quantize_model
from tests.helpers import tiny_model

# GQA (4 query heads over 2 kv heads), a small window so that tokens leave it every step, a peaked
# random model (weight_scale) so that quantization changes its greedy tokens.
GROUP = dict(group_size=8, residual_length=16, block_size=32)
CONFIGS = {
    "2-2": dict(k_bits=2, v_bits=2),
    "balanced": dict(k_bits=4, v_bits=2, sink_tokens=4),
    "4-4": dict(k_bits=4, v_bits=4),
}
NEW = 200
SCALE = 3.0
# Each case generates 2 x 200 tokens (about 20-60 s on the shared 2-core box): the default suite runs
# one case per kind of speculation, KIVI_SLOW=1 runs all of them.
FAST = {("cpu", "2-2"), ("cpu", "balanced")}
CASES = [pytest.param(b, c, id=f"{c}-{b}", marks=() if (b, c) in FAST else pytest.mark.slow)
         for b in ("reference", "cpu") for c in CONFIGS]


def _model(backend: str, config: dict, seed: int = 0, **kw):
    return quantize_model(tiny_model(seed=seed, weight_scale=SCALE, **kw),
                          KiviConfig(**GROUP, **config, attention_backend=backend))


def _prompt(length: int = 40, seed: int = 1) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    half = torch.randint(1, 128, (1, length // 2), generator=g)
    return torch.cat([half, half], dim=1)  # repeated text: prompt lookup finds candidates


def _plain(model, prompt: torch.Tensor) -> torch.Tensor:
    with torch.no_grad():
        return model.generate(prompt, max_new_tokens=NEW, min_new_tokens=NEW, do_sample=False)


def _speculative(model, prompt: torch.Tensor, **spec) -> torch.Tensor:
    with torch.no_grad():
        return model.generate(prompt, max_new_tokens=NEW, min_new_tokens=NEW, do_sample=False, **spec)


@pytest.mark.parametrize("backend,config", CASES)
def test_prompt_lookup_equals_greedy(backend, config):
    model = _model(backend, CONFIGS[config])
    prompt = _prompt()
    want = _plain(model, prompt)
    assert len(set(want[0, prompt.shape[1]:].tolist())) > 5  # the model does not emit one constant token
    got = _speculative(model, prompt, prompt_lookup_num_tokens=8, max_matching_ngram_size=2)
    assert torch.equal(got, want)


@pytest.mark.parametrize("backend,config", CASES)
def test_assisted_generation_with_a_kivi_draft_equals_greedy(backend, config):
    model = _model(backend, CONFIGS[config])
    # A smaller draft (one layer), also on a KIVI cache (quantize_model makes generate build one).
    draft = _model(backend, CONFIGS[config], seed=3, num_hidden_layers=1)
    prompt = _prompt()
    want = _plain(model, prompt)
    got = _speculative(model, prompt, assistant_model=draft, num_assistant_tokens=6)
    assert torch.equal(got, want)
