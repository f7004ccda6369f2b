"""``create_app``: OpenAI's ``/v1/completions``, ``/v1/chat/completions`` and ``/v1/models``, vLLM's
``/tokenize`` and ``/detokenize``, Prometheus ``/metrics`` and a ``/health`` report, on FastAPI, in
front of a ``Scheduler``.

Handlers tokenize (chat messages through the tokenizer's chat template, or the one the server was
given), check and submit a ``Run``; streamed responses are server-sent events ending with
``data: [DONE]``. With an API key, every route but ``/health`` (open for probes) needs
``Authorization: Bearer KEY``. Each request's body is read first, bounded in size and time and checked
for UTF-8 and JSON nesting (``efla.serving.limits``). The server writes no files.
"""

from __future__ import annotations

import hashlib
import hmac
import time
from contextlib import asynccontextmanager
from functools import cache, partial

from fastapi import APIRouter, Depends, FastAPI, Header, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response, StreamingResponse
from starlette.concurrency import run_in_threadpool
from starlette.exceptions import HTTPException as StarletteHTTPException

from .chat import render_chat
from .responses import ChatResponse, CompletionResponse
from .limits import DEFAULT_MAX_BODY_BYTES, BodyGuard
from .metrics import Metrics
from .openapi import ChatCompletion, Completion, Health, ModelCard, ModelList, Text, Tokens, documented, server_openapi
from .protocol import (
    DEFAULTS_ONLY,
    RETRY_AFTER_DRAINING_S,
    APIError,
    ChatCompletionRequest,
    CompletionRequest,
    DetokenizeRequest,
    TokenizeRequest,
    error_body,
    model_card,
    model_list,
)
from .requests import SamplingParams
from .runs import Run
from .scheduler import Scheduler
from .structured import Grammars

__all__ = ["create_app"]


