"""Run the app with uvicorn: in the foreground (tools/serve.py) or in a background thread (tests, demos).

Shutdown as vLLM and Kubernetes expect it: the first SIGTERM (or SIGINT) stops admitting requests (503,
/health 503) and lets the admitted ones finish for `drain_timeout_s` seconds; then every request still
running ends with an error (a stream: an error event and [DONE]; otherwise error JSON), uvicorn closes the
connections and the process exits 0. A second signal ends the drain at once. A fatal fault (the
scheduler's, e.g. a TP rank that died or hung) with on_fatal "exit" makes `serve` exit 1 after one
`error:` line, so that a supervisor restarts the server, also when the fault is found only as a drain
ends (TP ranks that died just before a SIGTERM: exit 1, not 0); with on_fatal "serve" a drain exits 0.
"""

from __future__ import annotations

import gc
import socket
import sys
import threading
import time
from pathlib import Path
from types import FrameType

import uvicorn
from fastapi import FastAPI

from passes.errors import UserError
from runtime.serve.app import (
    DEFAULT_MAX_TOKENS,
    MAX_REQUEST_BYTES,
    REQUEST_READ_TIMEOUT_S,
    abort,
    create_app,
    drain,
)
from runtime.serve.connections import guarded_protocol
from runtime.serve.loading import ServedModel, load
from runtime.serve.scheduler import PREFILL_CHUNK

DRAIN_TIMEOUT_S = 20.0  # below Kubernetes' default 30 s grace period
CLOSE_TIMEOUT_S = 5.0  # uvicorn's wait for connections once the requests have ended
KEEP_ALIVE_S = 5.0  # an idle kept-alive connection is closed after this (uvicorn's default)
MAX_CONNECTIONS = 512  # open connections; beyond them a request is answered 503


class Server(uvicorn.Server):
    """uvicorn with the drain of the module docstring and a fatal exit code (`exit_code`, `exit_reason`)."""

    def __init__(
        self, config: uvicorn.Config, app: FastAPI, drain_timeout_s: float = DRAIN_TIMEOUT_S
    ) -> None:
        super().__init__(config)
        self.fastapi, self.drain_timeout_s = app, drain_timeout_s
        self.exit_code, self.exit_reason = 0, ""
        self._drain_started = threading.Event()
        app.state.exit = self.fatal_exit

    def handle_exit(self, sig: int, frame: FrameType | None) -> None:
        """A signal (main thread): drain, or when already draining, stop now. The signal is not re-raised
        after the shutdown (uvicorn's default): a drained server exits 0."""
        if self._drain_started.is_set():
            abort(self.fastapi)
            self.should_exit = True
            return
        self.begin_shutdown()

    def begin_shutdown(self) -> None:
        self._drain_started.set()
        drain(self.fastapi)
        threading.Thread(target=self._drain, name="serve-drain", daemon=True).start()

    def _drain(self) -> None:
        scheduler = self.fastapi.state.scheduler
        deadline = time.monotonic() + self.drain_timeout_s
        while not scheduler.idle and time.monotonic() < deadline and not self.should_exit:
            time.sleep(0.05)
        if not scheduler.idle:
            abort(self.fastapi)
            deadline = time.monotonic() + CLOSE_TIMEOUT_S
            while not scheduler.idle and time.monotonic() < deadline:
                time.sleep(0.05)
        time.sleep(0.2)  # the last events reach their streams before uvicorn closes the connections
        if problem := scheduler.problem:  # e.g. TP ranks that died before the scheduler's next look
            self.fastapi.state.fatal(problem)
        self.should_exit = True

    def fatal_exit(self, code: int, reason: str) -> None:
        """The app's exit hook (called on the scheduler thread after every request was failed)."""
        self.exit_code, self.exit_reason = code, reason
        self.should_exit = True


def _config(
    app: FastAPI,
    *,
    max_connections: int | None = MAX_CONNECTIONS,
    keep_alive_s: float = KEEP_ALIVE_S,
    **kwargs: object,
) -> uvicorn.Config:
    """uvloop where installed and httptools (the serve extra): the event loop's time per request and per
    streamed event is what /health waits behind (measured: p95 0.07 s against 0.13 s with asyncio and h11,
    64 streams on 2 loaded cores). The protocol adds the header deadline, the connection cap and the
    lingering close (runtime/serve/connections.py); the app's RequestGuard bounds the body."""
    protocol = guarded_protocol(app.state.request_read_timeout, max_connections)
    return uvicorn.Config(
        app,
        timeout_graceful_shutdown=CLOSE_TIMEOUT_S,
        timeout_keep_alive=keep_alive_s,  # type: ignore[arg-type] - a float is a delay like any other
        loop="auto",
        http=protocol,
        **kwargs,
    )


