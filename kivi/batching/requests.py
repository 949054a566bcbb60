"""The checks of a continuous-batching request, before anything is scheduled.

A request is a prompt (a list or tuple of token ids, or a 1-D integer tensor; not empty; every id in
``[0, vocab_size)``) and ``max_new_tokens`` (a positive int), and prompt + ``max_new_tokens`` must stay
within the model's context (``max_position_embeddings``). transformers' continuous batching checks none
of these: a bad request fails inside the generation loop (taking the other requests of its batch with
it) or runs past the model's positions without a word.

:func:`check_requests` (``generate_batch``, ``KiviBatchingManager.add_requests``) and
:func:`check_request` (``KiviBatchingManager.add_request``) run them all; ``kivi serve`` calls
:func:`check_prompt_ids` and :func:`check_context` for the same rules. Errors name the parameter (with
the request's index), the value and what is allowed: ``TypeError`` for a wrong type, otherwise
:class:`InvalidRequest` (a ``ValueError``) with a ``code`` saying which rule failed.
"""

from __future__ import annotations

import numbers
from dataclasses import dataclass
from typing import Any

import torch

from ..cache.support import max_position_embeddings, text_config


class InvalidRequest(ValueError):
    """A request that cannot run. ``param``: the parameter (``"inputs[2]"``, ``"max_new_tokens"``);
    ``code``: ``"empty_prompt"``, ``"invalid_value"`` (a token id or ``max_new_tokens`` out of range) or
    ``"context_length_exceeded"``."""

    def __init__(self, message: str, *, param: str, code: str) -> None:
        super().__init__(message)
        self.param, self.code = param, code


@dataclass(frozen=True)
class RequestLimits:
    """What a model accepts: token ids in ``[0, vocab_size)``, at most ``max_context`` tokens per request
    (``None``: the model's config does not say, not checked)."""

    vocab_size: int | None
    max_context: int | None

    @classmethod
    def of(cls, model: Any) -> RequestLimits:
        vocab = getattr(text_config(model.config), "vocab_size", None)
        vocab = vocab if isinstance(vocab, int) and not isinstance(vocab, bool) and vocab > 0 else None
        return cls(vocab, max_position_embeddings(model.config))


def _is_int(value: Any) -> bool:
    return isinstance(value, numbers.Integral) and not isinstance(value, bool)


def prompt_ids(prompt: Any, *, param: str = "inputs") -> list[int]:
    """``prompt`` as a list of ints; ``TypeError`` unless it is a list / tuple of ints or a 1-D integer tensor."""
    allowed = "a list of token ids (ints) or a 1-D integer tensor"
    if isinstance(prompt, torch.Tensor):
        if prompt.dim() != 1 or prompt.dtype == torch.bool or prompt.dtype.is_floating_point or prompt.is_complex():
            raise TypeError(f"{param} is a tensor of shape {list(prompt.shape)} and dtype {prompt.dtype}; "
                            f"a prompt must be {allowed}")
        return prompt.tolist()
    if isinstance(prompt, str):
        raise TypeError(f"{param} is a str ({prompt[:40]!r}); a prompt must be {allowed}: tokenize it first")
    if not isinstance(prompt, (list, tuple)):
        raise TypeError(f"{param} is a {type(prompt).__name__}; a prompt must be {allowed}")
    bad = next((i for i, t in enumerate(prompt) if not _is_int(t)), None)
    if bad is not None:
        raise TypeError(f"{param}[{bad}] = {prompt[bad]!r} ({type(prompt[bad]).__name__}); a prompt must be {allowed}")
    return [int(t) for t in prompt]


def check_prompt_ids(ids: list[int], vocab_size: int | None, *, param: str = "inputs") -> None:
    """:class:`InvalidRequest` when ``ids`` is empty or holds an id outside ``[0, vocab_size)``."""
    if not ids:
        raise InvalidRequest(f"{param} is empty (0 token ids); a prompt needs at least one token",
                             param=param, code="empty_prompt")
    if vocab_size is None:
        return
    bad = next((i for i, t in enumerate(ids) if not 0 <= t < vocab_size), None)
    if bad is not None:
        raise InvalidRequest(f"{param}[{bad}] = {ids[bad]} is not a token id of this model: ids must be in "
                             f"[0, {vocab_size}) (vocab_size={vocab_size})", param=param, code="invalid_value")


def check_max_new_tokens(value: Any, *, param: str = "max_new_tokens") -> int:
    """``value`` as an int; ``TypeError`` / :class:`InvalidRequest` unless it is a positive int."""
    if not _is_int(value):
        raise TypeError(f"{param}={value!r} ({type(value).__name__}) must be a positive int")
    if value < 1:
        raise InvalidRequest(f"{param}={value} must be a positive int (tokens to generate)", param=param,
                             code="invalid_value")
    return int(value)


def check_context(prompt_tokens: int, max_new_tokens: int | None, max_context: int | None, *,
                  prompt_param: str = "inputs", new_param: str = "max_new_tokens") -> None:
    """:class:`InvalidRequest` when the prompt is empty or ``prompt_tokens + max_new_tokens`` (at least one new
    token when ``max_new_tokens`` is ``None``) exceeds ``max_context``; ``param`` is ``prompt_param`` when the
    prompt alone leaves no room for a new token, else ``new_param``."""
    if prompt_tokens < 1:
        raise InvalidRequest(f"{prompt_param} is empty (0 tokens); a prompt needs at least one token",
                             param=prompt_param, code="empty_prompt")
    if max_context is None:
        return
    if prompt_tokens >= max_context:
        raise InvalidRequest(
            f"{prompt_param} has {prompt_tokens} tokens; this model's context is {max_context} tokens "
            "(max_position_embeddings), which leaves no room for a new token: shorten the prompt",
            param=prompt_param, code="context_length_exceeded")
    if max_new_tokens is not None and prompt_tokens + max_new_tokens > max_context:
        raise InvalidRequest(
            f"{prompt_param} has {prompt_tokens} tokens + {new_param}={max_new_tokens} = "
            f"{prompt_tokens + max_new_tokens}, beyond this model's context of {max_context} tokens "
            f"(max_position_embeddings): {new_param} may be at most {max_context - prompt_tokens}",
            param=new_param, code="context_length_exceeded")


def check_request(prompt: Any, max_new_tokens: Any, limits: RequestLimits, *, param: str = "inputs",
                  new_param: str = "max_new_tokens") -> list[int]:
    """Every check of one request (see the module docstring); returns the prompt as a list of ints."""
    new = check_max_new_tokens(max_new_tokens, param=new_param)
    ids = prompt_ids(prompt, param=param)
    check_prompt_ids(ids, limits.vocab_size, param=param)
    check_context(len(ids), new, limits.max_context, prompt_param=param, new_param=new_param)
    return ids


def check_requests(inputs: Any, max_new_tokens: Any, limits: RequestLimits, *,
                   param: str = "inputs") -> list[list[int]]:
    """:func:`check_request` for every prompt of ``inputs`` (``param[i]`` names one), all before any runs."""
    if isinstance(inputs, (str, torch.Tensor)) or not isinstance(inputs, (list, tuple)):
        raise TypeError(f"{param} is a {type(inputs).__name__}; it must be a list of prompts, each a list of "
                        "token ids (ints) or a 1-D integer tensor")
    return [check_request(p, max_new_tokens, limits, param=f"{param}[{i}]") for i, p in enumerate(inputs)]


__all__ = ["InvalidRequest", "RequestLimits", "prompt_ids", "check_prompt_ids", "check_max_new_tokens",
           "check_context", "check_request", "check_requests"]
