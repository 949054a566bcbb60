"""Fuzz (hypothesis): random JSON bodies, valid-ish and not, for /v1/completions and /v1/chat/completions
of a running `kivi serve` -> a 200 (a stream without an error event) or an OpenAI-shaped 4xx, never a
5xx; afterwards the server is healthy, holds no block and has failed no request.

Numbers come from the edges of every range the server checks (temperature [0, 2], top_p (0, 1],
max_tokens >= 1 and the server's cap, token ids and the vocabulary, n = 1): 0, -0.0, the smallest
subnormal, 1e-300, 1e-40, just below and above each bound, 1e308, huge and negative integers, bools
for integers, numbers as strings, and NaN / Infinity literals (Python's json writes them; they are
not JSON). Strings include lone surrogates (``\\ud800``, which JSON can spell).
"""

from __future__ import annotations

import json
import math
import os
import time

import pytest

httpx = pytest.importorskip("httpx")
from hypothesis import HealthCheck, given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402

from tests.serving.server import CHARS, ServeProcess  # noqa: E402

MAX_EXAMPLES = int(os.environ.get("KIVI_FUZZ_EXAMPLES", 150))  # per endpoint; more for a one-off deep run
MAX_NEW = 8  # the server's --max-new-tokens: a request that passes generates at most this many tokens
VOCAB = len(CHARS) + 2

EDGE_NUMBERS = [0, -0.0, 1, -1, 2, 3, 0.5, 1.0, 2.0, 2.0000000000000004, 0.9999999999999999, 1.0000000000000002,
                5e-324, 1e-300, 1e-40, 1e-5, 9.99e-6, 1e308, -1e308, 1.7976931348623157e308, float("nan"),
                float("inf"), float("-inf"), MAX_NEW, MAX_NEW + 1, 4095, 4096, 2**31, 2**63, 10**30, -(10**30),
                VOCAB - 1, VOCAB, True, False]
NUMBER_STRINGS = ["inf", "nan", "NaN", "-Infinity", "1", "0.5", "", "1e-300"]
SURROGATES = ["\ud800", "a\udfffb", "\udc00\ud800"]

numbers = st.one_of(st.sampled_from(EDGE_NUMBERS), st.integers(), st.floats(), st.floats(-3, 3))
texts = st.one_of(st.text(alphabet=CHARS, max_size=12), st.text(max_size=8), st.sampled_from(SURROGATES))
scalars = st.one_of(st.none(), numbers, texts, st.sampled_from(NUMBER_STRINGS))
anything = st.recursive(scalars, lambda inner: st.one_of(st.lists(inner, max_size=3),
                                                         st.dictionaries(texts, inner, max_size=3)), max_leaves=6)


in_range = {  # values each check must accept, its bounds included
    "max_tokens": st.integers(1, MAX_NEW),
    "temperature": st.one_of(st.floats(0, 2), st.sampled_from([0, 5e-324, 1e-300, 1e-40, 9.99e-6, 1e-5, 2])),
    "top_p": st.one_of(st.floats(0, 1, exclude_min=True), st.sampled_from([5e-324, 1e-300, 1e-40, 1])),
    "stop": st.one_of(st.text(alphabet=CHARS, min_size=1, max_size=3),
                      st.lists(st.text(alphabet=CHARS, min_size=1, max_size=3), max_size=4)),
    "stream": st.booleans(), "n": st.just(1), "user": st.text(max_size=5), "model": st.text(max_size=5),
    "stream_options": st.just({"include_usage": True}),
}
prompts = st.one_of(st.text(alphabet=CHARS, min_size=1, max_size=12),
                    st.lists(st.integers(0, VOCAB - 1), min_size=1, max_size=6))
messages = st.lists(st.fixed_dictionaries(
    {"role": st.sampled_from(["user", "system", "assistant", "developer", "tool"]),
     "content": st.one_of(st.text(alphabet=CHARS, max_size=10),
                          st.lists(st.fixed_dictionaries({"type": st.just("text"), "text": texts}), max_size=2))}),
    min_size=1, max_size=3)
COMPLETION = {"prompt": prompts, "echo": st.just(False), "suffix": st.just("")}
CHAT = {"messages": messages, "max_completion_tokens": st.integers(1, MAX_NEW)}
EXTRA_FIELDS = ["seed", "logprobs", "tools", "best_of", "n", "max_tokens", "temperature", "top_p", "stream", "stop"]


def _bodies(fields: dict, required: str):
    """A valid body, the same with 1-2 fields set to edge numbers or anything, or anything at all."""
    valid = st.fixed_dictionaries({required: fields[required]},
                                  optional={**in_range, **{k: v for k, v in fields.items() if k != required}})
    broken = st.dictionaries(st.one_of(st.sampled_from([*fields, *in_range, *EXTRA_FIELDS]), texts),
                             st.one_of(numbers, st.sampled_from(NUMBER_STRINGS), anything), min_size=1, max_size=2)
    return st.one_of(valid, valid, st.builds(lambda b, m: {**b, **m}, valid, broken), anything)


