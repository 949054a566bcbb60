"""vLLM's OpenAI server with the plugin (``--additional-config '{"kivi": {...}}'``) answers a completion with
kivi's own tokens.

The server (``python -m vllm.entrypoints.openai.api_server``; the ``vllm`` console script does not start on
this CPU build) serves SmolLM2 in float32; one ``/v1/completions`` request of a 128-token prompt, greedy,
48 tokens, is compared with ``quantize_model(model, cfg).generate()`` (tokens and logprobs), and its logprobs
are checked to be KIVI's, not full precision's: the full-precision model's differ by more than the tolerance.
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request

import pytest

from tests.vllm._reference import compare_tokens, kivi_generate

pytestmark = [pytest.mark.vllm, pytest.mark.slow]  # engine runs of minutes each: KIVI_SLOW=1

KIVI = {"k_bits": 2, "v_bits": 2, "group_size": 32, "residual_length": 32}
NEW_TOKENS = 48
PROMPT = ("Once upon a time, in a small village at the edge of a great forest, there lived an old clockmaker who "
          "had never once left the valley. Every morning he opened his shop, wound the clocks on the wall, and "
          "waited for the travellers who came down the mountain road to have their watches mended. The clocks were "
          "his only company: a tall case clock from the city, a cuckoo clock with a broken wing, a ship's "
          "chronometer that still kept perfect time, and a small brass alarm clock that rang every evening at six.")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def post(url: str, body: dict) -> dict:
    req = urllib.request.Request(url, json.dumps(body).encode(), {"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=600) as r:
        return json.loads(r.read())


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    """The server's base URL and its model name; shut down (SIGTERM, then SIGKILL) after the module."""
    from kivi.models import converted_cache_path

    path, port = str(converted_cache_path("smollm2")), free_port()
    log = tmp_path_factory.mktemp("server") / "server.log"
    cmd = [sys.executable, "-m", "vllm.entrypoints.openai.api_server", "--model", path, "--host", "127.0.0.1",
           "--port", str(port), "--dtype", "float32", "--max-model-len", "512", "--enforce-eager", "--seed", "0",
           "--additional-config", json.dumps({"kivi": KIVI})]
    with open(log, "w") as out:
        proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT,
                                env=dict(os.environ, VLLM_CPU_KVCACHE_SPACE="1"))
    base = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 900
        while True:
            assert proc.poll() is None, f"the server exited ({proc.returncode}):\n{log.read_text()[-4000:]}"
            assert time.monotonic() < deadline, f"no answer on {base}/health:\n{log.read_text()[-4000:]}"
            try:
                with urllib.request.urlopen(f"{base}/health", timeout=5) as r:
                    if r.status == 200:
                        break
            except (urllib.error.URLError, ConnectionError, TimeoutError):
                time.sleep(2)
        yield base, path
    finally:
        proc.terminate()
        try:
            proc.wait(60)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
    assert proc.returncode is not None


def test_completion_is_kivis(server):
    from kivi import KiviConfig, load_model

    base, path = server
    model, tok = load_model("smollm2", dtype="float32")
    ids = tok(PROMPT)["input_ids"]
    answer = post(f"{base}/v1/completions", dict(
        model=path, prompt=ids, max_tokens=NEW_TOKENS, temperature=0, ignore_eos=True, logprobs=2,
        return_tokens_as_token_ids=True, return_token_ids=True))
    choice = answer["choices"][0]
    got = choice["token_ids"]
    assert len(got) == NEW_TOKENS == answer["usage"]["completion_tokens"]
    assert choice["text"] == tok.decode(got)
    top = [{t.removeprefix("token_id:"): lp for t, lp in d.items()} for d in choice["logprobs"]["top_logprobs"]]
    want, logprobs = kivi_generate(model, KiviConfig(**KIVI), ids, len(ids), NEW_TOKENS)
    done, _ = compare_tokens(got, top, want, logprobs)
    assert done >= NEW_TOKENS // 2
    with pytest.raises(AssertionError):  # full precision is further away than the tolerance: the server ran KIVI
        compare_tokens(got, top, *fp_generate(model, ids))


def fp_generate(model, ids: list[int]):
    """The same greedy run without kivi (transformers' own cache)."""
    import torch

    with torch.no_grad():
        out = model.generate(torch.tensor([ids]), max_new_tokens=NEW_TOKENS, min_new_tokens=NEW_TOKENS,
                             do_sample=False, return_dict_in_generate=True, output_logits=True)
    return out.sequences[0, len(ids):].tolist(), torch.log_softmax(torch.cat(out.logits).float(), dim=-1)
