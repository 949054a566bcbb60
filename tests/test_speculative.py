"""Speculative decoding on a KIVI cache is lossless: greedy assisted generation (a draft model) and
prompt-lookup decoding give the tokens of plain greedy decoding with the same KIVI config. The verify
forward attends over k + 1 queries at once, one-token decoding over one (another kernel, another
summation order), so the two agree up to rounding: logits within LOGIT_ATOL at every step, tokens equal
up to a near-tie (tests.helpers.assert_greedy_close).

The verify forward of k + 1 tokens gives each query the precision one-token decoding would give it
(kivi.cache.schedule.query_boundaries), crop after it is exact (past recording, KiviLayer), and the
first forward, which transformers makes of the prompt and the first candidates, is exact for the
prompt's queries only (KiviCache.set_prompt_length, set by quantize_model's generate).
"""

from __future__ import annotations

import pytest
import torch

from kivi import KiviConfig, quantize_model
from tests.helpers import LOGIT_ATOL, Greedy, assert_greedy_close, greedy, tiny_model

# GQA (4 query heads over 2 kv heads), a small window so that tokens leave it every step, a peaked
# random model (weight_scale) so that quantization changes its greedy tokens.
GROUP = dict(group_size=8, residual_length=16, block_size=32)
CONFIGS = {
    "2-2": dict(k_bits=2, v_bits=2),
    "balanced": dict(k_bits=4, v_bits=2, sink_tokens=4),
    "4-4": dict(k_bits=4, v_bits=4),
    # position tiers small enough that every verify forward demotes tokens (docs/python.md, "Position tiers")
    "tiers": dict(k_bits=4, v_bits=4, sink_tokens=4, tiers=[(16, None), (16, 4), (None, 2)]),
}
NEW = 200
SCALE = 3.0
# Each case generates 2 x 200 tokens (about 20-60 s on the shared 2-core box): the default suite runs
# one case per kind of speculation, KIVI_SLOW=1 runs all of them.
SMOLLM2_ATOL = 2e-3  # float32; SmolLM2's logits reach ~40 (the tiny models': ~3), the two paths differ by ~1e-4
FAST = {("cpu", "2-2"), ("cpu", "balanced"), ("cpu", "tiers")}
CASES = [pytest.param(b, c, id=f"{c}-{b}", marks=() if (b, c) in FAST else pytest.mark.slow)
         for b in ("reference", "cpu") for c in CONFIGS]


def _model(backend: str, config: dict, seed: int = 0, **kw):
    return quantize_model(tiny_model(seed=seed, weight_scale=SCALE, **kw),
                          KiviConfig(**GROUP, **config, attention_backend=backend))


