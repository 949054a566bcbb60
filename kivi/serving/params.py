"""The request bodies ``kivi serve`` accepts, checked field by field.

Every field is either used, accepted with its only supported value (``n=1``, ``echo=false``), or
refused with a 400 that names it: a parameter the server would silently ignore (``seed``,
``presence_penalty``, ``tools``, ...) changes what the client gets without telling it.
"""

from __future__ import annotations

import dataclasses
import json
from typing import Any

from ..sampling import is_greedy_temperature
from .errors import ApiError

#: fields both endpoints take
COMMON_FIELDS = ("model", "max_tokens", "temperature", "top_p", "stop", "stream", "stream_options", "n", "user",
                 "ignore_eos")
CHAT_FIELDS = COMMON_FIELDS + ("messages", "max_completion_tokens")
COMPLETION_FIELDS = COMMON_FIELDS + ("prompt", "echo", "suffix")
MAX_STOP_SEQUENCES = 4
CHAT_ROLES = ("system", "user", "assistant", "developer", "tool")


@dataclasses.dataclass(frozen=True)
class GenerationRequest:
    """A checked request. ``messages`` (chat) or ``prompt`` (completions: text, or token ids) is set.

    ``max_tokens=None``: as many as fit (the server's cap, the context, the budget). ``temperature``
    ``None`` or below :data:`kivi.sampling.GREEDY_BELOW`: greedy. ``ignore_eos`` (vLLM's extension field):
    the model's end token does not end the request, which then generates exactly ``max_tokens`` (stop
    sequences still end it).
    """

    model: str | None
    max_tokens: int | None
    temperature: float | None
    top_p: float
    stop: tuple[str, ...]
    stream: bool
    messages: tuple[dict[str, str], ...] = ()
    prompt: str | tuple[int, ...] | None = None
    ignore_eos: bool = False

    @property
    def greedy(self) -> bool:
        return self.temperature is None or is_greedy_temperature(self.temperature)

    @property
    def text_chars(self) -> int:
        """Characters of the text the tokenizer will read (0 for token ids): checked against the context
        before tokenizing."""
        if isinstance(self.prompt, str):
            return len(self.prompt)
        return sum(len(m["content"]) + len(m.get("name", "")) for m in self.messages)


def parse_json(raw: bytes) -> Any:
    """The request body as JSON (:class:`ApiError` 400 ``invalid_json`` for anything that is not: bad
    syntax or UTF-8, ``NaN`` / ``Infinity`` (not JSON, though Python's parser takes them), nesting deeper
    than Python's recursion limit, an integer of more than 4300 digits)."""
    def no_constant(name: str) -> Any:
        raise ValueError(f"{name} is not a JSON value")

    try:
        return json.loads(raw, parse_constant=no_constant)
    except RecursionError:
        raise ApiError(400, "the request body is not valid JSON: nested too deeply", code="invalid_json") from None
    except (ValueError, UnicodeDecodeError) as e:  # JSONDecodeError is a ValueError
        raise ApiError(400, f"the request body is not valid JSON: {e}", code="invalid_json") from None


def _bad(field: str, value: Any, allowed: str) -> ApiError:
    shown = repr(value)
    shown = shown if len(shown) <= 60 else shown[:57] + "..."
    return ApiError(400, f"{field}={shown} is invalid: {allowed}", param=field, code="invalid_value")


def _check_fields(body: Any, allowed: tuple[str, ...]) -> dict[str, Any]:
    if not isinstance(body, dict):
        raise ApiError(400, f"the request body must be a JSON object, got {type(body).__name__}", code="invalid_body")
    for key, value in body.items():
        if key not in allowed and value is not None:
            raise ApiError(400, f"unsupported field {key!r}: kivi serve accepts {', '.join(allowed)}",
                           param=key, code="unsupported_field")
    return {k: v for k, v in body.items() if v is not None}  # JSON null = not given, as in OpenAI's API


def _int(body: dict, field: str, low: int) -> int | None:
    v = body.get(field)
    if v is None:
        return None
    if isinstance(v, bool) or not isinstance(v, int) or v < low:
        raise _bad(field, v, f"an integer >= {low}")
    return v


def _number(body: dict, field: str, low: float, high: float, *, low_open: bool = False) -> float | None:
    v = body.get(field)
    if v is None:
        return None
    if isinstance(v, bool) or not isinstance(v, (int, float)) or not (low < v if low_open else low <= v) or v > high:
        raise _bad(field, v, f"a number in {'(' if low_open else '['}{low}, {high}]")
    return float(v)


