"""Run the app with uvicorn: in the foreground (tools/serve.py) or in a background thread (tests, demos)."""

from __future__ import annotations

import socket
import sys
import threading
import time
from pathlib import Path

import uvicorn

from passes.errors import UserError
from runtime.serve.app import create_app
from runtime.serve.loading import ServedModel, load


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
    **load_args,
) -> None:
    _check_port(host, port)
    served = load(model, **load_args)
    print(
        f"serving {served.id} ({served.source.backend}: {served.source.target}) on http://{host}:{port}/v1 "
        f"(max batch {max_batch}, context {served.max_context})",
        file=sys.stderr,
        flush=True,
    )
    app = create_app(served, max_batch, max_queue)
    uvicorn.run(app, host=host, port=port, log_level=log_level, timeout_graceful_shutdown=5)


class ServerThread:
    """The app on 127.0.0.1 at a free port, served by uvicorn in a daemon thread; a context manager."""

    def __init__(self, served: ServedModel, max_batch: int = 8, max_queue: int = 64, port: int = 0) -> None:
        self.app = create_app(served, max_batch, max_queue)
        self.sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        self.sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        self.sock.bind(("127.0.0.1", port))
        self.port = self.sock.getsockname()[1]
        config = uvicorn.Config(self.app, log_level="warning", timeout_graceful_shutdown=2)
        self.server = uvicorn.Server(config)
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
