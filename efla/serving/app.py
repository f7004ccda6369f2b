"""``create_app``: OpenAI's ``/v1/completions`` and ``/v1/models`` and a ``/health`` report, on FastAPI,
in front of a ``Scheduler``.

Handlers tokenize, check and submit; the scheduler's thread hands each request's events to the
handler's event loop (``call_soon_threadsafe``). A streamed completion is server-sent events, one
per piece of text, ending with ``data: [DONE]``. A client that goes away (a closed stream, or a
dropped connection while a plain request waits) cancels its requests, whose slots the scheduler
frees at its next step. With an API key, every ``/v1`` route needs ``Authorization: Bearer KEY``;
``/health`` stays open for probes. The server writes no files.
"""

from __future__ import annotations

import asyncio
import json
import secrets
import time
from contextlib import asynccontextmanager, suppress

from fastapi import APIRouter, Depends, FastAPI, Header, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, StreamingResponse
from starlette.concurrency import run_in_threadpool
from starlette.exceptions import HTTPException as StarletteHTTPException

from .protocol import (
    DEFAULTS_ONLY,
    APIError,
    CompletionRequest,
    choice,
    completion_object,
    error_body,
    model_list,
    new_completion_id,
    usage,
)
from .requests import ErrorEvent, FinishEvent, QueueFull, SamplingParams, ShuttingDown
from .scheduler import Scheduler

__all__ = ["create_app"]


def create_app(scheduler: Scheduler, tokenizer, *, model_name: str, api_key: str | None = None) -> FastAPI:
    """The HTTP app serving ``scheduler``'s model as ``model_name``; it starts the scheduler and, when
    the server shuts down, ends what is still queued or running and stops it."""
    created = int(time.time())

    @asynccontextmanager
    async def lifespan(_app: FastAPI):
        scheduler.start()
        yield
        await run_in_threadpool(scheduler.close)

    app = FastAPI(title="efla", lifespan=lifespan, docs_url=None, redoc_url=None, openapi_url=None)
    _add_error_handlers(app)
    v1 = APIRouter(prefix="/v1", dependencies=[Depends(_key_check(api_key))])

    @v1.get("/models")
    async def models():
        return model_list(model_name, created)

    @v1.post("/completions")
    async def completions(body: CompletionRequest, request: Request):
        if body.model != model_name:
            raise APIError(
                404,
                f"The model '{body.model}' does not exist; this server serves '{model_name}'",
                param="model",
                code="model_not_found",
            )
        prompts = await run_in_threadpool(_encode, tokenizer, body.prompts)
        _check_lengths(prompts, body.max_tokens, scheduler.max_context)
        completion = _Completion(scheduler, model_name, prompts, _sampling(body))
        if body.stream:
            include_usage = body.stream_options is not None and body.stream_options.include_usage
            return StreamingResponse(completion.stream(request, include_usage), media_type="text/event-stream")
        return await completion.result(request)

    @app.get("/health")
    async def health():
        alive = scheduler.running
        return JSONResponse(
            {"status": "ok" if alive else "stopped", "model": model_name, **scheduler.status()}, status_code=200 if alive else 503
        )

    app.include_router(v1)
    return app


def _key_check(api_key: str | None):
    async def check(authorization: str | None = Header(None)) -> None:
        if api_key is None:
            return
        scheme, _, key = (authorization or "").partition(" ")
        if scheme.lower() != "bearer" or not secrets.compare_digest(key.strip().encode(), api_key.encode()):
            raise APIError(
                401, "Missing or incorrect API key: send the header 'Authorization: Bearer KEY'", code="invalid_api_key"
            )

    return check


def _encode(tokenizer, prompts: list[str]) -> list[list[int]]:
    return [list(ids) for ids in tokenizer(prompts)["input_ids"]]


def _check_lengths(prompts: list[list[int]], max_tokens: int, max_context: int) -> None:
    for ids in prompts:
        if not ids:
            raise APIError(400, "prompt: a prompt encodes to no tokens", param="prompt")
        if len(ids) >= max_context:
            raise APIError(
                400,
                f"prompt: {len(ids)} tokens, but this server's context is {max_context} tokens (prompt and completion)",
                param="prompt",
                code="context_length_exceeded",
            )
        if len(ids) + max_tokens > max_context:
            raise APIError(
                400,
                f"max_tokens: the prompt's {len(ids)} tokens and max_tokens = {max_tokens} exceed "
                f"this server's context of {max_context} tokens",
                param="max_tokens",
                code="context_length_exceeded",
            )


def _sampling(body: CompletionRequest) -> SamplingParams:
    return SamplingParams(
        max_tokens=body.max_tokens,
        temperature=body.temperature,
        top_k=max(body.top_k, 0),
        top_p=body.top_p,
        seed=body.seed,
        stop=body.stop_strings,
    )


