"""The OpenAI-compatible HTTP API (FastAPI, server-sent events through sse-starlette) over a Scheduler.

Routes: GET /health, GET /metrics (Prometheus), GET /v1/models[/{id}], POST /v1/completions,
POST /v1/chat/completions. Errors are OpenAI error JSON with 400 (bad parameters, malformed JSON),
404 (unknown model or route), 503 (the waiting queue is full; Retry-After: 1) or 500. Tokenization and
detokenization run on the event loop thread; the model runs on the scheduler's thread.
"""

from __future__ import annotations

import asyncio
import json
import time
import uuid
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response
from sse_starlette.sse import EventSourceResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from runtime.serve.loading import ServedModel
from runtime.serve.metrics import Metrics
from runtime.serve.protocol import ApiError, ChatRequest, CompletionRequest, TextStream, _Generation
from runtime.serve.sampling import Sampler
from runtime.serve.scheduler import Event, GenerationRequest, QueueFull, Scheduler

DISCONNECT_POLL_S = 0.25


class GenerationFailed(Exception):
    """The model call behind a request failed (the scheduler's error event)."""


def create_app(served: ServedModel, max_batch: int = 8, max_queue: int = 64) -> FastAPI:
    metrics = Metrics()
    max_batch = min(max_batch, served.max_batch or max_batch)  # an engine's profile may allow fewer
    scheduler = Scheduler(served.runner(), max_batch, max_queue, metrics)

    @asynccontextmanager
    async def lifespan(_: FastAPI):
        scheduler.start()
        yield
        scheduler.stop()
        served.close()  # a TP folder's rank processes end with the server

    app = FastAPI(title="ffn-fusion serve", lifespan=lifespan)
    app.state.served, app.state.scheduler, app.state.metrics = served, scheduler, metrics
    api = _Api(served, scheduler, metrics)
    _error_handlers(app, metrics)

    @app.get("/health")
    async def health() -> Response:
        problem = scheduler.problem
        return JSONResponse({"status": problem or "ok"}, status_code=503 if problem else 200)

    @app.get("/metrics")
    async def prometheus() -> Response:
        return Response(metrics.render(), media_type="text/plain; version=0.0.4; charset=utf-8")

    @app.get("/v1/models")
    async def models() -> dict:
        return {"object": "list", "data": [api.model_card()]}

    @app.get("/v1/models/{model_id:path}")
    async def model(model_id: str) -> dict:
        api.check_model(model_id)
        return api.model_card()

    @app.post("/v1/completions")
    async def completions(body: CompletionRequest, request: Request) -> Response:
        return await api.respond("completions", body, api.completion_prompt(body), request)

    @app.post("/v1/chat/completions")
    async def chat_completions(body: ChatRequest, request: Request) -> Response:
        return await api.respond("chat", body, api.chat_prompt(body), request)

    return app


def _error_handlers(app: FastAPI, metrics: Metrics) -> None:
    def answer(request: Request, error: ApiError) -> JSONResponse:
        metrics.requests.labels(_endpoint(request), str(error.status)).inc()
        headers = {"Retry-After": "1"} if error.status in (429, 503) else None
        return JSONResponse(error.body(), status_code=error.status, headers=headers)

    @app.exception_handler(ApiError)
    async def api_error(request: Request, exc: ApiError) -> JSONResponse:
        return answer(request, exc)

    @app.exception_handler(RequestValidationError)
    async def invalid(request: Request, exc: RequestValidationError) -> JSONResponse:
        first = exc.errors()[0] if exc.errors() else {}
        if first.get("type") == "json_invalid":
            return answer(
                request, ApiError(400, f"malformed JSON body: {first.get('msg', '')}", code="json_invalid")
            )
        where = ".".join(str(p) for p in first.get("loc", ()) if p != "body")
        message = str(first.get("msg", "invalid request")).removeprefix("Value error, ")
        return answer(
            request, ApiError(400, f"{where}: {message}" if where else message, param=where or None)
        )

    @app.exception_handler(StarletteHTTPException)
    async def http_error(request: Request, exc: StarletteHTTPException) -> JSONResponse:
        return answer(request, ApiError(exc.status_code, str(exc.detail), code=str(exc.status_code)))

    @app.exception_handler(Exception)
    async def internal(request: Request, exc: Exception) -> JSONResponse:
        return answer(request, ApiError(500, f"internal error: {type(exc).__name__}: {exc}"))


def _endpoint(request: Request) -> str:
    path = request.url.path
    return path if path in ("/v1/completions", "/v1/chat/completions", "/v1/models", "/health") else "other"


