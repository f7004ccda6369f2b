"""A ``Run``'s events as OpenAI's responses: ``CompletionResponse`` (``text_completion``, with ``echo``,
``logprobs`` and ``best_of``) and ``ChatResponse`` (``chat.completion``), each whole or streamed as
server-sent events ending with ``data: [DONE]``.

A choice's ``index`` is ``prompt * n + choice``. With ``best_of`` greater than ``n``, ``best_of``
choices are generated per prompt and the ``n`` of the highest total log-probability returned.
``usage`` counts each prompt once and every generated token.
"""

from __future__ import annotations

import json

from fastapi import Request
from fastapi.responses import JSONResponse

from .logprob_objects import TokenTexts, chat_logprobs, completion_logprobs
from .protocol import (
    ChatCompletionRequest,
    CompletionRequest,
    chat_chunk_choice,
    chat_choice,
    chat_object,
    choice,
    completion_object,
    error_body,
    new_chat_id,
    new_completion_id,
    usage,
)
from .requests import ErrorEvent, FinishEvent
from .runs import Choice, Run

__all__ = ["CompletionResponse", "ChatResponse", "sse"]

DONE = "data: [DONE]\n\n"


def sse(obj: dict) -> str:
    return f"data: {json.dumps(obj, ensure_ascii=False)}\n\n"


def _joined(first: dict | None, second: dict | None) -> dict | None:
    """Two completions ``logprobs`` objects as one (``None``: nothing)."""
    if first is None or second is None:
        return first or second
    return {key: first[key] + second[key] for key in first}


class _Response:
    def __init__(self, run: Run, tokenizer, model_name: str, response_id: str):
        self.run, self.model_name, self.id = run, model_name, response_id
        self.texts = TokenTexts(tokenizer)

    async def result(self, request: Request):
        watcher = self.run.cancel_on_disconnect(request)
        try:
            failure = await self.run.gather()
        finally:
            watcher.cancel()
        if failure is not None:
            return JSONResponse(error_body(failure, "server_error"), status_code=500)
        return self.whole()

    async def stream(self, request: Request):
        watcher = self.run.cancel_on_disconnect(request)
        try:
            for chunk in self.opening():
                yield sse(chunk)
            async for state, event in self.run.events():
                if isinstance(event, ErrorEvent):
                    yield sse(error_body(event.message, "server_error"))
                    break
                for chunk in self.chunks(state, event):
                    yield sse(chunk)
            else:
                if self.include_usage:
                    yield sse(self.usage_chunk(usage(self.run.prompt_tokens, self.run.completion_tokens)))
            yield DONE
        finally:
            watcher.cancel()

    def opening(self) -> list[dict]:
        return []


