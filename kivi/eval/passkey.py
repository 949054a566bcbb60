"""Passkey retrieval: a random 5-digit number hidden in filler text; can the model repeat it?

A prompt of about ``length`` tokens repeats the filler ("The grass is green. The sky is blue. ...");
the sentence "The pass key is NNNNN. Remember it. NNNNN is the pass key." sits at ``depth`` (0 =
start, 1 = end of the filler). The prompt ends with the question; the model's chat template is
used when the tokenizer has one. Greedy decoding of a few tokens; a trial counts as correct when
the key's digits appear in the answer.

Small models (SmolLM2-135M) can fail this even at full precision: always read a config's accuracy
next to the ``fp`` row.
"""

from __future__ import annotations

import random
import re
import time
from typing import Any, Sequence

import torch

from .caches import CacheSpec, check_spec, make_cache, spec_name, spec_to_json
from .progress import progress_bar

INTRO = ("There is an important piece of information hidden inside a lot of irrelevant text. "
         "Find it and memorize it. I will quiz you about it.\n")
FILLER = "The grass is green. The sky is blue. The sun is yellow. Here we go. There and back again. "
QUESTION = "What is the pass key?"
ANSWER_PREFIX = "The pass key is"


def _needle(key: str) -> str:
    return f"The pass key is {key}. Remember it. {key} is the pass key. "


def _render(tokenizer: Any, body: str) -> str:
    if getattr(tokenizer, "chat_template", None):
        msgs = [{"role": "user", "content": body + "\n" + QUESTION}]
        text = tokenizer.apply_chat_template(msgs, tokenize=False, add_generation_prompt=True)
        return text + ANSWER_PREFIX
    return body + "\n" + QUESTION + " " + ANSWER_PREFIX


def passkey_prompt(tokenizer: Any, length: int, depth: float, key: str) -> tuple[str, torch.Tensor]:
    """``(prompt_text, input_ids [1, n])`` with ``n`` close to (at most) ``length`` tokens."""
    if not 0.0 <= depth <= 1.0:
        raise ValueError(f"depth must be in [0, 1], got {depth}")
    if length < 64:
        raise ValueError(f"length={length} is too short for a passkey prompt (use >= 64 tokens)")

    def build(n_fill: int) -> str:
        before = round(n_fill * depth)
        return _render(tokenizer, INTRO + FILLER * before + _needle(key) + FILLER * (n_fill - before))

    def ntok(text: str) -> int:
        return len(tokenizer(text, add_special_tokens=False)["input_ids"])

    per = max(1, ntok(FILLER * 8) // 8)
    base = ntok(build(0))
    n_fill = max(0, (length - base) // per)
    while n_fill > 0 and ntok(build(n_fill)) > length:
        n_fill -= 1
    text = build(n_fill)
    ids = torch.tensor([tokenizer(text, add_special_tokens=False)["input_ids"]], dtype=torch.long)
    return text, ids


def passkey(
    model: Any,
    tokenizer: Any,
    configs: Sequence[CacheSpec] = (None,),
    *,
    lengths: Sequence[int] = (1024, 2048, 4096),
    depths: Sequence[float] = (0.1, 0.5, 0.9),
    seeds: int = 3,
    max_new_tokens: int = 12,
    progress: bool = True,
) -> dict[str, Any]:
    """Passkey accuracy for each cache spec, length and depth (``seeds`` random keys each).

    Every spec sees the same prompts. Returns ``{"results": [{"name", "config", "accuracy",
    "by_length": {L: acc}, "by_depth": {d: acc}, "trials": [...]}], "lengths", "depths", "seeds"}``.
    """
    if tokenizer is None:
        raise ValueError("passkey needs a tokenizer")
    if isinstance(seeds, bool) or not isinstance(seeds, int) or seeds < 1:
        raise ValueError(f"seeds must be a positive integer, got {seeds!r}")
    specs = [check_spec(c) for c in configs]
    dev = next(model.parameters()).device
    prompts = []
    for length in lengths:
        for depth in depths:
            for seed in range(seeds):
                key = str(random.Random(f"{seed}-{length}-{depth}").randint(10000, 99999))
                _, ids = passkey_prompt(tokenizer, int(length), float(depth), key)
                prompts.append((int(length), float(depth), seed, key, ids))
    bar = progress_bar(len(prompts) * len(specs), "passkey", progress)
    results = []
    try:
        for spec in specs:
            trials = []
            error = None
            t0 = time.time()
            for length, depth, seed, key, ids in prompts:
                try:
                    cache = make_cache(model, spec)
                    with torch.inference_mode():
                        out = model.generate(
                            input_ids=ids.to(dev),
                            attention_mask=torch.ones_like(ids).to(dev),
                            cache=cache,
                            max_new_tokens=max_new_tokens,
                            do_sample=False,
                            pad_token_id=tokenizer.pad_token_id
                            if tokenizer.pad_token_id is not None
                            else tokenizer.eos_token_id,
                        )
                except Exception as e:  # noqa: BLE001
                    if isinstance(spec, str):
                        error = f"{type(e).__name__}: {e}"
                        break
                    raise
                answer = tokenizer.decode(out[0, ids.shape[1]:], skip_special_tokens=True)
                ok = key in re.sub(r"\D", "", answer)
                trials.append({"length": length, "prompt_tokens": int(ids.shape[1]), "depth": depth, "seed": seed,
                               "key": key, "answer": answer.strip(), "correct": ok})
                bar.update(1)
            r: dict[str, Any] = {"name": spec_name(spec), "config": spec_to_json(spec)}
            if error:
                r["unavailable"] = error
            else:
                r["accuracy"] = sum(t["correct"] for t in trials) / len(trials)
                r["by_length"] = {str(L): _acc([t for t in trials if t["length"] == L]) for L in map(int, lengths)}
                r["by_depth"] = {str(d): _acc([t for t in trials if t["depth"] == float(d)]) for d in depths}
                r["trials"] = trials
                r["seconds"] = round(time.time() - t0, 1)
            results.append(r)
    finally:
        bar.close()
    return {"lengths": list(map(int, lengths)), "depths": list(map(float, depths)), "seeds": seeds,
            "max_new_tokens": max_new_tokens, "results": results}


def _acc(trials: list[dict]) -> float | None:
    return sum(t["correct"] for t in trials) / len(trials) if trials else None
