"""Hostile and broken clients over real sockets: bodies too large, too deep, not UTF-8 or never sent;
connections that send nothing, or too many of them; a stream whose client never reads. Each is
answered in OpenAI's error shape or closed after its timeout, and none stalls the other streams or
keeps a slot."""

from __future__ import annotations

import http.client
import json
import socket
import threading
import time

import pytest

from .conftest import MODEL_NAME, error_of, http_stack, serve

http_stack()
import httpx  # noqa: E402

GOOD = {"model": MODEL_NAME, "prompt": "def main(", "max_tokens": 4, "temperature": 0}
JSON = {"content-type": "application/json"}


@pytest.fixture(scope="module")
def guarded(loaded):
    """A server with small limits: 4 KiB bodies, 0.5 s to send a request, 1 s of not reading, 64
    connections, a small kernel send buffer (a client that does not read fills it soon)."""
    from efla.serving.server import ConnectionLimits

    limits = ConnectionLimits(read_timeout=0.5, write_timeout=1.0, max_connections=64)
    app_options = {"max_body_bytes": 4096, "read_timeout": 0.5}
    with serve(*loaded, max_batch=4, max_context=100_000, limits=limits, app_options=app_options, send_buffer=4096) as served:
        yield served


def _connect(served, receive_buffer: int | None = None) -> socket.socket:
    host, port = served.url.removeprefix("http://").split(":")
    sock = socket.socket()
    if receive_buffer is not None:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, receive_buffer)
    sock.connect((host, int(port)))
    return sock


def _request_bytes(body: dict, path: str = "/v1/completions") -> bytes:
    data = json.dumps(body).encode()
    head = f"POST {path} HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\nContent-Length: {len(data)}\r\n\r\n"
    return head.encode() + data


def _closed_within(sock: socket.socket, seconds: float) -> bool:
    """Whether the server closes ``sock`` within ``seconds`` (reading whatever it sends until then)."""
    sock.settimeout(seconds)
    try:
        while sock.recv(65536):
            pass
    except TimeoutError:
        return False
    except ConnectionResetError:
        pass
    return True


def test_a_body_over_the_limit_is_a_413(guarded):
    big = {**GOOD, "prompt": "x" * 5000}
    response = httpx.post(f"{guarded.url}/v1/completions", json=big, timeout=10)
    assert response.status_code == 413 and error_of(response)["code"] == "body_too_large"

    def chunked():  # no Content-Length: the size shows only while reading
        yield json.dumps(big).encode()

    response = httpx.post(f"{guarded.url}/v1/completions", content=chunked(), headers=JSON, timeout=10)
    assert response.status_code == 413 and "4096" in error_of(response)["message"]
    assert httpx.post(f"{guarded.url}/v1/completions", json=GOOD, timeout=10).status_code == 200


def test_a_prompt_over_the_context_is_a_400_naming_the_lengths(server):
    response = httpx.post(f"{server.url}/v1/completions", json={**GOOD, "prompt": list(range(1, 601))}, timeout=10)
    assert response.status_code == 400
    error = error_of(response)
    assert error["code"] == "context_length_exceeded" and "600 tokens" in error["message"] and "512" in error["message"]


@pytest.mark.parametrize("depth", [64, 65, 100_000])
def test_deeply_nested_json_is_a_400(server, depth):
    inner = depth - 1  # the request's object is one level
    body = b'{"model": "tiny", "prompt": ' + b"[" * inner + b"]" * inner + b', "stop": "]]]]"}'
    response = httpx.post(f"{server.url}/v1/completions", content=body, headers=JSON, timeout=10)
    assert response.status_code == 400
    error = error_of(response)
    if depth <= 64:  # within the limit: refused by the request's model, as a prompt of the wrong shape
        assert error["param"] == "prompt"
    else:
        assert error["code"] == "json_too_deep" and f"nests {depth} levels" in error["message"]


