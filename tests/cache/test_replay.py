"""kivi.cache.replay: a recorded full-precision prefill replayed into a cache stores exactly what a real
prefill into that cache stores (every tensor it holds, its bytes) and the next tokens' logits match bit
for bit; for plain KIVI, sinks, per-head widths, position tiers, sliding-window layers and quanto."""

from __future__ import annotations

import pytest
import torch

from kivi import KiviConfig
from kivi.attention.interface import reading_views
from kivi.cache.replay import replay_prefill
from kivi.eval.caches import baseline_unavailable_reason, cache_nbytes, make_cache
from kivi.eval.longctx.runner import record_prefill
from tests.helpers import tiny_model

MODELS = {
    "llama": dict(model_type="llama"),
    "mistral-sliding": dict(model_type="mistral", sliding_window=48),
    "qwen2-mixed": dict(model_type="qwen2", use_sliding_window=True, sliding_window=48, max_window_layers=1),
}


def _cfg(**kw):
    return KiviConfig(**{"k_bits": 2, "v_bits": 2, "group_size": 16, "residual_length": 32, "block_size": 64,
                         "attention_backend": "reference", **kw})


SPECS = {
    "fp": None,
    "plain": _cfg(),
    "sinks": _cfg(sink_tokens=4),
    "per-head": _cfg(head_bits={0: {"k_bits": [4, 2], "v_bits": [2, 3]}}, sink_tokens=3),
    "tiers": _cfg(tiers=[(32, None), (48, 4), (None, 2)], k_bits=4, v_bits=4),
}


def _tensors(obj, path="", seen=None):
    """Every tensor reachable from ``obj`` (attributes, lists, dicts), by access path."""
    seen = set() if seen is None else seen
    if id(obj) in seen:
        return {}
    seen.add(id(obj))
    if isinstance(obj, torch.Tensor):
        return {path: obj}
    out = {}
    if isinstance(obj, dict):
        items = obj.items()
    elif isinstance(obj, (list, tuple)):
        items = enumerate(obj)
    elif hasattr(obj, "__dict__") and type(obj).__module__.split(".")[0] in ("kivi", "transformers", "optimum"):
        items = vars(obj).items()
    else:
        return {}
    for k, v in items:
        out.update(_tensors(v, f"{path}.{k}", seen))
    return out


def _stored(cache, model, path):
    """What ``cache`` stores: a ``KiviCache`` as it saves itself (the valid rows of its blocks, the unused
    tail of a block is never written), any other cache as every tensor it holds."""
    from safetensors import safe_open

    from kivi.cache.kivi_cache import KiviCache
    from kivi.prefix import model_fingerprint

    if not isinstance(cache, KiviCache):
        return _tensors(cache)
    cache.save(path, fingerprint=model_fingerprint(model, None))
    with safe_open(str(path), "pt") as f:
        return {"metadata": f.metadata(), **{k: f.get_tensor(k) for k in f.keys()}}


def _decode(model, cache, logits, steps=4):
    got = [logits]
    with torch.inference_mode(), reading_views(model, cache):
        for _ in range(steps):
            x = got[-1].argmax(-1).view(1, 1)
            got.append(model(input_ids=x, cache=cache, use_cache=True).logits[:, -1].float())
    return torch.stack(got)


def _check(model, spec, tmp_path, n=150):
    ids = torch.randint(1, 128, (1, n), generator=torch.Generator().manual_seed(1))
    states, logits = record_prefill(model, ids[0].tolist())
    real = make_cache(model, spec, read_packed=True)
    with torch.inference_mode(), reading_views(model, real):
        real_logits = model(input_ids=ids, cache=real, use_cache=True, logits_to_keep=1).logits[:, -1].float()
    replayed = make_cache(model, spec, read_packed=True)
    with reading_views(model, replayed):
        replay_prefill(replayed, states)
    assert torch.equal(real_logits, logits)  # the shared prefill's logit is the one a real prefill gives
    a, b = _stored(real, model, tmp_path / "real.safetensors"), _stored(replayed, model, tmp_path / "re.safetensors")
    assert a.keys() == b.keys() and len(a) > 1
    for k in a:
        assert a[k] == b[k] if k == "metadata" else a[k].dtype == b[k].dtype and torch.equal(a[k], b[k]), k
    assert cache_nbytes(real) == cache_nbytes(replayed) > 0
    assert torch.equal(_decode(model, real, real_logits), _decode(model, replayed, logits))


CASES = [("llama", s) for s in SPECS] + [("mistral-sliding", "plain"), ("qwen2-mixed", "sinks"),
                                        ("qwen2-mixed", "per-head")]  # tiers: not on sliding-window layers


@pytest.mark.parametrize("model_name,spec_name", CASES)
def test_replay_equals_a_real_prefill(model_name, spec_name, tmp_path):
    spec = dict(MODELS[model_name])
    model = tiny_model(spec.pop("model_type"), weight_scale=4.0, **spec)
    _check(model, SPECS[spec_name], tmp_path)


@pytest.mark.long  # ~45 s: optimum-quanto's first import (the KIVI and FP replay cases stay in the default run)
@pytest.mark.parametrize("name", ["quanto-int2"])
def test_replay_equals_a_real_prefill_quanto(name, tmp_path):
    if baseline_unavailable_reason(name):
        pytest.skip(baseline_unavailable_reason(name))
    _check(tiny_model("llama", weight_scale=4.0), name, tmp_path, n=200)


def test_replay_refuses_empty_states():
    with pytest.raises(ValueError, match="states is empty"):
        replay_prefill(make_cache(tiny_model("llama"), None), [])
