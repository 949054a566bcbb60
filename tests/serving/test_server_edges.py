"""`kivi serve` at its edges (a subprocess, as in test_server.py): requests that used to stop the
generation loop, bodies that used to reach a 500 or hold up the event loop, routes and fields."""

from __future__ import annotations

import json
import threading
import time

import pytest

httpx = pytest.importorskip("httpx")

from tests.serving.server import tiny_tokenizer  # noqa: E402


def _post(server, body, path="/v1/completions", timeout=60.0, **kw):
    content = body if isinstance(body, (str, bytes)) else json.dumps(body)
    return httpx.post(f"{server.url}{path}", content=content, headers={"Content-Type": "application/json"},
                      timeout=timeout, **kw)


def _assert_openai_error(r, status, code, param=None):
    assert r.status_code == status, r.text
    err = r.json()["error"]
    assert err["code"] == code and err["param"] == param and err["message"] and err["type"], err


def test_tiny_temperatures_are_greedy_and_the_server_keeps_serving(server, reference):
    """1e-300 is 0 in float32 and 1e-40 overflows the logits: both used to end in a nan multinomial, a 500,
    and a 503 for every later request. They are greedy now; 5 more requests follow, /health stays ok."""
    ids = tiny_tokenizer()("Tiny t")["input_ids"]
    for t in (1e-300, 1e-40, 5e-324):
        r = _post(server, {"prompt": ids, "max_tokens": 8, "temperature": t})
        assert r.status_code == 200, r.text
        assert r.json()["choices"][0]["text"] == reference(ids, 8)
    for k in range(5):
        r = _post(server, {"prompt": f"then {k}", "max_tokens": 3, "temperature": 0.8, "top_p": 1e-300})
        assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 3, r.text
    h = server.health()
    assert h["status"] == "ok" and h["cache"]["requests_failed"] == 0


@pytest.mark.parametrize(("body", "path", "param"), [
    ('{"messages": ' + "[" * 100_000 + "]" * 100_000 + "}", "/v1/chat/completions", None),
    ('{"prompt": "a", "temperature": NaN}', "/v1/completions", None),
    ('{"prompt": "a", "max_tokens": Infinity}', "/v1/completions", None),
    ('{"prompt": "a", "max_tokens": ' + "9" * 5000 + "}", "/v1/completions", None),
    (b'{"prompt": "\xff"}', "/v1/completions", None),
], ids=["nested-100000", "nan", "infinity", "int-5000-digits", "not-utf8"])
def test_bodies_that_are_not_json_get_a_400(server, body, path, param):
    _assert_openai_error(_post(server, body, path), 400, "invalid_json", param)
    assert _post(server, {"prompt": "ok", "max_tokens": 1}).status_code == 200


@pytest.mark.parametrize(("body", "param"), [
    ({"prompt": "a\ud800b"}, "prompt"),
    ({"messages": [{"role": "user", "content": "\udc00"}]}, "messages[0].content"),
    ({"prompt": "a", "n": True}, "n"),
    ({"prompt": "a", "n": 1.0}, "n"),
    ({"messages": [{"role": "user", "content": "x", "name": 7}]}, "messages[0].name"),
    ({"messages": [{"role": "user", "content": "x", "name": ""}]}, "messages[0].name"),
    # the tiny template shows no names: a name would be dropped
    ({"messages": [{"role": "user", "content": "x", "name": "ann"}]}, "messages[0].name"),
], ids=["surrogate-prompt", "surrogate-content", "n-true", "n-float", "name-int", "name-empty", "name-unused"])
def test_fields_that_were_accepted_or_crashed_get_a_400(server, body, param):
    path = "/v1/chat/completions" if "messages" in body else "/v1/completions"
    r = _post(server, json.dumps(body), path)
    assert r.status_code == 400, r.text
    assert r.json()["error"]["param"] == param


def test_a_body_over_the_limit_gets_a_413_before_it_is_read(server):
    big = json.dumps({"prompt": "x" * (5 * 2**20)})  # the default --max-body-size is 4MiB
    _assert_openai_error(_post(server, big), 413, "request_too_large")

    def chunks():  # no Content-Length: counted while reading
        for _ in range(5):
            yield b" " * 2**20
    r = httpx.post(f"{server.url}/v1/completions", content=chunks(), timeout=60)
    _assert_openai_error(r, 413, "request_too_large")
    assert server.health()["status"] == "ok"


def test_a_prompt_longer_than_the_context_can_hold_is_refused_before_tokenizing(server):
    """3 MiB of prompt text (under the body limit): refused from its length, while /health answers at once."""
    answered = {}

    def health_meanwhile():
        time.sleep(0.05)
        t0 = time.monotonic()
        server.health()
        answered["health_s"] = time.monotonic() - t0

    t = threading.Thread(target=health_meanwhile)
    t0 = time.monotonic()
    t.start()
    r = _post(server, {"prompt": "a" * (3 * 2**20)})
    took = time.monotonic() - t0
    t.join()
    _assert_openai_error(r, 400, "context_length_exceeded", "prompt")
    assert "characters" in r.json()["error"]["message"]
    assert answered["health_s"] < 2.0 and took < 10.0, (answered, took)


def test_routes(server):
    assert httpx.head(f"{server.url}/health").status_code == 200
    for path in ("/openapi.json", "/docs", "/redoc"):
        r = httpx.get(f"{server.url}{path}")
        assert r.status_code == 404 and "error" in r.json(), path
