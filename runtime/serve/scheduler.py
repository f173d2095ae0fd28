"""Continuous batching at step granularity: one worker thread owns the model and runs the step loop.

Every iteration (1) drops cancelled requests (a client went away, or a stop string was seen) and frees
their rows, (2) admits waiting requests while fewer than `max_batch` are admitted (prefilling or running),
(3) prefills prompt tokens within the step's token budget, (4) runs ONE decode step for all running
sequences together (runtime.serve.batch). A request therefore joins and leaves the batch between any two
steps. Tokens go back through each request's `emit` callback (called on the worker thread or the scorer's;
the web layer hands them to its event loop).

Chunked prefill, as vLLM's scheduler (max_num_batched_tokens, decode first): a step processes at most
`prefill_chunk` tokens; each running sequence's decode takes one, and what is left goes to the admitted
prompts in arrival order, a prompt cut wherever the budget ends (on runners that can: `runner.chunked`;
others take whole prompts). So a long prompt is prefilled over several steps, and the running sequences
get a token after each: one request's 2000-token prompt no longer stops every stream for its whole prefill.
Prompts that fit are still prefilled together in one call.

Per request: its prompt's logprobs when `prompt_logprobs` asks ("prompt" events, one per chunk, in order),
each token with its logprob entry when `logprobs` asks, end-of-sequence and `stop_ids` banned before
`min_tokens` tokens, and `max_tokens` 0 (prompt scoring only: prefill, no token). The prompt's logprobs are
computed off the model's thread by the `Scorer` (its own thread: the next step runs meanwhile), from each
chunk's float32 logits (runtime.serve.logprobs.score_chunk); at most MAX_UNSCORED chunks of a request wait
for it (their logits are held), further chunks of that request wait a step. The scorer also passes on the
later events of a request with chunks in its queue, so every request's events keep their order. The
logprobs are the model's own (runtime.serve.logprobs), the token is the sampler's choice
(runtime.serve.sampling).

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

import numpy as np

from runtime.serve.batch import Chunk, RowsFailed, Runner
from runtime.serve.logprobs import TokenLogprob, score_chunk, score_token
from runtime.serve.metrics import Metrics
from runtime.serve.sampling import NoTokenAllowed, Sampler

_ids = itertools.count(1)
PREFILL_CHUNK = 64  # tokens per step (--prefill-chunk): measured on SmolLM2 on 2 CPU cores, docs/serving.md
MAX_UNSCORED = 2  # a request's chunks whose logits wait for the scorer (each [chunk, vocab] float32)


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
    prompt: tuple[TokenLogprob, ...] = ()  # the next prompt tokens, from token 1 on ("prompt" events)
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
    prefilled: int = 0  # prompt tokens in the runner's cache
    unscored: int = 0  # chunks of its prompt the scorer has not scored yet
    queued: int = 0  # its jobs (chunks and events) in the scorer's queue
    ended: bool = False  # its "done" or "error" event went out: nothing follows it

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
        prefill_chunk: int = PREFILL_CHUNK,
    ) -> None:
        if prefill_chunk < 1:
            raise ValueError(f"prefill_chunk must be at least 1, not {prefill_chunk}")
        self.runner = runner
        self.prefill_chunk = prefill_chunk
        self.on_fatal = on_fatal
        self.fatal: str | None = None
        self._abort: tuple[str, int] | None = None
        self.max_batch = max_batch
        self.max_queue = max_queue
        self.metrics = metrics
        self.waiting: deque[GenerationRequest] = deque()
        self.running: dict[int, GenerationRequest] = {}  # decoding
        self.prefilling: dict[int, GenerationRequest] = {}  # admitted, prompt not all prefilled (in order)
        self.live: dict[int, GenerationRequest] = {}  # submitted and not yet ended (error, done, cancelled)
        self.steps = 0
        self._cond = threading.Condition()
        self._stopping = False
        self._thread: threading.Thread | None = None
        self.scorer = Scorer(self._wake)

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
        return not self.waiting and not self.running and not self.prefilling and self.scorer.idle

    def cancel(self, request: GenerationRequest) -> None:
        request.cancelled = True
        with self._cond:
            self._cond.notify()

    def start(self) -> None:
        self.scorer.start()
        self._thread = threading.Thread(target=self._loop, name="serve-scheduler", daemon=True)
        self._thread.start()

    def stop(self) -> None:
        with self._cond:
            self._stopping = True
            self._cond.notify()
        if self._thread is not None:
            self._thread.join(timeout=30)
        self.scorer.stop()

    def _wake(self) -> None:
        """The scorer finished a chunk: a request waiting for it may take its next one."""
        with self._cond:
            self._cond.notify()

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
            while not self._stopping and self._abort is None and not self._work():
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
            while self.waiting and len(self.running) + len(self.prefilling) < self.max_batch:
                request = self.waiting.popleft()
                self.prefilling[request.id] = request
        self._gauges()
        plan = self._plan()
        if plan:
            self._prefill(plan)
        if self.running:
            self._decode()
        return True

    def _work(self) -> bool:
        """Whether a step has something to do (the caller holds the lock)."""
        admissible = self.waiting and len(self.running) + len(self.prefilling) < self.max_batch
        cancelled = any(r.cancelled for r in self.waiting) or any(
            r.cancelled for r in self.prefilling.values()
        )
        return bool(
            self.running or admissible or cancelled or any(map(self._ready, self.prefilling.values()))
        )

    @staticmethod
    def _ready(request: GenerationRequest) -> bool:
        """A prefilling request may take its next chunk (a scored one: when the scorer keeps up)."""
        return request.prompt_logprobs is None or request.unscored < MAX_UNSCORED

    def _plan(self) -> dict[int, tuple[GenerationRequest, int]]:
        """How many prompt tokens each prefilling request gets this step: the budget left by the decode
        rows (at least one token), in arrival order; a runner that cannot chunk takes whole prompts (a long
        one alone)."""
        budget = max(1, self.prefill_chunk - len(self.running))
        chunked = getattr(self.runner, "chunked", False)
        plan: dict[int, tuple[GenerationRequest, int]] = {}
        for request in list(self.prefilling.values()):
            if budget <= 0:
                break
            if not self._ready(request):
                continue
            left = len(request.prompt) - request.prefilled
            size = min(left, budget) if chunked else left
            if plan and size > budget:
                break
            plan[request.id] = (request, size)
            budget -= size
        return plan

    def _prefill(self, plan: dict[int, tuple[GenerationRequest, int]]) -> None:
        """The step's chunks in one runner call; a call that fails is retried one request at a time."""
        if self.metrics:
            self.metrics.prefill_batch_size.observe(len(plan))
        chunks = {}
        for key, (request, size) in plan.items():
            end = request.prefilled + size
            scored = request.prompt_logprobs is not None
            chunks[key] = Chunk(request.prompt[request.prefilled : end], end == len(request.prompt), scored)
        try:
            out = self.runner.prefill(chunks)
        except Exception as exc:  # noqa: BLE001 - these requests fail, the server keeps serving
            if len(plan) > 1 and getattr(self.runner, "problem", None) is None:
                for key, item in plan.items():  # one at a time: only a prompt that breaks the model fails
                    self._prefill({key: item})
                return
            for request, _ in plan.values():
                self.prefilling.pop(request.id, None)
                self.runner.release(request.id)
                self._emit(request, Event("error", reason=f"prefill failed: {exc}"))
            return
        for key, (request, size) in plan.items():
            prefilled, start = out[key], request.prefilled
            request.prefilled += size
            if prefilled.positions is not None:
                self.scorer.score(request, start, prefilled.positions)
            if not chunks[key].last:
                continue
            del self.prefilling[key]
            self.running[key] = request
            if request.max_tokens == 0:
                self._finish(request, "length")
            else:
                self._accept(request, prefilled.logits)

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
            self.prefilling.pop(request.id, None)
            with contextlib.suppress(Exception):  # a broken runner must not keep the others waiting
                self.runner.release(request.id)
            self._emit(request, Event("error", reason=reason, status=status))
        self.waiting.clear()
        self._gauges()

    def _drop_cancelled(self) -> None:
        for request in [r for r in self.waiting if r.cancelled]:
            self.live.pop(request.id, None)
        self.waiting = deque(r for r in self.waiting if not r.cancelled)
        for request in [r for r in (*self.running.values(), *self.prefilling.values()) if r.cancelled]:
            self._finish(request)

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
        self.prefilling.pop(request.id, None)
        if request.cancelled:
            self.live.pop(request.id, None)
        self.runner.release(request.id)
        if reason is not None:
            self._emit(request, Event("done", reason=reason))
        self._gauges()

    def _emit(self, request: GenerationRequest, event: Event) -> None:
        if event.kind in ("done", "error"):
            self.live.pop(request.id, None)
        self.scorer.send(request, event)

    def _gauges(self) -> None:
        if self.metrics:
            self.metrics.queue_depth.set(len(self.waiting))
            self.metrics.running.set(len(self.running) + len(self.prefilling))


