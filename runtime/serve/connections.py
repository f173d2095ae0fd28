"""What one client can hold, and for how long: a connection slot, the time to send a request, body bytes.

uvicorn bounds only the idle time between two requests of a keep-alive connection (`timeout_keep_alive`).
A client that sends its headers or its body slowly, or never, held its connection forever (issue 48: a
Content-Length of 3000 followed by 47 bytes was never answered nor closed: the slowloris pattern), and
uvicorn's `limit_concurrency` counts such connections too, then answers everyone else a plain-text 503.
Closing a socket whose input was not read sends a reset, which can discard the response the client has not
read yet: an early 413 reached a client under load, or sending a chunked upload, as a connection reset.

- `guarded_protocol(...)`: uvicorn's httptools protocol (the serve extra's parser) with
  - a header deadline: a request's headers must arrive within `read_timeout` s of the connection's opening
    (or of the request's first byte, on a kept-alive connection), else 408 (OpenAI error JSON) and close
    (a connection that sent nothing is closed without an answer);
  - a body backstop: a body the app does not read (a 404 or a GET that came with a body) must arrive within
    read_timeout + BACKSTOP_S of its headers, else the connection closes after the response (the bodies
    the app reads get their 408 from `RequestGuard`);
  - a cap on open connections: a request on a connection beyond `max_connections` is answered 503 (JSON,
    Retry-After: 1) and its connection closed;
  - a lingering close: when a response ends a connection while the request is still arriving (413, 408,
    the cap's 503), the server half-closes (FIN after the response) and reads and drops what the client
    still sends for up to LINGER_S s, as nginx does, so the client reads the response instead of a reset.
- `RequestGuard` (ASGI middleware): 413 for a body above `limit` bytes (from Content-Length before anything
  is read; for a chunked body as soon as the bytes received pass it) and 408 when the body the app reads
  has not all arrived within read_timeout s of its headers; both with Connection: close.
"""

from __future__ import annotations

import asyncio
import json
from typing import Any

from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.types import ASGIApp, Message, Receive, Scope, Send
from uvicorn.protocols.http.httptools_impl import STATUS_LINE, HttpToolsProtocol

from runtime.serve.protocol import ApiError

LINGER_S = 5.0  # how long a closing connection drains what its client still sends
BACKSTOP_S = 1.0  # after read_timeout: RequestGuard's 408 comes first for bodies the app reads
CLOSE = {"Connection": "close"}


def timeout_error(read_timeout: float, what: str) -> ApiError:
    return ApiError(
        408,
        f"the request's {what} did not arrive within {read_timeout:g} s (--request-read-timeout)",
        code="request_timeout",
    )


def busy_error(max_connections: int) -> ApiError:
    return ApiError(
        503,
        f"the server has {max_connections} open connections (--max-connections); retry later",
        code="too_many_connections",
    )


# ------------------------------------------------------------------------------------ ASGI middleware


class RequestGuard:
    """413 above `limit` body bytes, 408 for a body not all arrived within `read_timeout` s (module
    docstring); both before the body is parsed, with Connection: close."""

    def __init__(self, app: ASGIApp, limit: int, read_timeout: float | None = None) -> None:
        self.app, self.limit, self.read_timeout = app, limit, read_timeout

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        length = dict(scope.get("headers") or []).get(b"content-length", b"")
        if length.isdigit() and int(length) > self.limit:
            response = JSONResponse(self.too_large().body(), status_code=413, headers=CLOSE)
            await response(scope, receive, send)
            return
        loop = asyncio.get_running_loop()
        deadline = None if self.read_timeout is None else loop.time() + self.read_timeout
        seen, complete = 0, False

        async def guarded() -> Message:
            nonlocal seen, complete
            if complete or deadline is None:  # after the body: the app listens for a disconnect
                return await receive()
            try:
                message = await asyncio.wait_for(receive(), max(0.0, deadline - loop.time()))
            except TimeoutError:  # FastAPI re-raises an HTTPException met while reading the body
                error = timeout_error(self.read_timeout or 0.0, "body")
                raise StarletteHTTPException(408, error.message, headers=CLOSE) from None
            if message["type"] == "http.request":
                seen += len(message.get("body", b""))
                if seen > self.limit:
                    raise StarletteHTTPException(413, self.too_large().message, headers=CLOSE)
                complete = not message.get("more_body", False)
            return message

        await self.app(scope, guarded, send)

    def too_large(self) -> ApiError:
        return ApiError(
            413, f"the request body exceeds {self.limit} bytes (--max-request-bytes)", code="body_too_large"
        )


# ---------------------------------------------------------------------------------- uvicorn protocol


class _LingeringTransport:
    """A connection's transport whose close() half-closes and drains while a request is still arriving
    (module docstring); everything else is the transport's own."""

    def __init__(self, transport: asyncio.Transport, protocol: _Guarded) -> None:
        self._transport, self._protocol = transport, protocol
        self.lingering = False
        self._timer: asyncio.TimerHandle | None = None

    def __getattr__(self, name: str) -> Any:
        return getattr(self._transport, name)

    def is_closing(self) -> bool:
        return self.lingering or self._transport.is_closing()

    def write(self, data: bytes) -> None:
        if not self.lingering:  # after the FIN nothing more can go out (a late answer of the app)
            self._transport.write(data)

    def close(self) -> None:
        if self.is_closing():
            return
        if not (self._protocol.reading and self._transport.can_write_eof()):
            self._transport.close()  # nothing unread is on its way: a plain close
            return
        self.lingering = True
        try:
            self._transport.write_eof()  # the response (already buffered) goes out, then FIN
        except (OSError, RuntimeError):
            self._transport.close()
            return
        self._transport.resume_reading()
        self._timer = self._protocol.loop.call_later(LINGER_S, self.finish)
        self._protocol.closed_early()

    def finish(self) -> None:
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None
        self._transport.close()

    def abort(self) -> None:
        if self._timer is not None:
            self._timer.cancel()
        self._transport.abort()


