"""The server's OpenAPI schema (``GET /openapi.json``): what each route answers, and the limits of
this server's requests.

The response models document the JSON the handlers build (``efla.serving.protocol``); they are not
used to build it. Every error is OpenAI's shape. The request models' bounds that depend on the
server (``max_tokens`` and a prompt's token ids below its context and vocabulary, ``n`` and
``best_of`` up to its slots) are written into the schema when it is made.
"""

from __future__ import annotations

from typing import Literal

from fastapi.openapi.utils import get_openapi
from pydantic import BaseModel, ConfigDict

__all__ = ["documented", "server_openapi"]


class _Error(BaseModel):
    message: str
    type: str
    param: str | None
    code: str | None


class ErrorResponse(BaseModel):
    error: _Error


class Usage(BaseModel):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int


class CompletionLogprobs(BaseModel):
    tokens: list[str]
    token_logprobs: list[float | None]
    top_logprobs: list[dict[str, float] | None]
    text_offset: list[int]


FinishReason = Literal["stop", "length"]


class CompletionChoice(BaseModel):
    index: int
    text: str
    logprobs: CompletionLogprobs | None
    finish_reason: FinishReason | None


class Completion(BaseModel):
    id: str
    object: Literal["text_completion"]
    created: int
    model: str
    choices: list[CompletionChoice]
    usage: Usage


class TopLogprob(BaseModel):
    token: str
    logprob: float
    bytes: list[int]


class TokenLogprob(TopLogprob):
    top_logprobs: list[TopLogprob]


class ChatLogprobs(BaseModel):
    content: list[TokenLogprob]


class AssistantMessage(BaseModel):
    role: Literal["assistant"]
    content: str


class ChatChoice(BaseModel):
    index: int
    message: AssistantMessage
    logprobs: ChatLogprobs | None
    finish_reason: FinishReason | None


class ChatCompletion(BaseModel):
    id: str
    object: Literal["chat.completion"]
    created: int
    model: str
    choices: list[ChatChoice]
    usage: Usage


class ModelCard(BaseModel):
    id: str
    object: Literal["model"]
    created: int
    owned_by: str
    max_model_len: int


class ModelList(BaseModel):
    object: Literal["list"]
    data: list[ModelCard]


class Tokens(BaseModel):
    tokens: list[int]
    count: int
    max_model_len: int


class Text(BaseModel):
    prompt: str


class Health(BaseModel):
    model_config = ConfigDict(extra="allow")  # the scheduler's counters
    status: Literal["ok", "draining", "stopped"]
    model: str
    slots_total: int
    slots_free: int
    waiting: int


_ERRORS = {
    400: "a field is wrong (``param`` names it), the prompt is too long, or the body is not UTF-8 JSON",
    401: "the API key is missing or wrong",
    404: "no such model or route",
    408: "the request body did not arrive in time",
    413: "the request body is too large",
    429: "the queue is full (``Retry-After``)",
    500: "generation failed (the server log has why)",
    503: "the server is shutting down or has too many connections (``Retry-After``)",
}
# each server-sent event: a JSON chunk (the answer's shape, one choice's piece) or [DONE]
_SSE = {"text/event-stream": {"schema": {"type": "object", "required": ["data"], "properties": {"data": {"type": "string"}}}}}


def documented(model: type[BaseModel] | None, *errors: int, stream: bool = False, media_type: str | None = None) -> dict:
    """A route decorator's arguments documenting its answer ``model`` (``None``: ``media_type`` text)
    and its error statuses (401 and the body's limits are added)."""
    ok: dict = {"description": "OK"}
    if model is not None:
        ok["model"] = model
    if stream:
        ok["content"] = dict(_SSE)
    if media_type is not None:
        ok["content"] = {media_type: {"schema": {"type": "string"}}}
    statuses = sorted({401, 503, *errors})
    responses = {200: ok, **{s: {"model": ErrorResponse, "description": _ERRORS[s]} for s in statuses}}
    return {"response_model": None, "responses": responses}


def _integer(prop: dict) -> dict:
    """The integer schema of a property (itself, or its alternative beside null)."""
    for option in prop.get("anyOf", [prop]):
        if option.get("type") == "integer":
            return option
    raise KeyError("no integer schema")


def server_openapi(app, *, model_name: str, max_context: int, max_batch: int, vocab: int) -> dict:
    """``app``'s OpenAPI schema with this server's bounds, and the shapes its validators check, in its
    request models."""
    schema = get_openapi(title=app.title, version=app.version, routes=app.routes)
    models = schema["components"]["schemas"]
    completion, chat = models["CompletionRequest"]["properties"], models["ChatCompletionRequest"]["properties"]
    token_id = {"type": "integer", "minimum": 0, "maximum": vocab - 1}
    for props in (completion, chat):
        props["model"] = {"type": "string", "enum": [model_name]}
        props["stop"] = {"anyOf": [_TEXT, {"type": "array", "items": _TEXT, "maxItems": 4}, {"type": "null"}]}
        props["stop_token_ids"] = {"anyOf": [{"type": "array", "items": token_id}, {"type": "null"}]}
        props["logit_bias"] = {"anyOf": [_LOGIT_BIAS, {"type": "null"}]}
        props["top_k"]["maximum"] = vocab
        props["min_tokens"]["maximum"] = max_context - 1
    for props, names in ((completion, ("max_tokens",)), (chat, ("max_tokens", "max_completion_tokens"))):
        for name in names:
            _integer(props[name])["maximum"] = max_context - 1
    for props, names in ((completion, ("n", "best_of")), (chat, ("n",))):
        for name in names:
            _integer(props[name])["maximum"] = max_batch
    ids = {"type": "array", "items": token_id, "minItems": 1}
    texts = {"type": "array", "items": _TEXT, "minItems": 1}
    completion["prompt"] = {"anyOf": [_TEXT, texts, ids, {"type": "array", "items": ids, "minItems": 1}]}
    chat["messages"] = {"type": "array", "items": _MESSAGE, "minItems": 1}
    tokenize = models["TokenizeRequest"]
    tokenize["properties"]["messages"] = {"anyOf": [chat["messages"], {"type": "null"}]}
    tokenize["oneOf"] = [  # a prompt or messages
        {"required": ["prompt"], "properties": {"prompt": {"type": "string"}, "messages": {"type": "null"}}},
        {"required": ["messages"], "properties": {"messages": chat["messages"], "prompt": {"type": "null"}}},
    ]
    detokenize = models["DetokenizeRequest"]["properties"]
    detokenize["tokens"] = {"type": "array", "items": token_id}
    for props in (tokenize["properties"], detokenize):
        props["model"] = {"anyOf": [{"type": "string", "enum": [model_name]}, {"type": "null"}]}
    for parameter in schema["paths"]["/v1/models/{model}"]["get"]["parameters"]:
        parameter["schema"] = {"type": "string", "enum": [model_name]}
    return schema


_TEXT = {"type": "string", "minLength": 1}
_LOGIT_BIAS = {
    "type": "object",
    "propertyNames": {"pattern": "^[0-9]+$"},
    "additionalProperties": {"type": "number", "minimum": -100, "maximum": 100},
}
_MESSAGE = {
    "type": "object",
    "required": ["role"],
    "properties": {
        "role": _TEXT,
        "content": {
            "anyOf": [
                {"type": "string"},
                {"type": "null"},
                {
                    "type": "array",
                    "items": {
                        "type": "object",
                        "required": ["type", "text"],
                        "properties": {"type": {"enum": ["text"]}, "text": {"type": "string"}},
                    },
                },
            ]
        },
    },
}
