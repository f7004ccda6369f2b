"""What a client of the scheduler hands in and gets back: a request's sampling settings, the
request itself, the events of its progress (text, the end, an error), and the refusals of a full
queue or a server shutting down."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from .text import CompletionText

__all__ = ["SamplingParams", "Request", "TokenEvent", "FinishEvent", "ErrorEvent", "QueueFull", "ShuttingDown"]


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


@dataclass
class TokenEvent:
    text: str  # new text ready to show ("" while a character or a possible stop string is incomplete)
    tokens: int = 1


@dataclass
class FinishEvent:
    text: str  # the rest of the text
    reason: str  # "length", "stop" or "cancelled"
    prompt_tokens: int
    completion_tokens: int


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
    block_keys: list[int] = field(default_factory=list)
    save_points: list[int] = field(default_factory=list)
    generator: torch.Generator | None = None
    cancelled: bool = False
    done: bool = False
