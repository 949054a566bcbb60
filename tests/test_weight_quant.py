"""KIVI on weight-quantized models: kivi.models.quantize_weights (optimum-quanto qint8 / qint4 linear layers),
quantize_model on top of it, and the planner's weight bytes against the real quantized tensors."""

from __future__ import annotations

import sys

import pytest
import torch

from kivi import KiviCache, KiviConfig, quantize_model
from kivi.memory import estimate_kv_memory
from kivi.memory.weights import quanto_group_size
from kivi.models import WeightQuantizationUnavailable, quantizable_linears, quantize_weights, weight_bytes
from tests.helpers import LOGIT_ATOL, assert_decode_close, assert_greedy_close, greedy, tiny_model

pytest.importorskip("optimum.quanto")

BITS = [8, 4]
BITS_IDS = ["int8", "int4"]
# hidden 256: quanto groups int4 weights by 128 input channels (hidden 128 would give one scale per output
# channel), so both of quanto's int4 layouts are exercised across the tests.
GROUPED = dict(hidden_size=256, intermediate_size=384)
CFG = KiviConfig(residual_length=32, block_size=64)  # 2/2 G32: tokens leave the window within 100 tokens


def _wq_model(bits: int, dtype: torch.dtype = torch.float32, **kw):
    model = tiny_model("llama", weight_scale=4.0, **kw).to(dtype)
    return quantize_weights(model, bits)


def _generate(model, ids, mask, n=24):
    out = model.generate(ids, attention_mask=mask, max_new_tokens=n, do_sample=False, pad_token_id=0,
                         return_dict_in_generate=True)
    return out.sequences, out.cache


@pytest.mark.parametrize("bits", BITS, ids=BITS_IDS)
def test_linear_layers_become_quanto_and_lm_head_stays_float(bits):
    from optimum.quanto import QLinear

    model = _wq_model(bits, **GROUPED)
    names = [n for n, _ in quantizable_linears(model)]
    assert len(names) == 2 * 7  # q k v o gate up down per layer
    assert all(isinstance(model.get_submodule(n), QLinear) for n in names)
    assert type(model.lm_head) is torch.nn.Linear and model.lm_head.weight.dtype == torch.float32
    assert not any(p.requires_grad for p in model.parameters())
    assert model.kivi_weight_bits == bits


