"""The HTTP row of ``bench_serving.py``: the same requests sent to ``kivi serve`` by concurrent clients.

The server runs as a subprocess (``python -m kivi serve``) on a free localhost port with the row's model, pages
(``--float-cache``, or the row's ``KiviConfig`` as a ``--config`` file), budget, threads, page size and tokens per
forward. It is waited for (``GET /health``) and stopped with SIGINT (SIGKILL after 15 s) whatever happens. Each
client (a thread with its own ``httpx`` client) takes the next request and streams ``POST /v1/completions`` with
the prompt as token ids, ``temperature`` 0 (greedy), ``max_tokens`` = the request's new tokens and
``ignore_eos`` (as the batch rows, which run with no EOS).

A checkout whose kivi serve has no ``ignore_eos`` / ``--page-size`` (``--kivi-root-before`` an older one) is
served without them: its requests may end at the model's EOS. Either way the row counts the tokens from each
response's ``usage`` and fails, naming the request, when one got fewer than it asked for, so every row it
reports generated exactly the requested tokens.
"""

from __future__ import annotations

import json
import os
import queue
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

from serving_rows import Workload, summary

#: kivi serve's page size without --page-size (a checkout from before the option has only this one)
SERVER_PAGE_SIZE = 256


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Server:
    """``python -m kivi serve ARGS`` on a free localhost port, as a context manager: entered once ``/health``
    answers 200, stopped on exit (SIGINT, then SIGKILL). Its output goes to a temporary file (a pipe nobody
    reads could fill and block it); :attr:`output` holds it after the stop."""

    def __init__(self, args: list[str], *, env: dict[str, str] | None = None, start_timeout: float = 600.0,
                 cwd: str | None = None) -> None:
        self.args, self.env, self.start_timeout, self.cwd = args, env or {}, start_timeout, cwd
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.output = ""
        self.returncode: int | None = None

    def __enter__(self) -> "Server":
        import httpx

        self._log = tempfile.TemporaryFile(mode="w+")
        self.proc = subprocess.Popen([sys.executable, "-m", "kivi", "serve", "--port", str(self.port), *self.args],
                                     env={**os.environ, **self.env}, stdout=self._log, stderr=subprocess.STDOUT,
                                     text=True, cwd=self.cwd)
        try:
            deadline = time.monotonic() + self.start_timeout
            while True:
                if self.proc.poll() is not None:
                    raise RuntimeError(f"kivi serve exited with {self.proc.returncode} before it answered")
                try:
                    if httpx.get(f"{self.url}/health", timeout=2.0).status_code == 200:
                        return self
                except httpx.HTTPError:
                    pass
                if time.monotonic() > deadline:
                    raise RuntimeError(f"kivi serve did not answer /health within {self.start_timeout:.0f} s")
                time.sleep(0.2)
        except BaseException as e:
            self.stop()
            raise RuntimeError(f"{e}:\n{self.output[-3000:]}") from None

    def __exit__(self, *exc) -> None:
        self.stop()

    def stop(self, timeout: float = 15.0) -> int:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGINT)
            try:
                self.proc.wait(timeout=timeout)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self._log.seek(0)
        self.output = self._log.read()
        self._log.close()
        self.returncode = self.proc.returncode
        return self.returncode

    def health(self) -> dict:
        import httpx

        return httpx.get(f"{self.url}/health", timeout=5.0).json()


#: how often a row asks ``/health`` how many requests hold blocks: each poll is a request the server and the
#: client process (on the same cores here) pay for; every request lives for seconds, so 0.5 s sees them all
HELD_POLL_S = 0.5


def serve_features(kivi_root: str | None) -> set[str]:
    """What the kivi serve of checkout ``kivi_root`` (None: this one) takes of ``ignore_eos`` (a request
    field) and ``page_size`` (``--page-size``): read from its source, so an older checkout still runs."""
    root = Path(kivi_root) if kivi_root is not None else Path(__file__).resolve().parent.parent
    params = (root / "kivi" / "serving" / "params.py").read_text()
    serve = (root / "kivi" / "cli" / "serve.py").read_text()
    found = (("ignore_eos", '"ignore_eos"' in params), ("page_size", '"--page-size"' in serve))
    return {name for name, present in found if present}