def test_json_nested_within_the_limit_in_free_form_fields_is_no_5xx(server):
    nested = {"type": "object"}
    for _ in range(25):  # 2 levels each, 50 in all with the request's own
        nested = {"type": "object", "properties": {"a": nested}}
    for body, path in (
        ({**GOOD, "response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": nested}}}, "completions"),
        ({"model": MODEL_NAME, "messages": [{"role": "user", "content": "hi", "name": nested}]}, "chat/completions"),
    ):
        response = httpx.post(f"{server.url}/v1/{path}", json=body, timeout=60)
        assert response.status_code < 500, response.text


def test_a_body_that_is_not_utf8_is_a_400(server):
    body = b'{"model": "tiny", "prompt": "caf\xe9", "max_tokens": 2}'
    response = httpx.post(f"{server.url}/v1/completions", content=body, headers=JSON, timeout=10)
    assert response.status_code == 400 and error_of(response)["code"] == "invalid_encoding"


def test_a_body_that_never_arrives_is_a_408(guarded):
    with _connect(guarded) as sock:
        sock.sendall(_request_bytes(GOOD)[:-5])  # headers and all but 5 bytes of the body
        sock.settimeout(5)
        answer = b""
        while chunk := sock.recv(65536):  # the answer, then the server closes
            answer += chunk
        answer = answer.decode()
    assert answer.startswith("HTTP/1.1 408") and '"request_timeout"' in answer


def test_a_connection_that_sends_nothing_or_trickles_its_headers_is_closed(guarded):
    with _connect(guarded) as silent, _connect(guarded) as trickling:
        try:
            for byte in b"POST /v1/completions HTTP/1.1\r\nHost: x\r\n":  # a byte each 50 ms: 2 s in all
                trickling.sendall(bytes([byte]))
                time.sleep(0.05)
            trickled_through = True
        except (BrokenPipeError, ConnectionResetError):  # closed by the server
            trickled_through = False
        assert not trickled_through and _closed_within(silent, 3)
    assert httpx.post(f"{guarded.url}/v1/completions", json=GOOD, timeout=10).status_code == 200


def _answer(sock: socket.socket) -> int:
    """The status of one whole answer read from ``sock`` (which stays open)."""
    response = http.client.HTTPResponse(sock)
    response.begin()
    response.read()
    return response.status


def _busy_loop_lets_a_request_in_as_it_closes(served, timer: str, send) -> None:
    """Stalls the server's event loop past the idle connection's ``timer``, then runs ``send`` in the
    same turn of the loop as the timer, before it: the request reaches the socket after the loop has
    looked for input, as it does when a loaded server is slow to run its callbacks."""
    (protocol,) = served.server.server_state.connections
    loop, holding, sent = protocol.loop, threading.Event(), threading.Event()

    def hold() -> None:
        holding.set()
        sent.wait(10)

    def stall() -> None:
        closes_at = getattr(protocol, timer).when()
        loop.call_at(closes_at - 0.01, hold)
        time.sleep(max(0.0, closes_at - loop.time()) + 0.05)

    loop.call_soon_threadsafe(stall)
    assert holding.wait(10)
    send()
    sent.set()


def _limits_closing_idle_first_by(timer: str):
    """Limits under which the timer under test (the header deadline or the keep-alive timeout) closes
    an idle connection long before the other one would."""
    from efla.serving.server import ConnectionLimits

    short, long = 0.5, 30.0
    if timer == "_read_deadline":
        return ConnectionLimits(read_timeout=short, keep_alive_timeout=long)
    return ConnectionLimits(read_timeout=long, keep_alive_timeout=short)