@pytest.mark.parametrize("bits", BITS, ids=BITS_IDS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_generate_cpu_backend_equals_reference_backend(bits, dtype):
    """The packed cpu backend on a weight-quantized model decodes like the reference backend (the same
    weight-quantized model, KIVI cache dequantized for every forward): logits within LOGIT_ATOL at every
    step, tokens equal up to a near-tie (in bf16 the two backends round differently, and this model's
    top-2 logits tie within one bf16 ulp after a few tokens); the cache is a KiviCache."""
    ids = torch.randint(1, 128, (1, 150), generator=torch.Generator().manual_seed(1))
    mask = torch.ones_like(ids)
    ref = quantize_model(
        _wq_model(bits, dtype, **GROUPED), KiviConfig.from_dict({**CFG.to_dict(), "attention_backend": "reference"})
    )
    fast = quantize_model(
        _wq_model(bits, dtype, **GROUPED), KiviConfig.from_dict({**CFG.to_dict(), "attention_backend": "cpu"})
    )
    assert fast.config._attn_implementation == "kivi"
    got, _ = assert_decode_close(fast, ref, ids, new_tokens=24, atol=LOGIT_ATOL[dtype], mask=mask, pad_token_id=0)
    assert isinstance(got.cache, KiviCache) and got.cache.memory_breakdown()["codes"] > 0


def _padded_batch(pad: int = 0):
    g = torch.Generator().manual_seed(2)
    long, short = torch.randint(1, 128, (1, 140), generator=g), torch.randint(1, 128, (1, 97), generator=g)
    batch = torch.full((2, 140), pad, dtype=torch.long)
    mask = torch.zeros_like(batch)
    batch[0], mask[0] = long[0], 1
    batch[1, 43:], mask[1, 43:] = short[0], 1
    return batch, mask, long


@pytest.mark.parametrize("bits", BITS, ids=BITS_IDS)
def test_left_padded_batch_cpu_equals_reference_and_pad_values_change_nothing(bits):
    """A left-padded batch: the cpu backend gives the reference backend's tokens; the padding's token ids
    change no generated token (padding never enters a quantization statistic); the unpadded row equals
    its own run alone (quantization groups never span batch rows). A padded row is not compared with its
    run alone: its key groups sit on other token positions, so its quantization differs by design."""
    kw = {**CFG.to_dict()}
    ref = quantize_model(_wq_model(bits, **GROUPED), KiviConfig.from_dict({**kw, "attention_backend": "reference"}))
    fast = quantize_model(_wq_model(bits, **GROUPED), KiviConfig.from_dict({**kw, "attention_backend": "cpu"}))
    batch, mask, long = _padded_batch()
    atol = LOGIT_ATOL[torch.float32]
    got, _ = assert_decode_close(fast, ref, batch, new_tokens=16, atol=atol, mask=mask, pad_token_id=0)
    assert isinstance(got.cache, KiviCache)
    for pad in (7, 99):  # the same path and arithmetic (padding is masked out of every sum): bit-identical
        other = greedy(fast, _padded_batch(pad)[0], new_tokens=16, mask=mask, pad_token_id=0)
        assert torch.equal(other.sequences[:, -16:], got.sequences[:, -16:])
    # alone, the row runs through kernels of another batch size (another summation order): up to rounding
    alone = greedy(fast, long, new_tokens=16, mask=torch.ones_like(long), pad_token_id=0)
    assert_greedy_close(got.row(0), alone, atol=atol)


@pytest.mark.parametrize("bits", BITS, ids=BITS_IDS)
def test_forward_under_inference_mode(bits):
    """kivi's eval and CLI run under torch.inference_mode(); quanto's int4 weight quantized outside it fails
    there ("Cannot set version_counter for inference tensor"), so quantize_weights quantizes inside it."""
    model = _wq_model(bits, **GROUPED)
    ids = torch.randint(1, 128, (1, 40))
    with torch.no_grad():
        want = model(ids).logits
    with torch.inference_mode():
        got = model(ids).logits
    assert torch.equal(got, want)
    assert torch.equal(model(ids).logits, want)  # grad mode too: nothing requires grad


def test_kivi_eval_perplexity_runs_on_an_int4_model():
    from kivi.eval import compare

    model = _wq_model(4, **GROUPED)
    windows = torch.randint(1, 128, (2, 160), generator=torch.Generator().manual_seed(3))
    r = compare(model, windows, [CFG], prefix=96, chunk=16, progress=False)
    assert r["fp"]["tokens_scored"] == 2 * 64 and torch.isfinite(torch.tensor(r["results"][0]["ppl"]))
    assert r["results"][0]["cache_bytes"] > 0


def test_bad_bits_and_double_quantization_are_clear_errors():
    model = tiny_model()
    with pytest.raises(ValueError, match=r"weight bits=3 .*allowed: 16, 8, 4"):
        quantize_weights(model, 3)
    assert quantize_weights(model, 16) is model and type(model.model.layers[0].mlp.up_proj) is torch.nn.Linear
    quantize_weights(model, 8)
    with pytest.raises(ValueError, match="already quantized to 8 bits"):
        quantize_weights(model, 4)


def test_missing_quanto_is_a_one_line_error(monkeypatch):
    monkeypatch.setitem(sys.modules, "optimum.quanto", None)
    with pytest.raises(WeightQuantizationUnavailable, match=r"weight bits=4 needs optimum-quanto: pip install"):
        quantize_weights(tiny_model(), 4)
    assert WeightQuantizationUnavailable.user_facing


# ------------------------------------------------------------------ planner vs the real quantized tensors

SHAPES = {
    "tiny": {},
    "tied": {"tie_word_embeddings": True},
    "grouped": GROUPED,
    "smollm2-like": {"hidden_size": 576, "intermediate_size": 1536, "num_attention_heads": 9,
                     "num_key_value_heads": 3},  # groups of 96 (576) and 128 (1536)
    "odd": {"hidden_size": 200, "intermediate_size": 301, "head_dim": 32},  # ungrouped, odd rows to pack
    "bias": {"attention_bias": True, "mlp_bias": True, **GROUPED},
}


@pytest.mark.parametrize("shape", list(SHAPES))
@pytest.mark.parametrize("bits", [16, 8, 4], ids=["fp", "int8", "int4"])
def test_planned_weight_bytes_equal_the_quantized_models_tensors(shape, bits):
    model = tiny_model("llama", **SHAPES[shape])
    est = estimate_kv_memory(model, 256, weight_bits=bits)
    quantize_weights(model, bits)
    assert est.weights_bytes == weight_bytes(model)
    assert sum(est.weights_breakdown.values()) == est.weights_bytes
    assert est.total_kivi_bytes == est.weights_bytes + est.kivi_total_bytes
    assert est.total_fp_bytes == est.weights_bytes + est.fp_total_bytes


@pytest.mark.parametrize("in_features", [64, 128, 160, 192, 200, 256, 576, 1536])
def test_group_size_rule_is_quantos(in_features):
    from optimum.quanto import QLinear, qint4

    q = QLinear(in_features, 8, bias=False, weights=qint4)
    assert quanto_group_size(in_features) == q.weight_group_size


def test_loaded_quantized_model_spec_reports_its_measured_bytes():
    model = quantize_weights(tiny_model(), 4)
    est = estimate_kv_memory(model, 128)
    assert est.weights_bytes == weight_bytes(model) < tiny_model().num_parameters() * 4


def test_weight_bits_needs_linear_shapes_for_an_explicit_shape():
    spec = dict(num_layers=2, num_kv_heads=2, head_dim=32, params=10**6)
    assert estimate_kv_memory(spec, 128, weight_bits=16).weights_bytes == 2 * 10**6  # float16 default
    with pytest.raises(ValueError, match="needs the shapes of the model's linear layers"):
        estimate_kv_memory(spec, 128, weight_bits=4)
    with pytest.raises(ValueError, match=r"weight bits=5 is not supported"):
        estimate_kv_memory(spec, 128, weight_bits=5)


def test_order_of_weight_and_cache_quantization_does_not_matter():
    cfg = KiviConfig.from_dict({**CFG.to_dict(), "attention_backend": "cpu"})
    ids = torch.randint(1, 128, (1, 120), generator=torch.Generator().manual_seed(4))
    first = quantize_model(_wq_model(4, **GROUPED), cfg)
    second = quantize_weights(quantize_model(tiny_model("llama", weight_scale=4.0, **GROUPED), cfg), 4)
    assert second.config._attn_implementation == "kivi"
    # the same weights and cache config, hence the same arithmetic: bit-identical tokens
    assert torch.equal(_generate(first, ids, torch.ones_like(ids))[0], _generate(second, ids, torch.ones_like(ids))[0])


@pytest.mark.slow
def test_smollm2_planned_weight_bytes_equal_the_quantized_model(smollm2_cache_root):
    """The real model: SmolLM2-135M's int8 / int4 tensors (groups of 96 and 128 input channels, tied
    embedding left float) against the planner reading only the alias's config."""
    from kivi.models import load_model

    for bits in (8, 4):
        model = quantize_weights(load_model("smollm2", cache_dir=smollm2_cache_root)[0], bits)  # a private copy
        assert weight_bytes(model) == estimate_kv_memory("smollm2", 1024, weight_bits=bits).weights_bytes