def create_app(
    scheduler: Scheduler,
    tokenizer,
    *,
    model_name: str,
    api_key: str | None = None,
    chat_template: str | None = None,
    max_body_bytes: int = DEFAULT_MAX_BODY_BYTES,
    read_timeout: float = 10.0,
) -> FastAPI:
    """The HTTP app serving ``scheduler``'s model as ``model_name``; it starts the scheduler and, when
    the server shuts down, ends what is still queued or running and stops it. ``chat_template``: a
    Jinja chat template used instead of the tokenizer's own; ``max_body_bytes``, ``read_timeout``: a
    request body's limits (413, 408)."""
    created = int(time.time())
    metrics = Metrics(scheduler)
    grammars = Grammars(tokenizer, scheduler.vocab, scheduler.stop_tokens)

    @asynccontextmanager
    async def lifespan(_app: FastAPI):
        scheduler.start()
        yield
        await run_in_threadpool(scheduler.close)

    app = FastAPI(title="efla", lifespan=lifespan, docs_url=None, redoc_url=None, openapi_url=None)
    _add_error_handlers(app)
    app.add_middleware(BodyGuard, max_bytes=max_body_bytes, read_timeout=read_timeout)
    keyed = [Depends(_key_check(api_key))]
    v1 = APIRouter(prefix="/v1", dependencies=keyed)
    keyed_routes = APIRouter(dependencies=keyed)

    def check_model(name: str | None) -> None:
        if name is not None and name != model_name:
            raise APIError(
                404,
                f"The model '{name}' does not exist; this server serves '{model_name}'",
                param="model",
                code="model_not_found",
            )

    @v1.get("/models", **documented(ModelList))
    async def models():
        return model_list(model_name, created, scheduler.max_context)

    @v1.get("/models/{model:path}", **documented(ModelCard, 404))
    async def model(model: str):
        check_model(model)
        return model_card(model_name, created, scheduler.max_context)

    @v1.post("/completions", **documented(Completion, *_GENERATION_ERRORS, stream=True))
    async def completions(body: CompletionRequest, request: Request):
        check_model(body.model)
        prompts = await run_in_threadpool(_encode, tokenizer, body.prompts)
        _check_lengths(prompts, body.max_tokens, scheduler.max_context, "prompt", "max_tokens")
        generated = body.best_of or body.n
        if generated > scheduler.max_batch:
            field = "best_of" if body.best_of else "n"
            message = f"{field}: at most {scheduler.max_batch} choices (this server's slots), got {generated}"
            raise APIError(400, message, param=field)
        grammar = await run_in_threadpool(grammars.compile, body.response_format)
        run = Run(scheduler, prompts, _completion_sampling(body, grammar, ranked=generated > body.n), generated, metrics)
        response = CompletionResponse(run, body, tokenizer, model_name, prompts)
        if body.stream:
            return StreamingResponse(response.stream(request), media_type="text/event-stream")
        return await response.result(request)

    @v1.post("/chat/completions", **documented(ChatCompletion, *_GENERATION_ERRORS, stream=True))
    async def chat_completions(body: ChatCompletionRequest, request: Request):
        check_model(body.model)
        prompt = await run_in_threadpool(render_chat, tokenizer, body.messages, chat_template, True)
        limit_name = "max_completion_tokens" if body.max_completion_tokens is not None else "max_tokens"
        limit = body.token_limit if body.token_limit is not None else max(scheduler.max_context - len(prompt), 1)
        _check_lengths([prompt], limit, scheduler.max_context, "messages", limit_name)
        grammar = await run_in_threadpool(grammars.compile, body.response_format)
        run = Run(scheduler, [prompt], _chat_sampling(body, limit, grammar), body.n, metrics)
        response = ChatResponse(run, body, tokenizer, model_name)
        if body.stream:
            return StreamingResponse(response.stream(request), media_type="text/event-stream")
        return await response.result(request)

    @keyed_routes.post("/tokenize", **documented(Tokens, *_BODY_ERRORS))
    async def tokenize(body: TokenizeRequest):
        check_model(body.model)
        if body.messages is not None:
            ids = await run_in_threadpool(
                render_chat, tokenizer, body.messages, chat_template, body.add_generation_prompt, body.add_special_tokens
            )
        else:
            add_special = True if body.add_special_tokens is None else body.add_special_tokens
            # off the event loop: a prompt of megabytes takes the tokenizer seconds
            encoded = await run_in_threadpool(tokenizer, body.prompt, add_special_tokens=add_special)
            ids = list(encoded["input_ids"])
        return {"tokens": ids, "count": len(ids), "max_model_len": scheduler.max_context}

    @keyed_routes.post("/detokenize", **documented(Text, *_BODY_ERRORS))
    async def detokenize(body: DetokenizeRequest):
        check_model(body.model)
        if any(not 0 <= t < scheduler.vocab for t in body.tokens):
            raise APIError(400, f"tokens: token ids must be in [0, {scheduler.vocab})", param="tokens")
        return {"prompt": await run_in_threadpool(tokenizer.decode, body.tokens)}

    @keyed_routes.get("/metrics", **documented(None, media_type="text/plain"))
    async def prometheus_metrics():
        return Response(metrics.exposition(), media_type="text/plain; version=0.0.4; charset=utf-8")

    @app.get("/health", response_model=None, responses={200: {"model": Health}, 503: {"model": Health}})
    async def health():
        state = "ok" if scheduler.accepting else "draining"
        state = state if scheduler.running else "stopped"
        headers = {"Retry-After": str(RETRY_AFTER_DRAINING_S)} if state != "ok" else None
        return JSONResponse(
            {"status": state, "model": model_name, **scheduler.status()},
            status_code=200 if state == "ok" else 503,
            headers=headers,
        )

    @keyed_routes.get("/openapi.json", include_in_schema=False)
    async def openapi():
        return app.openapi()

    app.include_router(v1)
    app.include_router(keyed_routes)
    schema_of_this_server = partial(
        server_openapi,
        app,
        model_name=model_name,
        max_context=scheduler.max_context,
        max_batch=scheduler.max_batch,
        vocab=scheduler.vocab,
    )
    app.openapi = cache(schema_of_this_server)
    return app


_BODY_ERRORS = (400, 404, 408, 413)
_GENERATION_ERRORS = (*_BODY_ERRORS, 429, 500)


def _digest(key: str) -> bytes:
    return hashlib.sha256(key.encode("utf-8", "surrogateescape")).digest()


def _key_check(api_key: str | None):
    # digests compared in constant time: neither the key's bytes nor its length show in the timing
    wanted = _digest(api_key) if api_key is not None else None

    async def check(authorization: str | None = Header(None)) -> None:
        if wanted is None:
            return
        scheme, _, key = (authorization or "").partition(" ")
        if not hmac.compare_digest(_digest(key.strip()), wanted) or scheme.lower() != "bearer":
            raise APIError(
                401, "Missing or incorrect API key: send the header 'Authorization: Bearer KEY'", code="invalid_api_key"
            )

    return check


def _encode(tokenizer, prompts: list[str | list[int]]) -> list[list[int]]:
    """Token ids of each prompt (a string is tokenized, token ids pass as they are)."""
    return [list(tokenizer(p)["input_ids"]) if isinstance(p, str) else list(p) for p in prompts]


