"""One request in flight: the engine's token outputs turned into text deltas, with stop sequences,
the finish reason, and cancellation when the consumer goes away."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from typing import Any

from .engine import Aborted, Engine, Sampling
from .stop import StopMatcher


class GenerationFailed(RuntimeError):
    """The manager failed this request (``output.error``)."""


class RequestAborted(RuntimeError):
    """The server ended this request before it finished (it is shutting down)."""


class RunningRequest:
    """Submit ``input_ids`` and iterate :meth:`deltas` for the generated text.

    Text is decoded incrementally with the tokenizer's ``DecodeStream`` (as transformers' ``CBStreamer``
    does): a piece appears once its bytes form whole characters. If the iteration stops before the
    request finished (the client disconnected, the task was cancelled, an error) the request is
    cancelled in the engine, which frees its pages.
    """

    def __init__(self, engine: Engine, input_ids: list[int], sampling: Sampling, stop: tuple[str, ...]) -> None:
        from tokenizers.decoders import DecodeStream

        self.engine, self.sampling = engine, sampling
        self.prompt_tokens = len(input_ids)
        self.completion_tokens = 0
        self.finish_reason: str | None = None
        self._outputs: asyncio.Queue[Any] = asyncio.Queue()
        self._stop = StopMatcher(list(stop))
        self._decode = DecodeStream(skip_special_tokens=True)
        self._rust_tokenizer = engine.tokenizer._tokenizer
        self.request_id = engine.submit(input_ids, sampling, self._outputs.put_nowait)

    async def deltas(self) -> AsyncIterator[str]:
        """The generated text, piece by piece; :attr:`finish_reason` is set when it ends normally."""
        try:
            last_token = None
            while self.finish_reason is None:
                output = await self._outputs.get()
                if isinstance(output, Aborted):
                    raise RequestAborted(output.reason)
                new = output.generated_tokens[self.completion_tokens:]
                for token in new:
                    self.completion_tokens += 1
                    last_token = token
                    piece = self._decode.step(self._rust_tokenizer, token)
                    text = self._stop.feed(piece) if piece else ""
                    if text:
                        yield text
                    if self._stop.stopped:
                        self.finish_reason = "stop"
                        self.engine.cancel(self.request_id, stopped=True)  # frees its pages now
                        return
                if output.error is not None:
                    raise GenerationFailed(output.error)
                if output.is_finished():
                    tail = self._stop.flush()
                    if tail:
                        yield tail
                    hit_eos = (not self.sampling.ignore_eos and last_token is not None
                               and last_token in self._eos_ids())
                    self.finish_reason = "length" if not hit_eos and self.completion_tokens >= \
                        self.sampling.max_new_tokens else "stop"
        finally:
            if self.finish_reason is None:  # abandoned: the client left, or an error
                self.engine.cancel(self.request_id)

    async def text(self) -> str:
        return "".join([piece async for piece in self.deltas()])

    def _eos_ids(self) -> tuple[int, ...]:
        eos = self.engine.eos_token_id
        return tuple(eos) if isinstance(eos, (list, tuple)) else (eos,)