def _prompt(length: int = 40, seed: int = 1) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    half = torch.randint(1, 128, (1, length // 2), generator=g)
    return torch.cat([half, half], dim=1)  # repeated text: prompt lookup finds candidates


def _greedy(model, prompt: torch.Tensor, **spec) -> Greedy:
    """NEW greedy tokens, plain (no ``spec``) or speculative (``spec``: generate's speculation arguments)."""
    return greedy(model, prompt, new_tokens=NEW, **spec)


@pytest.mark.parametrize("backend,config", CASES)
def test_prompt_lookup_equals_greedy(backend, config):
    model = _model(backend, CONFIGS[config])
    prompt = _prompt()
    want = _greedy(model, prompt)
    assert len(set(want.sequences[0, prompt.shape[1]:].tolist())) > 5  # the model does not emit one constant token
    got = _greedy(model, prompt, prompt_lookup_num_tokens=8, max_matching_ngram_size=2)
    assert_greedy_close(got, want, atol=LOGIT_ATOL[torch.float32])


@pytest.mark.parametrize("backend,config", CASES)
def test_assisted_generation_with_a_kivi_draft_equals_greedy(backend, config):
    model = _model(backend, CONFIGS[config])
    # A smaller draft (one layer), also on a KIVI cache (quantize_model makes generate build one).
    draft = _model(backend, CONFIGS[config], seed=3, num_hidden_layers=1)
    prompt = _prompt()
    want = _greedy(model, prompt)
    got = _greedy(model, prompt, assistant_model=draft, num_assistant_tokens=6)
    assert_greedy_close(got, want, atol=LOGIT_ATOL[torch.float32])


# --------------------------------------------------------------------------- the first forward
# transformers runs the prompt and the first candidates in one forward. Its prompt queries must go
# through the same arithmetic as a plain prefill of the prompt: a last-bit difference in a layer's
# attention output changes the next layers' keys/values of the prompt and flips some of their 2-bit
# codes (on SmolLM2 K2V2 this made greedy speculative decoding diverge at new token 29 / 2). The tiny
# model's tokens survive such differences, so these tests compare the prompt's keys and values as they
# enter each layer's cache, bit for bit.


def _prompt_kv(monkeypatch, model, prompt: torch.Tensor, **spec) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Per layer (in call order): the prompt's keys and values handed to the cache by generate's first forward."""
    from kivi.cache.layer import KiviLayer

    seen: list[tuple[torch.Tensor, torch.Tensor]] = []
    append = KiviLayer._append

    def record(self, k, v, valid):
        if self.seen == 0:
            seen.append((k[:, :, : prompt.shape[1]].clone(), v[:, :, : prompt.shape[1]].clone()))
        return append(self, k, v, valid)

    with monkeypatch.context() as m:
        m.setattr(KiviLayer, "_append", record)
        with torch.no_grad():
            model.generate(prompt, max_new_tokens=4, min_new_tokens=4, do_sample=False, **spec)
    return seen


@pytest.mark.parametrize("backend", ["cpu", "reference"])
@pytest.mark.parametrize("kind", ["prompt_lookup", "assisted"])
def test_the_prompt_enters_every_layer_as_in_plain_greedy(monkeypatch, backend, kind):
    model = _model(backend, CONFIGS["2-2"], num_hidden_layers=4)
    prompt = _prompt(200)
    if kind == "prompt_lookup":
        spec = dict(prompt_lookup_num_tokens=8, max_matching_ngram_size=2)
    else:
        spec = dict(
            assistant_model=_model(backend, CONFIGS["2-2"], seed=3, num_hidden_layers=1), num_assistant_tokens=6
        )
    want = _prompt_kv(monkeypatch, model, prompt)
    got = _prompt_kv(monkeypatch, model, prompt, **spec)
    assert len(got) >= len(want) == 4  # the draft's layers come after (assisted)
    for layer, ((k0, v0), (k1, v1)) in enumerate(zip(want, got[-4:] if kind == "assisted" else got)):
        assert torch.equal(k0, k1) and torch.equal(v0, v1), f"layer {layer}: the prompt's keys/values differ"


@pytest.mark.parametrize("mask", ["none", "ones", "padded"])
def test_generate_tells_the_cache_the_prompt_length(mask):
    # transformers 5 drops an all-ones attention mask before it prepares the cache; the prompt length must
    # still reach the cache, or the candidates of the first speculative forward get an exact prefill.
    model = _model("cpu", CONFIGS["2-2"])
    prompt = _prompt(30).repeat(2, 1)
    kw = {}
    if mask != "none":
        kw["attention_mask"] = torch.ones_like(prompt)
        if mask == "padded":
            prompt[1, :3] = 0
            kw["attention_mask"][1, :3] = 0
    with torch.no_grad():
        out = model.generate(prompt, max_new_tokens=2, do_sample=False, return_dict_in_generate=True, **kw)
    assert [layer.prompt_length for layer in out.past_key_values.layers] == [30, 30]


@pytest.mark.slow
@pytest.mark.parametrize("preset", ["extreme", "balanced"])
def test_smollm2_speculative_equals_greedy(smollm2, preset):
    """The embedded model, a WikiText document the model is asked to restate: greedy prompt lookup and assisted
    generation (SmolLM2 as its own draft, with its own KIVI cache) give the tokens of plain greedy decoding
    (up to a near-tie; SmolLM2's logits reach ~40, so the float32 tolerance is wider than the tiny models')."""
    from kivi import dequantize_model
    from kivi.data import load_text

    model, tok = smollm2
    ids = tok(load_text()[:20000], return_tensors="pt").input_ids[0, :400]
    text = f"{tok.decode(ids)}\n\nThe same text again, word for word:\n\n{tok.decode(ids[:24])}"
    prompt = tok(text, return_tensors="pt").input_ids
    try:
        quantize_model(model, KiviConfig.preset(preset, attention_backend="cpu"))
        want = _greedy(model, prompt)
        for spec in (dict(prompt_lookup_num_tokens=10), dict(assistant_model=model, num_assistant_tokens=5)):
            assert_greedy_close(_greedy(model, prompt, **spec), want, atol=SMOLLM2_ATOL)
    finally:
        dequantize_model(model)