#: a fuzz of valid-ish bodies must have this many of its requests served (200): not a fuzz of refusals only
MIN_SERVED = MAX_EXAMPLES // 10


@pytest.fixture(scope="module")
def fuzz_server(checkpoint):
    pytest.importorskip("fastapi")
    proc = ServeProcess(["--model", str(checkpoint), "--float-cache", "--cache-memory", "2MiB", "--max-new-tokens",
                         str(MAX_NEW), "--max-batch-tokens", "256", "--threads", "1"])
    proc.client = httpx.Client(base_url=proc.url, timeout=60)
    yield proc
    proc.client.close()
    proc.stop_cleanly()


def _check_answer(r: httpx.Response, raw: str, answers: dict[int, int]) -> None:
    text = r.read().decode()
    answers[r.status_code] = answers.get(r.status_code, 0) + 1
    assert r.status_code < 500, f"{r.status_code} for {raw[:300]!r}: {text[:500]}"
    if r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream"):
        events = [line[6:] for line in text.splitlines() if line.startswith("data: ")]
        assert events[-1] == "[DONE]" and all("error" not in json.loads(e) for e in events[:-1]), (raw, text)
    elif r.status_code == 200:
        assert json.loads(text)["usage"]["completion_tokens"] <= MAX_NEW
    else:
        assert 400 <= r.status_code < 500
        err = json.loads(text)["error"]
        assert isinstance(err["message"], str) and err["message"] and isinstance(err["type"], str), text
        assert {"param", "code"} <= set(err), text


def _post(server, path: str, raw: bytes | str, answers: dict[int, int], shown: str) -> None:
    with server.client.stream("POST", path, content=raw, headers={"Content-Type": "application/json"}) as r:
        _check_answer(r, shown, answers)


def _json(body) -> str:
    return json.dumps(body, allow_nan=True)  # NaN / Infinity literals as Python writes them (the server refuses them)


def _assert_healthy(server, answers: dict[int, int], served: int) -> None:
    """After a fuzz: the server is up, holds no block, has failed no request, and served at least ``served`` of
    the fuzz's requests. Each fuzz test checks this itself (xdist may run the tests of this module in different
    workers, each with its own server)."""
    deadline = time.monotonic() + 10
    while True:
        h = server.health()
        if h["cache"]["requests_open"] == 0 or time.monotonic() > deadline:
            break
        time.sleep(0.05)
    c = h["cache"]
    print(f"fuzz answers by status: {dict(sorted(answers.items()))}; cache: {c}")
    assert h["status"] == "ok" and c["requests_open"] == 0 and c["blocks_held"] == 0, h
    assert c["requests_failed"] == 0 and answers.get(200, 0) >= served, (answers, h)


SETTINGS = settings(max_examples=MAX_EXAMPLES, deadline=None, database=None,
                    suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture,
                                           HealthCheck.data_too_large])


def _fuzz_bodies(server, path: str, bodies) -> None:
    answers: dict[int, int] = {}

    @SETTINGS
    @given(body=bodies)
    def run(body):
        raw = _json(body)
        _post(server, path, raw, answers, raw)

    run()
    _assert_healthy(server, answers, MIN_SERVED)


@pytest.mark.long  # ~9 s: the body fuzzer (tests/serving/test_server*.py name each refusal)
def test_fuzz_completion_bodies(fuzz_server):
    _fuzz_bodies(fuzz_server, "/v1/completions", _bodies(COMPLETION, "prompt"))


@pytest.mark.long  # ~8 s: the body fuzzer
def test_fuzz_chat_bodies(fuzz_server):
    _fuzz_bodies(fuzz_server, "/v1/chat/completions", _bodies(CHAT, "messages"))


def test_fuzz_raw_bytes(fuzz_server):
    answers: dict[int, int] = {}

    @settings(max_examples=MAX_EXAMPLES // 3, deadline=None, database=None,
              suppress_health_check=[HealthCheck.too_slow])
    @given(raw=st.one_of(st.binary(max_size=40), st.text(max_size=40).map(str.encode)),
           path=st.sampled_from(["/v1/completions", "/v1/chat/completions"]))
    def run(raw, path):
        _post(fuzz_server, path, raw, answers, repr(raw))

    run()
    _assert_healthy(fuzz_server, answers, 0)


def test_edge_numbers_cover_every_range():
    """The edge list holds a value on each side of every bound the server checks (kept honest here)."""
    finite = [x for x in EDGE_NUMBERS if not isinstance(x, bool) and math.isfinite(x)]
    for bound in (0, 1, 2, MAX_NEW, VOCAB):
        assert any(x < bound for x in finite) and any(x > bound for x in finite) and bound in finite