class Scorer:
    """Prompt logprobs (echo), chunk by chunk, on a thread of its own: the scheduler queues a chunk's logits
    and goes on with the next step. Every event of a request that has jobs in the queue goes through the
    queue too, behind them, so the request's events keep their order ("prompt" events, then tokens, then
    the end); others go out at once. A chunk that cannot be scored (logits that are not finite) ends its
    request with a 500 and cancels it (the scheduler then frees its row)."""

    def __init__(self, on_scored: Callable[[], None] | None = None) -> None:
        self.on_scored = on_scored
        self._jobs: deque[tuple[GenerationRequest, Event | tuple[int, np.ndarray]]] = deque()
        self._cond = threading.Condition()
        self._busy = False
        self._stopping = False
        self._thread: threading.Thread | None = None

    @property
    def idle(self) -> bool:
        return not self._jobs and not self._busy

    def start(self) -> None:
        self._thread = threading.Thread(target=self._loop, name="serve-scorer", daemon=True)
        self._thread.start()

    def stop(self) -> None:
        with self._cond:
            self._stopping = True
            self._cond.notify()
        if self._thread is not None:
            self._thread.join(timeout=30)

    def score(self, request: GenerationRequest, start: int, logits: np.ndarray) -> None:
        """Queue the entries of the prompt tokens after positions start.. (`logits`: theirs, float32)."""
        with self._cond:
            request.unscored += 1
            self._queue(request, (start, logits))

    def send(self, request: GenerationRequest, event: Event) -> None:
        with self._cond:
            if request.queued:
                self._queue(request, event)
                return
        _deliver(request, event)

    def _queue(self, request: GenerationRequest, job: Event | tuple[int, np.ndarray]) -> None:
        request.queued += 1
        self._jobs.append((request, job))
        self._cond.notify()

    def _loop(self) -> None:
        while True:
            with self._cond:
                while not self._jobs and not self._stopping:
                    self._cond.wait()
                if not self._jobs:
                    return
                request, job = self._jobs.popleft()
                self._busy = True
            try:
                if isinstance(job, Event):
                    _deliver(request, job)
                else:
                    self._score(request, *job)
            finally:
                with self._cond:
                    request.queued -= 1
                    if not isinstance(job, Event):
                        request.unscored -= 1
                    self._busy = False
                if not isinstance(job, Event) and self.on_scored is not None:
                    self.on_scored()

    @staticmethod
    def _score(request: GenerationRequest, start: int, logits: np.ndarray) -> None:
        if request.ended or request.cancelled or request.prompt_logprobs is None:
            return
        tokens = request.prompt[start + 1 : start + 1 + len(logits)]  # row t predicts token t + 1
        try:
            entries = score_chunk(logits, tokens, request.prompt_logprobs)
        except Exception as exc:  # noqa: BLE001 - this request's fault ends this request only
            request.cancelled = True
            reason = f"prompt scoring failed: {type(exc).__name__}: {exc}"
            _deliver(request, Event("error", reason=reason, status=500))
            return
        _deliver(request, Event("prompt", prompt=tuple(entries)))


def _deliver(request: GenerationRequest, event: Event) -> None:
    """Send an event unless the request has ended (nothing follows its "done" or "error")."""
    if request.ended:
        return
    if event.kind in ("done", "error"):
        request.ended = True
    _send(request, event)


def _send(request: GenerationRequest, event: Event) -> None:
    try:
        request.emit(event)
    except Exception:  # noqa: BLE001, S110 - a consumer that is gone (closed event loop) must not stop the loop
        request.cancelled = True