class CompletionResponse(_Response):
    """``/v1/completions``' answer to ``body`` for the run of ``prompts`` (token ids)."""

    def __init__(self, run: Run, body: CompletionRequest, tokenizer, model_name: str, prompts: list[list[int]]):
        super().__init__(run, tokenizer, model_name, new_completion_id())
        self.body, self.include_usage = body, body.include_usage
        wants_text = body.echo or body.logprobs is not None
        self.prompt_texts = [_prompt_text(tokenizer, p, ids) for p, ids in zip(body.prompts, prompts)] if wants_text else []
        self._offsets: dict[int, int] = {}  # per choice streamed: where its next token's text starts

    def _prompt_text(self, state: Choice) -> str:
        return self.prompt_texts[state.request.index // self.run.choices_per_prompt]

    def _echo(self, state: Choice) -> tuple[str, dict | None, int]:
        """The echoed prompt of a choice: its text, its logprobs object and the offset after it."""
        prompt_text = self._prompt_text(state)
        if self.body.logprobs is None:
            return prompt_text, None, len(prompt_text)
        request = state.request
        logprobs, _ = completion_logprobs(self.texts, request.prompt, request.prompt_logprobs, 0)
        return prompt_text, logprobs, len(prompt_text)

    def _start(self, state: Choice) -> tuple[str, dict | None, int]:
        """What comes before a choice's new text: the echo, or nothing (its offset: after the prompt)."""
        if self.body.echo:
            return self._echo(state)
        return "", None, len(self._prompt_text(state)) if self.prompt_texts else 0

    def _new_logprobs(self, entries, offset: int) -> tuple[dict | None, int]:
        if self.body.logprobs is None:
            return None, offset
        return completion_logprobs(self.texts, [e.token for e in entries], entries, offset)

    def whole(self) -> dict:
        choices = []
        for index, state in enumerate(self._returned()):
            text, logprobs, offset = self._start(state)
            new_logprobs, _ = self._new_logprobs(state.logprobs, offset)
            choices.append(choice(index, text + state.text, state.finish_reason, _joined(logprobs, new_logprobs)))
        return completion_object(self.id, self.model_name, choices, usage(self.run.prompt_tokens, self.run.completion_tokens))

    def _returned(self) -> list[Choice]:
        """The choices returned, prompt by prompt: all, or the ``n`` best of ``best_of``."""
        per_prompt, n = self.run.choices_per_prompt, self.body.n
        if per_prompt == n:
            return self.run.choices
        groups = [self.run.choices[i : i + per_prompt] for i in range(0, len(self.run.choices), per_prompt)]
        return [best for group in groups for best in sorted(group, key=lambda c: -c.cumulative_logprob)[:n]]

    def chunks(self, state: Choice, event) -> list[dict]:
        index, chunks = state.request.index, []
        if index not in self._offsets:
            text, logprobs, self._offsets[index] = self._start(state)
            if text:
                chunks.append(self._chunk(index, text, None, logprobs))
        finish = event.reason if isinstance(event, FinishEvent) else None
        logprobs, self._offsets[index] = (
            self._new_logprobs(event.logprobs, self._offsets[index]) if event.logprobs else (None, self._offsets[index])
        )
        if event.text or finish or logprobs:
            chunks.append(self._chunk(index, event.text, finish, logprobs))
        return chunks

    def _chunk(self, index: int, text: str, finish: str | None, logprobs: dict | None) -> dict:
        return completion_object(self.id, self.model_name, [choice(index, text, finish, logprobs)], None)

    def usage_chunk(self, counts: dict) -> dict:
        return completion_object(self.id, self.model_name, [], counts)


def _prompt_text(tokenizer, prompt: str | list[int], ids: list[int]) -> str:
    return prompt if isinstance(prompt, str) else tokenizer.decode(ids, skip_special_tokens=True)


class ChatResponse(_Response):
    """``/v1/chat/completions``' answer to ``body``: an assistant message per choice."""

    def __init__(self, run: Run, body: ChatCompletionRequest, tokenizer, model_name: str):
        super().__init__(run, tokenizer, model_name, new_chat_id())
        self.body, self.include_usage = body, body.include_usage

    def _logprobs(self, entries) -> dict | None:
        return chat_logprobs(self.texts, entries) if self.body.logprobs else None

    def whole(self) -> dict:
        choices = [
            chat_choice(state.request.index, state.text, state.finish_reason, self._logprobs(state.logprobs))
            for state in self.run.choices
        ]
        return chat_object(self.id, self.model_name, choices, usage(self.run.prompt_tokens, self.run.completion_tokens))

    def opening(self) -> list[dict]:
        """The first chunk of every choice: the assistant's role."""
        return [self._chunk(state.request.index, {"role": "assistant", "content": ""}, None, None) for state in self.run.choices]

    def chunks(self, state: Choice, event) -> list[dict]:
        index, chunks = state.request.index, []
        if event.text or event.logprobs:
            chunks.append(self._chunk(index, {"content": event.text}, None, self._logprobs(event.logprobs)))
        if isinstance(event, FinishEvent):
            chunks.append(self._chunk(index, {}, event.reason, None))
        return chunks

    def _chunk(self, index: int, delta: dict, finish: str | None, logprobs: dict | None) -> dict:
        return chat_object(self.id, self.model_name, [chat_chunk_choice(index, delta, finish, logprobs)], None, chunk=True)

    def usage_chunk(self, counts: dict) -> dict:
        return chat_object(self.id, self.model_name, [], counts, chunk=True)
