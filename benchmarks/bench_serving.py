"""Serving throughput in a fixed cache budget: transformers' continuous batching with its float paged cache vs
KIVI pages (2/2 and ``balanced``), and the same requests served one at a time by ``generate()``.

Every continuous-batching row gets the same byte budget (each of ``--budgets``; by default what the float
cache needs to hold ``--fp-requests`` of the longest requests at once, also written ``fp:N``) and the same
requests, all submitted at once, greedy, no EOS; ``--rows NAME@BUDGET`` runs a row at its own budget only,
so one run (same load, same-run ratios) can hold a tight and a roomy budget. Workloads:

* ``uniform``: ``--requests`` random-id prompts of ``--prompt-len`` tokens (independent, or
  ``--shared-prefix F``: the first ``F`` of every prompt is one common prefix), ``--new-tokens`` each;
* ``decode-heavy``: ``--requests`` prompts of WikiText-2 text with lengths spread over ``--prompt-range``
  and new tokens over ``--new-range`` (default 512-4096 and 128-256), more requests than the default
  budget's float pages hold.

``--baselines dynamic kivi-2/2`` adds the one-at-a-time rows: each request through ``model.generate()``
(DynamicCache, or a ``quantize_model``-ed model), one after another, all counted as submitted at the start.
Columns: generated tokens/s (the headline), tokens/s with the prompts, p50/p95 time to first token,
p50/p95 per-token latency (a request's decode time / its tokens after the first), requests held at once
(sampled every 20 ms) and the budget's capacity for the longest request, prompt tokens served from shared
pages. ``--max-batch-tokens`` and ``--scheduler`` take several values: every row runs under each (default:
kivi's defaults). Each row runs in a fresh process (``--same-process``: all in this one). ``--plot F.png``:
generated tokens/s vs budget.

``--http ROW[@BUDGET]`` adds rows served over HTTP by ``kivi serve`` (a fresh server
subprocess, ``--http-clients`` concurrent streaming clients, tokens counted from each response's usage and
checked equal to the request's). ``--kivi-root-before DIR`` runs every batch and HTTP row a second time with
kivi imported from the checkout ``DIR`` (two checkouts compared in one run; a batch row then reports whether its
greedy tokens equal the ``DIR`` row's, ``same_tokens_as_before``).

    OMP_NUM_THREADS=2 python benchmarks/bench_serving.py --model smollm2 --workload decode-heavy --requests 12 \\
        --budgets 400MiB 800MiB 1600MiB --baselines dynamic kivi-2/2 --threads 2 \\
        --out results/serving/serving_decode_heavy_smollm2.json --plot results/serving/serving_decode_heavy_smollm2.png
    OMP_NUM_THREADS=1 python benchmarks/bench_serving.py --model smollm2 --requests 16 --prompt-len 1024 \\
        --new-tokens 64 --fp-requests 4 --threads 1 --out results/serving/serving_smollm2.json
    OMP_NUM_THREADS=2 python benchmarks/bench_serving.py --model smollm2 --requests 8 --prompt-len 512 \\
        --new-tokens 128 --shared-prefix 0 --threads 2 --check-single 0 --baselines kivi-2/2 \\
        --rows kivi-2/2@1GiB float@fp:2 kivi-2/2@fp:2 float@1GiB --http kivi-2/2@1GiB float@1GiB \\
        --out results/serving/serving_8x512_128.json

The file's parts: the workloads and rows, the HTTP row, the report (table and plot), then the command line.
"""

from __future__ import annotations

import argparse
import itertools
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
from dataclasses import dataclass
from pathlib import Path
from typing import NamedTuple

import torch
from transformers import GenerationConfig

#: the checkout whose kivi a row imports (``--kivi-root-before`` sets it in a row's fresh process)
KIVI_ROOT_ENV = "KIVI_ROOT"
sys.path.insert(0, os.environ.get(KIVI_ROOT_ENV) or str(Path(__file__).resolve().parent.parent))

from common import command_line, environment, run_fresh, set_threads, write_json, write_text_file  # noqa: E402
from kivi import KiviConfig  # noqa: E402
from kivi.batching import build_layout, fp_block_bytes, generate_batch, init_continuous_batching  # noqa: E402
from kivi.memory.units import parse_bytes  # noqa: E402

# ============================== workloads and rows
# The rows of ``bench_serving.py``: one continuous-batching run over a byte budget, or the same requests
# served one at a time by ``generate()``; and the workloads they serve.
#
# A row returns a dict of measurements (generated tokens/s first) and the greedy tokens of every request.

ROWS = {"float": None, "kivi-2/2": KiviConfig(k_bits=2, v_bits=2), "balanced": KiviConfig.preset("balanced"),
        # the materialized path: pages dequantized one layer at a time, transformers' SDPA (not run by default)
        "kivi-2/2-reference": KiviConfig(k_bits=2, v_bits=2, attention_backend="reference"),
        # a 32-token window: a short request's window blocks, not its pages, bound how many fit a tight budget
        "kivi-2/2-r32": KiviConfig(k_bits=2, v_bits=2, residual_length=32)}