@pytest.mark.parametrize("timer", ["_read_deadline", "timeout_keep_alive_task"])
def test_a_request_reaching_an_idle_connection_as_a_slow_loop_closes_it_is_answered(loaded, timer):
    with serve(*loaded, max_batch=2, limits=_limits_closing_idle_first_by(timer)) as served, _connect(served) as sock:
        sock.sendall(_request_bytes(GOOD))
        assert _answer(sock) == 200
        _busy_loop_lets_a_request_in_as_it_closes(served, timer, lambda: sock.sendall(_request_bytes(GOOD)))
        sock.settimeout(10)
        assert _answer(sock) == 200  # not a reset: the request was in the socket before the close
        assert _closed_within(sock, 5)  # idle again, the connection is closed as before


@pytest.mark.parametrize("timer", ["_read_deadline", "timeout_keep_alive_task"])
def test_an_idle_connection_closed_by_a_slow_loop_tells_its_client_at_once(loaded, timer):
    """A client checks a pooled connection for the server's end of the stream before reusing it
    (httpx does): the server's must be out when it decides, not when its loop next gets to closing the
    socket (a request sent in between would be reset)."""
    with serve(*loaded, max_batch=2, limits=_limits_closing_idle_first_by(timer)) as served, _connect(served) as sock:
        sock.sendall(_request_bytes(GOOD))
        assert _answer(sock) == 200
        (protocol,) = served.server.server_state.connections
        loop, holding, checked = protocol.loop, threading.Event(), threading.Event()

        def hold() -> None:  # right after the close, in the same turn of the loop
            holding.set()
            checked.wait(10)

        def stall() -> None:
            closes_at = getattr(protocol, timer).when()
            loop.call_at(closes_at + 1e-6, hold)
            time.sleep(max(0.0, closes_at - loop.time()) + 0.05)

        loop.call_soon_threadsafe(stall)
        try:
            assert holding.wait(10)
            sock.settimeout(2)
            assert sock.recv(1) == b""  # the server's end of the stream, while its loop is still busy
        finally:
            checked.set()


def test_connections_beyond_the_limit_get_503_and_idle_ones_are_closed(guarded):
    idle = [_connect(guarded) for _ in range(1000)]  # the server keeps at most 64 open
    try:
        response = httpx.post(f"{guarded.url}/v1/completions", json=GOOD, timeout=10)
        assert response.status_code == 503 and error_of(response)["code"] == "too_many_connections"
        assert response.headers["retry-after"] == "1"
        assert all(_closed_within(sock, 5) for sock in idle[:64])  # closed after the read timeout
    finally:
        for sock in idle:
            sock.close()
    deadline = time.monotonic() + 10
    while (status := httpx.post(f"{guarded.url}/v1/completions", json=GOOD, timeout=10).status_code) == 503:
        assert time.monotonic() < deadline, "connections still over the limit"
        time.sleep(0.2)
    assert status == 200


def test_a_client_that_never_reads_its_stream_is_dropped_and_the_others_go_on(guarded, reference):
    stalled = _connect(guarded, receive_buffer=4096)
    stalled.sendall(_request_bytes({**GOOD, "max_tokens": 50_000, "ignore_eos": True, "logprobs": 20, "stream": True}))
    try:
        time.sleep(0.2)
        body = {**GOOD, "prompt": "The model", "max_tokens": 40, "stream": True}
        with httpx.stream("POST", f"{guarded.url}/v1/completions", json=body, timeout=30) as response:
            lines = [line for line in response.iter_lines() if line]
        assert lines[-1] == "data: [DONE]"
        text = "".join(json.loads(line[len("data: ") :])["choices"][0]["text"] for line in lines[:-1])
        assert text == reference("The model", 40)[0]  # the stalled stream did not hold this one back
        status = guarded.wait_idle(timeout=20)  # the stalled client's slot is free while its socket is open
        assert (status["slots_free"], status["requests_cancelled"] >= 1) == (4, True), status
        assert _closed_within(stalled, 5)
    finally:
        stalled.close()


