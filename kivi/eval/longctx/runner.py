"""Running the suite: one full-precision prefill per sample, replayed into every compared cache, then a
short greedy answer per cache; rows stream to a JSONL file a killed run resumes from.

Protocols:

* ``question-after`` (default): the context (template head, intro, document) is prefilled; each cache
  gets it replayed (:func:`kivi.cache.replay.replay_prefill`), then the question is a separate forward
  that reads the cache as that cache stores it (quantized, for a quantized cache) — as in multi-turn
  chat, saved prefixes and prefix caching.
* ``one-shot``: context and question are prefilled together; the answer's first token comes from that
  exact-attention forward (the shared prefill's last logit), later tokens read the cache.

Each row records wall and CPU seconds (``process_time``, all threads) of the shared prefill and of the
config's replay + question + answer: on a shared machine the CPU seconds are the steadier cost.

A greedy answer stops at an end-of-sequence token, at the task's ``max_new_tokens``, or once every
expected string is in it (the score cannot rise or fall after that: :func:`.scoring.string_match_all`).

A cache that raises while it answers (hqq's 2-bit packing refuses some token counts) gives a row with
``score: None`` and the ``error`` (:func:`failed_answer`), and the run goes on; a resumed run does not retry it.

A grid splits into shards (``shard=(i, n)``: every ``n``-th prompt from the ``i``-th, :func:`shard_todo`), each its
own process and JSONL file, on as many cores or machines as there are shards; :func:`merge_logs` reads their files
back as one run's rows.
"""

from __future__ import annotations

import json
import os
import time
from pathlib import Path
from typing import Any, Iterable, Sequence

import torch

from ...cache.replay import replay_prefill
from ..caches import CacheSpec, bits_per_element, cache_nbytes, make_cache, spec_to_json
from ..progress import progress_bar
from .haystack import Haystack, Template, decode
from .protocols import PROTOCOLS, check_protocols
from .scoring import string_match_all
from .tasks import Sample, make_sample

KEY = ("config", "length", "task", "protocol", "sample")
META = ("model", "text", "seed", "samples")


def record_prefill(model: Any, ids: Sequence[int]) -> tuple[list[tuple[torch.Tensor, torch.Tensor]], torch.Tensor]:
    """``(states, last_logits [1, V])`` of a full-precision prefill of ``ids``: per layer the ``(keys, values)``
    the model handed its cache. The recording cache is a ``DynamicCache`` built without a config, whose layers
    keep every token (a sliding-window layer's cache needs them all on replay, as a prefill hands them)."""
    from transformers import DynamicCache  # noqa: PLC0415

    dev = next(model.parameters()).device
    cache = DynamicCache()
    with torch.inference_mode():
        out = model(input_ids=torch.tensor([list(ids)], device=dev), cache=cache, use_cache=True, logits_to_keep=1)
    return [(layer.keys, layer.values) for layer in cache.layers], out.logits[:, -1].float()


def answer(model: Any, tok: Any, spec: CacheSpec, sample: Sample, protocol: str,
           prefill: tuple[list[tuple[torch.Tensor, torch.Tensor]], torch.Tensor]) -> dict[str, Any]:
    """Build ``spec``'s cache from the shared ``prefill`` (of ``sample.context`` for question-after, of
    ``sample.ids`` for one-shot), run the protocol, decode greedily; the row's measured fields."""
    from ...attention.interface import reading_views  # noqa: PLC0415

    dev = next(model.parameters()).device
    t0, c0 = time.perf_counter(), time.process_time()
    states, logits = prefill
    cache = make_cache(model, spec, read_packed=True)
    eos = _eos_ids(tok, model)
    out: list[int] = []
    with torch.inference_mode(), reading_views(model, cache):
        replay_prefill(cache, states)
        if protocol == "question-after":
            q = torch.tensor([list(sample.question)], device=dev)
            logits = model(input_ids=q, cache=cache, use_cache=True, logits_to_keep=1).logits[:, -1].float()
        bits = bits_per_element(model, cache, sample.length)
        nbytes = cache_nbytes(cache)
        text = ""
        for step in range(sample.max_new_tokens):
            nxt = int(logits[0].argmax())
            if nxt in eos:
                break
            out.append(nxt)
            text = decode(tok, out)
            if string_match_all(text, sample.expected) == 1.0 or step == sample.max_new_tokens - 1:
                break
            logits = model(input_ids=torch.tensor([[nxt]], device=dev), cache=cache, use_cache=True).logits[:, -1]
    return {"score": string_match_all(text, sample.expected), "answer": text, "new_tokens": len(out),
            "bits_per_element": bits, "cache_bytes": nbytes, "decode_seconds": time.perf_counter() - t0,
            "decode_cpu_seconds": time.process_time() - c0}


