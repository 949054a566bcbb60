"""vLLM's scheduler around the plugin: chunked prefill mixed with decode rows, preemption, prefix caching.

Each engine runs once in a child process (``tests/vllm/_engine_runs.py``, engine core in that
process so the test reads what the scheduler did), SmolLM2 in float32, K2 V2 (G=32, R=32), without sinks and with
5 sink tokens (5 does not divide G; the sink rows live in the window rings' first slots). Each request is
compared with kivi's own ``quantize_model(model, cfg, prefill_chunk_size=c).generate()`` of every start vLLM
gave it (``c`` = the first forward's tokens; tests/vllm/_reference.py says why that is the equal one).
"""

from __future__ import annotations

import pytest

from tests.vllm._engine_runs import run_engine
from tests.vllm._reference import assert_request_matches, compare_tokens, mixed_steps, segments

pytestmark = [pytest.mark.vllm, pytest.mark.slow]  # engine runs of minutes each: KIVI_SLOW=1

KIVI = {"k_bits": 2, "v_bits": 2, "group_size": 32, "residual_length": 32}
CONFIGS = {"k2v2": KIVI, "k2v2-sinks": {**KIVI, "sink_tokens": 5}}
BUDGET = 64  # max_num_batched_tokens: prompts longer than this are chunked, and share steps with decode rows
TEXTS = [
    "The history of the printing press begins in the fifteenth century, when",
    "def merge_sort(values):\n    \"\"\"Sort a list of numbers.\"\"\"\n",
    "Once upon a time, in a small village at the edge of a great forest, there lived an old clockmaker who "
    "had never once left the valley. Every morning he opened his shop, wound the clocks on the wall, and "
    "waited for the travellers who came down the mountain road to have their watches mended. The clocks were "
    "his only company: a tall case clock from the city, a cuckoo clock with a broken wing, a ship's chronometer "
    "that still kept perfect time, and a small brass alarm clock that rang every evening at six. The villagers "
    "said he talked to them when he thought nobody was listening. One winter",
    "Photosynthesis is the process by which green plants and some other organisms use sunlight to",
]
LONG = ("The committee met on Tuesday to review the budget for the coming year. " * 30).strip()


@pytest.fixture(scope="module")
def smollm2():
    from kivi import load_model
    from kivi.models import converted_cache_path

    model, tok = load_model("smollm2", dtype="float32")
    return model, tok, str(converted_cache_path("smollm2"))


@pytest.fixture(scope="module", params=list(CONFIGS))
def fields(request):
    return CONFIGS[request.param]


@pytest.fixture(scope="module")
def cfg(fields):
    from kivi import KiviConfig

    return KiviConfig(**fields)


@pytest.fixture(scope="module")
def mixed(smollm2, fields):
    """One engine, chunked prefill (64 tokens a step): the staggered batch, 4 prompts x 256 new tokens."""
    _, tok, path = smollm2
    prompts = [tok(t)["input_ids"] for t in TEXTS]
    job = dict(model=path, kivi=fields, record=True,
               engine=dict(dtype="float32", max_model_len=1024, max_num_batched_tokens=BUDGET,
                           enable_prefix_caching=False, async_scheduling=False),
               runs=[dict(prompts=prompts, max_tokens=256, logprobs=2)])
    return prompts, run_engine(job)


def check_run(model, cfg, prompts, run) -> list[dict]:
    return [assert_request_matches(model, cfg, p, run["tokens"][i], run["logprobs"][i], segments(run["steps"], i))
            for i, p in enumerate(prompts)]


def test_chunked_prefill_mixed_with_decode_equals_kivi_generate(smollm2, cfg, mixed):
    model, _, _ = smollm2
    prompts, result = mixed
    run = result["runs"][0]
    assert max(len(p) for p in prompts) > BUDGET > min(len(p) for p in prompts)
    assert mixed_steps(run["steps"]) > 0, "no step ran a prefill chunk next to a decode row"
    firsts = [segments(run["steps"], i)[0][2] for i in range(len(prompts))]
    assert any(f < len(p) for f, p in zip(firsts, prompts)), f"no prompt was chunked: first chunks {firsts}"
    reports = check_run(model, cfg, prompts, run)
    assert sum(r["compared"] for r in reports) >= 3 * 256, reports


