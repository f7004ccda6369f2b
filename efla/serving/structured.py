"""Structured output: OpenAI's ``response_format`` (``json_object``, ``json_schema``) as a grammar that
masks each step's tokens, through xgrammar's public API.

``Grammars`` compiles a request's ``response_format`` once (in the handler, so a wrong schema is a
400 before anything is queued); each request then holds a matcher of its own (``new_matcher``) that
the scheduler advances by every token the request produced and asks for the tokens allowed next
(``allowed_tokens``). The grammar ends with the tokenizer's end-of-sequence token, so a complete
value ends the request as a stop token does. xgrammar is imported only when a request asks for a
``response_format``: a server without it answers those requests with a 400 and serves the rest.
"""

from __future__ import annotations

import importlib.util
import json
import threading

import torch

from .protocol import APIError

__all__ = ["Grammars", "new_matcher", "allowed_tokens", "advance"]

_PARAM = "response_format"


def _error(message: str) -> APIError:
    return APIError(400, f"{_PARAM}: {message}", param=_PARAM)


def _xgrammar():
    if importlib.util.find_spec("xgrammar") is None:
        raise _error("this server lacks the xgrammar package for structured output: pip install xgrammar")
    import xgrammar  # noqa: PLC0415 (lazy: only requests with a response_format need it)

    return xgrammar


class Grammars:
    """The compiler of ``response_format`` grammars for ``tokenizer`` over a model of ``vocab`` tokens,
    made on the first request that needs it."""

    def __init__(self, tokenizer, vocab: int, stop_tokens: list[int]):
        self.tokenizer, self.vocab, self.stop_tokens = tokenizer, vocab, list(stop_tokens)
        self._compiler = None
        self._lock = threading.Lock()

    def compile(self, response_format: dict | None):
        """The grammar of ``response_format`` (``None``: free text); an ``APIError`` (400) when it is
        not one this server supports or its schema is wrong."""
        schema, strict = _schema_of(response_format)
        if schema is None:
            return None
        compiler = self._compiler_of(_xgrammar())
        try:
            # no free whitespace: a model that likes spaces would otherwise fill max_tokens with them
            return compiler.compile_json_schema(json.dumps(schema), any_whitespace=False, strict_mode=strict)
        except (RuntimeError, ValueError, TypeError) as error:
            raise _error(f"the JSON schema is not valid or not supported: {str(error).strip().splitlines()[-1]}") from None

    def _compiler_of(self, xgr):
        with self._lock:
            if self._compiler is None:
                if not self.stop_tokens:
                    raise _error("this server's tokenizer has no end-of-sequence token to end a structured output")
                info = xgr.TokenizerInfo.from_huggingface(self.tokenizer, vocab_size=self.vocab, stop_token_ids=self.stop_tokens)
                self._compiler = xgr.GrammarCompiler(info)
            return self._compiler


def _schema_of(response_format: dict | None) -> tuple[dict | None, bool]:
    """The JSON schema that ``response_format`` asks for (``None``: text) and whether properties the
    schema does not name are ruled out."""
    kind = (response_format or {}).get("type", "text")
    if kind == "text":
        return None, False
    if kind == "json_object":
        return {"type": "object"}, False  # any object: its properties are the model's choice
    if kind != "json_schema":
        raise _error(f"expected type 'text', 'json_object' or 'json_schema', got {kind!r}")
    spec = response_format.get("json_schema")
    if not isinstance(spec, dict) or not isinstance(spec.get("name"), str):
        raise _error("json_schema: expected an object with a 'name' (a string) and a 'schema'")
    schema = spec.get("schema", {})
    if not isinstance(schema, dict):
        raise _error("json_schema.schema: expected a JSON schema (an object)")
    # always strict: what satisfies the strict grammar (no properties beyond those named) also
    # satisfies the schema, and a tiny model is not left to wander through extra properties
    return schema, True


def new_matcher(grammar):
    """A fresh matcher of a compiled ``grammar``: one per request, advanced by its tokens."""
    return _xgrammar().GrammarMatcher(grammar)


def allowed_tokens(matchers: list, vocab: int) -> torch.Tensor:
    """``[rows, vocab]`` bool (on the host): the tokens each row's matcher allows next; every token on
    rows without a matcher or whose grammar has ended (a finished row, whose token is thrown away)."""
    # xgrammar's layout (allocate_token_bitmask): 32 tokens per int32, all bits set: everything allowed
    bitmask = torch.full((len(matchers), (vocab + 31) // 32), -1, dtype=torch.int32)
    for row, matcher in enumerate(matchers):
        if matcher is not None and not matcher.is_terminated():
            matcher.fill_next_token_bitmask(bitmask, row)
    ids = torch.arange(vocab)
    return ((bitmask[:, ids // 32] >> (ids % 32)) & 1).bool()


def advance(matchers: list, tokens: list[int], finished: list[bool]) -> None:
    """Each row's matcher takes its row's new token (a finished row's token is padding, not its own)."""
    for matcher, token, done in zip(matchers, tokens, finished):
        if matcher is not None and not done and not matcher.is_terminated() and not matcher.accept_token(token):
            raise RuntimeError(f"the grammar refused token {token}, which its own mask allowed")