def failed_answer(error: BaseException) -> dict[str, Any]:
    """The measured fields of an answer whose cache raised ``error``: no score (the summary leaves the row out
    and counts it, :func:`.summary.failures`), the error's type and first line in ``error``."""
    first = (str(error).strip().splitlines() or [""])[0][:300]
    return {"score": None, "error": f"{type(error).__name__}: {first}", "answer": None, "new_tokens": 0,
            "bits_per_element": None, "cache_bytes": None, "decode_seconds": None, "decode_cpu_seconds": None}


def _eos_ids(tok: Any, model: Any) -> set[int]:
    ids: set[int] = set()
    for v in (getattr(tok, "eos_token_id", None), getattr(getattr(model, "generation_config", None), "eos_token_id",
                                                                 None)):
        if isinstance(v, int):
            ids.add(v)
        elif isinstance(v, (list, tuple)):
            ids.update(int(x) for x in v)
    return ids


def spread_order(n: int) -> list[int]:
    """Sample indices ``0..n-1`` in the order a run visits them: the ends first, then each gap's midpoint,
    coarse to fine (``n=5``: 0 4 2 1 3). Sample ``i``'s needle depth is ``i / (n - 1)``, so a run stopped
    after any number of samples has them spread over all depths instead of the shallow ones only."""
    if n <= 2:
        return list(range(n))
    order, seen, gaps = [0, n - 1], {0, n - 1}, [(0, n - 1)]
    while gaps:
        nxt = []
        for lo, hi in gaps:
            mid = (lo + hi) // 2
            if mid not in seen:
                seen.add(mid)
                order.append(mid)
            if mid - lo > 1:
                nxt.append((lo, mid))
            if hi - mid > 1:
                nxt.append((mid, hi))
        gaps = nxt
    return order


def shard_todo(todo: Sequence, shard: tuple[int, int]) -> list:
    """The prompts of ``todo`` shard ``(i, n)`` runs: every ``n``-th from the ``i``-th (``0 <= i < n``). The ``n``
    shards partition ``todo``; as ``todo`` runs over lengths, then tasks, then samples in :func:`spread_order`, each
    shard gets about ``1/n`` of every length and task, spread over the depths. ``ValueError`` on a shard outside
    ``0 <= i < n``."""
    i, n = shard
    if not (isinstance(i, int) and isinstance(n, int) and 0 <= i < n):
        raise ValueError(f"shard={shard!r} must be (i, n) with 0 <= i < n")
    return list(todo[i::n])


class ResultLog:
    """The JSONL file rows stream to: one row per (config, length, task, protocol, sample), appended and
    flushed as each finishes. Opening an existing file resumes it: its rows count as done (a last line
    cut by a kill is dropped); rows of another run (model, text, seed, samples) are refused."""

    def __init__(self, path: str | os.PathLike | None, meta: dict[str, Any]):
        self.path = Path(path) if path else None
        self.meta = meta
        self.rows: list[dict[str, Any]] = []
        if self.path is not None and self.path.exists():
            raw = self.path.read_bytes()
            keep = raw[: raw.rfind(b"\n") + 1]  # a line without its newline was cut by a kill
            if len(keep) != len(raw):
                from ...files import write_bytes

                write_bytes(self.path, keep)  # the one writer: atomic, the file stays a regular file
            for n, line in enumerate(keep.decode("utf-8").splitlines(), 1):
                if not line.strip():
                    continue
                try:
                    row = json.loads(line)
                except json.JSONDecodeError:
                    raise ValueError(f"{self.path}: line {n} is not JSON; give another --jsonl file") from None
                other = {k: row.get(k) for k in META if row.get(k) != meta.get(k)}
                if other:
                    raise ValueError(f"{self.path} holds rows of another run ({other} vs {[meta[k] for k in other]});"
                                     " give another --jsonl file")
                self.rows.append(row)
        self.done = {tuple(r[k] for k in KEY) for r in self.rows}

    def add(self, row: dict[str, Any]) -> None:
        row = {**self.meta, **row}
        self.rows.append(row)
        self.done.add(tuple(row[k] for k in KEY))
        if self.path is not None:
            from ...files import check_write_target

            check_write_target(self.path)  # still a regular file (or absent): never append to a FIFO or device
            with self.path.open("a", encoding="utf-8") as f:
                f.write(json.dumps(row, default=str) + "\n")
                f.flush()


