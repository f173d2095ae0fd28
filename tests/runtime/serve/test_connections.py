"""What one client can hold (issue 48, runtime/serve/connections.py), through raw sockets against a real
server: a request whose headers or body never arrive is answered 408 and closed within the read timeout, an
idle kept-alive connection is closed, a body the app does not read cannot hold its connection, open
connections are capped (503, OpenAI error JSON), and an oversized upload gets a 413 the client can read
(the server drains the rest of the body instead of resetting the connection)."""

from __future__ import annotations

import json
import socket
import threading
import time
from collections.abc import Iterator

import httpx
import pytest

from runtime.serve.connections import BACKSTOP_S
from runtime.serve.server import ServerThread
from tests.runtime.serve.clients import error_of

TIMEOUT_S = 0.5  # --request-read-timeout of these servers
SLACK_S = 5.0  # a loaded 2-core machine answers late, never early
POST = b"POST /v1/completions HTTP/1.1\r\nHost: t\r\nContent-Type: application/json\r\n"


@pytest.fixture(scope="module")
def guarded(tiny) -> Iterator[ServerThread]:
    with ServerThread(
        tiny, max_request_bytes=65536, request_read_timeout=TIMEOUT_S, keep_alive_s=0.3
    ) as running:
        yield running


def connect(server: ServerThread) -> socket.socket:
    sock = socket.create_connection(("127.0.0.1", server.port))
    sock.settimeout(30)
    return sock


def read_until_closed(sock: socket.socket) -> tuple[bytes, float]:
    """Everything the server sends until it closes the connection, and how long that took."""
    start, data = time.monotonic(), b""
    while chunk := sock.recv(65536):
        data += chunk
    sock.close()
    return data, time.monotonic() - start


def response_of(data: bytes) -> tuple[int, dict[str, str], dict]:
    head, _, body = data.partition(b"\r\n\r\n")
    lines = head.decode("latin-1").split("\r\n")
    headers = {k.lower(): v.strip() for k, _, v in (line.partition(":") for line in lines[1:])}
    return int(lines[0].split()[1]), headers, json.loads(body)


@pytest.mark.parametrize(
    "partial",
    [
        POST
        + b"Content-Length: 3000\r\n\r\n"
        + b'{"model": "tiny_decode", "prompt": "w4", "max_',  # the issue's
        POST
        + b"Transfer-Encoding: chunked\r\n\r\n"
        + b'20\r\n{"model": "tiny_d',  # a chunked body that stops
        POST + b"Content-Len",  # headers that stop
    ],
    ids=["body", "chunked-body", "headers"],
)
def test_a_request_that_never_arrives_is_408_and_closed(guarded, partial):
    """Before: never answered nor closed (waited 90 s). Now 408 (OpenAI error JSON, Connection: close) and
    the connection closed within the read timeout; other clients are served meanwhile."""
    sock = connect(guarded)
    sock.sendall(partial)
    ok = httpx.post(
        guarded.url + "/v1/completions", json={"model": "tiny_decode", "prompt": "w4", "max_tokens": 1}
    )
    assert ok.status_code == 200
    data, waited = read_until_closed(sock)
    status, headers, body = response_of(data)
    assert status == 408 and headers["connection"] == "close" and body["error"]["code"] == "request_timeout"
    assert "--request-read-timeout" in body["error"]["message"]
    assert waited < TIMEOUT_S + SLACK_S


def test_silent_and_idle_connections_are_closed(guarded):
    """A connection that sends nothing is closed (without an answer) after the read timeout, a kept-alive
    one after --keep-alive-timeout."""
    silent = connect(guarded)
    assert read_until_closed(silent)[0] == b""
    idle = connect(guarded)
    idle.sendall(b"GET /health HTTP/1.1\r\nHost: t\r\n\r\n")
    data, _ = read_until_closed(idle)
    assert response_of(data)[0] == 200


def test_a_body_the_app_does_not_read_cannot_hold_the_connection(guarded):
    """/health answers without reading the body its client announced; a client that trickles that body
    (never idle, so the keep-alive timer never fires) is closed read_timeout + BACKSTOP_S after its
    headers."""
    sock = connect(guarded)
    sock.sendall(b"GET /health HTTP/1.1\r\nHost: t\r\nContent-Length: 60000\r\n\r\nx")
    stop = threading.Event()

    def trickle() -> None:
        while not stop.wait(0.05):
            try:
                sock.sendall(b"x")
            except OSError:
                return

    sender = threading.Thread(target=trickle, daemon=True)
    sender.start()
    try:
        data, waited = read_until_closed(sock)
    finally:
        stop.set()
        sender.join()
    assert response_of(data)[0] == 200
    assert waited < TIMEOUT_S + BACKSTOP_S + SLACK_S


def test_open_connections_are_capped_with_a_503(tiny):
    """--max-connections 2: with two connections open, a third client's request gets 503 (OpenAI error JSON,
    Retry-After, Connection: close); once they close, it is served."""
    with ServerThread(tiny, max_connections=2, request_read_timeout=30) as capped:
        held = [connect(capped) for _ in range(2)]
        connections = capped.server.server_state.connections
        deadline = time.monotonic() + 30
        while len(connections) < 2 and time.monotonic() < deadline:  # the server has accepted both
            time.sleep(0.01)
        busy = httpx.get(capped.url + "/health", timeout=30)
        assert busy.status_code == 503 and busy.headers["retry-after"] == "1"
        assert busy.headers["connection"] == "close"
        assert error_of(busy)["code"] == "too_many_connections"
        for sock in held:
            sock.close()
        while connections and time.monotonic() < deadline:
            time.sleep(0.01)
        assert httpx.get(capped.url + "/health", timeout=30).status_code == 200


@pytest.mark.parametrize("chunked", [False, True], ids=["content-length", "chunked"])
def test_an_oversized_upload_gets_a_413_the_client_can_read(guarded, chunked):
    """A 4 MiB upload to a server that takes 64 KiB: the 413 comes at once, the client sends the whole body
    without a reset (the server reads and drops it while the connection lingers), then reads the 413.
    Before: the server closed with unread input, which resets the connection (send fails with EPIPE or
    ECONNRESET, and the reset may discard the response unread)."""
    for _ in range(3):
        sock = connect(guarded)
        framing = b"Transfer-Encoding: chunked\r\n" if chunked else b"Content-Length: %d\r\n" % (4 << 20)
        sock.sendall(POST + framing + b"\r\n")
        block = b" " * 65536
        for _ in range(64):
            sock.sendall(b"10000\r\n" + block + b"\r\n" if chunked else block)
        if chunked:
            sock.sendall(b"0\r\n\r\n")
        data, _ = read_until_closed(sock)
        status, headers, body = response_of(data)
        assert status == 413 and headers["connection"] == "close"
        assert body["error"]["code"] == "body_too_large"
