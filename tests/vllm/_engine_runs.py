"""One vLLM engine, several batches, and what its scheduler did: ``python tests/vllm/_engine_runs.py JSON``
prints one line ``RESULT {...}``.

The job: ``{"model", "engine": LLM keyword arguments, "kivi": a KiviConfig object or null, "runs": [{"prompts":
[[token ids]], "max_tokens": n, "logprobs": k}], "record": bool}``. Each run is one ``LLM.generate`` call (one
batch: vLLM schedules its requests together), greedy with ``ignore_eos``.

The result: per run ``tokens`` and ``logprobs`` (per request, per new token: ``{token id: logprob}`` of vLLM's
``k`` best, raw model logprobs), ``cached`` (vLLM's ``num_cached_tokens``: prompt tokens read from its prefix
cache) and, with ``record``, ``steps``: per scheduler step, ``{request index: [computed, scheduled, tokens]}``
(tokens already computed before the step, tokens scheduled in it, the request's prompt + output tokens then);
a request whose ``computed`` is 0 starts (again, after a preemption) with an exact prefill of ``scheduled``
tokens. ``metrics``: vLLM's counters and gauges (``vllm:num_preemptions``, ``vllm:prefix_cache_hits``, ...).

``record`` runs vLLM's engine core in this process (``VLLM_ENABLE_V1_MULTIPROCESSING=0``) and wraps its
scheduler's ``schedule`` to read each step's plan: a test's window into vLLM internals, pinned by
``kivi/vllm/version.py``.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path


def run_engine(job: dict, *, timeout: float = 3600, env: dict | None = None) -> dict:
    """Run ``job`` in a child process (this file) with 1 GiB of KV cache; its result (asserts it finished).

    An engine bound to one core (``VLLM_CPU_OMP_THREADS_BIND`` a single core id: tests/vllm/conftest.py under
    xdist) runs one torch thread: vLLM sets that for the worker processes it spawns, not for an engine that runs
    in this child (``record``), whose two threads would otherwise spin against the other worker's engine."""
    env = dict(os.environ, VLLM_CPU_KVCACHE_SPACE="1", **(env or {}))
    if env.get("VLLM_CPU_OMP_THREADS_BIND", "").isdigit():
        env.setdefault("OMP_NUM_THREADS", "1")
    proc = subprocess.run([sys.executable, str(Path(__file__)), json.dumps(job)], capture_output=True, text=True,
                          env=env, timeout=timeout)
    lines = [ln for ln in proc.stdout.splitlines() if ln.startswith("RESULT ")]
    assert proc.returncode == 0 and lines, proc.stderr[-4000:]
    return json.loads(lines[-1][len("RESULT "):])


def _recorder(llm, steps: list):
    sched = llm.llm_engine.engine_core.engine_core.scheduler
    schedule = sched.schedule

    def recording_schedule(*args, **kwargs):
        out = schedule(*args, **kwargs)
        step = {}
        for rid, n in out.num_scheduled_tokens.items():
            req = sched.requests[rid]  # num_computed_tokens is advanced by schedule() itself
            step[rid] = [req.num_computed_tokens - n, n, req.num_tokens]
        if step:
            steps.append(step)
        return out

    sched.schedule = recording_schedule


def main() -> None:
    job = json.loads(sys.argv[1])
    if job.get("record"):
        os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
    from vllm import LLM, SamplingParams

    kwargs = dict(job.get("engine", {}))
    if job.get("kivi") is not None:
        kwargs["additional_config"] = {"kivi": job["kivi"]}
    llm = LLM(job["model"], enforce_eager=True, seed=0, disable_log_stats=False, **kwargs)
    steps: list = []
    if job.get("record"):
        _recorder(llm, steps)
    results = []
    for run in job["runs"]:
        steps.clear()
        params = SamplingParams(temperature=0, max_tokens=run["max_tokens"], ignore_eos=True,
                                logprobs=run.get("logprobs"))
        outs = llm.generate([{"prompt_token_ids": p} for p in run["prompts"]], params, use_tqdm=False)
        index = {o.request_id: i for i, o in enumerate(outs)}  # the scheduler's ids are "<id>-<suffix>"
        results.append(dict(
            tokens=[list(o.outputs[0].token_ids) for o in outs],
            logprobs=[[{str(t): lp.logprob for t, lp in d.items()} for d in o.outputs[0].logprobs or []]
                      for o in outs],
            cached=[o.num_cached_tokens for o in outs],
            steps=[{index[rid.rsplit("-", 1)[0]]: v for rid, v in s.items()} for s in steps],
        ))
    metrics = {m.name: m.value for m in llm.get_metrics() if isinstance(getattr(m, "value", None), (int, float))}
    print("RESULT " + json.dumps(dict(runs=results, metrics=metrics)), flush=True)


if __name__ == "__main__":
    main()
