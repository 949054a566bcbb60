"""Tensor parallel 2 with the plugin decodes what tensor parallel 1 does (each rank's KIVI pages hold its own
KV heads).

SmolLM2's 3 KV heads cannot be split in two, so a tiny random Llama (4 query / 2 KV heads of 64, 2 layers,
weights scaled up so its predictions are peaked, SmolLM2's tokenizer) is saved to a folder for vLLM. Tensor
parallel 1 is first checked against kivi's own ``generate()`` of the same weights, so that both runs are
known to run KIVI pages; vLLM's CPU ranks need ``VLLM_CPU_OMP_THREADS_BIND=nobind`` on a small machine (and one
thread each, ``OMP_NUM_THREADS=1``, so that two ranks and another test's engine do not oversubscribe 2 cores).
"""

from __future__ import annotations

import pytest

from tests.vllm._engine_runs import run_engine
from tests.vllm._reference import assert_request_matches, compare_tokens, segments

pytestmark = [pytest.mark.vllm, pytest.mark.slow,  # engine runs of minutes each: KIVI_SLOW=1
              pytest.mark.xdist_group("tensor_parallel")]  # one worker: the tp1 engine starts once

KIVI = {"k_bits": 2, "v_bits": 2, "group_size": 32, "residual_length": 32}
NEW_TOKENS = 96
SIZES = [70, 130, 25]  # prompt lengths: quantized pages from the prompt on, and from decoding on


@pytest.fixture(scope="module")
def tiny_llama(tmp_path_factory):
    from transformers import AutoTokenizer

    from kivi.models import converted_cache_path
    from tests.helpers import tiny_model

    tok = AutoTokenizer.from_pretrained(converted_cache_path("smollm2"))
    model = tiny_model("llama", vocab_size=len(tok), hidden_size=256, intermediate_size=512, num_attention_heads=4,
                       num_key_value_heads=2, weight_scale=3.0)
    folder = tmp_path_factory.mktemp("tiny-llama")
    model.save_pretrained(folder, safe_serialization=True)
    tok.save_pretrained(folder)
    prompts = [[(7 * i + 13 * n) % 5000 + 100 for i in range(n)] for n in SIZES]
    return model, str(folder), prompts


def engine(folder: str, prompts, tp: int) -> dict:
    job = dict(model=folder, kivi=KIVI, record=tp == 1,
               engine=dict(dtype="float32", max_model_len=512, tensor_parallel_size=tp, async_scheduling=False),
               runs=[dict(prompts=prompts, max_tokens=NEW_TOKENS, logprobs=2)])
    return run_engine(job, env={"VLLM_CPU_OMP_THREADS_BIND": "nobind", "OMP_NUM_THREADS": "1"})["runs"][0]


@pytest.fixture(scope="module")
def tp1(tiny_llama):
    _, folder, prompts = tiny_llama
    return engine(folder, prompts, 1)


def test_tp1_equals_kivi_generate(tiny_llama, tp1):
    from kivi import KiviConfig

    model, _, prompts = tiny_llama
    reports = [assert_request_matches(model, KiviConfig(**KIVI), p, tp1["tokens"][i], tp1["logprobs"][i],
                                      segments(tp1["steps"], i)) for i, p in enumerate(prompts)]
    assert sum(r["compared"] for r in reports) >= 2 * NEW_TOKENS, reports


def test_tp2_equals_tp1(tiny_llama, tp1):
    _, folder, prompts = tiny_llama
    tp2 = engine(folder, prompts, 2)
    done = [compare_tokens(tp2["tokens"][i], tp2["logprobs"][i], tp1["tokens"][i], tp1["logprobs"][i])[0]
            for i in range(len(prompts))]
    assert sum(done) >= 2 * NEW_TOKENS, done