class _Guarded(HttpToolsProtocol):
    """uvicorn's httptools protocol with the deadlines, the cap and the lingering close (module docstring).
    `guarded_protocol` sets the class attributes."""

    read_timeout: float | None = None
    max_connections: int | None = None

    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        self.reading = False  # a request has begun and its body has not all arrived
        self._header_timer: asyncio.TimerHandle | None = None
        self._body_timer: asyncio.TimerHandle | None = None
        super().connection_made(_LingeringTransport(transport, self))  # type: ignore[arg-type]
        self._arm_header_timer()

    def connection_lost(self, exc: Exception | None) -> None:
        self._cancel_timers()
        super().connection_lost(exc)

    def data_received(self, data: bytes) -> None:
        if getattr(self.transport, "lingering", False):
            return  # what the client still sends after the response that closed the connection
        super().data_received(data)

    def eof_received(self) -> bool | None:
        if getattr(self.transport, "lingering", False):
            self.transport.finish()  # type: ignore[attr-defined]
        return super().eof_received()

    def on_message_begin(self) -> None:
        super().on_message_begin()
        self.reading = True
        if self._header_timer is None:
            self._arm_header_timer()

    def on_headers_complete(self) -> None:
        self._cancel(self._header_timer)
        self._header_timer = None
        if self.read_timeout is not None:
            self._body_timer = self.loop.call_later(self.read_timeout + BACKSTOP_S, self._body_late)
        if self.max_connections is not None and len(self.connections) > self.max_connections:
            app, self.app = self.app, _answer(busy_error(self.max_connections), {"Retry-After": "1"})
            try:
                super().on_headers_complete()
            finally:
                self.app = app
            return
        super().on_headers_complete()

    def on_message_complete(self) -> None:
        self.reading = False
        self._cancel(self._body_timer)
        self._body_timer = None
        super().on_message_complete()

    def closed_early(self) -> None:
        """The connection lingers: a request still being handled sees its client gone (as on a close)."""
        cycle = self.cycle
        if cycle is not None and not cycle.response_complete:
            cycle.disconnected = True
            cycle.message_event.set()

    # ---------------------------------------------------------------------------------- deadlines

    def _arm_header_timer(self) -> None:
        if self.read_timeout is not None:
            self._header_timer = self.loop.call_later(self.read_timeout, self._headers_late)

    def _headers_late(self) -> None:
        self._header_timer = None
        if self.transport.is_closing():
            return
        if self.cycle is not None and not self.cycle.response_complete:
            self.cycle.keep_alive = False  # a pipelined request is late: close after this response
            return
        if self.reading:  # part of a request came: say why (a silent connection is just closed, as an
            # idle keep-alive one: a client may have opened it ahead and would read a 408 as its answer)
            error = timeout_error(self.read_timeout or 0.0, "headers")
            self.transport.write(_raw_response(error, self.server_state.default_headers))
        self.transport.close()

    def _body_late(self) -> None:
        self._body_timer = None
        if self.transport.is_closing() or self.cycle is None:
            return
        if self.cycle.response_complete:
            self.transport.close()
        else:
            self.cycle.keep_alive = False

    def _cancel_timers(self) -> None:
        self._cancel(self._header_timer)
        self._cancel(self._body_timer)
        self._header_timer = self._body_timer = None

    @staticmethod
    def _cancel(timer: asyncio.TimerHandle | None) -> None:
        if timer is not None:
            timer.cancel()


def guarded_protocol(read_timeout: float | None, max_connections: int | None) -> type[HttpToolsProtocol]:
    """The protocol class for uvicorn.Config(http=...): deadlines of `read_timeout` s (None: none) and at most
    `max_connections` open connections (None: no cap)."""
    return type(
        "GuardedHttpToolsProtocol",
        (_Guarded,),
        {"read_timeout": read_timeout, "max_connections": max_connections},
    )


def _answer(error: ApiError, headers: dict[str, str]) -> ASGIApp:
    response = JSONResponse(error.body(), status_code=error.status, headers={**headers, **CLOSE})

    async def app(scope: Scope, receive: Receive, send: Send) -> None:
        await response(scope, receive, send)

    return app


def _raw_response(error: ApiError, default_headers: list[tuple[bytes, bytes]]) -> bytes:
    """A whole response written straight to the transport (no ASGI request exists yet)."""
    body = json.dumps(error.body(), ensure_ascii=True, separators=(",", ":")).encode("ascii")
    head = [STATUS_LINE[error.status].rstrip(b"\r\n")]
    head += [name + b": " + value for name, value in default_headers]
    head += [b"content-type: application/json", b"content-length: %d" % len(body), b"connection: close"]
    return b"\r\n".join(head) + b"\r\n\r\n" + body
