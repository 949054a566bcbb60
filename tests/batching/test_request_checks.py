"""generate_batch / the manager's add_request(s) check every request before anything is scheduled."""

from __future__ import annotations

import pytest
import torch
from transformers.generation.continuous_batching.continuous_api import ContinuousBatchingManager

from kivi import KiviConfig
from kivi.batching import generate_batch, init_continuous_batching
from kivi.batching.requests import InvalidRequest, RequestLimits, check_context, check_requests
from tests.helpers import tiny_model

CFG = KiviConfig(k_bits=2, v_bits=2, group_size=16, residual_length=32)
CB = dict(page_size=64, max_batch_tokens=512)
MEM = 4 * 1024**2
CONTEXT = 4096  # tiny_model's max_position_embeddings; vocab_size 128


@pytest.fixture
def starts(monkeypatch):
    """Every manager start (a refused request must not start one)."""
    started = []
    start = ContinuousBatchingManager.start
    monkeypatch.setattr(ContinuousBatchingManager, "start", lambda self: (started.append(self), start(self))[1])
    return started


@pytest.mark.parametrize(("inputs", "new", "error", "words"), [
    ([[5, 6, 7], []], 4, ValueError, ["inputs[1]", "empty"]),
    ([[5, 6], [1, 128]], 4, ValueError, ["inputs[1][1] = 128", "[0, 128)"]),
    ([[5, -1, 6]], 4, ValueError, ["inputs[0][1] = -1", "[0, 128)"]),
    ([[5, 6], "hello"], 4, TypeError, ["inputs[1]", "str", "tokenize"]),
    ([[5, 6.0]], 4, TypeError, ["inputs[0][1]", "float"]),
    ([[5, True]], 4, TypeError, ["inputs[0][1]", "bool"]),
    ([torch.tensor([[5, 6]])], 4, TypeError, ["inputs[0]", "shape [1, 2]", "1-D"]),
    ([torch.tensor([5.0, 6.0])], 4, TypeError, ["inputs[0]", "float32"]),
    ([[5, 6]], -1, ValueError, ["max_new_tokens=-1", "positive int"]),
    ([[5, 6]], 0, ValueError, ["max_new_tokens=0", "positive int"]),
    ([[5, 6]], 2.5, TypeError, ["max_new_tokens=2.5", "positive int"]),
    ([[5, 6], [1] * (CONTEXT - 10)], 16, ValueError, ["inputs[1]", f"{CONTEXT - 10} tokens + max_new_tokens=16",
                                                      f"context of {CONTEXT}", "at most 10"]),
    ([[1] * CONTEXT], 1, ValueError, ["inputs[0]", f"{CONTEXT} tokens", "no room"]),
], ids=["empty-next-to-normal", "id-beyond-vocab", "negative-id", "str-prompt", "float-id", "bool-id", "2-D-tensor",
        "float-tensor", "max-new-negative", "max-new-zero", "max-new-float", "beyond-context", "prompt-fills-context"])
def test_generate_batch_refuses_a_bad_request_before_anything_runs(starts, inputs, new, error, words):
    with pytest.raises(error) as e:
        generate_batch(tiny_model(), inputs, CFG, cache_memory=MEM, max_new_tokens=new, **CB)
    for w in words:
        assert w in str(e.value), (w, str(e.value))
    assert not starts  # refused before a manager started


def test_refusals_name_the_parameter_and_rule():
    limits = RequestLimits(vocab_size=128, max_context=CONTEXT)
    with pytest.raises(InvalidRequest) as e:
        check_requests([[1, 2], []], 4, limits)
    assert (e.value.param, e.value.code) == ("inputs[1]", "empty_prompt")
    with pytest.raises(InvalidRequest) as e:
        check_context(100, CONTEXT, CONTEXT, prompt_param="prompt", new_param="max_tokens")
    assert (e.value.param, e.value.code) == ("max_tokens", "context_length_exceeded")
    with pytest.raises(InvalidRequest) as e:
        check_context(CONTEXT, None, CONTEXT, prompt_param="prompt", new_param="max_tokens")
    assert (e.value.param, e.value.code) == ("prompt", "context_length_exceeded")
    with pytest.raises(TypeError, match="list of prompts"):
        check_requests("hello", 4, limits)
    assert check_requests([(1, 2), torch.tensor([3, 4])], 4, limits) == [[1, 2], [3, 4]]
    check_context(CONTEXT - 4, 4, CONTEXT)  # exactly the context is allowed
    check_context(10, 10**6, None)  # a model that does not say its context: not checked


def test_a_tensor_prompt_runs_as_its_list():
    prompt = [5, 9, 17, 3, 44, 2]
    as_list = generate_batch(tiny_model(), [prompt], CFG, cache_memory=MEM, max_new_tokens=6, **CB)
    as_tensor = generate_batch(tiny_model(), [torch.tensor(prompt)], CFG, cache_memory=MEM, max_new_tokens=6, **CB)
    assert [o.generated_tokens for o in as_tensor.values()] == [o.generated_tokens for o in as_list.values()]


def test_manager_add_request_and_add_requests_check_before_queueing():
    manager = init_continuous_batching(tiny_model(), CFG, cache_memory=MEM, **CB)
    try:
        with pytest.raises(ValueError, match=r"input_ids\[0\] = 300"):
            manager.add_request([300, 1], max_new_tokens=4)
        with pytest.raises(ValueError, match="max_new_tokens=-3"):
            manager.add_request([3, 1], max_new_tokens=-3)
        with pytest.raises(ValueError, match=r"inputs\[2\] is empty"):
            manager.add_requests([[1, 2], [3], []], max_new_tokens=4)
        assert manager.input_queue.empty()  # none of them was queued
    finally:
        manager.restore_attention()
