"""What a client of the scheduler hands in and gets back: a request's sampling settings, the
request itself, the events of its progress (text, the end, an error), and the refusals of a full
queue or a server shutting down."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from .completion_text import CompletionText

__all__ = [
    "SamplingParams",
    "Request",
    "TokenLogprob",
    "TokenEvent",
    "FinishEvent",
    "ErrorEvent",
    "QueueFull",
    "ShuttingDown",
]


class QueueFull(RuntimeError):
    """More requests than free slots plus ``max_queue`` waiting places."""


class ShuttingDown(RuntimeError):
    """The scheduler no longer takes requests."""


@dataclass(frozen=True)
class SamplingParams:
    max_tokens: int = 16
    temperature: float = 0.0  # 0: greedy
    top_k: int = 0  # 0: off
    top_p: float = 1.0  # 1: off
    seed: int | None = None  # sampling only: a generator of the request's own
    stop: tuple[str, ...] = ()
    stop_token_ids: tuple[int, ...] = ()  # tokens that end the request as the end-of-sequence token does, besides it
    logprobs: int | None = None  # each new token's log-probability and this many top ones (None: off)
    prompt_logprobs: int | None = None  # the same for the prompt's tokens (None: off)
    # logit processors (efla.serving.processors)
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0  # 1: off
    logit_bias: tuple[tuple[int, float], ...] = ()  # (token, bias) pairs
    min_tokens: int = 0  # new tokens before a stop token may come
    ignore_eos: bool = False  # the end-of-sequence tokens do not end the request
    grammar: object | None = None  # a compiled response_format (efla.serving.structured); None: free text


@dataclass
class TokenLogprob:
    """A token's log-probability and the ``top`` most likely tokens' ``(token, logprob)`` at its place."""

    token: int
    logprob: float
    top: list[tuple[int, float]]


@dataclass
class TokenEvent:
    text: str  # new text ready to show ("" while a character or a possible stop string is incomplete)
    tokens: int = 1
    logprobs: list[TokenLogprob] = field(default_factory=list)  # of the new tokens, when asked for


@dataclass
class FinishEvent:
    text: str  # the rest of the text
    reason: str  # "length", "stop" or "cancelled"
    prompt_tokens: int
    completion_tokens: int
    logprobs: list[TokenLogprob] = field(default_factory=list)  # of the last token, when asked for


@dataclass
class ErrorEvent:
    message: str


@dataclass(eq=False)
class Request:
    """One prompt's generation; ``on_event(request, event)`` is called from the scheduler's thread."""

    prompt: list[int]
    params: SamplingParams
    on_event: Callable[[Request, object], None]
    index: int = 0  # its place among the prompts submitted together
    tokens: list[int] = field(default_factory=list)
    text: CompletionText | None = None
    slot: int | None = None
    row: int = -1  # its row in the decoding bucket
    prefilled: int = 0  # prompt tokens in its slot's state
    block_keys: list[bytes] = field(default_factory=list)
    save_points: list[int] = field(default_factory=list)
    generator: torch.Generator | None = None
    prompt_logprobs: list[TokenLogprob | None] | None = None  # set before its first event, when asked for
    fork_of: Request | None = None  # the request whose prefilled state this one starts from
    forks: list[Request] = field(default_factory=list)  # requests starting from this one's state
    matcher: object | None = None  # its grammar's state (params.grammar), from its admission
    cancelled: bool = False
    done: bool = False
