"""kivi's continuous-batching defaults: tokens per forward, and SDPA (not paged|eager) for the float path on CPU."""

from __future__ import annotations

import pytest
import torch

from kivi import KiviConfig
from kivi.batching import generate_batch, init_continuous_batching
from kivi.batching.manager import DEFAULT_MAX_BATCH_TOKENS
from tests.helpers import tiny_model

CFG = KiviConfig(k_bits=2, v_bits=2, group_size=16, residual_length=32)
MEM = 4 * 1024**2


def _run_one(manager) -> tuple[int, str]:
    """``(max_batch_tokens the started cache uses, attention the model ran)`` for one short request."""
    seen = {}
    manager.start()
    try:
        rid = manager.add_request(list(range(1, 41)), max_new_tokens=3)
        assert manager.get_result(rid, timeout=60).is_finished()
        seen["attn"] = manager.model.config._attn_implementation
        return manager.batch_processor.cache.max_batch_tokens, seen["attn"]
    finally:
        manager.stop(block=True, timeout=30)
        manager.destroy()


@pytest.mark.parametrize("cfg", [None, CFG], ids=["float", "kivi"])
def test_unset_max_batch_tokens_is_kivis_default_and_a_set_one_wins(cfg):
    assert DEFAULT_MAX_BATCH_TOKENS == 512
    tokens, _ = _run_one(init_continuous_batching(tiny_model(), cfg, cache_memory=MEM, page_size=64))
    assert tokens == DEFAULT_MAX_BATCH_TOKENS  # transformers alone would take 8192
    tokens, _ = _run_one(init_continuous_batching(tiny_model(), cfg, cache_memory=MEM, page_size=64,
                                                  max_batch_tokens=128))
    assert tokens == 128


@pytest.mark.parametrize("cfg", [None, KiviConfig(k_bits=2, v_bits=2, group_size=16, residual_length=32,
                                                  attention_backend="reference")], ids=["float", "kivi-reference"])
def test_eager_model_runs_sdpa_on_cpu_and_gets_eager_back(cfg):
    """The float cache runs SDPA (transformers alone switches eager to paged|eager); KIVI pages run the
    "kivi_paged" step, "reference" included. Both give the model its eager attention back."""
    model = tiny_model(attn_implementation="eager")
    manager = init_continuous_batching(model, cfg, cache_memory=MEM, page_size=64)
    _, ran = _run_one(manager)
    assert ran == ("sdpa" if cfg is None else "kivi_paged")
    assert model.config._attn_implementation == "eager"


def test_sdpa_and_paged_eager_give_the_same_greedy_tokens():
    """The switch changes the speed, not the tokens (same batch mask, same math)."""
    g = torch.Generator().manual_seed(0)
    inputs = [torch.randint(1, 128, (n,), generator=g).tolist() for n in (30, 70, 110)]
    eager = tiny_model()
    eager.set_attn_implementation("paged|eager")
    a = generate_batch(eager, inputs, None, cache_memory=MEM, max_new_tokens=8, page_size=64)
    b = generate_batch(tiny_model(), inputs, None, cache_memory=MEM, max_new_tokens=8, page_size=64)
    assert [x.generated_tokens for x in a.values()] == [x.generated_tokens for x in b.values()]
