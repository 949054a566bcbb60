"""kivi.eval.longctx.runner on a tiny random model and the byte tokenizer: the rows of both protocols,
JSONL streaming, and resuming a killed run (a cut last line, missing rows) to the same rows as an
uninterrupted run, without redoing what was done."""

from __future__ import annotations

import json

import pytest

from kivi import KiviConfig
from kivi.data import load_text
from kivi.eval.longctx import runner
from kivi.eval.longctx.runner import ResultLog, run_suite, spread_order
from tests.helpers import ByteTokenizer, tiny_model

TEXT = load_text()[:40_000]
META = {"model": "tiny", "text": "t", "seed": 0, "samples": 2}
CONFIGS = [("fp", None), ("k2", KiviConfig(k_bits=2, v_bits=2, group_size=16, residual_length=32,
                                            attention_backend="reference"))]
KW = dict(lengths=[420], tasks=["niah_single"], samples=2, protocols=["question-after", "one-shot"], seed=0,
          progress=False)


@pytest.fixture(scope="module")
def model():
    return tiny_model("llama", vocab_size=257, max_position_embeddings=512)


def _key(r):
    return tuple(r[k] for k in runner.KEY)


def test_rows_stream_and_resume(model, tmp_path):
    full = tmp_path / "full.jsonl"
    rows = run_suite(model, ByteTokenizer(), TEXT, CONFIGS, log=ResultLog(full, META), **KW)
    assert len(rows) == 2 * 2 * 2 and len({_key(r) for r in rows}) == 8
    lines = full.read_text().splitlines()
    assert len(lines) == 8 and [_key(json.loads(x)) for x in lines] == [_key(r) for r in rows]
    by = {_key(r): r for r in rows}
    assert {r["protocol"] for r in rows} == {"question-after", "one-shot"}
    assert all(by[k]["bits_per_element"] == 32.0 for k in by if k[0] == "fp")
    assert all(by[k]["bits_per_element"] < 16 for k in by if k[0] == "k2")
    assert all(0.0 <= r["score"] <= 1.0 and r["new_tokens"] <= 12 for r in rows)

    cut = tmp_path / "cut.jsonl"  # killed while writing the 6th row
    cut.write_text("\n".join(lines[:5]) + "\n" + lines[5][:40])
    calls = {"answer": 0, "prefill": 0}
    answer, prefill = runner.answer, runner.record_prefill

    def counting(name, fn):
        def f(*a, **k):
            calls[name] += 1
            return fn(*a, **k)
        return f

    pytest.MonkeyPatch.setattr(pytest.MonkeyPatch(), runner, "answer", counting("answer", answer))
    try:
        runner.record_prefill = counting("prefill", prefill)
        again = run_suite(model, ByteTokenizer(), TEXT, CONFIGS, log=ResultLog(cut, META), **KW)
    finally:
        runner.answer, runner.record_prefill = answer, prefill
    assert calls["answer"] == 3 and calls["prefill"] == 2  # rows 1-5 done: 2 of the 4 prefills fully served
    assert len(cut.read_text().splitlines()) == 8
    for r in again:
        want = by[_key(r)]
        assert (r["answer"], r["score"], r["cache_bytes"]) == (want["answer"], want["score"], want["cache_bytes"])


def test_a_log_of_another_run_is_refused(tmp_path):
    p = tmp_path / "r.jsonl"
    p.write_text(json.dumps({**META, "config": "fp", "length": 1, "task": "qa", "protocol": "one-shot",
                             "sample": 0}) + "\n")
    ResultLog(p, META)
    with pytest.raises(ValueError, match="holds rows of another run"):
        ResultLog(p, {**META, "seed": 1})
    p.write_text("not json\n")
    with pytest.raises(ValueError, match="line 1 is not JSON"):
        ResultLog(p, META)