#: one-at-a-time rows: name -> the cache generate() builds (None: DynamicCache; a KiviConfig: quantize_model's)
BASELINES = {"dynamic": None, "kivi-2/2": ROWS["kivi-2/2"], "balanced": ROWS["balanced"]}


@dataclass
class Workload:
    """Requests submitted at once: ``prompts[i]`` (token ids) generating ``new_tokens[i]`` greedy tokens (no EOS)."""

    name: str
    prompts: list[list[int]]
    new_tokens: list[int]


def uniform(n: int, length: int, new_tokens: int, shared: float, vocab: int, seed: int) -> Workload:
    """``n`` random-id prompts of ``length`` tokens; the first ``shared`` fraction is one common prefix."""
    g = torch.Generator().manual_seed(seed)
    low = min(100, vocab // 4)  # above the special tokens of a real vocabulary (and of a tiny one)
    common = torch.randint(low, vocab - 1, (int(length * shared),), generator=g).tolist()
    prompts = [common + torch.randint(low, vocab - 1, (length - len(common),), generator=g).tolist() for _ in range(n)]
    return Workload(f"shared_prefix_{shared:.2f}", prompts, [new_tokens] * n)


def spread(n: int, lo: int, hi: int, seed: int) -> list[int]:
    """``n`` integers spread evenly over ``[lo, hi]``, in an order shuffled by ``seed``."""
    values = [lo + round((hi - lo) * i / max(1, n - 1)) for i in range(n)]
    order = torch.randperm(n, generator=torch.Generator().manual_seed(seed)).tolist()
    return [values[i] for i in order]


def decode_heavy(n: int, prompt_range: tuple[int, int], new_range: tuple[int, int], ids: list[int] | None,
                 vocab: int, seed: int) -> Workload:
    """``n`` prompts of lengths spread over ``prompt_range``, each cut from consecutive text ``ids``
    (WikiText-2 tokens; ``None``: random ids, for a model without a tokenizer), with ``new_range`` new tokens."""
    lengths, news = spread(n, *prompt_range, seed), spread(n, *new_range, seed + 1)
    prompts, at = [], 0
    g = torch.Generator().manual_seed(seed)
    for length in lengths:
        if ids is None:
            prompts.append(torch.randint(min(100, vocab // 4), vocab - 1, (length,), generator=g).tolist())
            continue
        if at + length > len(ids):
            at = 0
        prompts.append(ids[at:at + length])
        at += length
    return Workload("decode_heavy", prompts, news)


def _pct(xs: list[float], q: float) -> float | None:
    if not xs:
        return None
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(round(q * (len(xs) - 1))))]


def latency_columns(t0: float, stamps: list[list[float]], prompts: list[list[int]], wall: float) -> dict:
    """Throughput and latency from each request's token times (``stamps[i]``: seconds of each generated token)."""
    ttft = [s[0] - t0 for s in stamps if s]
    tpot = [(s[-1] - s[0]) / (len(s) - 1) for s in stamps if len(s) > 1]
    return summary(ttft, tpot, sum(len(s) for s in stamps), prompts, wall)


def summary(ttft: list[float], tpot: list[float], gen: int, prompts: list[list[int]], wall: float) -> dict:
    """The columns every row reports: ``gen`` generated tokens in ``wall`` seconds, the percentiles of the
    requests' times to first token (``ttft``) and per-token latencies (``tpot``)."""
    return {"generated_tokens_per_s": gen / wall, "wall_s": wall, "generated_tokens": gen,
            "total_tokens_per_s": (gen + sum(len(p) for p in prompts)) / wall,
            "ttft_p50_s": _pct(ttft, 0.5), "ttft_p95_s": _pct(ttft, 0.95),
            "per_token_p50_s": _pct(tpot, 0.5), "per_token_p95_s": _pct(tpot, 0.95)}


def batch_row(model, cfg: KiviConfig | None, work: Workload, cache_memory: int, cb_kwargs: dict) -> dict:
    """All requests submitted at once to one continuous-batching manager over ``cache_memory`` bytes."""
    gen = GenerationConfig(max_new_tokens=max(work.new_tokens), do_sample=False, eos_token_id=-1)
    manager = init_continuous_batching(model, cfg, cache_memory=cache_memory, generation_config=gen, **cb_kwargs)
    for p, n in zip(work.prompts, work.new_tokens):
        manager.check_request_fits(len(p), n)
    held, results = 0, {}
    manager.start()
    try:
        t0 = time.perf_counter()
        ids = [manager.add_request(p, f"req_{i}", n, record_timestamps=True)
               for i, (p, n) in enumerate(zip(work.prompts, work.new_tokens))]
        while len(results) < len(ids):
            out = manager.get_result(timeout=0.02)
            bp = manager.batch_processor
            if bp is not None:
                held = max(held, len(bp.scheduler.active_requests))
            if out is not None and out.is_finished():
                if out.error is not None:
                    raise RuntimeError(f"request {out.request_id} failed: {out.error}")
                results[out.request_id] = out
            elif out is None and not manager.is_running():
                raise RuntimeError("the continuous-batching loop stopped")
        wall = time.perf_counter() - t0
        cache = manager.batch_processor.cache
        resolved = manager.batch_processor.scheduler
        shared = getattr(cache, "shared_tokens", None)
        blocks = cache.num_blocks
        cb = manager.continuous_batching_config
        settings = {"max_batch_tokens": cb.max_batch_tokens, "scheduler": cb.scheduler_type,
                    "safety_margin": resolved.safety_margin, "attention": model.config._attn_implementation}
    finally:
        manager.stop(block=True, timeout=60)
        manager.destroy()
    row = latency_columns(t0, [results[i].timestamps for i in ids], work.prompts, wall)
    longest = max(len(p) + n for p, n in zip(work.prompts, work.new_tokens))
    row.update({"requests_held_at_once": held, "capacity_requests": blocks // manager.request_blocks(longest),
                "cache_blocks": blocks, "block_bytes": manager.block_bytes, "settings": settings,
                "shared_prompt_tokens": shared,
                "tokens": [results[i].generated_tokens for i in ids]})
    return row


class _Stamps:
    """A ``generate()`` streamer that records the time of every generated token (the first put is the prompt)."""

    def __init__(self) -> None:
        self.times: list[float] = []
        self._prompt_seen = False

    def put(self, value) -> None:
        if not self._prompt_seen:
            self._prompt_seen = True
            return
        self.times.append(time.perf_counter())

    def end(self) -> None:
        pass


def generate_row(model, cfg: KiviConfig | None, work: Workload, limit: int | None = None) -> dict:
    """The requests served one after another by ``generate()`` (``cfg``: on a ``quantize_model``-ed model), all
    counted as submitted at the start: request i's first token waits for the requests before it."""
    from kivi import dequantize_model, quantize_model

    prompts = work.prompts[:limit]
    if cfg is not None:
        quantize_model(model, cfg)
    try:
        stamps, tokens = [], []
        t0 = time.perf_counter()
        for p, n in zip(prompts, work.new_tokens):
            s = _Stamps()
            out = model.generate(torch.tensor([p]), max_new_tokens=n, do_sample=False, eos_token_id=-1,
                                 pad_token_id=0, streamer=s)
            tokens.append(out[0, len(p):].tolist())
            stamps.append(s.times)
        wall = time.perf_counter() - t0
    finally:
        if cfg is not None:
            dequantize_model(model)
    row = latency_columns(t0, stamps, prompts, wall)
    row.update({"requests_held_at_once": 1, "tokens": tokens})
    return row


def identical(tokens: list[list[int]], reference: list[list[int]]) -> dict:
    """How many requests got the same greedy tokens as ``reference`` (and where each first differs)."""
    first = [next((j for j, (a, b) in enumerate(zip(t, r)) if a != b),
                  None if len(t) == len(r) else min(len(t), len(r))) for t, r in zip(tokens, reference)]
    return {"requests": len(first), "identical": sum(f is None for f in first), "first_differing_token": first}


# ============================== the HTTP row
# The HTTP row of ``bench_serving.py``: the same requests sent to ``kivi serve`` by concurrent clients.
#
# The server runs as a subprocess (``python -m kivi serve``) on a free localhost port with the row's model, pages
# (``--float-cache``, or the row's ``KiviConfig`` as a ``--config`` file), budget, threads, page size and tokens per
# forward. It is waited for (``GET /health``) and stopped with SIGINT (SIGKILL after 15 s) whatever happens. Each
# client (a thread with its own ``httpx`` client) takes the next request and streams ``POST /v1/completions`` with
# the prompt as token ids, ``temperature`` 0 (greedy), ``max_tokens`` = the request's new tokens and
# ``ignore_eos`` (as the batch rows, which run with no EOS).
#
# A checkout whose kivi serve has no ``ignore_eos`` / ``--page-size`` (``--kivi-root-before`` an older one) is
# served without them: its requests may end at the model's EOS. Either way the row counts the tokens from each
# response's ``usage`` and fails, naming the request, when one got fewer than it asked for, so every row it
# reports generated exactly the requested tokens.

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


# ============================== the report
# The table and the plot of ``bench_serving.py``'s report (generated tokens/s is the headline column).

def _s(x: float | None) -> str:
    return "-" if x is None else f"{x:.2f}s"


def _ms(x: float | None) -> str:
    return "-" if x is None else f"{x * 1e3:.0f}ms"


def format_table(report: dict) -> str:
    lines = [f"# {report['command']}",
             f"# model {report['model']} ({report['dtype']}), workload {report['workload']}, {report['requests']} "
             f"requests, page {report['page_size']}, {report['threads']} thread(s), "
             f"{'a fresh process per row' if report['fresh_process_per_row'] else 'rows in one process'}"]
    load = report.get("load_average")
    if load and "end" in load:
        lines.append("# load average (1/5/15 min) at the start " + "/".join(f"{x:.1f}" for x in load["start"])
                     + ", at the end " + "/".join(f"{x:.1f}" for x in load["end"]))
    for name in dict.fromkeys(r["workload"] for r in report["rows"]):
        rows = [r for r in report["rows"] if r["workload"] == name]
        p, n = rows[0]["prompt_tokens"], rows[0]["new_tokens"]
        lines.append(f"## {name}: prompts {min(p)}-{max(p)} tokens (sum {sum(p)}), new tokens {min(n)}-{max(n)} "
                     f"(sum {sum(n)})")
        lines.append(f"{'row':26s} {'budget':>9s} {'sched/mbt':>14s} {'gen tok/s':>9s} {'tok/s':>8s} "
                     f"{'TTFT p50':>9s} {'TTFT p95':>9s} {'tok p50':>8s} {'tok p95':>8s} {'held':>4s} {'fits':>4s} "
                     f"{'shared':>6s} {'same':>6s}")
        for r in rows:
            s = r.get("settings", {})
            label = {"one-at-a-time": "one-at-a-time ", "http": "http-"}.get(r["kind"], "") + r["cache"]
            if r.get("kivi_root"):
                label += f" ({Path(r['kivi_root']).name})"
            budget = "-" if r["budget_bytes"] is None else f"{r['budget_bytes'] / 2**20:.1f}Mi"
            sched = f"{s['scheduler']}/{s['max_batch_tokens']}" if s else "-"
            same = (r.get("same_tokens_as_before") or r.get("same_tokens_as_one_at_a_time")
                    or r.get("same_text_as_batch"))
            same = "-" if same is None else f"{same['identical']}/{same['requests']}"
            lines.append(
                f"{label:26s} {budget:>9s} {sched:>14s} {r['generated_tokens_per_s']:9.2f} "
                f"{r['total_tokens_per_s']:8.1f} {_s(r['ttft_p50_s']):>9s} {_s(r['ttft_p95_s']):>9s} "
                f"{_ms(r['per_token_p50_s']):>8s} {_ms(r['per_token_p95_s']):>8s} {r['requests_held_at_once']:4d} "
                f"{r.get('capacity_requests', '-'):>4} "
                f"{r.get('shared_prompt_tokens') or 0:6d} "
                f"{same:>6s}")
    if any(r["kind"] == "http" for r in report["rows"]):
        lines.append("same: batch rows, greedy tokens equal to the one-at-a-time row of the same cache; http rows, "
                     "text equal to the first batch row of the same cache")
    for name, a in report.get("single_request_agreement", {}).items():
        lines.append(f"greedy tokens vs one-request generate() with the same config ({name}): {a['identical']}/"
                     f"{a['requests']} requests identical (first differing token: {a['first_differing_token']})")
    cap = report["capacity"]
    lines.append(f"computed: requests of {cap['tokens_per_request']} tokens held at once in "
                 f"{cap['budget_bytes'] / 2**30:.1f} GiB (fp16 model, from page sizes): "
                 + ", ".join(f"{k} {v}" for k, v in cap["requests_that_fit"].items()))
    return "\n".join(lines)


def plot_budgets(report: dict, path: str | Path) -> Path:
    """Generated tokens/s vs budget (MiB): one line per cache and scheduler setting of the batch rows, the
    one-at-a-time rows as horizontal lines (they use no budget). One panel per workload."""
    import matplotlib  # noqa: PLC0415 (optional dependency)

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt  # noqa: PLC0415

    names = list(dict.fromkeys(r["workload"] for r in report["rows"]))
    fig, axes = plt.subplots(1, len(names), figsize=(6.5 * len(names), 4.5), squeeze=False)
    for ax, name in zip(axes[0], names):
        rows = [r for r in report["rows"] if r["workload"] == name]
        lines: dict[str, list[tuple[float, float]]] = {}
        for r in rows:
            if r["kind"] != "batch":
                continue
            s = r.get("settings", {})
            key = r["cache"] + (f" ({s['scheduler']}/{s['max_batch_tokens']})" if len(
                {(x.get("settings") or {}).get("max_batch_tokens") for x in rows if x["kind"] == "batch"}) > 1
                or len({(x.get("settings") or {}).get("scheduler") for x in rows if x["kind"] == "batch"}) > 1
                else "") + (f" (kivi from {Path(r['kivi_root']).name})" if r.get("kivi_root") else "")
            lines.setdefault(key, []).append((r["budget_bytes"] / 2**20, r["generated_tokens_per_s"]))
        for key, pts in lines.items():
            pts.sort()
            ax.plot([x for x, _ in pts], [y for _, y in pts], marker="o", label=key)
        for r in rows:
            if r["kind"] == "http":
                ax.scatter([r["budget_bytes"] / 2**20], [r["generated_tokens_per_s"]], marker="x", s=60,
                           label=f"kivi serve (HTTP), {r['cache']}")
            if r["kind"] == "one-at-a-time":
                ax.axhline(r["generated_tokens_per_s"], linestyle="--", linewidth=1,
                           label=f"one at a time, {r['cache']}", color="gray" if r["cache"] == "dynamic" else None)
        ax.set_xlabel("cache budget (MiB)")
        ax.set_ylabel("generated tokens/s")
        ax.set_title(f"{report['model']}, {name}, {report['threads']} thread(s)")
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
    fig.tight_layout()
    out = Path(path)
    out.parent.mkdir(parents=True, exist_ok=True)
    from kivi.files import write_file

    try:  # kivi's one writer: the figure goes to a temporary name, then replaces a regular file only
        write_file(out, lambda tmp: fig.savefig(tmp, dpi=110, format=out.suffix[1:].lower() or "png"))
    finally:
        plt.close(fig)
    return out


# ============================== the command line


DEFAULT_ROWS = ["float", "kivi-2/2", "balanced"]


class FloatNeeds(NamedTuple):
    """A budget named by what it holds: the bytes float pages need for ``requests`` of the longest requests."""

    requests: int

    def __str__(self) -> str:
        return f"fp:{self.requests}"


def budget_arg(text: str) -> int | FloatNeeds:
    """A budget: bytes (``67MiB``, ``1GiB``, a byte count) or ``fp:N`` (what float pages need for N of the
    workload's longest requests)."""
    if text.startswith("fp:"):
        n = text[3:]
        if not n.isdigit() or int(n) < 1:
            raise argparse.ArgumentTypeError(f"{text!r}: fp:N needs a whole number N >= 1 of requests")
        return FloatNeeds(int(n))
    try:
        return parse_bytes(text)
    except ValueError as e:
        raise argparse.ArgumentTypeError(f"{text!r}: {e}; or fp:N (what float pages need for N requests)") from None


def row_arg(text: str) -> tuple[str, int | FloatNeeds | None]:
    """``NAME`` (a row run at every ``--budgets`` value) or ``NAME@BUDGET`` (that row at that budget only)."""
    name, at, budget = text.partition("@")
    if name not in ROWS:
        raise argparse.ArgumentTypeError(f"{text!r}: the row must be one of {', '.join(ROWS)} (optionally @BUDGET)")
    if at and not budget:
        raise argparse.ArgumentTypeError(f"{text!r}: NAME@BUDGET needs a budget after @ (1GiB, fp:2)")
    return name, budget_arg(budget) if at else None


def _model(name: str):
    """``(model, tokenizer or None, vocab size)``: ``tiny`` is a random 4-layer model without a tokenizer; any other
    name is what ``kivi.load_model`` takes (an alias, a checkpoint folder)."""
    if name == "tiny":
        from tests.helpers import tiny_model

        return tiny_model(num_hidden_layers=4), None, 128
    from kivi.models import load_model

    model, tok = load_model(name)
    return model, tok, model.config.vocab_size


def workloads(args, tok, vocab: int) -> list[Workload]:
    """The request sets of this run (the same in every process: deterministic from the arguments)."""
    if args.workload == "uniform":
        return [uniform(args.requests, args.prompt_len, args.new_tokens, f, vocab, args.seed)
                for f in args.shared_prefix]
    ids = None
    if tok is not None:
        from kivi.data import load_text, token_ids

        ids = token_ids(tok, load_text()).tolist()
    return [decode_heavy(args.requests, tuple(args.prompt_range), tuple(args.new_range), ids, vocab, args.seed)]


def settings(args) -> list[dict]:
    """The scheduler settings every batch row runs under (an empty dict: kivi's defaults)."""
    out = []
    for mbt, sched in itertools.product(args.max_batch_tokens or [None], args.scheduler or [None]):
        out.append({k: v for k, v in (("max_batch_tokens", mbt), ("scheduler_type", sched)) if v is not None})
    return out


def float_needs(args, model, work: Workload, requests: int) -> int:
    """Bytes of float pages that hold ``requests`` of the workload's longest requests."""
    text = model.config.get_text_config()
    longest = max(len(p) + n for p, n in zip(work.prompts, work.new_tokens))
    return requests * -(-longest // args.page_size) * fp_block_bytes(text, model.dtype, args.page_size)


def row_plan(args, model, work: Workload) -> list[tuple[str, str, int]]:
    """``(kind, row, budget bytes)`` of every batch (``--rows``) and HTTP (``--http``) row, in run order: the rows
    without a budget of their own at each ``--budgets`` value (budget by budget), then those with one."""
    default = [args.cache_memory] if args.cache_memory else [FloatNeeds(args.fp_requests)]
    budgets = args.budgets or default
    resolve = lambda b: float_needs(args, model, work, b.requests) if isinstance(b, FloatNeeds) else b  # noqa: E731
    plan = []
    for kind, rows in (("batch", args.rows), ("http", args.http)):
        plan += [(kind, name, resolve(b)) for b in budgets for name, own in rows if own is None]
        plan += [(kind, name, resolve(own)) for name, own in rows if own is not None]
    return plan


def run_one(args, spec: dict) -> dict:
    """One row in this process: ``spec`` names the kind (``batch`` / ``generate``), row, workload and budget."""
    import kivi

    seconds = set_threads(args.threads)
    from kivi.quant.numba_quant import warmup as warm_quant

    warm_quant()
    model, tok, vocab = _model(args.model)
    if args.float_attention and spec["kind"] == "batch" and ROWS[spec["row"]] is None:
        model.set_attn_implementation(args.float_attention)
    work = next(w for w in workloads(args, tok, vocab) if w.name == spec["workload"])
    short = Workload("warmup", [work.prompts[0][: min(len(work.prompts[0]), 300)]], [3])
    if spec["kind"] == "generate":
        cfg = (ROWS if spec.get("table") == "rows" else BASELINES)[spec["row"]]
        generate_row(model, cfg, short)  # first-call overheads out of the timed run
        row = generate_row(model, cfg, work, spec.get("limit"))
    else:
        cb = {"page_size": args.page_size, **spec["settings"]}
        generate_batch(model, short.prompts, ROWS[spec["row"]], cache_memory=spec["budget"], max_new_tokens=3, **cb)
        row = batch_row(model, ROWS[spec["row"]], work, spec["budget"], cb)
    row["kernel_load_s"] = seconds
    row["kivi_path"] = os.path.dirname(kivi.__file__)
    return row


def run(args, argv: list[str], spec: dict) -> dict:
    """A row in a fresh process (this script with ``--child SPEC``), or here with ``--same-process``."""
    if args.same_process:
        return run_one(args, spec)
    env = {KIVI_ROOT_ENV: spec["kivi_root"]} if spec.get("kivi_root") else {KIVI_ROOT_ENV: ""}
    child = run_fresh([__file__, *argv, "--child", json.dumps(spec)], env=env, timeout=args.row_timeout)
    if child.returncode != 0 or child.result is None:
        raise RuntimeError(f"row {spec} failed (exit {child.returncode}):\n{child.stderr}")
    return child.result


def capacity_table(model_config, at: int, budget: int, page: int) -> dict:
    fp16 = (budget // fp_block_bytes(model_config, torch.float16, page)) // -(-at // page)
    out = {"float16": fp16}
    for name, cfg in ROWS.items():
        if cfg is not None:
            out[name] = build_layout(model_config, cfg, page, torch.float16).requests_that_fit(budget, at)
    return out


def _parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="smollm2", help="'smollm2' (embedded GGUF) or 'tiny' (random, for a smoke run)")
    ap.add_argument("--workload", choices=("uniform", "decode-heavy"), default="uniform")
    ap.add_argument("--requests", type=int, default=16)
    ap.add_argument("--prompt-len", type=int, default=1024, help="uniform: tokens of every prompt")
    ap.add_argument("--new-tokens", type=int, default=64, help="uniform: new tokens of every request")
    ap.add_argument("--prompt-range", type=int, nargs=2, default=[512, 4096], metavar=("MIN", "MAX"),
                    help="decode-heavy: prompt lengths, spread evenly over [MIN, MAX]")
    ap.add_argument("--new-range", type=int, nargs=2, default=[128, 256], metavar=("MIN", "MAX"),
                    help="decode-heavy: new tokens per request, spread evenly over [MIN, MAX]")
    ap.add_argument("--fp-requests", type=int, default=4,
                    help="default budget: bytes the float cache needs to hold this many of the longest requests "
                    "(the same as --budgets fp:N)")
    ap.add_argument("--cache-memory", type=parse_bytes, default=None, help="one budget (same as --budgets B)")
    ap.add_argument("--budgets", type=budget_arg, nargs="+", default=None,
                    help="budgets to sweep: bytes (64MiB, 1GiB) or fp:N, what float pages need for N of the longest "
                    "requests (overrides --fp-requests); every row without @BUDGET runs at each")
    ap.add_argument("--shared-prefix", type=float, nargs="+", default=[0.0, 0.75],
                    help="uniform: fractions of every prompt that are one common prefix; one variant each")
    ap.add_argument("--rows", nargs="*", type=row_arg, default=[(r, None) for r in DEFAULT_ROWS],
                    metavar="ROW[@BUDGET]",
                    help=f"continuous-batching rows, of {', '.join(ROWS)}; ROW@BUDGET (1GiB, fp:2) runs that row at "
                    "that budget only, so one run can mix budgets")
    ap.add_argument("--http", nargs="*", type=row_arg, default=[], metavar="ROW[@BUDGET]",
                    help="rows served by `kivi serve` (a subprocess; needs the serve extra) to --http-clients "
                    "concurrent clients: float (--float-cache) or a KIVI row's config, same model, budget, threads")
    ap.add_argument("--http-clients", type=int, default=None,
                    help="concurrent HTTP clients, each taking the next request (default: one per request)")
    ap.add_argument("--kivi-root-before", default=None, metavar="DIR",
                    help="also run every batch and HTTP row with kivi imported from the checkout DIR (before/after in "
                    "one run; fresh processes only)")
    ap.add_argument("--baselines", nargs="*", default=[], choices=list(BASELINES),
                    help="one-at-a-time generate() rows over the same requests (dynamic: DynamicCache)")
    ap.add_argument("--check-single", type=int, default=2,
                    help="uniform: compare the first N requests of every KIVI row with one-request generate()")
    ap.add_argument("--page-size", type=int, default=256)
    ap.add_argument("--max-batch-tokens", type=int, nargs="+", default=None,
                    help="tokens per forward; each value is a separate row (default: kivi's default)")
    ap.add_argument("--scheduler", nargs="+", choices=("fifo", "prefill_first"), default=None,
                    help="transformers' scheduler; each value is a separate row (default: kivi's default)")
    ap.add_argument("--float-attention", choices=("sdpa", "paged|eager"), default=None,
                    help="attention of the float rows (default: sdpa, what kivi's float path runs on CPU)")
    ap.add_argument("--capacity-at", type=int, default=4096)
    ap.add_argument("--capacity-budget", type=int, default=4 * 1024**3)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--same-process", action="store_true", help="run every row in this process (no fresh process)")
    ap.add_argument("--row-timeout", type=float, default=None, help="seconds one row may take (fresh processes)")
    ap.add_argument("--out", default=None, help="write the JSON here (and a .txt table beside it)")
    ap.add_argument("--plot", default=None, help="PNG of generated tokens/s vs budget (needs matplotlib)")
    ap.add_argument("--child", default=None, help=argparse.SUPPRESS)
    return ap


def _check(ap: argparse.ArgumentParser, args) -> None:
    for name in ("requests", "prompt_len", "new_tokens", "fp_requests", "page_size", "threads", "http_clients"):
        if getattr(args, name) is not None and getattr(args, name) < 1:
            ap.error(f"--{name.replace('_', '-')}={getattr(args, name)} must be >= 1")
    for name in ("prompt_range", "new_range"):
        lo, hi = getattr(args, name)
        if not 1 <= lo <= hi:
            ap.error(f"--{name.replace('_', '-')}={lo} {hi} must be 1 <= MIN <= MAX")
    if any(m < 1 for m in args.max_batch_tokens or []):
        ap.error(f"--max-batch-tokens={args.max_batch_tokens} must all be >= 1")
    if any(not 0 <= f < 1 for f in args.shared_prefix):
        ap.error(f"--shared-prefix={args.shared_prefix} must be fractions in [0, 1)")
    if args.http and args.kivi_root_before and args.page_size != SERVER_PAGE_SIZE \
            and "page_size" not in serve_features(args.kivi_root_before):
        ap.error(f"--kivi-root-before={args.kivi_root_before!r}: its kivi serve has no --page-size (its pages are "
                 f"{SERVER_PAGE_SIZE} tokens); --page-size={args.page_size} would measure other pages")
    if args.http and args.model == "tiny":
        ap.error("--http needs a model kivi serve loads (an alias or a checkpoint folder with a fast tokenizer), "
                 "not --model tiny")
    if args.kivi_root_before is not None:
        if args.same_process:
            ap.error("--kivi-root-before runs rows with another checkout's kivi in fresh processes; "
                     "drop --same-process")
        if not (Path(args.kivi_root_before) / "kivi" / "__init__.py").is_file():
            ap.error(f"--kivi-root-before={args.kivi_root_before!r} is not a checkout (no kivi/__init__.py in it)")
    if args.plot is not None:
        try:
            import matplotlib  # noqa: F401
        except ImportError:
            ap.error("--plot needs matplotlib: pip install matplotlib")


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    ap = _parser()
    args = ap.parse_args(argv)
    _check(ap, args)
    if args.child is not None:
        print(json.dumps(run_one(args, json.loads(args.child)), default=str), flush=True)
        return 0
    model, tok, vocab = _model(args.model)  # for shapes, the workloads and the budgets
    text = model.config.get_text_config()
    works = workloads(args, tok, vocab)
    report = {"command": command_line(), "environment": environment(), "model": args.model, "dtype": str(model.dtype),
              "workload": args.workload, "threads": args.threads, "requests": args.requests,
              "page_size": args.page_size, "fresh_process_per_row": not args.same_process,
              "load_average": {"start": os.getloadavg()},
              "capacity": {"tokens_per_request": args.capacity_at, "budget_bytes": args.capacity_budget,
                           "requests_that_fit": capacity_table(text, args.capacity_at, args.capacity_budget,
                                                               args.page_size)},
              "rows": []}
    plans = {w.name: row_plan(args, model, w) for w in works}
    del model
    roots = [None] if args.kivi_root_before is None else [args.kivi_root_before, None]
    for work in works:
        base = {"workload": work.name, "prompt_tokens": [len(p) for p in work.prompts], "new_tokens": work.new_tokens}
        singles = {}
        for name in args.baselines:
            r = run(args, argv, {"kind": "generate", "row": name, "workload": work.name})
            singles[name] = r.pop("tokens")
            report["rows"].append({**base, "kind": "one-at-a-time", "cache": name, "budget_bytes": None, **r})
            _progress(report["rows"][-1])
        first_tokens, before = {}, {}
        for kind, name, budget in plans[work.name]:
            for st, root in itertools.product(settings(args) if kind == "batch" else http_settings(args), roots):
                r = run_row(args, argv, kind, name, work, budget, st, root)
                if kind == "batch" and root is not None:  # the same row with the other checkout's kivi, next
                    before[name, budget, repr(st)] = r["tokens"]
                elif kind == "batch" and (name, budget, repr(st)) in before:
                    r["same_tokens_as_before"] = identical(r["tokens"], before[name, budget, repr(st)])
                if kind == "batch" and root is None:
                    first_tokens.setdefault(name, r["tokens"])
                compare(r, singles.get(name), first_tokens.get(name), tok)
                report["rows"].append({**base, "kind": kind, "cache": name, "budget_bytes": budget, **r})
                _progress(report["rows"][-1])
        if args.workload == "uniform" and args.check_single and work is works[0]:
            report["single_request_agreement"] = check_single(args, argv, work, first_tokens)
    report["load_average"]["end"] = os.getloadavg()
    table = format_table(report)
    print(table)
    if args.out:
        write_json(args.out, report)
        write_text_file(Path(args.out).with_suffix(".txt"), table + "\n")
    if args.plot:
        plot_budgets(report, args.plot)
    return 0


def http_settings(args) -> list[dict]:
    """The settings an HTTP row runs under: kivi serve takes ``--max-batch-tokens`` (its scheduler is FIFO)."""
    return [{} if m is None else {"max_batch_tokens": m} for m in args.max_batch_tokens or [None]]


def run_row(args, argv: list[str], kind: str, name: str, work: Workload, budget: int, st: dict,
            root: str | None) -> dict:
    """One batch row (a fresh process) or HTTP row (a fresh ``kivi serve``); ``root``: kivi from that checkout."""
    if kind == "batch":
        r = run(args, argv, {"kind": "batch", "row": name, "workload": work.name, "budget": budget, "settings": st,
                             "kivi_root": root})
    else:
        r = http_row(args.model, ROWS[name], work, budget, clients=args.http_clients or len(work.prompts),
                     threads=args.threads, max_batch_tokens=st.get("max_batch_tokens"), kivi_root=root,
                     timeout=args.row_timeout or 7200.0, page_size=args.page_size)
    if root is not None:
        r["kivi_root"] = root
    return r


def compare(r: dict, single: list[list[int]] | None, batch: list[list[int]] | None, tok) -> None:
    """Add to row ``r`` (and drop its tokens / texts) how many requests match the one-at-a-time row of the same
    cache (batch rows: greedy tokens) or its first batch row (HTTP rows: the text those tokens decode to)."""
    tokens, texts = r.pop("tokens", None), r.pop("texts", None)
    if tokens is not None and single is not None:
        r["same_tokens_as_one_at_a_time"] = identical(tokens, single)
    if texts is not None and batch is not None and tok is not None:
        same = [tok.decode(t, skip_special_tokens=True) == x for t, x in zip(batch, texts)]
        r["same_text_as_batch"] = {"requests": len(same), "identical": sum(same)}


def check_single(args, argv: list[str], work: Workload, tokens: dict[str, list[list[int]]]) -> dict:
    """Greedy tokens of each KIVI batch row (its first budget and setting) vs one-request ``generate()`` with the
    same config, over the first ``--check-single`` requests."""
    out = {}
    for name in (r for r in dict.fromkeys(n for n, _ in args.rows) if ROWS[r] is not None and r in tokens):
        ref = run(args, argv, {"kind": "generate", "row": name, "table": "rows", "workload": work.name,
                               "limit": args.check_single})["tokens"]
        out[name] = identical(tokens[name][: len(ref)], ref)
        print(f"{name}: {out[name]['identical']}/{out[name]['requests']} requests token-identical to one-request "
              "generate()", file=sys.stderr, flush=True)
    return out


def _progress(r: dict) -> None:
    s = r.get("settings", {})
    print(f"{r['workload']} {r['kind']:13s} {r['cache']:9s} budget {(r['budget_bytes'] or 0) / 2**20:7.1f} MiB "
          f"{s.get('scheduler', '-')}/{s.get('max_batch_tokens', '-')}  {r['generated_tokens_per_s']:7.2f} gen tok/s  "
          f"held {r['requests_held_at_once']}", file=sys.stderr, flush=True)


if __name__ == "__main__":
    raise SystemExit(main())
