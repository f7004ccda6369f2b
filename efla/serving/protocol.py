"""OpenAI's completions and chat completions APIs: the request bodies (checked by pydantic), response
objects and errors.

Errors have OpenAI's shape, ``{"error": {"message", "type", "param", "code"}}``. Fields of OpenAI's
API that this server does not implement are accepted only at their defaults (no ``suffix``); unknown
fields are refused, so a request never silently loses a setting. Besides OpenAI's fields, a request
takes vLLM's ``top_k``, ``stop_token_ids``, ``repetition_penalty``, ``min_tokens`` and ``ignore_eos``.
"""

from __future__ import annotations

import time
import uuid
from typing import Any

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

__all__ = [
    "CompletionRequest",
    "ChatCompletionRequest",
    "TokenizeRequest",
    "DetokenizeRequest",
    "StreamOptions",
    "APIError",
    "error_body",
    "completion_object",
    "choice",
    "chat_object",
    "chat_choice",
    "chat_chunk_choice",
    "usage",
    "model_card",
    "model_list",
    "new_completion_id",
    "new_chat_id",
    "DEFAULTS_ONLY",
    "MAX_CHOICES",
]

MAX_STOP_STRINGS = 4  # OpenAI's limit
MAX_LOGPROBS = 20  # OpenAI's limit on logprobs and top_logprobs
MAX_CHOICES = 128  # OpenAI's limit on n and best_of
DEFAULTS_ONLY = ("suffix",)
MAX_LOGIT_BIAS = 100  # OpenAI's range: -100 to 100
RETRY_AFTER_BUSY_S = 1  # a full queue: a place frees as soon as one request ends
RETRY_AFTER_DRAINING_S = 5  # a server shutting down: about the time a replacement takes to start


class APIError(Exception):
    """An error answered in OpenAI's shape with an HTTP status."""

    def __init__(
        self,
        status: int,
        message: str,
        type: str = "invalid_request_error",
        param: str | None = None,
        code: str | None = None,
        headers: dict[str, str] | None = None,
    ):
        super().__init__(message)
        self.status, self.message, self.type, self.param, self.code = status, message, type, param, code
        self.headers = headers

    def body(self) -> dict:
        return error_body(self.message, self.type, self.param, self.code)


def error_body(message: str, type: str = "invalid_request_error", param: str | None = None, code: str | None = None) -> dict:
    return {"error": {"message": message, "type": type, "param": param, "code": code}}


class StreamOptions(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)
    include_usage: bool = False


def _stop_strings(stop):
    stops = [stop] if isinstance(stop, str) else stop or []
    if len(stops) > MAX_STOP_STRINGS:
        raise ValueError(f"at most {MAX_STOP_STRINGS} stop strings, got {len(stops)}")
    if any(not s for s in stops):
        raise ValueError("a stop string is empty")
    return stop


class _Sampling(BaseModel):
    """What completions and chat share: sampling, stop strings and tokens (``stop_token_ids``: vLLM's
    extension), choices, streaming."""

    model_config = ConfigDict(extra="forbid", strict=True)

    model: str
    temperature: float = Field(1.0, ge=0, le=2)
    top_p: float = Field(1.0, gt=0, le=1)
    top_k: int = Field(0, ge=-1)
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = None
    seed: int | None = Field(None, ge=0, lt=2**63)
    n: int = Field(1, ge=1, le=MAX_CHOICES)
    stream: bool = False
    stream_options: StreamOptions | None = None
    logit_bias: dict[str, float] | None = None
    presence_penalty: float = Field(0.0, ge=-2, le=2)
    frequency_penalty: float = Field(0.0, ge=-2, le=2)
    repetition_penalty: float = Field(1.0, gt=0)
    min_tokens: int = Field(0, ge=0)
    ignore_eos: bool = False
    response_format: dict[str, Any] | None = None  # checked when compiled (efla.serving.structured)
    user: str | None = None

    _check_stop = field_validator("stop")(_stop_strings)

    @field_validator("logit_bias")
    @classmethod
    def _logit_bias(cls, bias):
        for token, value in (bias or {}).items():
            if not token.isdigit():
                raise ValueError(f"expected token ids (strings of digits) as keys, got {token!r}")
            if not -MAX_LOGIT_BIAS <= value <= MAX_LOGIT_BIAS:
                raise ValueError(f"expected biases from -{MAX_LOGIT_BIAS} to {MAX_LOGIT_BIAS}, got {value}")
        return bias

    @property
    def logit_bias_pairs(self) -> tuple[tuple[int, float], ...]:
        return tuple((int(token), float(value)) for token, value in (self.logit_bias or {}).items())

    @property
    def stop_strings(self) -> tuple[str, ...]:
        return (self.stop,) if isinstance(self.stop, str) else tuple(self.stop or ())

    @property
    def include_usage(self) -> bool:
        return self.stream_options is not None and self.stream_options.include_usage