def test_a_client_that_reads_its_stream_slowly_is_not_dropped(guarded):
    slow = _connect(guarded, receive_buffer=4096)
    slow.sendall(_request_bytes({**GOOD, "max_tokens": 50_000, "ignore_eos": True, "logprobs": 20, "stream": True}))
    try:
        time.sleep(0.2)
        (server_side,) = [c for c in guarded.server.server_state.connections if c.client == slow.getsockname()]
        slow.settimeout(5)
        held_back = False  # whether the server waited on this client, as the write timeout counts
        reading_until = time.monotonic() + 4.0  # four write timeouts, each too short to drain the server's buffer
        while time.monotonic() < reading_until:
            assert slow.recv(1024), "the server closed a stream its client was reading"
            held_back |= server_side.flow.write_paused
            time.sleep(0.05)  # 20 KiB/s: the server writes faster
    finally:
        slow.close()
    assert held_back
    assert guarded.wait_idle(timeout=20)["slots_free"] == 4


def test_the_api_key_guards_every_route_but_health(loaded):
    with serve(*loaded, api_key="sesame") as served:
        routes = [("GET", "/metrics", None), ("GET", "/v1/models", None), ("POST", "/tokenize", {"prompt": "hi"})]
        routes += [("POST", "/detokenize", {"tokens": [1, 2]}), ("POST", "/v1/completions", GOOD)]
        for method, path, body in routes:
            for headers in ({}, {"Authorization": "Bearer sesame2"}, {"Authorization": "Bearer sesam"}):
                response = httpx.request(method, f"{served.url}{path}", json=body, headers=headers, timeout=10)
                assert response.status_code == 401 and error_of(response)["code"] == "invalid_api_key", path
            response = httpx.request(method, f"{served.url}{path}", json=body, headers={"Authorization": "Bearer sesame"})
            assert response.status_code == 200, path
        assert httpx.get(f"{served.url}/health", timeout=10).status_code == 200


def test_a_full_queue_is_a_429_with_retry_after(loaded):
    with serve(*loaded, max_batch=1, max_queue=0, max_context=100_000) as served:
        body = {**GOOD, "max_tokens": 50_000, "ignore_eos": True, "stream": True}
        with httpx.stream("POST", f"{served.url}/v1/completions", json=body) as held:
            lines = held.iter_lines()  # kept: a dropped generator closes the connection
            next(lines)
            response = httpx.post(f"{served.url}/v1/completions", json=GOOD, timeout=10)
        assert response.status_code == 429 and error_of(response)["code"] == "queue_full"
        assert int(response.headers["retry-after"]) >= 1
        assert served.wait_idle()["slots_free"] == 1


def test_draining_answers_503_keeps_listening_and_ends_streams_with_a_finish_reason(loaded):
    with serve(*loaded, max_batch=2, max_context=100_000, grace=1.0) as served:
        body = {**GOOD, "max_tokens": 50_000, "ignore_eos": True, "stream": True}
        with httpx.stream("POST", f"{served.url}/v1/completions", json=body, timeout=30) as response:
            lines = response.iter_lines()
            first = next(lines)
            served.server.handle_exit(15, None)  # what SIGTERM does
            refused = httpx.post(f"{served.url}/v1/completions", json=GOOD, timeout=10)
            health = httpx.get(f"{served.url}/health", timeout=10)
            rest = [line for line in lines if line]
        assert refused.status_code == 503 and error_of(refused)["code"] == "shutting_down"
        assert int(refused.headers["retry-after"]) >= 1
        assert health.status_code == 503 and health.json()["status"] == "draining"
        assert rest[-1] == "data: [DONE]"
        chunks = [json.loads(line[len("data: ") :]) for line in [first, *rest[:-1]]]
        assert [c["choices"][0]["finish_reason"] for c in chunks].count("length") == 1
        assert chunks[-1]["choices"][0]["finish_reason"] == "length"
        assert 1 < len(chunks) < 50_000
        for _ in range(100):  # the server stops by itself once the streams have ended
            if not served.scheduler.running:
                break
            time.sleep(0.1)
        assert not served.scheduler.running