def server_args(model: str, cfg, budget: int, max_new_tokens: int, threads: int, max_batch_tokens: int | None,
                folder: Path, page_size: int | None = None) -> list[str]:
    """kivi serve's options for a row: ``cfg`` None is ``--float-cache``, else written to ``folder`` as JSON;
    ``page_size`` None: the server's default."""
    args = ["--model", model, "--cache-memory", str(budget), "--max-new-tokens", str(max_new_tokens),
            "--threads", str(threads)]
    if page_size is not None:
        args += ["--page-size", str(page_size)]
    if max_batch_tokens is not None:
        args += ["--max-batch-tokens", str(max_batch_tokens)]
    if cfg is None:
        return [*args, "--float-cache"]
    path = folder / "kivi_config.json"
    cfg.to_json(path)
    return [*args, "--config", str(path)]


def stream_completion(client, url: str, prompt: list[int], max_tokens: int, t0: float, *,
                      ignore_eos: bool = True) -> dict:
    """One streamed greedy completion: seconds (from ``t0``) of its first and last text piece, its usage, its
    finish reason and text."""
    body = {"model": "bench", "prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "stream": True}
    if ignore_eos:
        body["ignore_eos"] = True
    first = last = None
    usage, finish, text = None, None, []
    with client.stream("POST", f"{url}/v1/completions", json=body) as r:
        if r.status_code != 200:
            raise RuntimeError(f"kivi serve answered {r.status_code}: {r.read().decode(errors='replace')[:500]}")
        for line in r.iter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            event = json.loads(line[len("data: "):])
            if "error" in event:
                raise RuntimeError(f"kivi serve failed the request: {event['error']}")
            choice = (event.get("choices") or [{}])[0]
            if choice.get("text"):
                now = time.perf_counter() - t0
                first = now if first is None else first
                last = now
                text.append(choice["text"])
            finish = choice.get("finish_reason") or finish
            usage = event.get("usage") or usage
    if usage is None:
        raise RuntimeError("kivi serve's stream ended without usage")
    return {"first_s": first, "last_s": last, "usage": usage, "finish_reason": finish, "text": "".join(text)}


def send_all(url: str, work: Workload, clients: int, t0: float, timeout: float, *,
             ignore_eos: bool = True) -> list[dict]:
    """Every request of ``work`` through ``clients`` concurrent clients (each takes the next request)."""
    import httpx

    todo: queue.Queue = queue.Queue()
    for i in range(len(work.prompts)):
        todo.put(i)
    results: list[dict | None] = [None] * len(work.prompts)
    errors: list[BaseException] = []

    def client_loop() -> None:
        with httpx.Client(timeout=timeout) as client:
            while not errors:
                try:
                    i = todo.get_nowait()
                except queue.Empty:
                    return
                try:
                    results[i] = stream_completion(client, url, work.prompts[i], work.new_tokens[i], t0,
                                                   ignore_eos=ignore_eos)
                except BaseException as e:  # reported below, after every client has stopped
                    errors.append(RuntimeError(f"request {i}: {e}"))

    threads = [threading.Thread(target=client_loop, name=f"bench-client-{k}") for k in range(clients)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    if errors:
        raise errors[0]
    return results


def _watch_held(server: Server, stop: threading.Event, seen: list[int], every: float = HELD_POLL_S) -> None:
    """The largest ``requests_holding_blocks`` in ``/health`` (polled every ``every`` s) until ``stop``."""
    while not stop.is_set():
        try:
            seen.append(server.health()["cache"]["requests_holding_blocks"])
        except Exception:  # noqa: BLE001 (a poll that fails is not a measurement; the requests tell the errors)
            pass
        stop.wait(every)


def check_counts(work: Workload, results: list[dict]) -> None:
    """Every request got the prompt tokens it sent and the new tokens it asked for (``usage``), else
    ``RuntimeError`` naming the first that did not."""
    short = [(i, r["usage"]["completion_tokens"], r["finish_reason"]) for i, r in enumerate(results)
             if r["usage"]["completion_tokens"] != work.new_tokens[i]]
    if short:
        i, got, why = short[0]
        raise RuntimeError(f"request {i} got {got} of {work.new_tokens[i]} tokens (finish_reason {why!r}): a kivi "
                           f"serve without ignore_eos needs requests that do not reach EOS "
                           f"({len(short)} of {len(results)} did not get their tokens)")
    for i, r in enumerate(results):
        if r["usage"]["prompt_tokens"] != len(work.prompts[i]):
            raise RuntimeError(f"request {i}: kivi serve counted {r['usage']['prompt_tokens']} prompt tokens, "
                               f"sent {len(work.prompts[i])}")


def http_row(model: str, cfg, work: Workload, budget: int, *, clients: int, threads: int,
             max_batch_tokens: int | None, timeout: float = 7200.0, kivi_root: str | None = None,
             page_size: int = SERVER_PAGE_SIZE) -> dict:
    """The requests of ``work`` sent at once to a fresh ``kivi serve`` by ``clients`` concurrent clients, after an
    untimed warm-up request (the first 300 prompt tokens reversed, so no page of it is shared with a timed one)."""
    env = {"OMP_NUM_THREADS": str(threads)}
    if kivi_root is not None:
        env["PYTHONPATH"] = os.pathsep.join([kivi_root, *filter(None, [os.environ.get("PYTHONPATH")])])
    features = serve_features(kivi_root)
    if page_size != SERVER_PAGE_SIZE and "page_size" not in features:
        raise RuntimeError(f"the kivi serve of {kivi_root} has no --page-size: it serves {SERVER_PAGE_SIZE}-token "
                           f"pages only, not {page_size}")
    ignore_eos = "ignore_eos" in features
    with tempfile.TemporaryDirectory() as folder:
        args = server_args(model, cfg, budget, max(work.new_tokens), threads, max_batch_tokens, Path(folder),
                           page_size if "page_size" in features else None)
        # ``python -m`` imports from its working directory first: the checkout's, so its kivi is the one served
        with Server(args, env=env, cwd=kivi_root) as server:
            warm = Workload("warmup", [work.prompts[0][:300][::-1]], [3])
            send_all(server.url, warm, 1, time.perf_counter(), timeout, ignore_eos=ignore_eos)
            blocks = server.health()["cache"]["blocks_total"]
            stop, held = threading.Event(), [0]
            watcher = threading.Thread(target=_watch_held, args=(server, stop, held), daemon=True)
            watcher.start()
            t0 = time.perf_counter()
            try:
                results = send_all(server.url, work, clients, t0, timeout, ignore_eos=ignore_eos)
            finally:
                wall = time.perf_counter() - t0
                stop.set()
                watcher.join()
    check_counts(work, results)
    counts = [r["usage"]["completion_tokens"] for r in results]
    ttft = [r["first_s"] for r in results if r["first_s"] is not None]
    tpot = [(r["last_s"] - r["first_s"]) / (n - 1) for r, n in zip(results, counts)
            if n > 1 and r["first_s"] is not None and r["last_s"] > r["first_s"]]
    row = summary(ttft, tpot, sum(counts), work.prompts, wall)
    row.update({"requests_held_at_once": max(held), "cache_blocks": blocks, "clients": clients,
                "completion_tokens": counts, "requested_tokens": list(work.new_tokens),
                "finish_reasons": [r["finish_reason"] for r in results],
                "settings": {"max_batch_tokens": 512 if max_batch_tokens is None else max_batch_tokens,
                             "scheduler": "fifo", "page_size": page_size, "ignore_eos": ignore_eos,
                             "server": "kivi serve, /v1/completions, streamed"},
                "texts": [r["text"] for r in results]})
    return row
