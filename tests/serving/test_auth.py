"""kivi.serving.auth: what an API key may hold, and the 401 that comes before routing (in-process, httpx's ASGI
transport), and a client that leaves while sending its body (uvicorn on a thread, a raw socket)."""

from __future__ import annotations

import asyncio
import logging
import socket
import threading
import time

import pytest

httpx = pytest.importorskip("httpx")
pytest.importorskip("fastapi")

from kivi.batching import init_continuous_batching  # noqa: E402
from kivi.serving.app import build_app  # noqa: E402
from kivi.serving.auth import api_key_problem, check_api_key  # noqa: E402
from kivi.serving.engine import Engine  # noqa: E402
from tests.serving.server import tiny_chat_model, tiny_tokenizer  # noqa: E402

KEY = "s3cret-KEY_~!"


@pytest.fixture(scope="module")
def engine():
    e = Engine(tiny_chat_model(), tiny_tokenizer(), None, cache_memory=2**20, max_new_tokens=8,
               factory=init_continuous_batching)
    yield e
    e.stop()


@pytest.mark.parametrize("key", ["clé", "ключ", "key with space", "tab\there", "nul\x00", "del\x7f", "emoji🔑"])
def test_a_key_outside_printable_ascii_is_refused(engine, key):
    problem = api_key_problem(key)
    assert problem is not None and "printable ASCII" in problem and "\n" not in problem
    with pytest.raises(ValueError, match="printable ASCII"):
        check_api_key(key)
    with pytest.raises(ValueError, match="printable ASCII"):
        build_app(engine, model_name="m", api_key=key)


def test_printable_ascii_keys_pass():
    assert check_api_key(KEY) == KEY and check_api_key(None) is None
    assert api_key_problem("".join(map(chr, range(0x21, 0x7F)))) is None
    assert api_key_problem("") == "is empty"


def _requests(engine, api_key, calls):
    async def run():
        app = build_app(engine, model_name="m", api_key=api_key)
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://test",
                                     timeout=30) as c:
            return [await c.request(method, path, headers=headers) for method, path, headers in calls]

    return asyncio.run(run())


@pytest.mark.parametrize(("method", "path"), [("HEAD", "/v1/models"), ("OPTIONS", "/v1/completions"),
                                              ("GET", "/v1/models/"), ("PUT", "/v1/chat/completions"),
                                              ("GET", "/v1/nope"), ("GET", "/docs")])
def test_the_key_is_checked_before_routing(engine, method, path):
    """Without the key, any method and any path but /health gets the 401 (not 405, 307 or 404 first); with it,
    the router answers as it would without a key."""
    bearer = {"Authorization": f"Bearer {KEY}"}
    (without, wrong, with_key), (open_,) = (
        _requests(engine, KEY, [(method, path, {}), (method, path, {"Authorization": "Bearer nope"}),
                                (method, path, bearer)]),
        _requests(engine, None, [(method, path, {})]))
    for r in (without, wrong):
        assert r.status_code == 401 and r.headers["www-authenticate"] == "Bearer", (r.status_code, r.text)
        if method != "HEAD":
            assert r.json()["error"]["code"] == "invalid_api_key"
    assert with_key.status_code == open_.status_code != 401


def test_health_stays_open_and_the_key_opens_v1(engine):
    health, head, models = _requests(engine, KEY, [("GET", "/health", {}), ("HEAD", "/health", {}),
                                                   ("GET", "/v1/models", {"Authorization": f"bearer  {KEY} "})])
    assert health.status_code == head.status_code == 200 and models.json()["data"][0]["id"] == "m"


def test_a_client_that_leaves_mid_body_logs_no_traceback(engine, caplog):
    """Headers and part of a body, then the socket closes: at most one log line per client, no traceback
    (it was a ~60-line ClientDisconnect traceback each); the server keeps serving."""
    uvicorn = pytest.importorskip("uvicorn")
    app = build_app(engine, model_name="m")
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    sock.listen()
    port = sock.getsockname()[1]
    server = uvicorn.Server(uvicorn.Config(app, log_config=None, log_level="info", lifespan="off"))
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True)
    with caplog.at_level(logging.INFO):
        thread.start()
        try:
            deadline = time.monotonic() + 30
            while not server.started and time.monotonic() < deadline:
                time.sleep(0.05)
            caplog.clear()
            clients = 5
            for _ in range(clients):
                with socket.create_connection(("127.0.0.1", port)) as c:
                    c.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                              b"Content-Length: 1000\r\n\r\n{\"prompt\": \"abc\", ")
                    time.sleep(0.3)  # the handler is reading the body
            time.sleep(1.0)
            during = list(caplog.records)  # what the 5 clients made the server log
            assert httpx.get(f"http://127.0.0.1:{port}/health", timeout=10).status_code == 200
        finally:
            server.should_exit = True
            thread.join(timeout=30)
            sock.close()
    lines = [line for r in during for line in (r.getMessage() + "\n" + (r.exc_text or "")).splitlines()
             if line.strip()]
    assert not any(r.exc_info for r in during), lines
    assert len(lines) <= clients and all("Traceback" not in line for line in lines), lines
