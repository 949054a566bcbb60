"""Fixtures: one `kivi serve` subprocess over a tiny saved checkpoint, shared by a module's tests."""

from __future__ import annotations

import pytest
import torch

from tests.serving.server import ServeProcess, save_tiny_checkpoint, tiny_tokenizer

#: 2 MiB of float pages = 8 blocks of 256 tokens (the tiny model's block is 256 KiB): 2048 tokens in all
SERVE_ARGS = ["--float-cache", "--cache-memory", "2MiB", "--max-new-tokens", "4000", "--max-batch-tokens", "256",
              "--threads", "1", "--served-model-name", "tiny-kivi"]


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    return save_tiny_checkpoint(tmp_path_factory.mktemp("serve") / "tiny")


@pytest.fixture(scope="module")
def server(checkpoint):
    pytest.importorskip("fastapi")
    pytest.importorskip("uvicorn")
    pytest.importorskip("httpx")
    proc = ServeProcess(["--model", str(checkpoint), *SERVE_ARGS])
    yield proc
    proc.stop_cleanly()


@pytest.fixture(scope="module")
def reference(checkpoint):
    """Greedy ``model.generate`` (a float DynamicCache) on the same checkpoint: ``f(ids, n) -> text``."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(checkpoint).eval()
    tok = tiny_tokenizer()

    def greedy(ids: list[int], n: int) -> str:
        with torch.no_grad():
            out = model.generate(torch.tensor([ids]), do_sample=False, max_new_tokens=n, eos_token_id=1)
        return tok.decode(out[0, len(ids):], skip_special_tokens=True)

    return greedy