def _common(body: dict) -> dict[str, Any]:
    model = body.get("model")
    if model is not None and not isinstance(model, str):
        raise _bad("model", model, "a string (any name: this server serves one model)")
    if "n" in body and (type(body["n"]) is not int or body["n"] != 1):
        raise _bad("n", body["n"], "only n=1 (the integer) is supported")
    stream = body.get("stream", False)
    if not isinstance(stream, bool):
        raise _bad("stream", stream, "true or false")
    opts = body.get("stream_options")
    if opts is not None and (not isinstance(opts, dict) or set(opts) - {"include_usage"}):
        raise _bad("stream_options", opts, 'an object with only "include_usage" (usage is always in the last chunk)')
    if "user" in body and not isinstance(body["user"], str):
        raise _bad("user", body["user"], "a string")
    stop = body.get("stop", ())
    if isinstance(stop, str):
        stop = (stop,)
    if (not isinstance(stop, (list, tuple)) or len(stop) > MAX_STOP_SEQUENCES
            or any(not isinstance(s, str) or not s for s in stop)):
        raise _bad("stop", stop, f"a non-empty string or a list of at most {MAX_STOP_SEQUENCES} non-empty strings")
    ignore_eos = body.get("ignore_eos", False)
    if not isinstance(ignore_eos, bool):
        raise _bad("ignore_eos", ignore_eos, "true or false")
    top_p = _number(body, "top_p", 0.0, 1.0, low_open=True)
    return {"model": model, "stream": stream, "stop": tuple(stop), "ignore_eos": ignore_eos,
            "temperature": _number(body, "temperature", 0.0, 2.0), "top_p": 1.0 if top_p is None else top_p}


def parse_chat(body: Any) -> GenerationRequest:
    """A checked ``/v1/chat/completions`` body (:class:`~kivi.serving.errors.ApiError` 400 naming the field)."""
    body = _check_fields(body, CHAT_FIELDS)
    messages = body.get("messages")
    if not isinstance(messages, list) or not messages:
        raise _bad("messages", messages, "a non-empty list of {role, content} objects")
    checked = []
    for i, m in enumerate(messages):
        field = f"messages[{i}]"
        if not isinstance(m, dict) or m.get("role") not in CHAT_ROLES:
            raise _bad(f"{field}.role", m.get("role") if isinstance(m, dict) else m, f"one of {', '.join(CHAT_ROLES)}")
        extra = set(m) - {"role", "content", "name"}
        if extra:
            raise ApiError(400, f"unsupported field {field}.{sorted(extra)[0]}: messages take role, content, name",
                           param=f"{field}.{sorted(extra)[0]}", code="unsupported_field")
        message = {"role": m["role"], "content": _content(m.get("content"), f"{field}.content")}
        if m.get("name") is not None:
            message["name"] = _text(m["name"], f"{field}.name", "a non-empty string")
        checked.append(message)
    max_tokens = _int(body, "max_completion_tokens", 1)
    max_tokens = _int(body, "max_tokens", 1) if max_tokens is None else max_tokens
    return GenerationRequest(max_tokens=max_tokens, messages=tuple(checked), **_common(body))


def _text(value: Any, field: str, allowed: str, *, empty: bool = False) -> str:
    """``value`` if it is a string the tokenizer can read: JSON's ``\\ud800`` escapes give lone
    surrogates, which are not text."""
    if not isinstance(value, str) or (not value and not empty):
        raise _bad(field, value, allowed)
    try:
        value.encode("utf-8")
    except UnicodeEncodeError as e:
        raise _bad(field, value, f"{allowed}; character {e.start} is a lone surrogate "
                                 f"(U+{ord(value[e.start]):04X}), not text") from None
    return value


def _content(content: Any, field: str) -> str:
    """A message's text: a string, or a list of ``{"type": "text", "text": ...}`` parts (joined)."""
    allowed = 'a string or a list of {"type": "text", "text": ...} parts (text only)'
    if isinstance(content, list) and all(isinstance(p, dict) and p.get("type") == "text"
                                         and isinstance(p.get("text"), str) for p in content):
        content = "".join(p["text"] for p in content)
    return _text(content, field, allowed, empty=True)


def parse_completion(body: Any) -> GenerationRequest:
    """A checked ``/v1/completions`` body; ``prompt`` is a string, a list of one string, or token ids."""
    body = _check_fields(body, COMPLETION_FIELDS)
    prompt = body.get("prompt")
    if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], str):
        prompt = prompt[0]
    if isinstance(prompt, list) and prompt and all(isinstance(t, int) and not isinstance(t, bool) and t >= 0
                                                   for t in prompt):
        prompt = tuple(prompt)
    else:
        prompt = _text(prompt, "prompt", "a non-empty string, a list of one string, or a list of token ids")
    if body.get("echo", False) is not False:
        raise _bad("echo", body["echo"], "only echo=false is supported")
    if body.get("suffix") not in (None, ""):
        raise _bad("suffix", body["suffix"], "suffix (fill-in-the-middle) is not supported")
    return GenerationRequest(max_tokens=_int(body, "max_tokens", 1), prompt=prompt, **_common(body))
