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
`max_queue` (the choices of one HTTP request go in together or not at all).

No request can hurt another: a fault while sampling, scoring or emitting one request's token ends that
request with an error event (status 400 when the request asked for the impossible, 500 otherwise) and the
batch runs on. A model call that fails is retried row by row (prefills one prompt at a time here; a decode
step row by row in the runner, every runner and TP folder: runtime.serve.batch.RowsFailed), so a row that
breaks the backend fails alone. A fault the loop cannot contain (the runner reports a `problem`, such as a
TP rank that died or hung, or an error outside any one request) is fatal: every running and waiting request
gets an error at once, `problem` says why, and `on_fatal` is called (the app then exits or answers 503).

`abort(reason)` ends every request with an error (graceful shutdown after its drain timeout).
"""

from __future__ import annotations

import contextlib
import itertools
import threading
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Literal

from runtime.serve.batch import Prefilled, RowsFailed, Runner
from runtime.serve.logprobs import TokenLogprob, score_token
from runtime.serve.metrics import Metrics
from runtime.serve.sampling import NoTokenAllowed, Sampler

_ids = itertools.count(1)


@dataclass(frozen=True)
class Event:
    """The prompt's logprobs, a generated token (`stop`: an end-of-sequence or stop id that ends the
    request; its text is not part of the completion), the end of a request (reason "stop" or "length"), or
    an error message (`status`: the HTTP status it stands for)."""

    kind: Literal["prompt", "token", "done", "error"]
    token: int = -1
    reason: str = ""
    status: int = 500
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
        self,
        runner: Runner,
        max_batch: int = 8,
        max_queue: int = 64,
        metrics: Metrics | None = None,
        on_fatal: Callable[[str], None] | None = None,
    ) -> None:
        self.runner = runner
        self.on_fatal = on_fatal
        self.fatal: str | None = None
        self._abort: tuple[str, int] | None = None
        self.max_batch = max_batch
        self.max_queue = max_queue
        self.metrics = metrics
        self.waiting: deque[GenerationRequest] = deque()
        self.running: dict[int, GenerationRequest] = {}
        self.live: dict[int, GenerationRequest] = {}  # submitted and not yet ended (error, done, cancelled)
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
            self.live.update((r.id, r) for r in requests)
            self._cond.notify()
        self._gauges()

    def abort(self, reason: str, status: int = 503) -> None:
        """End every waiting and running request with an error (done by the worker between steps)."""
        with self._cond:
            self._abort = (reason, status)
            self._cond.notify()

    @property
    def idle(self) -> bool:
        return not self.waiting and not self.running

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
        if self.fatal is not None:
            return self.fatal
        if not self.alive:
            return "scheduler stopped"
        return getattr(self.runner, "problem", None)  # e.g. a TP rank process that died

    # ------------------------------------------------------------------------------------ the worker

    def _loop(self) -> None:
        try:
            while self._iteration():
                problem = getattr(self.runner, "problem", None)
                if problem is not None:
                    self._die(problem)
                    return
        except BaseException as exc:  # noqa: BLE001 - outside any one request: fail them all, then stop
            self._die(f"the scheduler failed: {type(exc).__name__}: {exc}")

    def _iteration(self) -> bool:
        """One step of the loop; False when the scheduler stops."""
        with self._cond:
            while not self._stopping and not self.waiting and not self.running and self._abort is None:
                self._cond.wait(timeout=1.0)  # wakes to notice a runner problem while idle
                if getattr(self.runner, "problem", None) is not None:
                    return True
            if self._stopping:
                return False
            if self._abort is not None:
                (reason, status), self._abort = self._abort, None
                self._fail_all(reason, status)
                return True
            self._drop_cancelled()
            admitted = []
            while self.waiting and len(self.running) + len(admitted) < self.max_batch:
                admitted.append(self.waiting.popleft())
        self._gauges()
        if admitted:
            self._prefill(admitted)
        if self.running:
            self._decode()
        return True

    def _die(self, reason: str) -> None:
        self.fatal = reason
        with self._cond:
            self._fail_all(reason, 503)
        if self.on_fatal is not None:
            self.on_fatal(reason)

    def _fail_all(self, reason: str, status: int) -> None:
        """Every request not yet ended gets an error (the caller holds the lock)."""
        for request in list(self.live.values()):
            self.running.pop(request.id, None)
            with contextlib.suppress(Exception):  # a broken runner must not keep the others waiting
                self.runner.release(request.id)
            self._emit(request, Event("error", reason=reason, status=status))
        self.waiting.clear()
        self._gauges()

    def _drop_cancelled(self) -> None:
        for request in [r for r in self.waiting if r.cancelled]:
            self.live.pop(request.id, None)
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
            if len(requests) > 1 and getattr(self.runner, "problem", None) is None:
                for request in requests:  # one at a time: only a prompt that breaks the model fails
                    self._prefill([request])
                return
            for request in requests:
                self._emit(request, Event("error", reason=f"prefill failed: {exc}"))
            return
        for request in requests:
            prefilled: Prefilled = out[request.id]
            self.running[request.id] = request
            if prefilled.prompt_logprobs is not None:
                self._emit(request, Event("prompt", prompt=tuple(prefilled.prompt_logprobs)))
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
        except RowsFailed as rows:  # the runner isolated the rows that break the model
            for request in batch:
                if request.id in rows.failed:
                    self._fail(request, f"decode step failed: {rows.failed[request.id]}", 500)
            out = rows.done
        except Exception as exc:  # noqa: BLE001 - fail this step's requests, keep the loop alive
            for request in batch:
                self._fail(request, f"decode step failed: {exc}", 500)
            return
        self.steps += 1
        for request in batch:
            if request.id in out:
                self._accept(request, out[request.id])

    def _fail(self, request: GenerationRequest, reason: str, status: int) -> None:
        self._finish(request)
        self._emit(request, Event("error", reason=reason, status=status))

    def _accept(self, request: GenerationRequest, logits) -> None:
        ending = request.eos_ids | request.stop_ids
        banned = ending if request.generated < request.min_tokens else ()
        try:
            token = request.sampler(logits, request.prompt, request.output, banned)
            entry = None if request.logprobs is None else score_token(logits, token, request.logprobs)
        except NoTokenAllowed as exc:  # what the request asked for
            self._fail(request, str(exc), 400)
            return
        except Exception as exc:  # noqa: BLE001 - this request's fault ends this request only
            self._fail(request, f"sampling failed: {type(exc).__name__}: {exc}", 500)
            return
        now = time.perf_counter()
        if self.metrics:
            if request.generated == 0:
                self.metrics.time_to_first_token.observe(now - request.arrived)
            else:
                self.metrics.time_per_output_token.observe(now - request.last_time)
            self.metrics.generation_tokens.inc()
        request.output.append(token)
        request.next_token, request.last_time = token, now
        self._emit(request, Event("token", token=token, logprob=entry, stop=token in ending))
        if token in ending:
            self._finish(request, "stop")
        elif request.generated >= request.max_tokens:
            self._finish(request, "length")

    def _finish(self, request: GenerationRequest, reason: str | None = None) -> None:
        """Its row is freed; with a reason, it ends with "done" (without, an error or a cancel ends it)."""
        self.running.pop(request.id, None)
        if request.cancelled:
            self.live.pop(request.id, None)
        self.runner.release(request.id)
        if reason is not None:
            self._emit(request, Event("done", reason=reason))
        self._gauges()

    def _emit(self, request: GenerationRequest, event: Event) -> None:
        if event.kind in ("done", "error"):
            self.live.pop(request.id, None)
        _send(request, event)

    def _gauges(self) -> None:
        if self.metrics:
            self.metrics.queue_depth.set(len(self.waiting))
            self.metrics.running.set(len(self.running))


def _send(request: GenerationRequest, event: Event) -> None:
    try:
        request.emit(event)
    except Exception:  # noqa: BLE001, S110 - a consumer that is gone (closed event loop) must not stop the loop
        request.cancelled = True