@pytest.mark.parametrize("n", [1, 2, 3, 5, 8, 50, 64])
def test_spread_order_is_a_permutation_ends_first(n):
    order = spread_order(n)
    assert sorted(order) == list(range(n))
    if n > 2:
        assert order[:3] == [0, n - 1, (n - 1) // 2]


def test_spread_order_prefix_covers_depths():
    # after any 9 of 50 samples, no depth gap is wider than a quarter of the document
    order = spread_order(50)
    first = sorted(order[:9])
    assert max(b - a for a, b in zip(first, first[1:])) <= 49 / 4 + 1


def test_a_cache_that_raises_is_a_failed_row_and_the_run_goes_on(model, tmp_path, monkeypatch):
    """A config whose cache raises (as hqq's 2-bit packing does on some token counts) gets rows with no score
    and the error; the other configs still answer; the summary leaves the failed rows out and counts them; a
    resumed run does not retry them."""
    from kivi.eval.longctx.summary import failures, summarize

    answer = runner.answer

    def breaks_k2(model_, tok, spec, sample, protocol, prefill):
        if spec is not None:
            raise RuntimeError("The size of tensor a (3) must match the size of tensor b (4)\nsecond line")
        return answer(model_, tok, spec, sample, protocol, prefill)

    monkeypatch.setattr(runner, "answer", breaks_k2)
    kw = {**KW, "protocols": ["question-after"]}
    path = tmp_path / "r.jsonl"
    rows = run_suite(model, ByteTokenizer(), TEXT, CONFIGS, log=ResultLog(path, META), **kw)
    bad = [r for r in rows if r["config"] == "k2"]
    assert len(rows) == 4 and len(bad) == 2
    assert all(r["score"] is None and r["error"] == "RuntimeError: The size of tensor a (3) must match the size of "
               "tensor b (4)" for r in bad)
    assert all(r["score"] is not None and "error" not in r for r in rows if r["config"] == "fp")
    assert {r["config"] for r in summarize(rows)} == {"fp"}
    assert failures(rows) == {"k2": {"failed": 2, "answers": 2, "error": bad[0]["error"]}}
    monkeypatch.setattr(runner, "answer", lambda *a, **k: pytest.fail("a done row was answered again"))
    assert len(run_suite(model, ByteTokenizer(), TEXT, CONFIGS, log=ResultLog(path, META), **kw)) == 4


@pytest.mark.parametrize("n", [1, 2, 3, 7])
def test_shards_partition_the_prompts(n):
    todo = [(L, t, i, p) for L in (2048, 4096) for t in ("a", "b") for i in spread_order(5) for p in ("x", "y")]
    parts = [runner.shard_todo(todo, (i, n)) for i in range(n)]
    assert sorted(x for part in parts for x in part) == sorted(todo)
    assert max(map(len, parts)) - min(map(len, parts)) <= 1
    for bad in [(n, n), (-1, n), (0, 0)]:
        with pytest.raises(ValueError, match="must be"):
            runner.shard_todo(todo, bad)


def test_two_shards_merge_to_the_unsharded_rows(model, tmp_path):
    """Each shard computes its own prompts only; their files merged are the rows of one unsharded run (the same
    answers); a row given twice is refused, naming both files."""
    whole = {_key(r): r for r in run_suite(model, ByteTokenizer(), TEXT, CONFIGS, log=ResultLog(None, META), **KW)}
    paths = [tmp_path / f"s{i}.jsonl" for i in range(2)]
    for i, p in enumerate(paths):
        run_suite(model, ByteTokenizer(), TEXT, CONFIGS, log=ResultLog(p, META), shard=(i, 2), **KW)
    keys = [{_key(json.loads(x)) for x in p.read_text().splitlines()} for p in paths]
    assert keys[0] and keys[1] and not keys[0] & keys[1]
    merged = runner.merge_logs(paths, META)
    assert {_key(r): (r["answer"], r["score"]) for r in merged} == {k: (r["answer"], r["score"])
                                                                     for k, r in whole.items()}
    with pytest.raises(ValueError, match="s0.jsonl and .*s0.jsonl both hold the row"):
        runner.merge_logs([paths[0], paths[1], paths[0]], META)
