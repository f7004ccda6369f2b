"""OpenAI's completions API: the request body (checked by pydantic), response objects and errors.

Errors have OpenAI's shape, ``{"error": {"message", "type", "param", "code"}}``. Fields of OpenAI's
API that this server does not implement are accepted only at their defaults (``n = 1``, no
``logprobs``, no ``echo``, no penalties or logit bias, no ``suffix``); unknown fields are refused,
so a request never silently loses a setting.
"""

from __future__ import annotations

import time
import uuid
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator

__all__ = [
    "CompletionRequest",
    "StreamOptions",
    "APIError",
    "error_body",
    "completion_object",
    "choice",
    "usage",
    "model_list",
    "new_completion_id",
    "DEFAULTS_ONLY",
]

MAX_STOP_STRINGS = 4  # OpenAI's limit
DEFAULTS_ONLY = ("n", "best_of", "echo", "logprobs", "suffix", "logit_bias", "presence_penalty", "frequency_penalty")


class APIError(Exception):
    """An error answered in OpenAI's shape with an HTTP status."""

    def __init__(
        self, status: int, message: str, type: str = "invalid_request_error", param: str | None = None, code: str | None = None
    ):
        super().__init__(message)
        self.status, self.message, self.type, self.param, self.code = status, message, type, param, code

    def body(self) -> dict:
        return error_body(self.message, self.type, self.param, self.code)


def error_body(message: str, type: str = "invalid_request_error", param: str | None = None, code: str | None = None) -> dict:
    return {"error": {"message": message, "type": type, "param": param, "code": code}}


class StreamOptions(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)
    include_usage: bool = False


class CompletionRequest(BaseModel):
    """``POST /v1/completions``: OpenAI's fields, plus ``top_k`` (0 or -1: off)."""

    model_config = ConfigDict(extra="forbid", strict=True)

    model: str
    prompt: str | list[str]
    max_tokens: int = Field(16, ge=1)
    temperature: float = Field(1.0, ge=0, le=2)
    top_p: float = Field(1.0, gt=0, le=1)
    top_k: int = Field(0, ge=-1)
    stop: str | list[str] | None = None
    seed: int | None = Field(None, ge=0, lt=2**63)
    stream: bool = False
    stream_options: StreamOptions | None = None
    n: Literal[1] = 1
    best_of: Literal[1] | None = None
    echo: Literal[False] = False
    logprobs: None = None
    suffix: None = None
    logit_bias: None = None
    presence_penalty: float = Field(0.0, ge=0, le=0)
    frequency_penalty: float = Field(0.0, ge=0, le=0)
    user: str | None = None

    @field_validator("prompt")
    @classmethod
    def _prompts_not_empty(cls, prompt):
        prompts = [prompt] if isinstance(prompt, str) else prompt
        if not prompts:
            raise ValueError("expected a string or a non-empty list of strings")
        if any(not p for p in prompts):
            raise ValueError("a prompt is empty")
        return prompt

    @field_validator("stop")
    @classmethod
    def _stop_strings(cls, stop):
        stops = [stop] if isinstance(stop, str) else stop or []
        if len(stops) > MAX_STOP_STRINGS:
            raise ValueError(f"at most {MAX_STOP_STRINGS} stop strings, got {len(stops)}")
        if any(not s for s in stops):
            raise ValueError("a stop string is empty")
        return stop

    @property
    def prompts(self) -> list[str]:
        return [self.prompt] if isinstance(self.prompt, str) else list(self.prompt)

    @property
    def stop_strings(self) -> tuple[str, ...]:
        return (self.stop,) if isinstance(self.stop, str) else tuple(self.stop or ())


def new_completion_id() -> str:
    return f"cmpl-{uuid.uuid4().hex}"


def choice(index: int, text: str, finish_reason: str | None) -> dict:
    return {"index": index, "text": text, "logprobs": None, "finish_reason": finish_reason}


def completion_object(completion_id: str, model: str, choices: list[dict], usage: dict | None) -> dict:
    obj = {"id": completion_id, "object": "text_completion", "created": int(time.time()), "model": model, "choices": choices}
    if usage is not None:
        obj["usage"] = usage
    return obj


def usage(prompt_tokens: int, completion_tokens: int) -> dict:
    return {
        "prompt_tokens": prompt_tokens,
        "completion_tokens": completion_tokens,
        "total_tokens": prompt_tokens + completion_tokens,
    }


def model_list(name: str, created: int) -> dict:
    return {"object": "list", "data": [{"id": name, "object": "model", "created": created, "owned_by": "efla"}]}
