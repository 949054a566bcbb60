"""kivi serve's token choice: greedy rows are the argmax of the logits and cost no sort or draw; sampled
rows draw from their temperature-scaled top-p nucleus."""

from __future__ import annotations

import asyncio
import math

import pytest
import torch

from kivi.batching import init_continuous_batching
from kivi.serving.engine import Engine, Sampling
from kivi.serving.sampler import serving_processors
from tests.serving.server import tiny_chat_model, tiny_tokenizer


def _args(temperatures, top_ps):
    """The two per-request argument rows transformers hands the processors (float32 viewed as int32)."""
    return torch.stack([torch.tensor(temperatures, dtype=torch.float32).view(torch.int32),
                        torch.tensor(top_ps, dtype=torch.float32).view(torch.int32)])


def _choose(processors, scores, temperatures, top_ps):
    """The tokens the manager picks (it is built greedy: the argmax of the processed scores)."""
    ids = torch.zeros(scores.shape[0], dtype=torch.long)
    return processors(ids, scores.clone(), _args(temperatures, top_ps)).argmax(-1)


def test_greedy_rows_are_the_argmax_and_sampled_rows_follow_the_nucleus():
    torch.manual_seed(0)
    p = serving_processors()
    logits = torch.log(torch.tensor([[0.5, 0.3, 0.2], [0.2, 0.3, 0.5]]))
    assert _choose(p, logits, [0.0, 0.0], [1.0, 1.0]).tolist() == [0, 2]
    counts = torch.zeros(2, 3)
    for _ in range(2000):  # row 0 samples inside its top-0.6 nucleus {0, 1}; row 1 stays greedy
        counts[torch.arange(2), _choose(p, logits, [1.0, 0.0], [0.6, 1.0])] += 1
    assert counts[1].tolist() == [0, 0, 2000] and counts[0, 2] == 0
    assert counts[0, 0] / 2000 == pytest.approx(0.5 / 0.8, abs=0.05)  # 0.625: renormalized over the nucleus
    counts = torch.zeros(3)
    for _ in range(2000):  # temperature 2: probabilities ~ p ** 0.5
        counts[_choose(p, logits[:1], [2.0], [1.0])] += 1
    expected = torch.tensor([0.5, 0.3, 0.2]).sqrt()
    assert (counts / 2000).tolist() == pytest.approx((expected / expected.sum()).tolist(), abs=0.05)
    assert _choose(p, logits[:1], [1.0], [1e-30]).tolist() == [0]  # a nucleus that rounds to one token


@pytest.fixture(scope="module")
def engine():
    e = Engine(tiny_chat_model(), tiny_tokenizer(), None, cache_memory=2 * 2**20, max_new_tokens=64,
               max_batch_tokens=128, factory=init_continuous_batching)
    yield e
    e.stop()


async def _tokens(engine, ids, sampling):
    seen = asyncio.Queue()
    engine.submit(ids, sampling, seen.put_nowait)
    while True:
        out = await seen.get()
        if out.is_finished():
            assert out.error is None, out.error
            return out.generated_tokens


def test_greedy_requests_sort_and_draw_nothing(engine, monkeypatch):
    """A batch of greedy requests costs no vocabulary sort and no multinomial draw (a manager built sampling
    with top-k / top-p processors sorts every row twice and draws from a softmax over it at every step);
    a sampled request in the batch does both, for its own row."""
    calls = []
    for name in ("sort", "multinomial"):
        real = getattr(torch, name)

        def counted(*a, _real=real, _name=name, **k):
            calls.append(_name)
            return _real(*a, **k)

        monkeypatch.setattr(torch, name, counted)

    async def run(samplings):
        return await asyncio.gather(*[_tokens(engine, list(range(2 + i, 30)), s) for i, s in enumerate(samplings)])

    greedy = asyncio.run(run([Sampling(8, ignore_eos=True)] * 3))
    assert [len(t) for t in greedy] == [8, 8, 8] and calls == []
    mixed = asyncio.run(run([Sampling(8, ignore_eos=True), Sampling(8, temperature=0.9, top_p=0.8, ignore_eos=True)]))
    assert mixed[0] == greedy[0]  # a sampled neighbour does not change a greedy request's tokens
    assert "sort" in calls and "multinomial" in calls and len(mixed[1]) == 8
    assert all(0 <= t < engine.model.config.vocab_size for t in mixed[1]) and not math.isnan(sum(mixed[1]))
