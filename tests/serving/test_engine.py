"""The engine in-process: request planning against context, server cap and cache budget; the factory."""

from __future__ import annotations

import asyncio

import pytest

from kivi import KiviConfig
from kivi.batching import init_continuous_batching
from kivi.batching.manager import KiviBatchingManager
from kivi.sampling import GREEDY_BELOW
from kivi.serving.engine import Engine, RequestRefused, Sampling
from tests.serving.server import tiny_chat_model, tiny_tokenizer


@pytest.fixture(scope="module")
def engine():
    """Float pages, 2 MiB = 8 blocks x 256 tokens; context 4096; cap 4000 new tokens."""
    e = Engine(tiny_chat_model(), tiny_tokenizer(), None, cache_memory=2 * 2**20, max_new_tokens=4000,
               max_batch_tokens=128, factory=init_continuous_batching)
    yield e
    e.stop()
    assert not e.manager.is_running()


def test_budget_and_capacity(engine):
    assert isinstance(engine.manager, KiviBatchingManager) and engine.manager.layout is None  # float pages
    assert engine.manager.capacity_blocks == 8 == engine.stats().blocks_total
    assert engine.stats().free_fraction == 1.0 and engine.stats().blocks_held == 0


def test_plan_default_is_the_largest_that_fits(engine):
    assert engine.plan(100, None) == 2048 - 100  # the budget binds (8 blocks of 256 tokens)
    assert engine.plan(100, 50) == 50
    assert engine.plan(2047, None) == 1


@pytest.mark.parametrize(("prompt", "max_tokens", "code", "param"), [
    (4096, None, "context_length_exceeded", "prompt"),
    (5000, 10, "context_length_exceeded", "prompt"),
    (100, 3997, "context_length_exceeded", "max_tokens"),
    (10, 4001, "max_tokens_exceeded", "max_tokens"),
    (100, 1949, "cache_budget_exceeded", "max_tokens"),
    (2048, None, "cache_budget_exceeded", "max_tokens"),
    (0, None, "empty_prompt", "prompt"),
])
def test_plan_refusals(engine, prompt, max_tokens, code, param):
    with pytest.raises(RequestRefused) as e:
        engine.plan(prompt, max_tokens)
    assert e.value.code == code and e.value.param == param


def test_greedy_and_sampling_processor_arguments():
    greedy = {"temperature": 0.0, "top_p": 1.0}
    assert Sampling(5).processor_kwargs() == greedy
    assert Sampling(5, temperature=0.7, top_p=0.9).processor_kwargs() == {"temperature": 0.7, "top_p": 0.9}
    for tiny in (0.0, 1e-300, 5e-324, 1e-40, GREEDY_BELOW * 0.999):  # would divide float32 logits into inf/nan
        assert Sampling(5, temperature=tiny, top_p=0.5).processor_kwargs() == greedy, tiny
    assert Sampling(5, temperature=GREEDY_BELOW).processor_kwargs()["temperature"] == GREEDY_BELOW


@pytest.mark.parametrize(("kw", "field"), [
    ({"temperature": float("nan")}, "temperature"), ({"temperature": float("inf")}, "temperature"),
    ({"temperature": -1e-9}, "temperature"), ({"temperature": 1.0, "top_p": 0.0}, "top_p"),
    ({"temperature": 1.0, "top_p": 1.5}, "top_p"), ({"temperature": 1.0, "top_p": float("nan")}, "top_p"),
])
def test_sampling_refuses_values_the_processors_cannot_take(kw, field):
    with pytest.raises(ValueError, match=field):
        Sampling(5, **kw)


async def _run_to_end(engine, ids, sampling):
    """The last output of one request (``generated_tokens``, ``error``)."""
    seen = asyncio.Queue()
    engine.submit(ids, sampling, seen.put_nowait)
    while True:
        out = await seen.get()
        if out.is_finished():
            return out


def test_tiny_temperatures_are_greedy_and_the_loop_survives(engine):
    """``temperature=1e-300`` (0 in float32) and ``1e-40`` (logits overflow) used to stop the loop for
    good with a nan multinomial; they are greedy now, token for token."""
    ids = list(range(2, 30))

    async def run():
        return [await _run_to_end(engine, ids, Sampling(8, temperature=t, top_p=p))
                for t, p in ((None, 1.0), (1e-300, 1.0), (1e-40, 0.9), (1e-6, 1e-300))]

    outs = asyncio.run(run())
    assert all(o.error is None for o in outs), [o.error for o in outs]
    assert all(o.generated_tokens == outs[0].generated_tokens for o in outs) and len(outs[0].generated_tokens) == 8
    assert engine.fatal_error() is None


def test_a_request_that_fails_inside_sampling_fails_alone(engine, monkeypatch):
    """An exception raised while sampling one request's token fails that request (its output carries the
    error, its blocks are freed); the generation loop goes on and the next 5 requests succeed."""
    runner = engine.manager.batch_processor.model_runner
    real_sample, calls = runner._sample, []

    def sample_failing_once(scores, output_ids):
        calls.append(scores.shape)
        if len(calls) == 1:
            raise RuntimeError("injected sampling failure")
        return real_sample(scores, output_ids)

    monkeypatch.setattr(runner, "_sample", sample_failing_once)
    before = engine.stats()

    async def run():
        failed = await _run_to_end(engine, list(range(2, 20)), Sampling(6))
        later = [await _run_to_end(engine, list(range(3 + k, 25)), Sampling(6)) for k in range(5)]
        return failed, later

    failed, later = asyncio.run(run())
    assert failed.error is not None and "injected sampling failure" in failed.error
    assert [o.error for o in later] == [None] * 5 and all(len(o.generated_tokens) == 6 for o in later)
    assert engine.fatal_error() is None
    after = engine.stats()
    assert after.requests_failed == before.requests_failed + 1 and after.requests_done == before.requests_done + 5
    assert after.blocks_held == 0 and after.requests_open == 0


