"""``BodyGuard``: the request body read in full, in bounded time and size, before the app parses it.

A body larger than ``max_bytes`` is answered 413 (its bytes read and dropped, so that a client still
sending gets the answer rather than a broken pipe), one that does not arrive within ``read_timeout``
seconds 408, one that is not UTF-8 or nests JSON arrays and objects deeper than ``MAX_JSON_DEPTH``
400, each in OpenAI's error shape, before any JSON parser or model sees it. A body that passes is
handed on unchanged.
"""

from __future__ import annotations

import asyncio
import itertools
import re

from starlette.concurrency import run_in_threadpool
from starlette.responses import JSONResponse

from .protocol import error_body

__all__ = ["BodyGuard", "DEFAULT_MAX_BODY_BYTES", "MAX_JSON_DEPTH", "json_depth"]

DEFAULT_MAX_BODY_BYTES = 8 << 20  # a prompt of 500,000 token ids fits; the largest bodies are prompts
MAX_JSON_DEPTH = 64  # a chat request nests 4 deep, a response_format's JSON schema a few more

# a string to its closing quote, or to the end of an unterminated one: every match attempt succeeds,
# so the scan stays linear whatever quotes and backslashes the body holds
_JSON_STRING = re.compile(rb'"[^"\\]*(?:\\(?:.|\Z)[^"\\]*)*(?:"|\Z)', re.DOTALL)
_NOT_BRACKETS = bytes(b for b in range(256) if b not in b"[]{}")
_DEPTH_STEP = {ord("["): 1, ord("{"): 1, ord("]"): -1, ord("}"): -1}


def json_depth(body: bytes) -> int:
    """How deep the arrays and objects of a JSON text nest (brackets inside strings do not count).
    Linear in the body, at C speed: no parser's recursion is involved."""
    brackets = _JSON_STRING.sub(b"", body).translate(None, _NOT_BRACKETS)
    return max(itertools.accumulate(map(_DEPTH_STEP.__getitem__, brackets)), default=0)


class BodyGuard:
    """Pure ASGI middleware reading each request's body first (see the module's doc)."""

    def __init__(self, app, max_bytes: int = DEFAULT_MAX_BODY_BYTES, read_timeout: float = 10.0):
        self.app, self.max_bytes, self.read_timeout = app, max_bytes, read_timeout

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] != "http" or scope["method"] in ("GET", "HEAD", "OPTIONS"):
            await self.app(scope, receive, send)
            return
        try:
            body, size = await asyncio.wait_for(self._read(receive), self.read_timeout)
        except asyncio.TimeoutError:
            message = f"the request body did not arrive within {self.read_timeout:g} s"
            await _refuse(408, message, "request_timeout", scope, receive, send)
            return
        if body is None:  # the client went away while sending
            return
        # a large body's checks take milliseconds to a second (a megabytes of quotes): off the event loop
        problem = await run_in_threadpool(self._problem, body, size) if size > 1 << 16 else self._problem(body, size)
        if problem is not None:
            await _refuse(*problem, scope, receive, send)
            return
        await self.app(scope, _replaying(body, receive), send)

    async def _read(self, receive) -> tuple[bytes | None, int]:
        """The body (``None``: the client disconnected) and its size; beyond ``max_bytes`` the bytes
        are counted and dropped."""
        chunks, size = [], 0
        while True:
            message = await receive()
            if message["type"] == "http.disconnect":
                return None, size
            chunk = message.get("body", b"")
            size += len(chunk)
            if size <= self.max_bytes:
                chunks.append(chunk)
            if not message.get("more_body", False):
                return b"".join(chunks), size

    def _problem(self, body: bytes, size: int) -> tuple[int, str, str] | None:
        if size > self.max_bytes:
            return 413, f"the request body has {size} bytes, more than this server's {self.max_bytes}", "body_too_large"
        try:
            body.decode("utf-8")
        except UnicodeDecodeError as error:
            return 400, f"the request body is not valid UTF-8 (byte {error.start})", "invalid_encoding"
        may_nest_deeply = body.count(b"[") + body.count(b"{") > MAX_JSON_DEPTH
        depth = json_depth(body) if may_nest_deeply else 0
        if depth > MAX_JSON_DEPTH:
            return 400, f"the request body nests {depth} levels deep, more than {MAX_JSON_DEPTH}", "json_too_deep"
        return None


def _replaying(body: bytes, receive):
    """A ``receive`` that hands over ``body`` first, then what the connection sends (a disconnect)."""
    handed = False

    async def replay():
        nonlocal handed
        if handed:
            return await receive()
        handed = True
        return {"type": "http.request", "body": body, "more_body": False}

    return replay


async def _refuse(status: int, message: str, code: str, scope, receive, send) -> None:
    headers = {"Connection": "close"} if status == 408 else None
    await JSONResponse(error_body(message, code=code), status_code=status, headers=headers)(scope, receive, send)