class _Api:
    def __init__(self, served: ServedModel, scheduler: Scheduler, metrics: Metrics) -> None:
        self.served, self.scheduler, self.metrics = served, scheduler, metrics
        self.tokenizer = served.tokenizer

    def model_card(self) -> dict:
        s = self.served
        return {
            "id": s.id,
            "object": "model",
            "created": s.created,
            "owned_by": "ffn-fusion",
            "max_model_len": s.max_context,
            "backend": s.source.backend,
        }

    def check_model(self, name: str) -> None:
        if name != self.served.id:
            raise ApiError(
                404,
                f"the model {name!r} does not exist; this server serves {self.served.id!r}",
                param="model",
                code="model_not_found",
            )

    # ------------------------------------------------------------------------------------------ prompts

    def completion_prompt(self, body: CompletionRequest) -> list[int]:
        self.check_model(body.model)
        if isinstance(body.prompt, str):
            return list(self.tokenizer(body.prompt)["input_ids"])
        return [int(t) for t in body.prompt]

    def chat_prompt(self, body: ChatRequest) -> list[int]:
        self.check_model(body.model)
        if not getattr(self.tokenizer, "chat_template", None):
            raise ApiError(400, "this model's tokenizer has no chat template: use /v1/completions")
        messages = [{"role": m.role, "content": m.text()} for m in body.messages]
        try:
            ids = self.tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True)
        except Exception as exc:  # noqa: BLE001 - a template that rejects the messages is the client's error
            raise ApiError(
                400, f"the chat template rejects these messages: {exc}", param="messages"
            ) from None
        if isinstance(ids, dict) or hasattr(ids, "input_ids"):
            ids = ids["input_ids"]
        return list(ids)

    # ------------------------------------------------------------------------------------- generation

    def _limits(self, body: _Generation, prompt: list[int]) -> int:
        """max_tokens, checked against the context; prompt ids checked against the vocabulary."""
        vocab, context = self.served.vocab, self.served.max_context
        if not prompt:
            raise ApiError(400, "the prompt is empty", param="prompt")
        if vocab is not None and not all(0 <= t < vocab for t in prompt):
            raise ApiError(400, f"prompt token ids must lie in 0..{vocab - 1}", param="prompt")
        wanted = body.max_tokens or getattr(body, "max_completion_tokens", None)
        if wanted is None:
            wanted = 16 if isinstance(body, CompletionRequest) else context - len(prompt)
        limit = self.served.max_prompt
        if limit is not None and len(prompt) > limit:
            raise ApiError(
                400, f"the prompt has {len(prompt)} tokens; this engine takes at most {limit}", param="prompt"
            )
        if len(prompt) + wanted > context:
            raise ApiError(
                400,
                f"this model's maximum context length is {context} tokens; the prompt has "
                f"{len(prompt)} and max_tokens is {wanted}",
                param="max_tokens",
            )
        return wanted

    async def respond(self, kind: str, body: _Generation, prompt: list[int], request: Request) -> Response:
        max_tokens = self._limits(body, prompt)
        if problem := self.scheduler.problem:
            raise ApiError(503, f"the model is not being served: {problem}", code="model_unavailable")
        temperature = 1.0 if body.temperature is None else body.temperature
        loop = asyncio.get_running_loop()
        queue: asyncio.Queue[Event] = asyncio.Queue()
        job = GenerationRequest(
            prompt,
            max_tokens,
            Sampler(temperature, 1.0 if body.top_p is None else body.top_p, body.seed),
            emit=lambda event: loop.call_soon_threadsafe(queue.put_nowait, event),
            eos_ids=frozenset() if body.ignore_eos else self.served.eos_ids,
        )
        try:
            self.scheduler.submit(job)
        except QueueFull as exc:
            raise ApiError(503, f"the server is busy: {exc}; retry later", code="queue_full") from None
        self.metrics.prompt_tokens.inc(len(prompt))
        reply = _Reply(kind, self.served.id, len(prompt))
        pieces = self._pieces(job, queue, TextStream(self.tokenizer, body.stop), reply)
        endpoint = "/v1/completions" if kind == "completions" else "/v1/chat/completions"
        if body.stream:
            self.metrics.requests.labels(endpoint, "200").inc()
            events = self._events(pieces, reply, body.include_usage, job)
            return EventSourceResponse(events, ping=15)
        text, reason = await self._collect(pieces, request)
        self.metrics.requests.labels(endpoint, "200").inc()
        self.metrics.request_latency.observe(time.perf_counter() - job.arrived)
        return JSONResponse(reply.whole(text, reason))

    async def _pieces(
        self, job: GenerationRequest, queue: asyncio.Queue, text: TextStream, reply: _Reply
    ) -> AsyncIterator[tuple[str, str | None]]:
        """(new text, finish reason or None) until the request ends; its slot is freed however it ends."""
        try:
            while True:
                event = await queue.get()
                if event.kind == "error":
                    raise GenerationFailed(event.reason)
                if event.kind == "done":
                    yield text.flush(), event.reason
                    return
                reply.completion_tokens += 1
                piece, stopped = text.push(event.token)
                if stopped:
                    yield piece, "stop"
                    return
                if piece:
                    yield piece, None
        finally:
            self.scheduler.cancel(job)  # no-op when it has finished; frees the row when the client left

    async def _collect(self, pieces: AsyncIterator, request: Request) -> tuple[str, str]:
        async def gather() -> tuple[str, str]:
            parts, reason = [], "length"
            async for piece, done in pieces:
                parts.append(piece)
                reason = done or reason
            return "".join(parts), reason

        task = asyncio.ensure_future(gather())
        while True:
            finished, _ = await asyncio.wait({task}, timeout=DISCONNECT_POLL_S)
            if finished:
                break
            if await request.is_disconnected():
                task.cancel()
                await asyncio.gather(task, return_exceptions=True)
                raise ApiError(499, "client disconnected")
        try:
            return task.result()
        except GenerationFailed as exc:
            raise ApiError(500, f"generation failed: {exc}") from None

    async def _events(
        self, pieces: AsyncIterator, reply: _Reply, usage: bool, job: GenerationRequest
    ) -> AsyncIterator[dict]:
        try:
            for chunk in reply.opening():
                yield {"data": json.dumps(chunk)}
            async for piece, reason in pieces:
                yield {"data": json.dumps(reply.chunk(piece, reason))}
            self.metrics.request_latency.observe(time.perf_counter() - job.arrived)
            if usage:
                yield {"data": json.dumps(reply.usage_chunk())}
        except GenerationFailed as exc:
            yield {"data": json.dumps(ApiError(500, f"generation failed: {exc}").body())}
        yield {"data": "[DONE]"}