def _check_port(host: str, port: int) -> None:
    with socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET, socket.SOCK_STREAM) as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            s.bind((host, port))
        except OSError as exc:
            raise UserError(
                f"cannot listen on {host}:{port} ({exc.strerror}); choose another --port"
            ) from None


def serve(
    model: str | Path,
    *,
    host: str = "127.0.0.1",
    port: int = 8000,
    max_batch: int = 8,
    max_queue: int = 64,
    log_level: str = "info",
    max_request_bytes: int = MAX_REQUEST_BYTES,
    drain_timeout_s: float = DRAIN_TIMEOUT_S,
    on_fatal: str = "exit",
    default_max_tokens: int = DEFAULT_MAX_TOKENS,
    request_read_timeout: float = REQUEST_READ_TIMEOUT_S,
    keep_alive_s: float = KEEP_ALIVE_S,
    max_connections: int = MAX_CONNECTIONS,
    prefill_chunk: int = PREFILL_CHUNK,
    **load_args,
) -> int:
    """Serve until a signal (exit status 0 after the drain) or a fatal fault with on_fatal "exit" (1)."""
    _check_port(host, port)
    served = load(model, **load_args)
    print(
        f"serving {served.id} ({served.source.backend}: {served.source.target}) on http://{host}:{port}/v1 "
        f"(max batch {max_batch}, context {served.max_context})",
        file=sys.stderr,
        flush=True,
    )
    app = create_app(
        served,
        max_batch,
        max_queue,
        max_request_bytes=max_request_bytes,
        on_fatal=on_fatal,
        default_max_tokens=default_max_tokens,
        request_read_timeout=request_read_timeout,
        prefill_chunk=prefill_chunk,
    )
    # What loading left (transformers, the tokenizer, the app: ~570k objects) never becomes garbage; a full
    # collection walked it all, holding the GIL for 0.3 s under a burst of requests (every thread, /health
    # too, stopped). Frozen, collections walk only what requests create.
    gc.collect()
    gc.freeze()
    config = _config(
        app,
        max_connections=max_connections,
        keep_alive_s=keep_alive_s,
        host=host,
        port=port,
        log_level=log_level,
    )
    server = Server(config, app, drain_timeout_s)
    server.run()
    if server.exit_code:
        print(f"error: {server.exit_reason}; exiting (--on-fatal exit)", file=sys.stderr, flush=True)
    return server.exit_code


class ServerThread:
    """The app on 127.0.0.1 at a free port, served by uvicorn in a daemon thread; a context manager."""

    def __init__(
        self,
        served: ServedModel,
        max_batch: int = 8,
        max_queue: int = 64,
        port: int = 0,
        *,
        drain_timeout_s: float = DRAIN_TIMEOUT_S,
        max_connections: int | None = MAX_CONNECTIONS,
        keep_alive_s: float = KEEP_ALIVE_S,
        **app_args: object,
    ) -> None:
        self.app = create_app(served, max_batch, max_queue, **app_args)  # type: ignore[arg-type]
        self.sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        self.sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        self.sock.bind(("127.0.0.1", port))
        self.port = self.sock.getsockname()[1]
        config = _config(
            self.app, max_connections=max_connections, keep_alive_s=keep_alive_s, log_level="warning"
        )
        self.server = Server(config, self.app, drain_timeout_s)
        self.thread = threading.Thread(target=self.server.run, kwargs={"sockets": [self.sock]}, daemon=True)

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def __enter__(self) -> ServerThread:
        self.thread.start()
        deadline = time.monotonic() + 60
        while not self.server.started:
            if not self.thread.is_alive() or time.monotonic() > deadline:
                raise RuntimeError("the server did not start")
            time.sleep(0.02)
        return self

    def __exit__(self, *exc: object) -> None:
        self.server.should_exit = True
        self.thread.join(timeout=30)
        self.sock.close()