class _Completion:
    """One ``/v1/completions`` call: its requests in the scheduler and their events."""

    def __init__(self, scheduler: Scheduler, model_name: str, prompts: list[list[int]], params: SamplingParams):
        self.scheduler, self.model_name = scheduler, model_name
        self.id = new_completion_id()
        self.events: asyncio.Queue = asyncio.Queue()
        loop = asyncio.get_running_loop()

        def on_event(request, event) -> None:  # called in the scheduler's thread
            # RuntimeError: the event loop has closed, nobody waits for this request any more
            with suppress(RuntimeError):
                loop.call_soon_threadsafe(self.events.put_nowait, (request.index, event))

        try:
            self.requests = scheduler.submit(prompts, params, on_event)
        except QueueFull as error:
            raise APIError(429, f"The server is busy: {error}; retry later", type="rate_limit_error", code="queue_full") from None
        except ShuttingDown as error:
            raise APIError(503, f"{error}; retry on another server", type="server_error", code="shutting_down") from None
        except ValueError as error:
            raise APIError(400, str(error), param=str(error).split(":")[0]) from None

    async def _events(self):
        """``(index, event)`` until every request has finished or failed; cancels the unfinished ones
        if the consumer stops early (the client went away)."""
        open_requests = len(self.requests)
        try:
            while open_requests:
                index, event = await self.events.get()
                if isinstance(event, (FinishEvent, ErrorEvent)):
                    open_requests -= 1
                yield index, event
        finally:
            if open_requests:
                self.scheduler.cancel(self.requests)

    async def stream(self, request: Request, include_usage: bool):
        watcher = self._cancel_on_disconnect(request)
        try:
            prompt_tokens = completion_tokens = 0
            async for index, event in self._events():
                if isinstance(event, ErrorEvent):
                    yield _sse(error_body(event.message, "server_error"))
                    break
                finish = event.reason if isinstance(event, FinishEvent) else None
                if event.text or finish:
                    yield _sse(completion_object(self.id, self.model_name, [choice(index, event.text, finish)], None))
                if finish:
                    prompt_tokens += event.prompt_tokens
                    completion_tokens += event.completion_tokens
            else:
                if include_usage:
                    yield _sse(completion_object(self.id, self.model_name, [], usage(prompt_tokens, completion_tokens)))
            yield "data: [DONE]\n\n"
        finally:
            watcher.cancel()

    async def result(self, request: Request):
        watcher = self._cancel_on_disconnect(request)
        try:
            return await self._collect()
        finally:
            watcher.cancel()

    def _cancel_on_disconnect(self, request: Request) -> asyncio.Task:
        """A task that cancels the requests when the client disconnects, also while no event is due
        (a request waiting for a slot)."""

        async def watch() -> None:
            while (await request.receive())["type"] != "http.disconnect":
                pass
            self.scheduler.cancel(self.requests)

        return asyncio.ensure_future(watch())

    async def _collect(self):
        texts, reasons = [[] for _ in self.requests], [None] * len(self.requests)
        prompt_tokens = completion_tokens = 0
        async for index, event in self._events():
            if isinstance(event, ErrorEvent):
                self.scheduler.cancel(self.requests)
                return JSONResponse(error_body(event.message, "server_error"), status_code=500)
            texts[index].append(event.text)
            if isinstance(event, FinishEvent):
                reasons[index] = event.reason
                prompt_tokens += event.prompt_tokens
                completion_tokens += event.completion_tokens
        choices = [choice(i, "".join(t), r) for i, (t, r) in enumerate(zip(texts, reasons))]
        return completion_object(self.id, self.model_name, choices, usage(prompt_tokens, completion_tokens))


def _sse(obj: dict) -> str:
    return f"data: {json.dumps(obj, ensure_ascii=False)}\n\n"


def _add_error_handlers(app: FastAPI) -> None:
    @app.exception_handler(APIError)
    async def api_error(_request: Request, error: APIError):
        return JSONResponse(error.body(), status_code=error.status)

    @app.exception_handler(RequestValidationError)
    async def invalid_request(_request: Request, error: RequestValidationError):
        message, param = _validation_message(error.errors())
        return JSONResponse(error_body(message, param=param), status_code=400)

    @app.exception_handler(StarletteHTTPException)
    async def http_error(_request: Request, error: StarletteHTTPException):
        return JSONResponse(
            error_body(str(error.detail), code=str(error.status_code)),
            status_code=error.status_code,
            headers=getattr(error, "headers", None),
        )


def _validation_message(errors) -> tuple[str, str | None]:
    """One line naming the first wrong field, and that field."""
    first = errors[0] if errors else {"loc": ("body",), "msg": "invalid request", "type": ""}
    loc = [str(part) for part in first.get("loc", ()) if part != "body"]
    kind = first.get("type", "")
    if kind == "json_invalid":
        return "the request body is not valid JSON", None
    if not loc:
        return "the request body must be a JSON object of the request's fields", None
    param = loc[0]
    if param in DEFAULTS_ONLY:
        return f"{param}: not supported by this server beyond its default", param
    if kind == "extra_forbidden":
        return f"{param}: unrecognized request argument" + (f" {loc[-1]!r}" if len(loc) > 1 else ""), param
    if param in _STRINGS and kind.endswith("_type"):
        return f"{param}: expected a string or a list of strings", param
    return f"{param}: {first.get('msg', 'invalid value').removeprefix('Value error, ')}", param


_STRINGS = ("prompt", "stop")  # fields of a string or a list of strings (pydantic reports each alternative)
