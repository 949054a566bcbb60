"""`kivi serve` end to end: a subprocess on localhost, real HTTP clients (openai, httpx), concurrent requests."""

from __future__ import annotations

import asyncio
import json
import time

import pytest

openai = pytest.importorskip("openai")
httpx = pytest.importorskip("httpx")

from tests.serving.server import tiny_tokenizer  # noqa: E402


def client(server) -> "openai.AsyncOpenAI":
    return openai.AsyncOpenAI(base_url=f"{server.url}/v1", api_key="unused", max_retries=0, timeout=60)


def chat_ids(messages) -> list[int]:
    return tiny_tokenizer().apply_chat_template(messages, add_generation_prompt=True, tokenize=True,
                                                return_dict=True)["input_ids"]


def test_concurrent_requests_equal_greedy_generate(server, reference):
    """Six requests at once (completions and chat, streaming and not) through the openai client: each
    greedy text equals model.generate's for its prompt."""
    prompts = ["Hello kivi", "The cache is small.", "abc", "Quantize me, please!"]
    chats = [[{"role": "user", "content": "Hi there"}], [{"role": "system", "content": "Be brief."},
                                                         {"role": "user", "content": "Why?"}]]
    tok = tiny_tokenizer()

    async def run():
        c = client(server)
        async def completion(p):
            r = await c.completions.create(model="anything", prompt=p, max_tokens=12, temperature=0)
            return r.choices[0].text, r.choices[0].finish_reason, r.usage.completion_tokens

        async def stream_chat(m):
            s = await c.chat.completions.create(model="tiny-kivi", messages=m, max_tokens=10, stream=True)
            text, finish = "", None
            async for chunk in s:
                text += chunk.choices[0].delta.content or ""
                finish = chunk.choices[0].finish_reason or finish
            return text, finish

        async def chat(m):
            r = await c.chat.completions.create(model="x", messages=m, max_tokens=10)
            return r.choices[0].message.content, r.choices[0].finish_reason

        return await asyncio.gather(*[completion(p) for p in prompts], stream_chat(chats[0]), chat(chats[1]),
                                    stream_chat(chats[1]))

    results = asyncio.run(run())
    for p, (text, finish, n) in zip(prompts, results[:4]):
        assert text == reference(tok(p)["input_ids"], 12) and finish == "length" and n == 12
    assert results[4] == (reference(chat_ids(chats[0]), 10), "length")
    assert results[5] == (reference(chat_ids(chats[1]), 10), "length")
    assert results[6] == results[5]
    h = server.health()["cache"]
    assert h["blocks_held"] == 0 and h["requests_open"] == 0 and h["requests_done"] >= 7


def test_token_id_prompt_stop_sequence_and_sampling(server, reference):
    ids = tiny_tokenizer()("Stop here")["input_ids"]
    full = reference(ids, 16)
    stop = full[6:8]
    expected = full[: full.find(stop)]

    async def run():
        c = client(server)
        stopped = await c.completions.create(model="m", prompt=ids, max_tokens=16, stop=[stop])
        streamed = await c.completions.create(model="m", prompt=ids, max_tokens=16, stop=stop, stream=True)
        pieces = [(ch.choices[0].text, ch.choices[0].finish_reason) async for ch in streamed]
        nucleus = c.completions.create(model="m", prompt=ids, max_tokens=16, temperature=1.0, top_p=1e-6)
        hot = [c.completions.create(model="m", prompt=ids, max_tokens=16, temperature=2.0) for _ in range(3)]
        return stopped, pieces, await asyncio.gather(nucleus, *hot)

    stopped, pieces, (nucleus, *hot) = asyncio.run(run())
    assert stopped.choices[0].text == expected and stopped.choices[0].finish_reason == "stop"
    assert "".join(t for t, _ in pieces) == expected and pieces[-1][1] == "stop"
    # per-request sampling settings: a tiny top_p keeps only the most likely token (= greedy) while
    # temperature 2 requests in the same batches sample (EOS may end them early: its logit is 0, not -inf)
    assert nucleus.choices[0].text == full
    assert any(h.choices[0].text != full[: len(h.choices[0].text)] or h.choices[0].finish_reason == "stop"
               for h in hot)


def test_models_lists_the_served_model(server):
    r = httpx.get(f"{server.url}/v1/models")
    assert r.status_code == 200
    assert [m["id"] for m in r.json()["data"]] == ["tiny-kivi"]