class _Reply:
    """Response bodies and stream chunks of one request, in the OpenAI formats."""

    def __init__(self, kind: str, model: str, prompt_tokens: int) -> None:
        self.chat = kind == "chat"
        self.id = ("chatcmpl-" if self.chat else "cmpl-") + uuid.uuid4().hex
        self.model, self.created = model, int(time.time())
        self.prompt_tokens, self.completion_tokens = prompt_tokens, 0

    def usage(self) -> dict:
        return {
            "prompt_tokens": self.prompt_tokens,
            "completion_tokens": self.completion_tokens,
            "total_tokens": self.prompt_tokens + self.completion_tokens,
        }

    def _head(self, chunk: bool) -> dict[str, Any]:
        kind = ("chat.completion" if self.chat else "text_completion") + (
            ".chunk" if chunk and self.chat else ""
        )
        return {"id": self.id, "object": kind, "created": self.created, "model": self.model}

    def whole(self, text: str, reason: str) -> dict:
        if self.chat:
            choice = {
                "index": 0,
                "message": {"role": "assistant", "content": text},
                "finish_reason": reason,
                "logprobs": None,
            }
        else:
            choice = {"index": 0, "text": text, "finish_reason": reason, "logprobs": None}
        return {**self._head(False), "choices": [choice], "usage": self.usage()}

    def opening(self) -> list[dict]:
        """A chat stream starts with the assistant role (as OpenAI's does)."""
        if not self.chat:
            return []
        return [
            {
                **self._head(True),
                "choices": [
                    {
                        "index": 0,
                        "delta": {"role": "assistant", "content": ""},
                        "finish_reason": None,
                        "logprobs": None,
                    }
                ],
            }
        ]

    def chunk(self, piece: str, reason: str | None) -> dict:
        if self.chat:
            choice = {
                "index": 0,
                "delta": {"content": piece} if piece else {},
                "finish_reason": reason,
                "logprobs": None,
            }
        else:
            choice = {"index": 0, "text": piece, "finish_reason": reason, "logprobs": None}
        return {**self._head(True), "choices": [choice]}

    def usage_chunk(self) -> dict:
        return {**self._head(True), "choices": [], "usage": self.usage()}
