"""vLLM with the plugin decodes greedily the tokens kivi's own ``quantize_model(...).generate()`` gives.

Both run the embedded SmolLM2 in float32 with the same KiviConfig. vLLM runs in a child process
(short: max_model_len 256, enforce_eager, 1 GiB of KV cache).
"""

from __future__ import annotations

import copy
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

pytestmark = pytest.mark.vllm

PROMPTS = ["The capital of France is", "def fibonacci(n):", "Once upon a time, in a small village,"]
MAX_TOKENS = 64


def run_engine(model_dir: str, prompts: list[list[int]], kivi: dict | None, **engine) -> list[list[int]]:
    job = dict(model=model_dir, prompts=prompts, kivi=kivi, max_tokens=MAX_TOKENS,
               engine=dict(dtype="float32", max_model_len=256, **engine))
    env = dict(os.environ, VLLM_CPU_KVCACHE_SPACE="1")
    proc = subprocess.run([sys.executable, str(Path(__file__).with_name("_engine.py")), json.dumps(job)],
                          capture_output=True, text=True, env=env, timeout=900)
    lines = [ln for ln in proc.stdout.splitlines() if ln.startswith("RESULT ")]
    assert proc.returncode == 0 and lines, proc.stderr[-4000:]
    return json.loads(lines[-1][len("RESULT "):])


@pytest.fixture(scope="module")
def smollm2():
    from kivi import load_model
    from kivi.models import converted_cache_path

    model, tok = load_model("smollm2", dtype="float32")
    return model, tok, str(converted_cache_path("smollm2"))


def kivi_generate(model, ids: list[int], cfg) -> list[int]:
    from kivi import KiviCache, dequantize_model, quantize_model

    gen = copy.deepcopy(model.generation_config)
    gen.eos_token_id = []  # as vLLM's ignore_eos: an end token is generated and decoding goes on (None falls back to
    gen.pad_token_id = None  # the model's end token through pad_token_id)
    gen.max_new_tokens, gen.do_sample = MAX_TOKENS, False
    quantize_model(model, cfg)
    try:
        out = model.generate(torch.tensor([ids]), generation_config=gen, return_dict_in_generate=True)
    finally:
        dequantize_model(model)
    cache = getattr(out, "cache", None)  # transformers 5.2x; vLLM's pinned 5.19 says past_key_values
    cache = getattr(out, "past_key_values", None) if cache is None else cache
    assert isinstance(cache, KiviCache), f"generate decoded with {type(cache).__name__}, not kivi's cache"
    return out.sequences[0, len(ids):].tolist()


R32 = {"group_size": 32, "residual_length": 32}


@pytest.mark.parametrize("kivi", [{"k_bits": 8, "v_bits": 8, **R32}, {"k_bits": 2, "v_bits": 2, **R32},
                                  {"k_bits": 2, "v_bits": 2, **R32, "sink_tokens": 4}],
                         ids=["k8v8-R32", "k2v2-R32", "k2v2-R32-sink4"])
def test_greedy_tokens_equal_kivi_generate(smollm2, kivi):
    from kivi import KiviConfig

    model, tok, path = smollm2
    prompts = [tok(p)["input_ids"] for p in PROMPTS]
    got = run_engine(path, prompts, kivi)
    cfg = KiviConfig(**kivi)
    wants = [kivi_generate(model, ids, cfg) for ids in prompts]
    firsts = [next((i for i, (a, b) in enumerate(zip(g, w)) if a != b), None) for g, w in zip(got, wants)]
    assert firsts == [None] * len(prompts), f"first differing token per prompt: {firsts}"