def test_an_error_with_no_request_to_blame_stays_fatal():
    """A failure outside any request's step (here the scheduler, with nothing in flight) still stops the
    loop, and /health says why: nothing is hidden."""
    e = Engine(tiny_chat_model(), tiny_tokenizer(), None, cache_memory=2**20, max_new_tokens=8,
               factory=init_continuous_batching)
    try:
        def broken(*_a, **_k):
            raise RuntimeError("scheduler broke")

        e.manager.batch_processor.scheduler.schedule_batch = broken

        async def run():
            return await _run_to_end(e, [2, 3, 4], Sampling(2))

        out = asyncio.run(run())
        assert out.error is not None and "scheduler broke" in str(e.fatal_error())
    finally:
        e.stop()


def test_cancel_frees_the_blocks_of_a_running_request(engine):
    async def run():
        seen = asyncio.Queue()
        rid = engine.submit(list(range(2, 40)), Sampling(1500), seen.put_nowait)
        while len((await seen.get()).generated_tokens) < 3:
            pass
        held = engine.stats()
        engine.cancel(rid)
        for _ in range(200):
            if engine.stats().blocks_held == 0:
                break
            await asyncio.sleep(0.02)
        return held, engine.stats()

    held, after = asyncio.run(run())
    assert held.blocks_held == 1 and held.requests_holding_blocks == 1 and held.requests_open == 1
    assert (
        after.blocks_held == 0 and after.requests_open == 0 and after.requests_cancelled == held.requests_cancelled + 1
    )


def test_default_factory_serves_kivi_pages():
    e = Engine(tiny_chat_model(), tiny_tokenizer(), KiviConfig(k_bits=2, v_bits=2, residual_length=32),
               cache_memory=2**18, max_new_tokens=64)
    try:
        assert type(e.manager).__name__ == "KiviBatchingManager" and e.stats().blocks_total > 0
        assert e.plan(10, None) == 64  # the server's cap
        with pytest.raises(RequestRefused) as refused:
            e.plan(4000, 64)  # within the context (4096), beyond the budget
        assert refused.value.code == "cache_budget_exceeded" and "cache_memory" in str(refused.value)
    finally:
        e.stop()


def test_a_manager_that_fails_to_start_is_reported_and_stopped():
    """A cache that cannot be built (here an invalid scheduler setting) fails on the generation thread:
    the engine says why and stops the manager (its non-daemon thread would keep the process alive)."""
    import dataclasses

    made = []

    def factory(model, kivi_config, *, cache_memory, generation_config, continuous_batching_config):
        cb = dataclasses.replace(continuous_batching_config, safety_margin=2.0)
        made.append(init_continuous_batching(model, kivi_config, cache_memory=cache_memory,
                                        generation_config=generation_config, continuous_batching_config=cb))
        return made[-1]

    with pytest.raises(RuntimeError, match="failed to start: .*safety_margin"):
        Engine(tiny_chat_model(), tiny_tokenizer(), None, cache_memory=2**20, max_new_tokens=8, factory=factory)
    assert not made[0].is_running()


def test_a_manager_that_does_not_start_in_time_is_stopped():
    import dataclasses
    import time as _time

    class Slow(KiviBatchingManager):
        def _create_batch_processor(self):
            _time.sleep(1.0)
            return super()._create_batch_processor()

    made = []

    def factory(model, kivi_config, *, cache_memory, generation_config, continuous_batching_config):
        cb = dataclasses.replace(continuous_batching_config, num_blocks=2)
        made.append(Slow(model, generation_config, cb, None, kivi_config=None, cache_memory=cache_memory, layout=None))
        return made[-1]

    with pytest.raises(RuntimeError, match="failed to start: no cache within"):
        Engine(tiny_chat_model(), tiny_tokenizer(), None, cache_memory=2**20, max_new_tokens=8, factory=factory,
               start_timeout=0.2)
    assert not made[0].is_running()


def test_ignore_eos_runs_a_request_to_max_new_tokens(engine):
    """With the model's end token set to the token greedy decoding emits first, a request stops after it
    (finish_reason "stop"); with ``ignore_eos`` the same request generates all its tokens ("length")."""
    from kivi.serving.running import RunningRequest

    ids = list(range(2, 30))

    async def run(sampling):
        running = RunningRequest(engine, ids, sampling, ())
        await running.text()
        return running.completion_tokens, running.finish_reason

    first = asyncio.run(_run_to_end(engine, ids, Sampling(1))).generated_tokens[0]
    saved = engine.eos_token_id
    engine.eos_token_id = first
    try:
        assert asyncio.run(run(Sampling(6))) == (1, "stop")
        assert asyncio.run(run(Sampling(6, ignore_eos=True))) == (6, "length")
    finally:
        engine.eos_token_id = saved


def test_page_size_reaches_the_manager():
    e = Engine(tiny_chat_model(), tiny_tokenizer(), None, cache_memory=2 * 2**20, max_new_tokens=16,
               page_size=128, factory=init_continuous_batching)
    try:
        assert e.manager.continuous_batching_config.page_size == 128 == e.manager.page_size
        assert e.stats().blocks_total == 16  # 2 MiB of 128-token float blocks (128 KiB each)
    finally:
        e.stop()
