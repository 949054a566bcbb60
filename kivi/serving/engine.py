"""The serving engine: one continuous-batching manager over one model, shared by every HTTP request.

:class:`Engine` owns transformers' ``ContinuousBatchingManager`` (built by a *manager factory*, see
:data:`DEFAULT_FACTORY`), a dispatcher thread that routes the manager's outputs to the asyncio loop
of the request they belong to, the per-request checks (context length, cache budget) and the cache
statistics that ``GET /health`` reports.

Per-request sampling on one manager: transformers' continuous batching fixes ``do_sample`` and the
set of logits processors when the manager is built; per request it only takes processor arguments
(``add_request(..., temperature=, top_p=)``). The manager is built greedy (``do_sample=False``: an
argmax) with kivi's two processors (:mod:`kivi.serving.sampler`): a greedy request (``temperature``
0, or below :data:`kivi.sampling.GREEDY_BELOW`) gets the argmax of the model's logits, as ``model.generate`` greedy
(the serving tests check it), and costs no sort or draw; a sampled request's token is drawn from its
temperature-scaled top-p nucleus.

One request's failure stays its own: transformers ends its generation loop for good on any exception
in a step (every later request would get a 503). :func:`_keep_loop_alive` makes such an exception
fail the requests of that step's batch (they ran in one forward: which of them caused it is not
known) and keeps the loop going; requests outside the batch, and later ones, are served as before.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import math
import threading
import time
from collections.abc import Callable
from typing import Any

from transformers import GenerationConfig
from transformers.generation.configuration_utils import ContinuousBatchingConfig
from transformers.generation.continuous_batching.continuous_api import ContinuousBatchingManager

from ..batching import block_usage, init_continuous_batching
from ..batching.requests import InvalidRequest, check_context
from ..config import KiviConfig
from ..sampling import is_greedy_temperature
from .sampler import serving_processors

#: The manager factory's signature: ``factory(model, kivi_config, *, cache_memory, generation_config,
#: continuous_batching_config) -> ContinuousBatchingManager`` (with ``check_request_fits``,
#: ``request_blocks`` and ``capacity_blocks``).
ManagerFactory = Callable[..., ContinuousBatchingManager]


#: KIVI pages (or, with ``kivi_config=None``, transformers' float pages) in one byte budget.
DEFAULT_FACTORY: ManagerFactory = init_continuous_batching


_log = logging.getLogger(__name__)


#: the end token of a request that ignores the model's (no token id is -1: it never ends a request)
NO_EOS = -1


class RequestRefused(ValueError):
    """A request the engine cannot serve; ``code`` is the OpenAI-style error code, ``param`` the field."""

    def __init__(self, message: str, *, code: str, param: str | None = None) -> None:
        super().__init__(message)
        self.code, self.param = code, param


@dataclasses.dataclass(frozen=True)
class Sampling:
    """How one request picks tokens. ``temperature=None`` or below :data:`kivi.sampling.GREEDY_BELOW`: greedy.
    ``top_p`` in ``(0, 1]``: the most likely token is always kept, so a ``top_p`` that rounds to 0 in
    float32 is greedy as well. ``ignore_eos``: the model's end token does not end the request (it runs
    to ``max_new_tokens``)."""

    max_new_tokens: int
    temperature: float | None = None
    top_p: float = 1.0
    ignore_eos: bool = False

    def __post_init__(self) -> None:
        t, p = self.temperature, self.top_p
        if t is not None and not (math.isfinite(t) and t >= 0):
            raise ValueError(f"temperature={t!r} is invalid: a finite number >= 0, or None for greedy")
        if not (0 < p <= 1):
            raise ValueError(f"top_p={p!r} is invalid: a number in (0, 1]")

    @property
    def greedy(self) -> bool:
        return self.temperature is None or is_greedy_temperature(self.temperature)

    def processor_kwargs(self) -> dict[str, Any]:
        """The per-request arguments of :func:`~kivi.serving.sampler.serving_processors` (greedy: temperature 0)."""
        if self.greedy:
            return {"temperature": 0.0, "top_p": 1.0}
        return {"temperature": float(self.temperature), "top_p": float(self.top_p)}


@dataclasses.dataclass(frozen=True)
class Aborted:
    """The last thing a request's callback receives when the server ends it early
    (:meth:`Engine.abort_open_requests`)."""

    reason: str


@dataclasses.dataclass
class EngineStats:
    """What ``GET /health`` reports about the cache and the requests (blocks: :class:`kivi.batching.BlockUsage`;
    ``blocks_held`` = ``page_blocks_held`` + ``window_blocks_held``)."""

    blocks_total: int
    blocks_held: int
    page_blocks_held: int
    window_blocks_held: int
    blocks_cached: int
    requests_holding_blocks: int
    free_fraction: float
    requests_open: int
    requests_done: int
    requests_cancelled: int
    requests_failed: int


class Engine:
    """One continuous-batching manager shared by all requests (see the module docstring).

    ``submit`` returns a request id; outputs (transformers ``GenerationOutput``) reach ``on_output``
    on the caller's event loop. ``cancel`` frees a request's pages (the manager drops it from its
    scheduler and cache on its next step).
    """

    def __init__(self, model: Any, tokenizer: Any, kivi_config: KiviConfig | None, *, cache_memory: int,
                 max_new_tokens: int, max_batch_tokens: int = 512, page_size: int = 256,
                 factory: ManagerFactory | None = None, start_timeout: float = 120.0) -> None:
        from ..models import model_max_context

        self.model, self.tokenizer, self.kivi_config = model, tokenizer, kivi_config
        self.max_context = model_max_context(model)
        self.max_new_tokens = max_new_tokens
        #: the most characters a prompt of ``max_context`` tokens can have when every token is the
        #: vocabulary's longest (in characters: byte-level vocabularies spell a byte as one character)
        self.max_text_chars = self.max_context * max(map(len, tokenizer.get_vocab()), default=1)
        self._closing: str | None = None
        eos = model.generation_config.eos_token_id
        if eos is None:
            eos = tokenizer.eos_token_id
        self.eos_token_id = NO_EOS if eos is None else eos
        gen = GenerationConfig(do_sample=False, eos_token_id=self.eos_token_id, max_new_tokens=max_new_tokens)
        cb = ContinuousBatchingConfig(max_batch_tokens=max_batch_tokens, page_size=page_size,
                                      use_async_batching=False)
        factory = DEFAULT_FACTORY if factory is None else factory
        self.manager = factory(model, kivi_config, cache_memory=cache_memory, generation_config=gen,
                               continuous_batching_config=cb)
        self.manager.logit_processor = serving_processors()  # read when the loop starts (start() below)
        _keep_loop_alive(self.manager)
        self._routes: dict[str, tuple[asyncio.AbstractEventLoop, Callable[[Any], None]]] = {}
        self._lock = threading.Lock()
        self._counts = {"done": 0, "cancelled": 0, "failed": 0}
        self._next_id = 0
        self._stopping = threading.Event()
        self.manager.start()
        deadline = time.monotonic() + start_timeout
        while self.manager.batch_processor is None:  # the cache is built on the generation thread
            problem = self.fatal_error()
            if problem is None and time.monotonic() > deadline:
                problem = f"no cache within {start_timeout:.0f} s"
            if problem is not None:
                self.manager.stop(block=True, timeout=10, hard_stop=True)  # its thread would keep the process alive
                raise RuntimeError(f"the continuous-batching manager failed to start: {problem}")
            time.sleep(0.01)
        self._dispatcher = threading.Thread(target=self._dispatch, name="kivi-serve-dispatch", daemon=True)
        self._dispatcher.start()

    # ------------------------------------------------------------------ requests
    def check_text_length(self, chars: int, *, field: str) -> None:
        """Refuse text that cannot fit the context whatever it tokenizes to (:attr:`max_text_chars`),
        before the tokenizer spends time and memory on it."""
        if chars > self.max_text_chars:
            raise RequestRefused(
                f"{field} has {chars:,} characters: more than this model's maximum context of {self.max_context} "
                f"tokens can hold (at most {self.max_text_chars:,} characters)", code="context_length_exceeded",
                param=field)

    def plan(self, prompt_tokens: int, max_tokens: int | None, *, prompt_field: str = "prompt") -> int:
        """The ``max_new_tokens`` a request of ``prompt_tokens`` gets (``max_tokens`` asked, or ``None`` for
        as many as fit the context, the budget and the server's cap); :class:`RequestRefused` when it cannot run
        (``param``: ``prompt_field`` when the prompt alone is too long, else ``max_tokens``)."""
        try:
            check_context(prompt_tokens, max_tokens, self.max_context, prompt_param=prompt_field,
                          new_param="max_tokens")
        except InvalidRequest as e:
            raise RequestRefused(str(e), code=e.code, param=e.param) from None
        room = self.max_context - prompt_tokens
        if max_tokens is not None and max_tokens > self.max_new_tokens:
            raise RequestRefused(f"max_tokens={max_tokens} is above this server's limit of {self.max_new_tokens} "
                                 "(kivi serve --max-new-tokens)", code="max_tokens_exceeded", param="max_tokens")
        if max_tokens is None:
            max_tokens = self._largest_fitting(prompt_tokens, min(room, self.max_new_tokens))
        try:
            self.manager.check_request_fits(prompt_tokens, max_tokens)
        except ValueError as e:
            raise RequestRefused(f"the request does not fit the server's cache budget: {e}",
                                 code="cache_budget_exceeded", param="max_tokens") from None
        return max_tokens

    def _largest_fitting(self, prompt_tokens: int, upper: int) -> int:
        """Largest ``n <= upper`` with ``prompt_tokens + n`` within the budget (``upper`` when none fits:
        ``check_request_fits`` then names the numbers)."""
        fits = lambda n: self.manager.request_blocks(prompt_tokens + n) <= self.manager.capacity_blocks  # noqa: E731
        if not fits(1):
            return upper
        lo, hi = 1, upper
        while lo < hi:
            mid = (lo + hi + 1) // 2
            lo, hi = (mid, hi) if fits(mid) else (lo, mid - 1)
        return lo

    def submit(self, input_ids: list[int], sampling: Sampling, on_output: Callable[[Any], None]) -> str:
        """Queue a request (checked by :meth:`plan` first); ``on_output(GenerationOutput)`` runs on the
        running event loop for every new token and at the end."""
        problem = self.fatal_error()
        if problem is not None:
            raise RuntimeError(f"the generation loop has stopped: {problem}")
        if self._closing is not None:
            raise RuntimeError(self._closing)
        loop = asyncio.get_running_loop()
        with self._lock:
            request_id = f"kivi-{self._next_id}"
            self._next_id += 1
            self._routes[request_id] = (loop, on_output)
        eos = NO_EOS if sampling.ignore_eos else self.eos_token_id
        try:
            self.manager.add_request(list(input_ids), request_id=request_id, max_new_tokens=sampling.max_new_tokens,
                                     streaming=True, eos_token_id=eos, **sampling.processor_kwargs())
        except BaseException:
            with self._lock:
                self._routes.pop(request_id, None)
            raise
        return request_id

    def cancel(self, request_id: str, *, stopped: bool = False) -> None:
        """Stop a request and free its pages; no more outputs reach its callback. ``stopped``: it ended
        on a stop sequence (counted as done, not as cancelled)."""
        with self._lock:
            if self._routes.pop(request_id, None) is None:
                return  # finished (or cancelled) already
            self._counts["done" if stopped else "cancelled"] += 1
        self.manager.cancel_request(request_id)

    def close(self, reason: str) -> None:
        """Take no new request from now on (:meth:`submit` raises ``RuntimeError(reason)``)."""
        self._closing = reason

    def abort_open_requests(self, reason: str) -> int:
        """End every open request now: its callback gets :class:`Aborted` ``(reason)`` as its last output
        and the manager drops it (frees its pages). Returns how many there were (counted as cancelled)."""
        with self._lock:
            routes, self._routes = self._routes, {}
            self._counts["cancelled"] += len(routes)
        for request_id, (loop, callback) in routes.items():
            self.manager.cancel_request(request_id)
            loop.call_soon_threadsafe(callback, Aborted(reason))
        return len(routes)

    def _dispatch(self) -> None:
        """Route the manager's outputs to the loop of the request they belong to (a background thread)."""
        while not self._stopping.is_set():
            output = self.manager.get_result(timeout=0.05)
            if output is None:
                if self.fatal_error() is not None:  # get_result returns at once then: fail the open requests
                    self._fail_open_requests()
                    self._stopping.wait(0.1)
                continue
            with self._lock:
                route = self._routes.get(output.request_id)
                if route is not None and output.is_finished():
                    del self._routes[output.request_id]
                    self._counts["failed" if output.error is not None else "done"] += 1
            if route is not None:  # None: a cancelled request's last step
                loop, callback = route
                loop.call_soon_threadsafe(callback, output)

    def _fail_open_requests(self) -> None:
        from transformers.generation.continuous_batching.requests import GenerationOutput, RequestStatus

        with self._lock:
            routes, self._routes = self._routes, {}
            self._counts["failed"] += len(routes)
        for request_id, (loop, callback) in routes.items():
            out = GenerationOutput(request_id=request_id, status=RequestStatus.FAILED,
                                   error=f"the generation loop stopped: {self.fatal_error()}")
            loop.call_soon_threadsafe(callback, out)

    # ------------------------------------------------------------------ state
    def fatal_error(self) -> BaseException | None:
        return self.manager.background_thread_status.fatal_error

    def stats(self) -> EngineStats:
        """The cache's blocks (:func:`kivi.batching.block_usage`) and the request counts."""
        usage = block_usage(self.manager.batch_processor.cache)
        with self._lock:
            open_requests, counts = len(self._routes), dict(self._counts)
        return EngineStats(blocks_total=usage.total, blocks_held=usage.held, page_blocks_held=usage.pages,
                           window_blocks_held=usage.window, blocks_cached=usage.cached,
                           requests_holding_blocks=usage.requests,
                           free_fraction=round(usage.free_fraction, 6), requests_open=open_requests,
                           requests_done=counts["done"], requests_cancelled=counts["cancelled"],
                           requests_failed=counts["failed"])

    def stop(self, timeout: float = 10.0) -> None:
        """Stop the dispatcher and the manager (fails what is still running)."""
        self._stopping.set()
        if self.manager.is_running():
            self.manager.stop(block=True, timeout=timeout, hard_stop=True)
        self._dispatcher.join(timeout=timeout)


def _keep_loop_alive(manager: ContinuousBatchingManager) -> None:
    """Make an exception in one step of ``manager``'s generation loop fail that step's requests only.

    transformers' loop (``_run_generation_loop``) treats any exception of ``_generation_loop_body``
    as fatal: it fails every request and stops for good. The body is wrapped here, on this one
    manager (the manager class comes from the factory, so there is no subclass to put it in): the
    requests of the batch being processed that are still active are failed with the error (their
    output carries it, their blocks are freed) and the loop goes on. An exception with no active
    request in the batch to blame is not a request's failure: it stays fatal, as before.
    """
    body = manager._generation_loop_body

    def guarded(batch_processor: Any, bootstrapping: bool) -> bool:
        try:
            return body(batch_processor, bootstrapping)
        except Exception as error:  # noqa: BLE001 - re-raised below when no request can be blamed
            scheduler = batch_processor.scheduler
            states = [f.state for f in batch_processor.inputs_and_outputs.prepare_batch_update()[0]]
            blamed = [s for s in states if s.request_id in scheduler.active_requests]
            if not blamed:
                raise
            for state in blamed:
                batch_processor._handle_request_error(error, state)
                scheduler.finish_request(state.request_id)
            _log.warning("kivi serve: a generation step failed (%s: %s); its %d request(s) failed, the others go on",
                         type(error).__name__, error, len(blamed))
            return True

    manager._generation_loop_body = guarded
