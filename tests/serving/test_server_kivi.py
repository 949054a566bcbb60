"""`kivi serve` over KIVI pages (kivi.batching): concurrent greedy requests equal single-request
``generate`` with the same KIVI config, and a client that leaves frees its KIVI blocks."""

from __future__ import annotations

import asyncio
import time

import pytest
import torch

openai = pytest.importorskip("openai")
httpx = pytest.importorskip("httpx")

from kivi import KiviConfig, quantize_model  # noqa: E402
from tests.serving.server import ServeProcess, tiny_tokenizer  # noqa: E402

#: 2-bit keys and values, a 32-token window: prompts of 60+ tokens are mostly quantized
KIVI_ARGS = ["--k-bits", "2", "--v-bits", "2", "--group-size", "32", "--residual-length", "32"]
CONFIG = KiviConfig(k_bits=2, v_bits=2, group_size=32, residual_length=32)


@pytest.fixture(scope="module")
def kivi_server(checkpoint):
    pytest.importorskip("fastapi")
    proc = ServeProcess(["--model", str(checkpoint), "--cache-memory", "1MiB", "--max-new-tokens", "2000",
                         "--max-batch-tokens", "256", "--threads", "1", *KIVI_ARGS])
    yield proc
    proc.stop_cleanly()


def test_concurrent_greedy_requests_equal_kivi_generate(kivi_server, checkpoint):
    from transformers import AutoModelForCausalLM

    model = quantize_model(AutoModelForCausalLM.from_pretrained(checkpoint).eval(), CONFIG)
    tok = tiny_tokenizer()
    prompts = ["The quick brown fox jumps over the lazy dog, again and again, until it is tired." * k
               for k in (1, 2)] + ["Short one.", "KIVI keeps keys per channel and values per token, in 2 bits!"]
    client = openai.AsyncOpenAI(base_url=f"{kivi_server.url}/v1", api_key="unused", max_retries=0, timeout=120)

    async def run():
        async def one(p, stream):
            if not stream:
                r = await client.completions.create(model="m", prompt=p, max_tokens=24, temperature=0)
                return r.choices[0].text
            s = await client.completions.create(model="m", prompt=p, max_tokens=24, temperature=0, stream=True)
            return "".join([c.choices[0].text async for c in s])
        return await asyncio.gather(*[one(p, i % 2 == 1) for i, p in enumerate(prompts)])

    texts = asyncio.run(run())
    for p, text in zip(prompts, texts):
        ids = tok(p)["input_ids"]
        with torch.no_grad():
            out = model.generate(torch.tensor([ids]), do_sample=False, max_new_tokens=24, eos_token_id=1)
        assert text == tok.decode(out[0, len(ids):], skip_special_tokens=True), p


def test_a_disconnected_client_frees_its_kivi_blocks(kivi_server):
    before = kivi_server.health()["cache"]
    body = {"model": "m", "prompt": "leave early, please " * 4, "max_tokens": 1500, "stream": True}
    with httpx.stream("POST", f"{kivi_server.url}/v1/completions", json=body, timeout=30) as r:
        lines = r.iter_lines()
        chunks = 0
        while chunks < 3:
            chunks += next(lines).startswith("data: ")
        during = kivi_server.health()["cache"]
        assert during["requests_holding_blocks"] == 1 and during["blocks_held"] >= 1, during
        assert during["window_blocks_held"] >= 1 and during["page_blocks_held"] >= 1, during  # its window and pages
        assert during["blocks_held"] == during["page_blocks_held"] + during["window_blocks_held"], during
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:
        after = kivi_server.health()["cache"]
        if after["blocks_held"] == 0:
            break
        time.sleep(0.05)
    assert after["blocks_held"] == 0 and after["window_blocks_held"] == 0 and after["requests_open"] == 0
    assert after["requests_cancelled"] == before["requests_cancelled"] + 1