def merge_logs(paths: Sequence[str | os.PathLike], meta: dict[str, Any]) -> list[dict[str, Any]]:
    """The rows of several JSONL files of one run (its shards, :func:`shard_todo`), in file order: each file read as
    :class:`ResultLog` reads it (rows of another run refused). ``ValueError`` naming both files when two hold the
    same (config, length, task, protocol, sample)."""
    rows: list[dict[str, Any]] = []
    seen: dict[tuple, str] = {}
    for path in paths:
        for row in ResultLog(path, meta).rows:
            key = tuple(row[k] for k in KEY)
            if key in seen:
                raise ValueError(f"{path} and {seen[key]} both hold the row {dict(zip(KEY, key))}; give each row's "
                                 "file once (shards of one run hold disjoint rows)")
            seen[key] = str(path)
            rows.append(row)
    return rows


def run_suite(model: Any, tok: Any, text: str, configs: Sequence[tuple[str, CacheSpec]], *,
              lengths: Iterable[int], tasks: Iterable[str], samples: int, protocols: Sequence[str] = PROTOCOLS[:1],
              seed: int = 0, log: ResultLog | None = None, progress: bool = True,
              shard: tuple[int, int] = (0, 1)) -> list[dict[str, Any]]:
    """Every (config, length, task, protocol, sample) row of shard ``shard`` (:func:`shard_todo`; ``(0, 1)``: all)
    not yet in ``log``; returns all of ``log``'s rows.

    Samples are visited in :func:`spread_order` (a stopped run covers every depth). Per (length, task,
    sample, protocol) the prompt is built once and prefilled once at full precision;
    each config that still lacks that row gets the prefill replayed into its own cache and answers."""
    hay = Haystack.from_text(tok, text)
    tpl = Template.of(tok)
    log = log or ResultLog(None, {})
    lengths, tasks, protocols = list(lengths), list(tasks), check_protocols(list(protocols))
    todo = shard_todo([(L, t, i, p) for L in lengths for t in tasks for i in spread_order(samples) for p in protocols],
                      shard)
    left = sum(1 for L, t, i, p in todo for c, _ in configs if (c, L, t, p, i) not in log.done)
    bar = progress_bar(left, "longctx", enabled=progress, unit="answer")
    try:
        for L, t, i, p in todo:
            need = [(c, s) for c, s in configs if (c, L, t, p, i) not in log.done]
            if not need:
                continue
            sample = make_sample(hay, tpl, t, L, i, samples=samples, seed=seed)
            t0, c0 = time.perf_counter(), time.process_time()
            pre = record_prefill(model, sample.context if p == "question-after" else sample.ids)
            pre_s, pre_c = time.perf_counter() - t0, time.process_time() - c0
            for c, s in need:
                bar.set_description(f"{L} {t} #{i} {p} {c}")
                try:
                    r = answer(model, tok, s, sample, p, pre)
                except Exception as e:  # noqa: BLE001 - a cache that cannot answer (e.g. a peer's limit) is a row
                    r = failed_answer(e)
                log.add({"config": c, "length": L, "task": t, "protocol": p, "sample": i, "depth": sample.depth,
                         "expected": list(sample.expected), **r, "prefill_seconds": pre_s,
                         "prefill_cpu_seconds": pre_c,
                         "spec": spec_to_json(s)})
                bar.update(1)
            del pre
    finally:
        bar.close()
    return log.rows


__all__ = ["KEY", "META", "ResultLog", "answer", "failed_answer", "merge_logs", "record_prefill", "run_suite",
           "shard_todo", "spread_order"]
