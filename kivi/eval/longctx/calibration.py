"""Suite prompts as the per-head profile's calibration text: head-sides ranked where the suite's answers
are decided.

`kivi profile --per-head` ranks (layer, kv head, side) by the attention error that quantizing each one alone
causes on the scored queries of its text (:mod:`kivi.eval.head_profile`). On WikiText windows that is every
query from the prefix on, most of which read the last few hundred tokens; the suite's answers are decided by
the question and answer tokens reading a needle thousands of tokens back (docs/evaluation.md, "Where the loss
is"). :func:`calibration_prompts` builds suite samples, appends full precision's greedy answer to each and
scores the queries from the question on, so :func:`kivi.eval.head_profile.head_profile_prompts` measures those
reads. The default seed (1) is not the evaluation's (0): a config chosen on these prompts is judged by
`kivi eval longctx` on samples it did not see.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Sequence

import torch

from ..progress import progress_bar
from .haystack import Haystack, Template
from .tasks import check_tasks, make_sample

#: the five tasks full precision does at 2K and 4K on SmolLM2 (docs/evaluation.md)
DEFAULT_TASKS = ("niah_single", "niah_multikey", "niah_multivalue", "niah_multiquery", "fwe")
DEFAULT_LENGTH = 2048
DEFAULT_SAMPLES = 8
DEFAULT_SEED = 1  # `kivi eval longctx` samples seed 0 by default


@dataclass(frozen=True)
class CalibrationPrompt:
    """``ids``: a suite sample's ``context + question`` then full precision's greedy answer; the queries at
    ``[scored_from, len(ids))`` (question and answer) are the ones a profile scores; ``scored_from`` is
    ``len(context)``."""

    task: str
    index: int
    ids: tuple[int, ...]
    scored_from: int
    answer_tokens: int


def greedy_answer(model: Any, ids: Sequence[int], max_new_tokens: int) -> list[int]:
    """Full precision's greedy continuation of ``ids`` as transformers' ``generate`` returns it: at most
    ``max_new_tokens`` tokens, ending with the model's end-of-sequence token where one stopped it (kept: the
    query that predicts it reads the document too)."""
    dev = next(model.parameters()).device
    x = torch.tensor([list(ids)], device=dev)
    eos = getattr(getattr(model, "generation_config", None), "eos_token_id", None)
    pad = eos[0] if isinstance(eos, (list, tuple)) and eos else eos
    with torch.inference_mode():
        out = model.generate(x, attention_mask=torch.ones_like(x), max_new_tokens=max_new_tokens, do_sample=False,
                             pad_token_id=pad)
    return out[0, x.shape[1]:].tolist()


def calibration_prompts(model: Any, tok: Any, text: str, *, length: int = DEFAULT_LENGTH,
                        tasks: Sequence[str] = DEFAULT_TASKS, samples: int = DEFAULT_SAMPLES, seed: int = DEFAULT_SEED,
                        progress: bool = True) -> list[CalibrationPrompt]:
    """``samples`` prompts of each task (depths spread over 0-100 % as the suite spreads them), ``length``
    tokens before the answer, in task order; deterministic in ``seed``."""
    tasks = list(tasks)
    check_tasks(tasks)
    if isinstance(samples, bool) or not isinstance(samples, int) or samples < 1:
        raise ValueError(f"samples={samples!r} must be a positive integer")
    hay, tpl = Haystack.from_text(tok, text), Template.of(tok)
    bar = progress_bar(len(tasks) * samples, "calibration prompts", enabled=progress, unit="prompt")
    out: list[CalibrationPrompt] = []
    try:
        for t in tasks:
            for i in range(samples):
                s = make_sample(hay, tpl, t, length, i, samples=samples, seed=seed)
                ans = greedy_answer(model, s.ids, s.max_new_tokens)
                out.append(CalibrationPrompt(t, i, tuple(s.ids) + tuple(ans), len(s.context), len(ans)))
                bar.update(1)
    finally:
        bar.close()
    return out


__all__ = ["DEFAULT_LENGTH", "DEFAULT_SAMPLES", "DEFAULT_SEED", "DEFAULT_TASKS", "CalibrationPrompt",
           "calibration_prompts", "greedy_answer"]