class CompletionRequest(_Sampling):
    """``POST /v1/completions``: OpenAI's fields, plus ``top_k`` (0 or -1: off). A prompt is a string,
    a list of strings, a list of token ids or a list of such lists."""

    prompt: str | list[str] | list[int] | list[list[int]]
    max_tokens: int = Field(16, ge=0)
    echo: bool = False
    logprobs: int | None = Field(None, ge=0, le=MAX_LOGPROBS)
    best_of: int | None = Field(None, ge=1, le=MAX_CHOICES)
    suffix: None = None

    @field_validator("prompt")
    @classmethod
    def _prompts_not_empty(cls, prompt):
        if not prompt:
            raise ValueError("expected a string, a non-empty list of strings or of token ids")
        prompts = [prompt] if isinstance(prompt, str) or isinstance(prompt[0], int) else prompt
        if any(len(p) == 0 for p in prompts):
            raise ValueError("a prompt is empty")
        if any(isinstance(p, list) and min(p) < 0 for p in prompts):
            raise ValueError("token ids must not be negative")
        return prompt

    @model_validator(mode="after")
    def _choices_and_length(self):
        if self.max_tokens == 0 and not self.echo:
            raise ValueError("max_tokens: 0 only with echo (the prompt's log-probabilities), else at least 1")
        if self.best_of is not None and self.best_of < self.n:
            raise ValueError(f"best_of: must be at least n ({self.n}), got {self.best_of}")
        if self.best_of is not None and self.best_of > self.n and self.stream:
            raise ValueError("best_of: greater than n cannot be streamed")
        return self

    @property
    def prompts(self) -> list[str | list[int]]:
        """One string or list of token ids per prompt."""
        if isinstance(self.prompt, str) or isinstance(self.prompt[0], int):
            return [self.prompt]
        return list(self.prompt)


class ChatCompletionRequest(_Sampling):
    """``POST /v1/chat/completions``: OpenAI's fields, plus ``top_k``. A message's content is a string
    or a list of text parts."""

    messages: list[dict[str, Any]] = Field(min_length=1)
    max_tokens: int | None = Field(None, ge=1)
    max_completion_tokens: int | None = Field(None, ge=1)
    logprobs: bool = False
    top_logprobs: int | None = Field(None, ge=0, le=MAX_LOGPROBS)

    @field_validator("messages")
    @classmethod
    def _messages(cls, messages):
        return [_message(m) for m in messages]

    @model_validator(mode="after")
    def _top_logprobs_needs_logprobs(self):
        if self.top_logprobs is not None and not self.logprobs:
            raise ValueError("top_logprobs: needs logprobs = true")
        return self

    @property
    def token_limit(self) -> int | None:
        return self.max_completion_tokens if self.max_completion_tokens is not None else self.max_tokens


def _message(message: dict[str, Any]) -> dict[str, Any]:
    """The message with its content as one string (text parts joined)."""
    role, content = message.get("role"), message.get("content")
    if not isinstance(role, str) or not role:
        raise ValueError("each message needs a role (a string)")
    if isinstance(content, list):
        if not all(isinstance(p, dict) and p.get("type") == "text" and isinstance(p.get("text"), str) for p in content):
            raise ValueError("a message's content parts must be text parts ({'type': 'text', 'text': ...})")
        content = "".join(p["text"] for p in content)
    elif content is not None and not isinstance(content, str):
        raise ValueError("a message's content must be a string or a list of text parts")
    return {**message, "content": content}


def new_completion_id() -> str:
    return f"cmpl-{uuid.uuid4().hex}"


def new_chat_id() -> str:
    return f"chatcmpl-{uuid.uuid4().hex}"


def choice(index: int, text: str, finish_reason: str | None, logprobs: dict | None = None) -> dict:
    return {"index": index, "text": text, "logprobs": logprobs, "finish_reason": finish_reason}


def completion_object(completion_id: str, model: str, choices: list[dict], usage: dict | None) -> dict:
    obj = {"id": completion_id, "object": "text_completion", "created": int(time.time()), "model": model, "choices": choices}
    if usage is not None:
        obj["usage"] = usage
    return obj


def chat_choice(index: int, content: str, finish_reason: str | None, logprobs: dict | None = None) -> dict:
    message = {"role": "assistant", "content": content}
    return {"index": index, "message": message, "logprobs": logprobs, "finish_reason": finish_reason}


def chat_chunk_choice(index: int, delta: dict, finish_reason: str | None, logprobs: dict | None = None) -> dict:
    return {"index": index, "delta": delta, "logprobs": logprobs, "finish_reason": finish_reason}


def chat_object(chat_id: str, model: str, choices: list[dict], usage: dict | None, chunk: bool = False) -> dict:
    obj = {
        "id": chat_id,
        "object": "chat.completion.chunk" if chunk else "chat.completion",
        "created": int(time.time()),
        "model": model,
        "choices": choices,
    }
    if usage is not None:
        obj["usage"] = usage
    return obj


def usage(prompt_tokens: int, completion_tokens: int) -> dict:
    return {
        "prompt_tokens": prompt_tokens,
        "completion_tokens": completion_tokens,
        "total_tokens": prompt_tokens + completion_tokens,
    }


def model_card(name: str, created: int, max_model_len: int) -> dict:
    return {"id": name, "object": "model", "created": created, "owned_by": "efla", "max_model_len": max_model_len}


def model_list(name: str, created: int, max_model_len: int) -> dict:
    return {"object": "list", "data": [model_card(name, created, max_model_len)]}


class TokenizeRequest(BaseModel):
    """``POST /tokenize`` (vLLM's): a ``prompt``, or chat ``messages`` rendered as for a chat completion."""

    model_config = ConfigDict(extra="forbid", strict=True)

    model: str | None = None
    prompt: str | None = None
    messages: list[dict[str, Any]] | None = None
    add_special_tokens: bool | None = None  # default: True for a prompt, False for messages (the template has them)
    add_generation_prompt: bool = True

    @field_validator("messages")
    @classmethod
    def _messages(cls, messages):
        if not messages:
            raise ValueError("expected a non-empty list of messages")
        return [_message(m) for m in messages]

    @model_validator(mode="after")
    def _prompt_or_messages(self):
        if (self.prompt is None) == (self.messages is None):
            raise ValueError("prompt: give either prompt or messages")
        return self


class DetokenizeRequest(BaseModel):
    """``POST /detokenize`` (vLLM's)."""

    model_config = ConfigDict(extra="forbid", strict=True)

    model: str | None = None
    tokens: list[int]
