"""``Run``: one API call's requests in the scheduler, their events handed to the handler's event loop,
and what each choice has gathered (text, log-probabilities, finish reason, token counts).

The scheduler's thread hands each request's events over with ``call_soon_threadsafe``. A client that
goes away (a closed stream, or a dropped connection while a plain request waits) cancels the run's
requests, whose slots the scheduler frees at its next step.
"""

from __future__ import annotations

import asyncio
import time
from contextlib import suppress
from dataclasses import dataclass, field

from fastapi import Request as HTTPRequest

from .metrics import Metrics
from .protocol import RETRY_AFTER_BUSY_S, RETRY_AFTER_DRAINING_S, APIError
from .requests import ErrorEvent, FinishEvent, QueueFull, Request, SamplingParams, ShuttingDown, TokenEvent, TokenLogprob
from .scheduler import Scheduler

__all__ = ["Run", "Choice"]


@dataclass
class Choice:
    """What one request has produced so far."""

    request: Request
    texts: list[str] = field(default_factory=list)
    logprobs: list[TokenLogprob] = field(default_factory=list)
    finish_reason: str | None = None
    completion_tokens: int = 0
    first_token_at: float | None = None

    @property
    def text(self) -> str:
        return "".join(self.texts)

    @property
    def cumulative_logprob(self) -> float:
        return sum(entry.logprob for entry in self.logprobs)


class Run:
    """The requests of ``prompts`` (``choices`` each) submitted to ``scheduler``; ``events()`` yields
    ``(choice, event)`` on the running event loop until all have ended."""

    def __init__(
        self,
        scheduler: Scheduler,
        prompts: list[list[int]],
        params: SamplingParams,
        choices: int,
        metrics: Metrics,
    ):
        self.scheduler, self.metrics, self.choices_per_prompt = scheduler, metrics, choices
        self.submitted_at = time.monotonic()
        self._queue: asyncio.Queue = asyncio.Queue()
        loop = asyncio.get_running_loop()

        def on_event(request, event) -> None:  # called in the scheduler's thread
            # RuntimeError: the event loop has closed, nobody waits for this request any more
            with suppress(RuntimeError):
                loop.call_soon_threadsafe(self._queue.put_nowait, (request.index, event))

        try:
            self.requests = scheduler.submit(prompts, params, on_event, choices)
        except QueueFull as error:
            raise APIError(
                429,
                f"The server is busy: {error}; retry later",
                type="rate_limit_error",
                code="queue_full",
                headers={"Retry-After": str(RETRY_AFTER_BUSY_S)},
            ) from None
        except ShuttingDown as error:
            raise APIError(
                503,
                f"{error}; retry on another server",
                type="server_error",
                code="shutting_down",
                headers={"Retry-After": str(RETRY_AFTER_DRAINING_S)},
            ) from None
        except ValueError as error:
            raise APIError(400, str(error), param=str(error).split(":")[0]) from None
        self.choices = [Choice(request) for request in self.requests]
        self.prompt_tokens = sum(len(r.prompt) for r in self.requests[::choices])

    @property
    def completion_tokens(self) -> int:
        return sum(c.completion_tokens for c in self.choices)

    async def events(self):
        """``(choice, event)`` until every request has finished or failed, each event's text and
        log-probabilities already added to its choice; cancels the unfinished requests if the
        consumer stops early (the client went away)."""
        open_requests = len(self.requests)
        try:
            while open_requests:
                index, event = await self._queue.get()
                if isinstance(event, (FinishEvent, ErrorEvent)):
                    open_requests -= 1
                if not isinstance(event, ErrorEvent):
                    self._add(self.choices[index], event)
                yield self.choices[index], event
        finally:
            if open_requests:
                self.scheduler.cancel(self.requests)

    def _add(self, choice: Choice, event) -> None:
        choice.texts.append(event.text)
        choice.logprobs += event.logprobs
        if choice.first_token_at is None and (isinstance(event, TokenEvent) or event.completion_tokens):
            choice.first_token_at = time.monotonic()
            self.metrics.first_token(choice.first_token_at - self.submitted_at)
        if isinstance(event, FinishEvent):
            choice.finish_reason, choice.completion_tokens = event.reason, event.completion_tokens
            if choice.first_token_at is not None and event.completion_tokens > 1:
                self.metrics.time_per_output_token((time.monotonic() - choice.first_token_at) / (event.completion_tokens - 1))
            self.metrics.finished(event.prompt_tokens, event.completion_tokens)

    async def gather(self) -> str | None:
        """Wait for every request; the first error's message, if one failed (the rest cancelled)."""
        async for _, event in self.events():
            if isinstance(event, ErrorEvent):
                self.scheduler.cancel(self.requests)
                return event.message
        return None

    def cancel_on_disconnect(self, request: HTTPRequest) -> asyncio.Task:
        """A task that cancels the requests when the client disconnects, also while no event is due
        (a request waiting for a slot); cancel the task when the response is done."""

        async def watch() -> None:
            while (await request.receive())["type"] != "http.disconnect":
                pass
            self.scheduler.cancel(self.requests)

        return asyncio.ensure_future(watch())
