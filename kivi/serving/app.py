"""The FastAPI app of ``kivi serve``: OpenAI's chat completions and completions, streaming (SSE) and not,
``GET /v1/models`` and ``GET /health`` (with the cache's block counts).

Built from transformers' serving pieces (``transformers/cli/serving``, 5.24 and 5.25) where they fit: the
response objects and their SSE framing come from its ``ChatCompletionHandler`` / ``CompletionHandler``
(which build them from the ``openai`` package's types), the message flattening from its
``BaseHandler``. Its app factory (``build_server``) and its generation managers are not used: they
load hub models by name through its ``ModelManager`` (kivi serves the one model it loaded, KIVI
cache included), build the continuous-batching manager with ``model.init_continuous_batching`` and
the first request's sampling settings (no cache factory, no per-request temperature), answer
unsupported fields with a logged warning, and have no context / cache-budget check before a request
enters the scheduler (a request larger than the cache stalls or fails the whole batch).
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
import uuid
from collections.abc import AsyncIterator, Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Any

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, StreamingResponse
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.requests import ClientDisconnect
from transformers.cli.serving.chat_completion import ChatCompletionHandler
from transformers.cli.serving.completion import CompletionHandler
from transformers.cli.serving.utils import BaseHandler, Modality

from ..batching.requests import InvalidRequest, RequestLimits, check_prompt_ids
from .auth import RequireKey, check_api_key
from .engine import Engine, RequestRefused, Sampling
from .errors import ApiError, error_body
from .params import GenerationRequest, parse_chat, parse_completion, parse_json
from .running import GenerationFailed, RequestAborted, RunningRequest

logger = logging.getLogger(__name__)

#: the largest request body read by default (``kivi serve --max-body-size``): a body beyond it gets a 413
#: before it is read
DEFAULT_MAX_BODY_BYTES = 4 * 2**20


def build_app(engine: Engine, *, model_name: str, api_key: str | None = None,
              max_body_bytes: int = DEFAULT_MAX_BODY_BYTES) -> FastAPI:
    """The app serving ``engine``'s model under ``model_name`` (any ``model`` in a request is accepted).

    ``api_key``: every path but ``/health`` wants ``Authorization: Bearer <api_key>``, a 401 otherwise
    (:class:`~kivi.serving.auth.RequireKey`, before routing; a key outside printable ASCII is a ``ValueError``).
    A body is read up to ``max_body_bytes`` (413 beyond); parsing, checking
    and tokenizing a request run on one worker thread, so a large prompt never holds up the event loop
    (``/health``, streams in flight).
    """
    app = FastAPI(title="kivi serve", docs_url=None, redoc_url=None, openapi_url=None)
    created = int(time.time())
    # transformers' handlers, used only for their response builders (no model manager, no generation state)
    chat_builder = ChatCompletionHandler(model_manager=None, generation_state=None)  # type: ignore[arg-type]
    text_builder = CompletionHandler(model_manager=None, generation_state=None)  # type: ignore[arg-type]
    # one thread: the tokenizer is not shared across threads, and requests are prepared in arrival order
    worker = ThreadPoolExecutor(max_workers=1, thread_name_prefix="kivi-serve-prepare")
    names = _NameSupport(engine.tokenizer)
    app.add_middleware(RequireKey, api_key=check_api_key(api_key))  # before routing: 401 comes first

    @app.exception_handler(ApiError)
    async def _api_error(_request: Request, exc: ApiError) -> JSONResponse:
        headers = {"WWW-Authenticate": "Bearer"} if exc.status == 401 else None
        return JSONResponse(exc.body(), status_code=exc.status, headers=headers)

    @app.exception_handler(StarletteHTTPException)
    async def _http_error(_request: Request, exc: StarletteHTTPException) -> JSONResponse:
        return JSONResponse(error_body(exc.status_code, str(exc.detail)), status_code=exc.status_code)

    @app.exception_handler(Exception)
    async def _server_error(_request: Request, exc: Exception) -> JSONResponse:
        return JSONResponse(error_body(500, f"{type(exc).__name__}: {exc}"), status_code=500)

    async def prepare(request: Request, parse: Callable[[Any], GenerationRequest],
                      tokenize: Callable[[GenerationRequest], list[int]]) -> tuple[GenerationRequest, list[int]]:
        raw = await _read_body(request, max_body_bytes)

        def work() -> tuple[GenerationRequest, list[int]]:
            req = parse(parse_json(raw))
            field = "messages" if req.messages else "prompt"
            try:
                engine.check_text_length(req.text_chars, field=field)
            except RequestRefused as e:
                raise ApiError(400, str(e), param=e.param, code=e.code) from None
            return req, tokenize(req)

        return await asyncio.get_running_loop().run_in_executor(worker, work)

    @app.get("/v1/models")
    async def list_models() -> dict[str, Any]:
        return {"object": "list", "data": [{"id": model_name, "object": "model", "created": created,
                                            "owned_by": "kivi"}]}

    @app.api_route("/health", methods=["GET", "HEAD"])
    async def health() -> JSONResponse:
        problem = engine.fatal_error()
        stats = vars(engine.stats()) if engine.manager.batch_processor is not None else {}
        if problem is not None:
            return JSONResponse({"status": "unhealthy", "reason": str(problem), "cache": stats}, status_code=503)
        return JSONResponse({"status": "ok", "model": model_name, "cache": stats})

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request):
        req, ids = await prepare(request, parse_chat, lambda r: _chat_ids(engine, r, names))
        running = _start(engine, ids, req, "messages")
        rid = f"chatcmpl-{uuid.uuid4().hex}"
        if req.stream:
            async def events() -> AsyncIterator[str]:
                yield chat_builder._build_chunk_sse(rid, role="assistant", content="", model=model_name)
                async for piece in running.deltas():
                    yield chat_builder._build_chunk_sse(rid, content=piece, model=model_name)
                yield _with_usage(chat_builder._build_chunk_sse(rid, finish_reason=running.finish_reason,
                                                                model=model_name), running)
            return _sse(events())
        text = await _complete(running, request)
        return chat_builder._build_completion(rid, text, model_name, finish_reason=running.finish_reason,
                                              usage=_usage(running))

    @app.post("/v1/completions")
    async def completions(request: Request):
        req, ids = await prepare(request, parse_completion, lambda r: _prompt_ids(engine, r))
        running = _start(engine, ids, req, "prompt")
        rid = f"cmpl-{uuid.uuid4().hex}"
        if req.stream:
            async def events() -> AsyncIterator[str]:
                async for piece in running.deltas():
                    yield text_builder._build_chunk_sse(rid, model_name, text=piece)
                yield _with_usage(text_builder._build_chunk_sse(rid, model_name, finish_reason=running.finish_reason),
                                  running)
            return _sse(events())
        text = await _complete(running, request)
        return {"id": rid, "object": "text_completion", "created": int(time.time()), "model": model_name,
                "choices": [{"index": 0, "text": text, "logprobs": None, "finish_reason": running.finish_reason}],
                "usage": _usage(running).model_dump()}

    return app


async def _read_body(request: Request, limit: int) -> bytes:
    """The body, refused with a 413 as soon as it is known to exceed ``limit`` bytes (from
    ``Content-Length`` before reading, or while reading a body sent without one)."""
    too_large = ApiError(413, f"the request body is larger than this server's limit of {limit:,} bytes "
                              "(kivi serve --max-body-size)", code="request_too_large")
    declared = request.headers.get("content-length", "")
    if declared.isdigit() and int(declared) > limit:
        raise too_large
    chunks, size = [], 0
    try:
        async for chunk in request.stream():
            size += len(chunk)
            if size > limit:
                raise too_large
            chunks.append(chunk)
    except ClientDisconnect:  # gone before its body ended: nobody to answer, nothing to log but one line
        logger.info("a client left after %d bytes of its request body", size)
        raise ApiError(499, "the client closed the connection while sending its body",
                       code="client_closed_request") from None
    return b"".join(chunks)


class _NameSupport:
    """Whether the chat template shows ``messages[].name`` (rendered once with a probe name): when it
    does not, a request with a name gets a 400 rather than having it dropped."""

    PROBE = "kivi-probe-name-7f3a"

    def __init__(self, tokenizer: Any) -> None:
        self.tokenizer, self._reads = tokenizer, None

    def reads_name(self) -> bool:
        if self._reads is None:
            try:
                text = self.tokenizer.apply_chat_template(
                    [{"role": "user", "content": "x", "name": self.PROBE}], add_generation_prompt=True, tokenize=False)
                self._reads = self.PROBE in str(text)
            except Exception:  # noqa: BLE001 - a template that fails on the probe does not read names
                self._reads = False
        return self._reads


def _chat_ids(engine: Engine, req: GenerationRequest, names: _NameSupport) -> list[int]:
    tok = engine.tokenizer
    if not getattr(tok, "chat_template", None):
        raise ApiError(400, "this model's tokenizer has no chat template; use /v1/completions with a prompt",
                       param="messages", code="no_chat_template")
    messages = BaseHandler.get_processor_inputs_from_messages(list(req.messages), Modality.LLM)
    for i, (flat, given) in enumerate(zip(messages, req.messages)):
        if "name" in given:
            if not names.reads_name():
                raise ApiError(400, f"unsupported field messages[{i}].name: this model's chat template does not "
                               "show names, so it would be dropped", param=f"messages[{i}].name",
                               code="unsupported_field")
            flat["name"] = given["name"]
    try:
        enc = tok.apply_chat_template(messages, add_generation_prompt=True, tokenize=True, return_dict=True)
    except Exception as e:  # noqa: BLE001 - a template's own check (e.g. roles must alternate)
        raise ApiError(400, f"the chat template refused the messages: {e}", param="messages",
                       code="invalid_messages") from None
    return list(enc["input_ids"])


def _prompt_ids(engine: Engine, req: GenerationRequest) -> list[int]:
    if isinstance(req.prompt, tuple):
        try:
            check_prompt_ids(list(req.prompt), RequestLimits.of(engine.model).vocab_size, param="prompt")
        except InvalidRequest as e:
            raise ApiError(400, str(e), param="prompt", code=e.code) from None
        return list(req.prompt)
    return list(engine.tokenizer(req.prompt)["input_ids"])


def _start(engine: Engine, ids: list[int], req: GenerationRequest, prompt_field: str) -> RunningRequest:
    try:
        max_new = engine.plan(len(ids), req.max_tokens, prompt_field=prompt_field)
    except RequestRefused as e:
        raise ApiError(400, str(e), param=e.param, code=e.code) from None
    # a tiny temperature is greedy (Sampling.greedy)
    sampling = Sampling(max_new, req.temperature, req.top_p, ignore_eos=req.ignore_eos)
    try:
        return RunningRequest(engine, ids, sampling, req.stop)
    except RuntimeError as e:  # the generation loop has stopped, or the server is shutting down
        raise ApiError(503, str(e), code="engine_stopped") from None


#: how often a non-streamed request checks that its client is still there
DISCONNECT_POLL_S = 0.25


async def _complete(running: RunningRequest, request: Request) -> str:
    """The whole text of a non-streamed request. uvicorn does not cancel a handler whose client left,
    so the wait polls for the disconnect and cancels the request then (which frees its pages)."""
    task = asyncio.ensure_future(running.text())
    try:
        while not task.done():
            await asyncio.wait({task}, timeout=DISCONNECT_POLL_S)
            if not task.done() and await request.is_disconnected():
                raise ApiError(499, "the client closed the connection", code="client_closed_request")
        return task.result()
    except GenerationFailed as e:
        raise ApiError(500, f"generation failed: {e}", code="generation_failed") from None
    except RequestAborted as e:
        raise ApiError(503, str(e), code="server_shutting_down") from None
    finally:
        if not task.done():
            task.cancel()  # RunningRequest.deltas cancels the request in the engine


def _usage(running: RunningRequest):
    from openai.types.completion_usage import CompletionUsage

    return CompletionUsage(prompt_tokens=running.prompt_tokens, completion_tokens=running.completion_tokens,
                           total_tokens=running.prompt_tokens + running.completion_tokens)


def _with_usage(event: str, running: RunningRequest) -> str:
    """A stream's last chunk: the builder's ``finish_reason`` chunk (one choice) with the usage added.

    kivi's last chunk carries both, whatever ``stream_options`` says. transformers' builders cannot make it:
    from 5.25 on, a chunk given ``usage`` is a usage-only chunk with no choices (the finish reason is lost).
    """
    prefix = "data: "
    if not event.startswith(prefix):
        raise ValueError(f"event={event[:40]!r} is not an SSE data line")
    body = json.loads(event[len(prefix):])
    body["usage"] = _usage(running).model_dump(exclude_none=True)
    return f"{prefix}{json.dumps(body)}\n\n"


def _sse(events: AsyncIterator[str]) -> StreamingResponse:
    """SSE of ``events``, an OpenAI error event if generation fails mid-stream, then ``[DONE]``."""
    async def framed() -> AsyncIterator[str]:
        try:
            async for event in events:
                yield event
        except GenerationFailed as e:
            yield f"data: {json.dumps(error_body(500, f'generation failed: {e}', code='generation_failed'))}\n\n"
        except RequestAborted as e:
            yield f"data: {json.dumps(error_body(503, str(e), code='server_shutting_down'))}\n\n"
        yield "data: [DONE]\n\n"
    return _SSEResponse(framed(), media_type="text/event-stream")


class _SSEResponse(StreamingResponse):
    """A ``StreamingResponse`` that always watches for the client leaving and closes its iterator.

    Starlette (>= 1.0 under uvicorn's ASGI 2.4) notices a gone client only when a send fails and then
    leaves the body iterator to the garbage collector; here the disconnect cancels the stream at once
    and ``aclose()`` runs the iterator's ``finally`` blocks (``RunningRequest`` cancels the request
    there, which frees its pages).
    """

    async def __call__(self, scope, receive, send) -> None:  # noqa: ANN001 - ASGI
        import anyio

        try:
            async with anyio.create_task_group() as group:
                async def stream() -> None:
                    try:
                        await self.stream_response(send)
                    except OSError:  # the client is gone
                        pass
                    group.cancel_scope.cancel()

                group.start_soon(stream)
                await self.listen_for_disconnect(receive)
                group.cancel_scope.cancel()
        finally:
            await self.body_iterator.aclose()
