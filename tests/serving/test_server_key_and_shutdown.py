"""`kivi serve` with an API key (from $KIVI_API_KEY), and its end on Ctrl-C with a stream open."""

from __future__ import annotations

import json
import signal
import time

import pytest

openai = pytest.importorskip("openai")
httpx = pytest.importorskip("httpx")

from tests.serving.conftest import SERVE_ARGS  # noqa: E402
from tests.serving.server import ServeProcess  # noqa: E402

KEY = "s3cret-kivi-key"
GRACE_S = 0.5


@pytest.fixture(scope="module")
def keyed_server(checkpoint):
    pytest.importorskip("fastapi")
    proc = ServeProcess(["--model", str(checkpoint), *SERVE_ARGS, "--shutdown-timeout", str(GRACE_S)],
                        env={"KIVI_API_KEY": KEY})
    yield proc
    proc.stop()


@pytest.mark.parametrize("headers", [{}, {"Authorization": "Bearer wrong"}, {"Authorization": KEY},
                                     {"Authorization": f"Basic {KEY}"}, {"Authorization": f"Bearer {KEY}x"}],
                         ids=["none", "wrong", "no-scheme", "basic", "longer"])
@pytest.mark.parametrize(("method", "path"), [("POST", "/v1/completions"), ("POST", "/v1/chat/completions"),
                                              ("GET", "/v1/models")])
def test_v1_routes_want_the_key(keyed_server, headers, method, path):
    body = {"prompt": "a", "messages": [{"role": "user", "content": "a"}], "max_tokens": 1}
    r = httpx.request(method, f"{keyed_server.url}{path}", headers=headers, timeout=30,
                      json=body if method == "POST" else None)
    assert r.status_code == 401, r.text
    err = r.json()["error"]
    assert err["code"] == "invalid_api_key" and err["type"] == "invalid_request_error" and "--api-key" in err["message"]
    assert r.headers["www-authenticate"] == "Bearer"


def test_the_key_opens_them_and_health_stays_open(keyed_server):
    c = openai.OpenAI(base_url=f"{keyed_server.url}/v1", api_key=KEY, max_retries=0, timeout=60)
    assert c.completions.create(model="m", prompt="abc", max_tokens=3).usage.completion_tokens == 3
    assert [m.id for m in c.models.list().data] == ["tiny-kivi"]
    assert httpx.get(f"{keyed_server.url}/health").json()["status"] == "ok"
    with pytest.raises(openai.AuthenticationError):
        openai.OpenAI(base_url=f"{keyed_server.url}/v1", api_key="nope", max_retries=0).models.list()


def test_ctrl_c_ends_an_open_stream_with_an_error_event_and_exits_130(keyed_server):
    """The stream runs on for the --shutdown-timeout, then ends with an OpenAI error event and [DONE]
    (not a cut connection); the process exits 130 with one line after its banner."""
    body = {"model": "m", "prompt": "keep going", "max_tokens": 2000, "stream": True}
    events = []
    with httpx.stream("POST", f"{keyed_server.url}/v1/completions", json=body, timeout=30,
                      headers={"Authorization": f"Bearer {KEY}"}) as r:
        assert r.status_code == 200
        lines = (line for line in r.iter_lines() if line.startswith("data: "))
        events += [next(lines) for _ in range(3)]
        keyed_server.proc.send_signal(signal.SIGINT)
        t0 = time.monotonic()
        events += list(lines)
        ended_after = time.monotonic() - t0
    assert events[-1] == "data: [DONE]"
    error = json.loads(events[-2][len("data: "):])["error"]
    assert error["code"] == "server_shutting_down" and error["type"] == "server_error", error
    assert all("error" not in json.loads(e[6:]) for e in events[:-2])
    assert len(events) > 5 and GRACE_S * 0.8 <= ended_after < GRACE_S + 10, (len(events), ended_after)
    keyed_server.proc.wait(timeout=30)  # (a second SIGINT from stop() would cut the shutdown short)
    keyed_server.stop_cleanly()