def _check_lengths(prompts: list[list[int]], max_tokens: int, max_context: int, prompt_field: str, limit_field: str) -> None:
    for ids in prompts:
        if not ids:
            raise APIError(400, f"{prompt_field}: a prompt encodes to no tokens", param=prompt_field)
        if len(ids) >= max_context:
            raise APIError(
                400,
                f"{prompt_field}: {len(ids)} tokens, but this server's context is {max_context} tokens (prompt and completion)",
                param=prompt_field,
                code="context_length_exceeded",
            )
        if len(ids) + max_tokens > max_context:
            raise APIError(
                400,
                f"{limit_field}: the prompt's {len(ids)} tokens and {limit_field} = {max_tokens} exceed "
                f"this server's context of {max_context} tokens",
                param=limit_field,
                code="context_length_exceeded",
            )


def _completion_sampling(body: CompletionRequest, grammar, ranked: bool) -> SamplingParams:
    """``grammar``: of the ``response_format``; ``ranked``: best_of > n, whose choices are ranked by
    their log-probabilities."""
    logprobs = body.logprobs if body.logprobs is not None or not ranked else 0
    return _sampling(body, body.max_tokens, grammar, logprobs, prompt_logprobs=body.logprobs if body.echo else None)


def _chat_sampling(body: ChatCompletionRequest, max_tokens: int, grammar) -> SamplingParams:
    return _sampling(body, max_tokens, grammar, (body.top_logprobs or 0) if body.logprobs else None)


def _sampling(body: CompletionRequest | ChatCompletionRequest, max_tokens: int, grammar, logprobs, prompt_logprobs=None):
    """What both routes take alike; ``logprobs``: top log-probabilities per new token (``None``: none)."""
    return SamplingParams(
        max_tokens=max_tokens,
        temperature=body.temperature,
        top_k=max(body.top_k, 0),
        top_p=body.top_p,
        seed=body.seed,
        stop=body.stop_strings,
        stop_token_ids=tuple(body.stop_token_ids or ()),
        presence_penalty=body.presence_penalty,
        frequency_penalty=body.frequency_penalty,
        repetition_penalty=body.repetition_penalty,
        logit_bias=body.logit_bias_pairs,
        min_tokens=body.min_tokens,
        ignore_eos=body.ignore_eos,
        logprobs=logprobs,
        prompt_logprobs=prompt_logprobs,
        grammar=grammar,
    )


def _add_error_handlers(app: FastAPI) -> None:
    @app.exception_handler(APIError)
    async def api_error(_request: Request, error: APIError):
        return JSONResponse(error.body(), status_code=error.status, headers=error.headers)

    @app.exception_handler(RequestValidationError)
    async def invalid_request(_request: Request, error: RequestValidationError):
        message, param = _validation_message(error.errors())
        return JSONResponse(error_body(message, param=param), status_code=400)

    @app.exception_handler(StarletteHTTPException)
    async def http_error(request: Request, error: StarletteHTTPException):
        message = str(error.detail)
        if error.status_code in (404, 405):
            message = f"Invalid URL ({request.method} {request.url.path}): {message.lower()} on this server"
        return JSONResponse(
            error_body(message, code=str(error.status_code)),
            status_code=error.status_code,
            headers=getattr(error, "headers", None),
        )


def _validation_message(errors) -> tuple[str, str | None]:
    """One line naming the first wrong field, and that field."""
    first = errors[0] if errors else {"loc": ("body",), "msg": "invalid request", "type": ""}
    loc = [str(part) for part in first.get("loc", ()) if part != "body"]
    kind = first.get("type", "")
    message = first.get("msg", "invalid value").removeprefix("Value error, ")
    if kind == "json_invalid":
        return "the request body is not valid JSON", None
    if not loc and kind == "value_error":  # a check across fields: its message starts with the field
        param = message.split(":")[0]
        return message, param if param.isidentifier() else None
    if not loc:
        return "the request body must be a JSON object of the request's fields", None
    param = loc[0]
    if param in DEFAULTS_ONLY:
        return f"{param}: not supported by this server beyond its default", param
    if kind == "extra_forbidden":
        return f"{param}: unrecognized request argument" + (f" {loc[-1]!r}" if len(loc) > 1 else ""), param
    if param in _ALTERNATIVES and kind.endswith("_type"):
        return f"{param}: expected {_ALTERNATIVES[param]}", param
    return f"{param}: {message}", param


# fields of several shapes (pydantic reports each alternative)
_ALTERNATIVES = {
    "prompt": "a string, a list of strings, a list of token ids or a list of lists of token ids",
    "stop": "a string or a list of strings",
}
