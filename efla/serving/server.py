"""uvicorn as ``efla serve`` runs it: bounded connections, and a shutdown that drains.

``ConnectionLimits`` bound what a client can hold without doing anything: a connection whose request
headers have not all arrived ``read_timeout`` seconds after it opened (or after its last response)
is closed, and so is one left idle ``keep_alive_timeout`` seconds after a response (uvicorn's
keep-alive timeout); a response whose client reads nothing while its send buffer is full (uvicorn's
64 KiB high-water mark) for ``write_timeout`` seconds is dropped (one that reads, however slowly, is
not), which ends its requests and frees their slots; beyond ``max_connections`` open connections, a
new connection's request is answered 503 in OpenAI's error shape. uvicorn has no timeout for a
request's headers (its keep-alive timeout starts only after a first response), so these live in a
subclass of its h11 protocol, passed through its public ``http`` option.

An idle connection is never closed on bytes its client has already sent: under load the event loop
runs its callbacks long after it last looked for input, and closing a socket that holds unread bytes
makes the kernel reset the connection, so the client's request would fail (``ECONNRESET``) although
it arrived. A timer that finds such bytes looks again in the loop's next turn, by which the loop has
read them (and a request's first bytes have cancelled the keep-alive timeout). One that finds none
sends the end of the stream at once rather than when the loop next gets to closing the socket, so
that a client checking its pooled connection before reusing it (httpx does) sees the close.

``DrainingServer``: on SIGTERM or SIGINT the scheduler stops admitting (new requests get 503 with
``Retry-After``) while the listener stays open; requests in flight finish, for up to ``grace``
seconds; then every one still running ends as if it had reached its ``max_tokens`` (``finish_reason:
"length"``, a stream's last chunk and ``data: [DONE]``) and the server exits. A second signal ends the
grace period at once.
"""

from __future__ import annotations

import asyncio
import json
import selectors
import time
from dataclasses import dataclass

import h11
import uvicorn
from uvicorn.protocols.http.h11_impl import H11Protocol

from .protocol import RETRY_AFTER_BUSY_S, error_body
from .scheduler import Scheduler

__all__ = ["ConnectionLimits", "DrainingServer", "server_config"]


@dataclass(frozen=True)
class ConnectionLimits:
    read_timeout: float = 10.0
    write_timeout: float = 30.0
    max_connections: int = 1024
    keep_alive_timeout: float = 5.0  # uvicorn's and vLLM's: an idle keep-alive connection's life


def _client_sent_more(transport: asyncio.Transport) -> bool:
    """Whether the client's socket holds bytes (or its end of the stream) that the event loop has not
    read yet (see the module's doc)."""
    with selectors.DefaultSelector() as selector:
        selector.register(transport.get_extra_info("socket"), selectors.EVENT_READ)
        return bool(selector.select(0))


def _cancel(handle: asyncio.TimerHandle | None) -> None:
    if handle is not None:
        handle.cancel()


async def _too_many_connections(_scope, _receive, send) -> None:
    body = json.dumps(
        error_body("Too many open connections to this server; retry later", "server_error", code="too_many_connections")
    ).encode()
    headers = [
        (b"content-type", b"application/json"),
        (b"content-length", str(len(body)).encode()),
        (b"retry-after", str(RETRY_AFTER_BUSY_S).encode()),
        (b"connection", b"close"),
    ]
    await send({"type": "http.response.start", "status": 503, "headers": headers})
    await send({"type": "http.response.body", "body": body})