def _post(server, path, body, timeout=30.0):
    content = body if isinstance(body, (str, bytes)) else json.dumps(body)
    return httpx.post(f"{server.url}{path}", content=content, headers={"Content-Type": "application/json"},
                      timeout=timeout)


@pytest.mark.parametrize(("path", "body", "param", "code"), [
    ("/v1/completions", {"prompt": "a" * 4100, "max_tokens": 5}, "prompt", "context_length_exceeded"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "b" * 4100}]}, "messages",
     "context_length_exceeded"),
    ("/v1/completions", {"prompt": "hello", "max_tokens": 3000}, "max_tokens", "cache_budget_exceeded"),
    ("/v1/completions", {"prompt": "hello", "max_tokens": 5000}, "max_tokens", "context_length_exceeded"),
    ("/v1/completions", '{"prompt": "hel', None, "invalid_json"),
    ("/v1/completions", {"prompt": "hello", "max_tokens": "ten"}, "max_tokens", "invalid_value"),
    ("/v1/completions", {"prompt": "hello", "seed": 1}, "seed", "unsupported_field"),
    ("/v1/chat/completions", {"messages": "hi"}, "messages", "invalid_value"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}], "temperature": 9}, "temperature",
     "invalid_value"),
    ("/v1/completions", [1, 2], None, "invalid_body"),
], ids=["context-completion", "context-chat", "budget", "context-max-tokens", "bad-json", "wrong-type",
        "unsupported", "bad-messages", "bad-temperature", "not-an-object"])
def test_bad_requests_get_a_400_in_openai_shape_and_the_server_keeps_serving(server, path, body, param, code):
    r = _post(server, path, body)
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["code"] == code and err["param"] == param and err["type"] == "invalid_request_error"
    assert err["message"]
    ok = _post(server, "/v1/completions", {"prompt": "still here", "max_tokens": 2})
    assert ok.status_code == 200 and ok.json()["usage"]["completion_tokens"] == 2


def test_unknown_route_is_an_openai_error(server):
    r = httpx.get(f"{server.url}/v1/nothing")
    assert r.status_code == 404 and "error" in r.json()


def test_a_disconnected_client_frees_its_pages(server):
    """A stream of 1500 tokens, left after 3 chunks: the request is cancelled and its blocks freed in
    seconds (running to the end would take far longer on this box)."""
    before = server.health()["cache"]
    body = {"model": "m", "prompt": "leave early", "max_tokens": 1500, "stream": True}
    with httpx.stream("POST", f"{server.url}/v1/completions", json=body, timeout=30) as r:
        assert r.status_code == 200
        lines = r.iter_lines()  # (leaving this iterator closes the connection: keep it open while checking)
        chunks = 0
        while chunks < 3:
            chunks += next(lines).startswith("data: ")
        during = server.health()["cache"]
        assert during["requests_holding_blocks"] == 1 and during["blocks_held"] >= 1, during
        assert during["requests_cancelled"] == before["requests_cancelled"]
    # the client has closed the connection
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:
        after = server.health()["cache"]
        if after["blocks_held"] == 0 and after["requests_cancelled"] == before["requests_cancelled"] + 1:
            break
        time.sleep(0.05)
    assert after["blocks_held"] == 0 and after["requests_holding_blocks"] == 0 and after["requests_open"] == 0
    assert after["requests_cancelled"] == before["requests_cancelled"] + 1
    assert after["free_fraction"] == 1.0


def test_a_client_that_leaves_a_non_streamed_request_frees_its_pages(server):
    """uvicorn keeps running a handler whose client left; the server notices and cancels the request."""
    before = server.health()["cache"]
    # the client leaves long before 1500 tokens are done: the tiny model decodes ~1,000 tokens/s here with the
    # paged decode kernel, so a 0.3 s wait leaves a 5x margin (the old 2 s wait no longer did)
    with pytest.raises(httpx.ReadTimeout):
        _post(server, "/v1/completions", {"prompt": "wait for me", "max_tokens": 1500}, timeout=0.3)
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:
        after = server.health()["cache"]
        if after["requests_cancelled"] == before["requests_cancelled"] + 1 and after["blocks_held"] == 0:
            break
        time.sleep(0.05)
    assert after["blocks_held"] == 0 and after["requests_open"] == 0
    assert after["requests_cancelled"] == before["requests_cancelled"] + 1
