"""Runs vLLM on the embedded model in a child process (vLLM's engine wants its own process, and the
parent may hold a torch thread pool): ``python tests/vllm/_engine.py JSON`` prints one JSON line."""

from __future__ import annotations

import json
import sys


def main() -> None:
    job = json.loads(sys.argv[1])
    from vllm import LLM, SamplingParams

    kwargs = dict(job.get("engine", {}))
    if job.get("kivi") is not None:
        kwargs["additional_config"] = {"kivi": job["kivi"]}
    llm = LLM(job["model"], enforce_eager=True, seed=0, **kwargs)
    outs = llm.generate([{"prompt_token_ids": p} for p in job["prompts"]],
                        SamplingParams(temperature=0, max_tokens=job["max_tokens"], ignore_eos=True))
    print("RESULT " + json.dumps([list(o.outputs[0].token_ids) for o in outs]), flush=True)


if __name__ == "__main__":
    main()