def protocol_class(limits: ConnectionLimits) -> type[H11Protocol]:
    """uvicorn's h11 protocol with ``limits`` (see the module's doc)."""

    class BoundedH11Protocol(H11Protocol):
        _read_deadline: asyncio.TimerHandle | None = None
        _write_deadline: asyncio.TimerHandle | None = None

        def connection_made(self, transport) -> None:
            super().connection_made(transport)
            if len(self.connections) > limits.max_connections:
                self.app = _too_many_connections
            self._await_request()

        def on_response_complete(self) -> None:
            super().on_response_complete()
            self._await_request()

        def _await_request(self) -> None:
            _cancel(self._read_deadline)
            self._read_deadline = self.loop.call_later(limits.read_timeout, self._close_without_request)

        def _close_without_request(self) -> None:
            if self._bytes_unread():
                self._read_deadline = self.loop.call_later(0, self._close_without_request)
            elif self.conn.their_state is h11.IDLE and not self.transport.is_closing():  # no whole request head yet
                self._end_stream()
                self.transport.close()

        def timeout_keep_alive_handler(self) -> None:
            if self._bytes_unread():  # reading them cancels this (``data_received``): the request is answered
                self.timeout_keep_alive_task = self.loop.call_later(0, self.timeout_keep_alive_handler)
            else:
                self._end_stream()
                super().timeout_keep_alive_handler()

        def _end_stream(self) -> None:
            """Sends the client the end of the stream now: the transport closes its socket in a later
            turn of the loop, and a client checks for it before reusing a pooled connection."""
            if not self.transport.is_closing() and self.transport.can_write_eof():
                self.transport.write_eof()

        def _bytes_unread(self) -> bool:
            """Whether the client sent bytes that the loop will read in one of its next turns (then an
            idle connection's timer looks again: see the module's doc)."""
            reading = not self.transport.is_closing() and not self.flow.read_paused
            return reading and _client_sent_more(self.transport)

        def pause_writing(self) -> None:
            super().pause_writing()
            self._await_reading(self.transport.get_write_buffer_size())

        def _await_reading(self, unsent: int) -> None:
            _cancel(self._write_deadline)
            self._write_deadline = self.loop.call_later(limits.write_timeout, self._drop_if_not_reading, unsent)

        def _drop_if_not_reading(self, unsent_before: int) -> None:
            unsent = self.transport.get_write_buffer_size()
            if unsent < unsent_before:  # the client read some: slow, not stalled
                self._await_reading(unsent)
            else:
                self.transport.abort()

        def resume_writing(self) -> None:
            super().resume_writing()
            _cancel(self._write_deadline)

        def shutdown(self) -> None:
            if self.flow is not None and self.flow.write_paused:  # a client not reading gets nothing more
                self.transport.abort()
            else:
                super().shutdown()

        def connection_lost(self, exc) -> None:
            _cancel(self._read_deadline)
            _cancel(self._write_deadline)
            super().connection_lost(exc)

    return BoundedH11Protocol


def server_config(app, limits: ConnectionLimits, **options) -> uvicorn.Config:
    """uvicorn's settings for ``app`` with ``limits``; ``options``: uvicorn's own (``log_level``, ...)."""
    # a stream still open when the server stops has had its last chunk by then: a few seconds suffice
    options = {"timeout_graceful_shutdown": 10, **options}
    return uvicorn.Config(app, http=protocol_class(limits), timeout_keep_alive=limits.keep_alive_timeout, **options)


class DrainingServer(uvicorn.Server):
    """uvicorn's server with a drain before it stops (see the module's doc)."""

    def __init__(self, config: uvicorn.Config, scheduler: Scheduler, grace: float):
        super().__init__(config)
        self.scheduler, self.grace = scheduler, grace
        self.drain_deadline: float | None = None
        self._ended = False

    def handle_exit(self, _sig, _frame) -> None:
        if self.drain_deadline is None:
            self.scheduler.stop_accepting()
            self.drain_deadline = time.monotonic() + self.grace
        else:
            self.drain_deadline = time.monotonic()

    async def on_tick(self, counter: int) -> bool:
        if self.drain_deadline is not None and not self.should_exit:
            status = self.scheduler.status()
            if status["slots_free"] == status["slots_total"] and not status["waiting"]:
                self.should_exit = True
            elif time.monotonic() >= self.drain_deadline and not self._ended:
                self.scheduler.end_all("length")
                self._ended = True
        return await super().on_tick(counter)
