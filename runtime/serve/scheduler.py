"""Continuous batching at step granularity: one worker thread owns the model and runs the step loop.

Every iteration (1) drops cancelled requests (a client went away, or a stop string was seen) and frees
their rows, (2) admits waiting requests while fewer than `max_batch` run and prefills them together, (3) runs
ONE decode step for all running sequences together (runtime.serve.batch). A request therefore joins and
leaves the batch between any two steps. Tokens go back through each request's `emit` callback (called
on the worker thread; the web layer hands them to its event loop).

Per request: its prompt's logprobs after the prefill when `prompt_logprobs` asks (a "prompt" event), each
token with its logprob entry when `logprobs` asks, end-of-sequence and `stop_ids` banned before
`min_tokens` tokens, and `max_tokens` 0 (prompt scoring only: prefill, no token). The logprobs are the
model's own (runtime.serve.logprobs), the token is the sampler's choice (runtime.serve.sampling).

The waiting queue is bounded: `submit` raises QueueFull when the requests would not all fit in
`max_queue` (the choices of one HTTP request go in together or not at all). An error in a model call
fails only the requests of that call; the loop keeps running.
"""

from __future__ import annotations

import itertools
import threading
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Literal

from runtime.serve.batch import Prefilled, Runner
from runtime.serve.logprobs import TokenLogprob, score_token
from runtime.serve.metrics import Metrics
from runtime.serve.sampling import Sampler

_ids = itertools.count(1)


@dataclass(frozen=True)
class Event:
    """The prompt's logprobs, a generated token (`stop`: an end-of-sequence or stop id that ends the
    request; its text is not part of the completion), the end of a request (reason "stop" or "length"), or
    an error message."""

    kind: Literal["prompt", "token", "done", "error"]
    token: int = -1
    reason: str = ""
    logprob: TokenLogprob | None = None  # the token's, when the request asked for logprobs
    prompt: tuple[TokenLogprob, ...] = ()  # prompt tokens 1.. ("prompt" events)
    stop: bool = False


class QueueFull(Exception):
    """More requests are waiting than the server accepts; the client should retry later."""


@dataclass(eq=False)
class GenerationRequest:
    prompt: list[int]
    max_tokens: int  # 0: score the prompt only
    sampler: Sampler
    emit: Callable[[Event], None]
    eos_ids: frozenset[int] = frozenset()
    stop_ids: frozenset[int] = frozenset()  # stop_token_ids: end the request like an end-of-sequence id
    min_tokens: int = 0  # before this many tokens, eos_ids and stop_ids are banned
    logprobs: int | None = None  # top tokens per generated token's entry; None: no logprobs
    prompt_logprobs: int | None = None  # the same for the prompt's tokens (echo); None: not scored
    id: int = field(default_factory=lambda: next(_ids))
    arrived: float = field(default_factory=time.perf_counter)
    cancelled: bool = False
    output: list[int] = field(default_factory=list)
    next_token: int = -1
    last_time: float = 0.0

    @property
    def generated(self) -> int:
        return len(self.output)


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

    def submit(self, *requests: GenerationRequest) -> None:
        """Queue the requests, all of them or (QueueFull) none."""
        with self._cond:
            if len(self.waiting) + len(requests) > self.max_queue:
                raise QueueFull(
                    f"{len(self.waiting)} requests are waiting (--max-queue {self.max_queue})"
                    + (f" and this one brings {len(requests)}" if len(requests) > 1 else "")
                )
            self.waiting.extend(requests)
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
        scored = {r.id: r.prompt_logprobs for r in requests if r.prompt_logprobs is not None}
        try:
            out = self.runner.prefill_many({r.id: r.prompt for r in requests}, scored)
        except Exception as exc:  # noqa: BLE001 - these requests fail, the server keeps serving
            for request in requests:
                self.runner.release(request.id)
                _send(request, Event("error", reason=f"prefill failed: {exc}"))
            return
        for request in requests:
            prefilled: Prefilled = out[request.id]
            self.running[request.id] = request
            if prefilled.prompt_logprobs is not None:
                _send(request, Event("prompt", prompt=tuple(prefilled.prompt_logprobs)))
            if request.max_tokens == 0:
                self._finish(request, "length")
            else:
                self._accept(request, prefilled.logits)

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
        ending = request.eos_ids | request.stop_ids
        banned = ending if request.generated < request.min_tokens else ()
        token = request.sampler(logits, request.prompt, request.output, banned)
        entry = None if request.logprobs is None else score_token(logits, token, request.logprobs)
        now = time.perf_counter()
        if self.metrics:
            if request.generated == 0:
                self.metrics.time_to_first_token.observe(now - request.arrived)
            else:
                self.metrics.time_per_output_token.observe(now - request.last_time)
            self.metrics.generation_tokens.inc()
        request.output.append(token)
        request.next_token, request.last_time = token, now
        _send(request, Event("token", token=token, logprob=entry, stop=token in ending))
        if token in ending:
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
