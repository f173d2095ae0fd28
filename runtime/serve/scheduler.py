"""Continuous batching at step granularity: one worker thread owns the model and runs the step loop.

Every iteration (1) drops cancelled requests (a client went away, or a stop string was seen) and frees
their rows, (2) admits waiting requests while fewer than `max_batch` run and prefills them together, (3) runs
ONE decode step for all running sequences together (runtime.serve.batch). A request therefore joins and
leaves the batch between any two steps. Tokens go back through each request's `emit` callback (called
on the worker thread; the web layer hands them to its event loop).

The waiting queue is bounded: `submit` raises QueueFull beyond `max_queue` waiting requests. An error
in a model call fails only the requests of that call; the loop keeps running.
"""

from __future__ import annotations

import itertools
import threading
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Literal

from runtime.serve.batch import Runner
from runtime.serve.metrics import Metrics
from runtime.serve.sampling import Sampler

_ids = itertools.count(1)


@dataclass(frozen=True)
class Event:
    """A generated token, the end of a request (reason "stop" or "length"), or an error message."""

    kind: Literal["token", "done", "error"]
    token: int = -1
    reason: str = ""


class QueueFull(Exception):
    """More requests are waiting than the server accepts; the client should retry later."""


@dataclass(eq=False)
class GenerationRequest:
    prompt: list[int]
    max_tokens: int
    sampler: Sampler
    emit: Callable[[Event], None]
    eos_ids: frozenset[int] = frozenset()
    id: int = field(default_factory=lambda: next(_ids))
    arrived: float = field(default_factory=time.perf_counter)
    cancelled: bool = False
    generated: int = 0
    next_token: int = -1
    last_time: float = 0.0


class Scheduler:
    def __init__(
        self, runner: Runner, max_batch: int = 8, max_queue: int = 64, metrics: Metrics | None = None
    ) -> None:
        self.runner = runner
        self.max_batch = max_batch
        self.max_queue = max_queue
        self.metrics = metrics
        self.waiting: deque[GenerationRequest] = deque()
        self.running: dict[int, GenerationRequest] = {}
        self.steps = 0
        self._cond = threading.Condition()
        self._stopping = False
        self._thread: threading.Thread | None = None

    # ---------------------------------------------------------------------------- called by the web layer

    def submit(self, request: GenerationRequest) -> None:
        with self._cond:
            if len(self.waiting) >= self.max_queue:
                raise QueueFull(f"{len(self.waiting)} requests are waiting (--max-queue {self.max_queue})")
            self.waiting.append(request)
            self._cond.notify()
        self._gauges()

    def cancel(self, request: GenerationRequest) -> None:
        request.cancelled = True
        with self._cond:
            self._cond.notify()

    def start(self) -> None:
        self._thread = threading.Thread(target=self._loop, name="serve-scheduler", daemon=True)
        self._thread.start()

    def stop(self) -> None:
        with self._cond:
            self._stopping = True
            self._cond.notify()
        if self._thread is not None:
            self._thread.join(timeout=30)

    @property
    def alive(self) -> bool:
        return self._thread is not None and self._thread.is_alive()

    @property
    def problem(self) -> str | None:
        """None while requests can be served, else why not (/health answers 503 with it)."""
        if not self.alive:
            return "scheduler stopped"
        return getattr(self.runner, "problem", None)  # e.g. a TP rank process that died

    # ------------------------------------------------------------------------------------ the worker

    def _loop(self) -> None:
        while True:
            with self._cond:
                while not self._stopping and not self.waiting and not self.running:
                    self._cond.wait()
                if self._stopping:
                    return
                self._drop_cancelled()
                admitted = []
                while self.waiting and len(self.running) + len(admitted) < self.max_batch:
                    admitted.append(self.waiting.popleft())
            self._gauges()
            if admitted:
                self._prefill(admitted)
            if self.running:
                self._decode()

    def _drop_cancelled(self) -> None:
        self.waiting = deque(r for r in self.waiting if not r.cancelled)
        for request in [r for r in self.running.values() if r.cancelled]:
            self._finish(request)

    def _prefill(self, requests: list[GenerationRequest]) -> None:
        """The requests admitted together, prefilled in one call (runner.prefill_many batches them)."""
        if self.metrics:
            self.metrics.prefill_batch_size.observe(len(requests))
        try:
            out = self.runner.prefill_many({r.id: r.prompt for r in requests})
        except Exception as exc:  # noqa: BLE001 - these requests fail, the server keeps serving
            for request in requests:
                self.runner.release(request.id)
                _send(request, Event("error", reason=f"prefill failed: {exc}"))
            return
        for request in requests:
            self.running[request.id] = request
            self._accept(request, out[request.id])

    def _decode(self) -> None:
        batch = list(self.running.values())
        if self.metrics:
            self.metrics.batch_size.observe(len(batch))
        try:
            out = self.runner.decode({r.id: r.next_token for r in batch})
        except Exception as exc:  # noqa: BLE001 - fail this step's requests, keep the loop alive
            for request in batch:
                self._finish(request)
                _send(request, Event("error", reason=f"decode step failed: {exc}"))
            return
        self.steps += 1
        for request in batch:
            self._accept(request, out[request.id])

    def _accept(self, request: GenerationRequest, logits) -> None:
        token = request.sampler(logits)
        now = time.perf_counter()
        if self.metrics:
            if request.generated == 0:
                self.metrics.time_to_first_token.observe(now - request.arrived)
            else:
                self.metrics.time_per_output_token.observe(now - request.last_time)
            self.metrics.generation_tokens.inc()
        request.generated += 1
        request.next_token, request.last_time = token, now
        _send(request, Event("token", token=token))
        if token in request.eos_ids:
            self._finish(request, "stop")
        elif request.generated >= request.max_tokens:
            self._finish(request, "length")

    def _finish(self, request: GenerationRequest, reason: str | None = None) -> None:
        self.running.pop(request.id, None)
        self.runner.release(request.id)
        if reason is not None:
            _send(request, Event("done", reason=reason))
        self._gauges()

    def _gauges(self) -> None:
        if self.metrics:
            self.metrics.queue_depth.set(len(self.waiting))
            self.metrics.running.set(len(self.running))


def _send(request: GenerationRequest, event: Event) -> None:
    try:
        request.emit(event)
    except Exception:  # noqa: BLE001, S110 - a consumer that is gone (closed event loop) must not stop the loop
        request.cancelled = True
