"""How ``kivi serve`` picks each request's next token: greedy rows by the manager's argmax, sampled rows here.

transformers' continuous batching fixes ``do_sample`` and its logits processors when the manager is built.
Built sampling with its per-request temperature, top-k and top-p processors (a greedy request being
``top_k=1``), every decode step sorts the whole vocabulary twice per request and draws from a softmax
over it, greedy or not: on SmolLM2 (49,152 tokens) and 2 CPU threads that measured ~170 ms for the
processors and ~45 ms for softmax + multinomial per step of 8 requests, against ~8 ms for an argmax and
~95 ms for the float-page forward itself (docs/serving.md, "kivi serve over HTTP: where the time went").

So the manager is built greedy (``do_sample=False``: the next token is the argmax of the processed
scores) with the two processors of :func:`serving_processors`, and only the rows that sample do work:
their logits are divided by their temperature, cut to their top-p nucleus (when ``top_p < 1``), and one
token is drawn from the softmax; the row's scores then become ``-inf`` except for the drawn token, which
the argmax returns. A greedy row (temperature 0 or below :data:`kivi.sampling.GREEDY_BELOW`) is left as it is, so
its token is the argmax of the model's logits, as in ``model.generate`` greedy. A batch with no sampled row
costs one comparison.

transformers gives each per-request processor one argument row per step; a row needs two (temperature
and top-p), so the first processor only records the temperatures for the second, which runs right after
it in the same call.
"""

from __future__ import annotations

from typing import Any

import torch
from transformers.generation.continuous_batching.cb_logits_processors import (
    ContinuousBatchingLogitsProcessor,
    ContinuousBatchingLogitsProcessorList,
)
from transformers.generation.logits_process import LogitsProcessorList

from ..sampling import is_greedy_temperature


def _float_arg(values: list[float]) -> torch.Tensor:
    """Per-request float32 values as the int32 row transformers stores processor arguments in."""
    return torch.tensor(values, dtype=torch.float32, device="cpu").view(dtype=torch.int32)


class _Temperatures(ContinuousBatchingLogitsProcessor):
    """Records each row's temperature (0: greedy) for :class:`_SampleRows`; the scores pass unchanged."""

    supported_kwargs: dict[str, type] = {"temperature": float}
    ignored_kwargs: tuple[str, ...] = ()

    def __init__(self) -> None:
        self.current: torch.Tensor | None = None

    def fill_defaults(self, int32_tensor: torch.Tensor) -> None:
        int32_tensor.copy_(torch.zeros_like(int32_tensor, dtype=torch.float32).view(dtype=torch.int32))

    def prepare_tensor_args(self, requests_with_new_token: list[Any]) -> torch.Tensor:
        return _float_arg([r.state.logit_processor_kwargs.get("temperature", 0.0) for r in requests_with_new_token])

    def __call__(self, scores: torch.Tensor, tensor_arg: torch.Tensor) -> torch.Tensor:
        self.current = tensor_arg[: scores.size(0)].view(dtype=torch.float32)
        return scores


class _SampleRows(ContinuousBatchingLogitsProcessor):
    """Draws the token of every sampled row (see the module docstring); greedy rows are left as they are."""

    supported_kwargs: dict[str, type] = {"top_p": float}
    ignored_kwargs: tuple[str, ...] = ()

    def __init__(self, temperatures: _Temperatures) -> None:
        self.temperatures = temperatures

    def fill_defaults(self, int32_tensor: torch.Tensor) -> None:
        int32_tensor.copy_(torch.ones_like(int32_tensor, dtype=torch.float32).view(dtype=torch.int32))

    def prepare_tensor_args(self, requests_with_new_token: list[Any]) -> torch.Tensor:
        return _float_arg([r.state.logit_processor_kwargs.get("top_p", 1.0) for r in requests_with_new_token])

    def __call__(self, scores: torch.Tensor, tensor_arg: torch.Tensor) -> torch.Tensor:
        temperature = self.temperatures.current
        sampled = torch.nonzero(~is_greedy_temperature(temperature)).flatten()
        if sampled.numel() == 0:
            return scores
        top_p = tensor_arg[: scores.size(0)].view(dtype=torch.float32)[sampled]
        rows = scores[sampled].float() / temperature[sampled].unsqueeze(-1)
        if bool((top_p < 1).any()):
            rows = _nucleus(rows, top_p)
        tokens = torch.multinomial(torch.softmax(rows, dim=-1), num_samples=1)  # [S, 1]
        picked = torch.full((sampled.numel(), scores.size(-1)), float("-inf"), dtype=scores.dtype,
                            device=scores.device)
        picked.scatter_(-1, tokens, 0.0)
        scores[sampled] = picked
        return scores


def _nucleus(rows: torch.Tensor, top_p: torch.Tensor) -> torch.Tensor:
    """``rows [S, V]`` with every token outside its row's top-``top_p`` nucleus at ``-inf`` (transformers'
    ``TopPLogitsWarper`` rule: drop the tokens whose cumulative probability, in ascending order, is at most
    ``1 - top_p``; the most likely token always stays)."""
    ascending, order = torch.sort(rows, dim=-1)
    cumulative = ascending.softmax(dim=-1).cumsum(dim=-1)
    drop = cumulative <= (1 - top_p).unsqueeze(-1)
    drop[..., -1] = False
    return rows.masked_fill(drop.scatter(-1, order, drop), float("-inf"))


def serving_processors() -> ContinuousBatchingLogitsProcessorList:
    """The logits processors of a manager built greedy (``do_sample=False``) that samples the rows whose
    request passes to ``add_request`` a temperature that :func:`kivi.sampling.is_greedy_temperature` does not
    call greedy (and ``top_p``)."""
    temperatures = _Temperatures()
    processors = ContinuousBatchingLogitsProcessorList(LogitsProcessorList([temperatures, _SampleRows(temperatures)]))
    processors.tensors_required = 2  # one argument row each (transformers counts only the processors it converts)
    return processors


__all__ = ["serving_processors"]
