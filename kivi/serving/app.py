"""The FastAPI app of ``kivi serve``: OpenAI's chat completions and completions, streaming (SSE) and not,
``GET /v1/models`` and ``GET /health`` (with the cache's block counts).

Built from transformers' serving pieces (``transformers/cli/serving``, 5.24) where they fit: the
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
import time
import uuid
from collections.abc import AsyncIterator
from typing import Any

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, StreamingResponse
from starlette.exceptions import HTTPException as StarletteHTTPException
from transformers.cli.serving.chat_completion import ChatCompletionHandler
from transformers.cli.serving.completion import CompletionHandler
from transformers.cli.serving.utils import BaseHandler, Modality

from ..batching.requests import InvalidRequest, RequestLimits, check_prompt_ids
from .engine import Engine, RequestRefused, Sampling
from .errors import ApiError, error_body
from .params import GenerationRequest, parse_chat, parse_completion
from .running import GenerationFailed, RunningRequest


def build_app(engine: Engine, *, model_name: str) -> FastAPI:
    """The app serving ``engine``'s model under ``model_name`` (any ``model`` in a request is accepted)."""
    app = FastAPI(title="kivi serve", docs_url=None, redoc_url=None)
    created = int(time.time())
    # transformers' handlers, used only for their response builders (no model manager, no generation state)
    chat_builder = ChatCompletionHandler(model_manager=None, generation_state=None)  # type: ignore[arg-type]
    text_builder = CompletionHandler(model_manager=None, generation_state=None)  # type: ignore[arg-type]

    @app.exception_handler(ApiError)
    async def _api_error(_request: Request, exc: ApiError) -> JSONResponse:
        return JSONResponse(exc.body(), status_code=exc.status)

    @app.exception_handler(StarletteHTTPException)
    async def _http_error(_request: Request, exc: StarletteHTTPException) -> JSONResponse:
        return JSONResponse(error_body(exc.status_code, str(exc.detail)), status_code=exc.status_code)

    @app.exception_handler(Exception)
    async def _server_error(_request: Request, exc: Exception) -> JSONResponse:
        return JSONResponse(error_body(500, f"{type(exc).__name__}: {exc}"), status_code=500)

    @app.get("/v1/models")
    async def list_models() -> dict[str, Any]:
        return {"object": "list", "data": [{"id": model_name, "object": "model", "created": created,
                                            "owned_by": "kivi"}]}

    @app.get("/health")
    async def health() -> JSONResponse:
        problem = engine.fatal_error()
        stats = vars(engine.stats()) if engine.manager.batch_processor is not None else {}
        if problem is not None:
            return JSONResponse({"status": "unhealthy", "reason": str(problem), "cache": stats}, status_code=503)
        return JSONResponse({"status": "ok", "model": model_name, "cache": stats})

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request):
        req = parse_chat(await _json_body(request))
        ids = _chat_ids(engine, req)
        running = _start(engine, ids, req, "messages")
        rid = f"chatcmpl-{uuid.uuid4().hex}"
        if req.stream:
            async def events() -> AsyncIterator[str]:
                yield chat_builder._build_chunk_sse(rid, role="assistant", content="", model=model_name)
                async for piece in running.deltas():
                    yield chat_builder._build_chunk_sse(rid, content=piece, model=model_name)
                yield chat_builder._build_chunk_sse(rid, finish_reason=running.finish_reason, model=model_name,
                                                    usage=_usage(running))
            return _sse(events())
        text = await _complete(running, request)
        return chat_builder._build_completion(rid, text, model_name, finish_reason=running.finish_reason,
                                              usage=_usage(running))

    @app.post("/v1/completions")
    async def completions(request: Request):
        req = parse_completion(await _json_body(request))
        ids = _prompt_ids(engine, req)
        running = _start(engine, ids, req, "prompt")
        rid = f"cmpl-{uuid.uuid4().hex}"
        if req.stream:
            async def events() -> AsyncIterator[str]:
                async for piece in running.deltas():
                    yield text_builder._build_chunk_sse(rid, model_name, text=piece)
                yield text_builder._build_chunk_sse(rid, model_name, finish_reason=running.finish_reason,
                                                    usage=_usage(running))
            return _sse(events())
        text = await _complete(running, request)
        return {"id": rid, "object": "text_completion", "created": int(time.time()), "model": model_name,
                "choices": [{"index": 0, "text": text, "logprobs": None, "finish_reason": running.finish_reason}],
                "usage": _usage(running).model_dump()}

    return app


async def _json_body(request: Request) -> Any:
    raw = await request.body()
    try:
        return json.loads(raw)
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise ApiError(400, f"the request body is not valid JSON: {e}", code="invalid_json") from None


def _chat_ids(engine: Engine, req: GenerationRequest) -> list[int]:
    tok = engine.tokenizer
    if not getattr(tok, "chat_template", None):
        raise ApiError(400, "this model's tokenizer has no chat template; use /v1/completions with a prompt",
                       param="messages", code="no_chat_template")
    messages = BaseHandler.get_processor_inputs_from_messages(list(req.messages), Modality.LLM)
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
    sampling = Sampling(max_new, None if req.greedy else req.temperature, req.top_p)
    try:
        return RunningRequest(engine, ids, sampling, req.stop)
    except RuntimeError as e:  # the generation loop has stopped
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
    finally:
        if not task.done():
            task.cancel()  # RunningRequest.deltas cancels the request in the engine


def _usage(running: RunningRequest):
    from openai.types.completion_usage import CompletionUsage

    return CompletionUsage(prompt_tokens=running.prompt_tokens, completion_tokens=running.completion_tokens,
                           total_tokens=running.prompt_tokens + running.completion_tokens)


def _sse(events: AsyncIterator[str]) -> StreamingResponse:
    """SSE of ``events``, an OpenAI error event if generation fails mid-stream, then ``[DONE]``."""
    async def framed() -> AsyncIterator[str]:
        try:
            async for event in events:
                yield event
        except GenerationFailed as e:
            yield f"data: {json.dumps(error_body(500, f'generation failed: {e}', code='generation_failed'))}\n\n"
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