def prefix_job(path: str, kivi: dict | None, long: list[int], other: list[int]) -> dict:
    """The long prompt, again, another prompt (its window blocks may reuse the first ones'), the long one again;
    one run after the other, prefix caching on."""
    runs = [dict(prompts=[p], max_tokens=32, logprobs=2) for p in (long, long, other, long)]
    return dict(model=path, kivi=kivi, record=True, runs=runs,
                engine=dict(dtype="float32", max_model_len=1024, max_num_batched_tokens=BUDGET,
                            enable_prefix_caching=True, async_scheduling=False))


def test_repeated_prompt_with_prefix_caching(smollm2, fields):
    """With prefix caching on, a repeated prompt decodes what its first run did: the KIVI page group is never
    a hit (kivi.vllm.spec: a hit would read a window the shared blocks do not hold), so vLLM reports no
    cached token and recomputes the prompt from an empty cache in one chunk. The same engine without the
    plugin hits 384 tokens (next test), so the prompt is long enough for a hit."""
    _, tok, path = smollm2
    long, other = tok(LONG)["input_ids"], tok(TEXTS[2])["input_ids"]
    assert len(long) > 2 * 128  # two whole blocks a hit could share
    result = run_engine(prefix_job(path, fields, long, other))
    runs = result["runs"]
    assert [r["cached"] for r in runs] == [[0]] * 4
    assert not result["metrics"].get("vllm:prefix_cache_hits")
    first = runs[0]
    for again in (runs[1], runs[3]):
        assert again["tokens"] == first["tokens"]
        assert segments(again["steps"], 0)[0] == (0, len(long), BUDGET)
        done, worst = compare_tokens(again["tokens"][0], again["logprobs"][0], first["tokens"][0],
                                     first["logprobs"][0])
        assert done == 32, (done, worst)


def test_repeated_prompt_hits_without_the_plugin(smollm2):
    """Without ``"kivi"`` the same engine serves the repeats from its cache: the prompt is long enough to hit."""
    _, tok, path = smollm2
    long, other = tok(LONG)["input_ids"], tok(TEXTS[2])["input_ids"]
    result = run_engine(prefix_job(path, None, long, other))
    assert [r["cached"][0] for r in result["runs"]] == [0, 384, 0, 384] and result["metrics"]["vllm:prefix_cache_hits"]


def test_preempted_requests_recompute_to_kivis_tokens(smollm2, fields, cfg):
    """A pool of 11 blocks (a request takes one page block per 128 tokens and 4 window blocks; 13 and 5 with
    sinks) for 4 requests
    of up to 256 tokens: vLLM preempts (recompute) and restarts them; every stretch of tokens equals kivi's
    generate() from the same start. Prefix caching on (vLLM's default): before the KIVI page group opted out
    of hits (kivi.vllm.spec), a recompute resumed from a hit of its own page blocks (vLLM counted 2
    preemptions where the steps showed 1 restart from token 0) and read window rings that did not hold its
    window; now every restart is from token 0."""
    model, tok, path = smollm2
    prompts = [tok(t)["input_ids"] for t in TEXTS]
    # with 5 sinks a request holds 5 window blocks, not 4: 13 blocks admit two requests that cannot both grow
    blocks = 11 if not fields.get("sink_tokens") else 13
    job = dict(model=path, kivi=fields, record=True,
               engine=dict(dtype="float32", max_model_len=512, num_gpu_blocks_override=blocks,
                           enable_prefix_caching=True, async_scheduling=False),
               runs=[dict(prompts=prompts, max_tokens=128, logprobs=2)])
    result = run_engine(job)
    run = result["runs"][0]
    restarts = [len(segments(run["steps"], i)) - 1 for i in range(len(prompts))]
    assert result["metrics"]["vllm:num_preemptions"] == sum(restarts) > 0, (result["metrics"], restarts)
    reports = check_run(model, cfg, prompts, run)
    assert sum(r["compared"] for r in reports) >= 3 * 128, reports
