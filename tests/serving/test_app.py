"""The app in-process (httpx's ASGI transport, one event loop): what runs off that loop, and names
handed to a chat template that shows them."""

from __future__ import annotations

import asyncio
import time

import pytest

httpx = pytest.importorskip("httpx")
pytest.importorskip("fastapi")

from kivi.batching import init_continuous_batching  # noqa: E402
from kivi.serving.app import build_app  # noqa: E402
from kivi.serving.engine import Engine  # noqa: E402
from tests.serving.server import CHAT_TEMPLATE, tiny_chat_model, tiny_tokenizer  # noqa: E402

TOKENIZE_S = 1.5


class SlowTokenizer:
    """The tiny tokenizer, TOKENIZE_S slower per call (a prompt that takes long to tokenize)."""

    def __init__(self, tok):
        self._tok = tok

    def __call__(self, *a, **k):
        time.sleep(TOKENIZE_S)
        return self._tok(*a, **k)

    def __getattr__(self, name):
        return getattr(self._tok, name)


@pytest.fixture(scope="module")
def engine():
    tok = tiny_tokenizer()
    tok.chat_template = CHAT_TEMPLATE.replace("<{{ m['role'] }}>",
                                              "<{{ m['role'] }}{% if m.name %} {{ m.name }}{% endif %}>")
    e = Engine(tiny_chat_model(), SlowTokenizer(tok), None, cache_memory=2**20, max_new_tokens=16,
               factory=init_continuous_batching)
    yield e
    e.stop()


async def _client(engine):
    return httpx.AsyncClient(transport=httpx.ASGITransport(app=build_app(engine, model_name="m")),
                             base_url="http://test", timeout=60)


def test_tokenizing_runs_off_the_event_loop(engine):
    """While one prompt takes TOKENIZE_S to tokenize, /health answers at once (the old code tokenized
    on the loop: /health waited for it)."""
    async def run():
        async with await _client(engine) as c:
            t0 = time.monotonic()
            completion = asyncio.ensure_future(c.post("/v1/completions", json={"prompt": "slow", "max_tokens": 2}))
            await asyncio.sleep(0.2)
            health = await c.get("/health")
            health_at = time.monotonic() - t0
            done = await completion
            return health, health_at, done, time.monotonic() - t0

    health, health_at, done, done_at = asyncio.run(run())
    assert health.status_code == 200 and done.status_code == 200, done.text
    assert done_at >= TOKENIZE_S and health_at < TOKENIZE_S * 0.6, (health_at, done_at)


def test_a_name_reaches_a_template_that_shows_it(engine):
    plain = tiny_tokenizer

    async def run():
        async with await _client(engine) as c:
            return await c.post("/v1/chat/completions", json={
                "messages": [{"role": "user", "content": "hi", "name": "ann"}], "max_tokens": 2})

    r = asyncio.run(run())
    assert r.status_code == 200, r.text
    named = engine.tokenizer.apply_chat_template([{"role": "user", "content": "hi", "name": "ann"}],
                                                 add_generation_prompt=True, tokenize=False)
    assert "<user ann>" in named and r.json()["usage"]["prompt_tokens"] == len(plain()(named)["input_ids"])


def _events(text: str) -> list:
    """The JSON events of an SSE body, which must end with ``data: [DONE]``."""
    import json

    lines = [line[len("data: "):] for line in text.split("\n\n") if line.startswith("data: ")]
    assert lines[-1] == "[DONE]", text[-200:]
    return [json.loads(line) for line in lines[:-1]]


@pytest.mark.parametrize("route", ["/v1/chat/completions", "/v1/completions"])
@pytest.mark.parametrize("stream_options", [None, {"include_usage": True}], ids=["plain", "include_usage"])
def test_a_streams_last_chunk_has_its_finish_reason_and_usage(engine, route, stream_options):
    """The last chunk holds the one choice with its finish reason and the usage; no chunk before it has usage.
    (transformers 5.25's builders make a chunk given usage a usage-only chunk: the finish reason was lost.)"""
    body = {"max_tokens": 3, "stream": True, "temperature": 0}
    body.update({"messages": [{"role": "user", "content": "hi"}]} if "chat" in route else {"prompt": [5, 6, 7]})
    if stream_options is not None:
        body["stream_options"] = stream_options

    async def run():
        async with await _client(engine) as c:
            return await c.post(route, json=body)

    r = asyncio.run(run())
    assert r.status_code == 200, r.text
    events = _events(r.text)
    *before, last = events
    assert [c["finish_reason"] for c in last["choices"]] == ["length"], last
    assert last["usage"]["completion_tokens"] == 3 and last["usage"]["total_tokens"] == \
        last["usage"]["prompt_tokens"] + 3, last
    assert all("usage" not in e and e["choices"][0].get("finish_reason") is None for e in before), before
    assert len({e["id"] for e in events}) == 1
