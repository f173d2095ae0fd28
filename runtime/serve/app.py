"""The OpenAI-compatible HTTP API (FastAPI, server-sent events through sse-starlette) over a Scheduler.

Routes: GET /health, GET /metrics (Prometheus), GET /v1/models[/{id}], POST /v1/completions,
POST /v1/chat/completions. Errors are OpenAI error JSON with 400 (bad parameters, malformed JSON), 404
(unknown model or route), 405 (with Allow), 408 (a body that did not arrive within `request_read_timeout`),
413 (a body above `max_request_bytes`, refused before it is parsed), 503 (the waiting queue is full or the
server is draining: Retry-After: 1; the model is not being served any more: no Retry-After) or 500 (a fault
of this request's generation, named). The OpenAPI document (/openapi.json) states all of them, the
event-stream content type, and every bound (runtime/serve/openapi.py).

The event loop only moves bytes: tokenization and detokenization run in worker threads, the model on the
scheduler's thread, so /health answers at once whatever the requests hold.

Lifecycle: `drain()` (SIGTERM, runtime/serve/server.py) stops admitting (503) and lets the running requests
finish; `abort()` then ends the rest with an error (streams: an error event and [DONE]; others: JSON). A
fatal scheduler fault (runtime/serve/scheduler.py) fails every request; with on_fatal "exit" the server
then exits non-zero (through `app.state.exit`, set by the server) so that a supervisor restarts it; with
"serve" it stays up answering 503.
"""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from dataclasses import dataclass

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response
from sse_starlette.sse import AppStatus, EventSourceResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from runtime.serve.connections import RequestGuard
from runtime.serve.loading import ServedModel
from runtime.serve.logprobs import TokenLogprob, TokenTexts
from runtime.serve.metrics import Metrics
from runtime.serve.openapi import (
    HEALTH_RESPONSES,
    METRICS_RESPONSES,
    MODEL_RESPONSES,
    MODELS_RESPONSES,
    Limits,
    generation_responses,
    openapi_document,
)
from runtime.serve.protocol import (
    COMPLETION_MAX_TOKENS,
    ROLES,
    ApiError,
    ChatRequest,
    CompletionRequest,
    FieldError,
    TextStream,
    _Generation,
)
from runtime.serve.responses import Choice, Reply, Update
from runtime.serve.sampling import Sampler
from runtime.serve.scheduler import PREFILL_CHUNK, Event, GenerationRequest, QueueFull, Scheduler

DISCONNECT_POLL_S = 0.25
# chat's default (--default-max-tokens): without one, a request ran to the end of the context (8192 tokens,
# minutes on a CPU); vLLM's default is that, OpenAI's is bounded by each model's output limit
DEFAULT_MAX_TOKENS = 512
MAX_REQUEST_BYTES = 4 * 1024 * 1024  # well above what lm-eval's batched requests send
REQUEST_READ_TIMEOUT_S = (
    10.0  # headers, then the body (runtime/serve/connections.py); 4 MiB in 10 s: 420 kB/s
)
ON_FATAL = ("exit", "serve")
FATAL_EXIT_CODE = 1
SHUTTING_DOWN = "the server is shutting down"


class GenerationFailed(Exception):
    """The model call behind a request failed (the scheduler's error event) with this HTTP status."""

    def __init__(self, reason: str, status: int) -> None:
        super().__init__(reason)
        self.status = status


def create_app(
    served: ServedModel,
    max_batch: int = 8,
    max_queue: int = 64,
    *,
    max_request_bytes: int = MAX_REQUEST_BYTES,
    on_fatal: str = "exit",
    default_max_tokens: int = DEFAULT_MAX_TOKENS,
    request_read_timeout: float | None = REQUEST_READ_TIMEOUT_S,
    prefill_chunk: int = PREFILL_CHUNK,
) -> FastAPI:
    """`default_max_tokens`: a chat request's token limit when it sends none (capped by the context).
    `request_read_timeout`: seconds a request's body may take to arrive after its headers (408; the
    server's protocol bounds the headers the same way: runtime/serve/server.py). `prefill_chunk`: the
    scheduler's tokens per step (chunked prefill; an engine's profile may allow fewer per call)."""
    if on_fatal not in ON_FATAL:
        raise ValueError(f"on_fatal must be one of {ON_FATAL}, not {on_fatal!r}")
    if default_max_tokens < 1:
        raise ValueError(f"default_max_tokens must be at least 1, not {default_max_tokens}")
    # streams end by drain/abort (runtime/serve/server.py), not cut by sse-starlette on the first signal
    getattr(AppStatus, "disable_automatic_graceful_drain", lambda: None)()
    metrics = Metrics()
    max_batch = min(max_batch, served.max_batch or max_batch)  # an engine's profile may allow fewer

    def fatal(reason: str) -> None:
        exit_hook = getattr(app.state, "exit", None)
        if on_fatal == "exit" and exit_hook is not None:
            exit_hook(FATAL_EXIT_CODE, f"the model is not being served: {reason}")

    prefill_chunk = min(prefill_chunk, served.max_prompt or prefill_chunk)
    scheduler = Scheduler(
        served.runner(), max_batch, max_queue, metrics, on_fatal=fatal, prefill_chunk=prefill_chunk
    )

    @asynccontextmanager
    async def lifespan(_: FastAPI):
        scheduler.start()
        yield
        scheduler.stop()
        served.close()  # a TP folder's rank processes end with the server

    app = FastAPI(title="ffn-fusion serve", lifespan=lifespan)
    app.state.served, app.state.scheduler, app.state.metrics = served, scheduler, metrics
    app.state.draining = False
    app.state.request_read_timeout = request_read_timeout
    app.state.exit = None  # (code, reason) -> None: set by the server that runs the app
    app.state.fatal = fatal  # the server's drain reports a problem the scheduler has not acted on yet
    api = _Api(served, scheduler, metrics, app, default_max_tokens)
    _error_handlers(app, metrics)
    app.add_middleware(RequestGuard, limit=max_request_bytes, read_timeout=request_read_timeout)

    @app.get("/health", responses=HEALTH_RESPONSES)
    async def health() -> Response:
        problem = scheduler.problem or (SHUTTING_DOWN if app.state.draining else None)
        return JSONResponse({"status": problem or "ok"}, status_code=503 if problem else 200)

    @app.get("/metrics", response_class=Response, responses=METRICS_RESPONSES)
    async def prometheus() -> Response:
        return Response(metrics.render(), media_type="text/plain; version=0.0.4; charset=utf-8")

    @app.get("/v1/models", responses=MODELS_RESPONSES)
    async def models() -> dict:
        return {"object": "list", "data": [api.model_card()]}

    @app.get("/v1/models/{model_id:path}", responses=MODEL_RESPONSES)
    async def model(model_id: str) -> dict:
        api.check_model(model_id)
        return api.model_card()

    @app.post("/v1/completions", responses=generation_responses("text_completion"))
    async def completions(body: CompletionRequest, request: Request) -> Response:
        prompts = await asyncio.to_thread(api.completion_prompts, body)
        return await api.respond("completions", body, prompts, request)

    @app.post("/v1/chat/completions", responses=generation_responses("chat.completion"))
    async def chat_completions(body: ChatRequest, request: Request) -> Response:
        prompts = await asyncio.to_thread(api.chat_prompts, body)
        return await api.respond("chat", body, prompts, request)

    limits = Limits(
        served.id,
        served.vocab,
        max_queue,
        served.max_context,
        served.max_prompt,
        api.max_chars,
        default_max_tokens,
    )
    app.openapi = lambda: openapi_document(app, limits)  # type: ignore[method-assign]
    return app


def drain(app: FastAPI) -> None:
    """Stop admitting requests (503, /health 503); those already admitted go on."""
    app.state.draining = True


def abort(app: FastAPI, reason: str = SHUTTING_DOWN) -> None:
    """End every waiting and running request with an error (503)."""
    app.state.scheduler.abort(reason)


def _error_handlers(app: FastAPI, metrics: Metrics) -> None:
    def answer(request: Request, error: ApiError, headers: dict | None = None) -> JSONResponse:
        metrics.requests.labels(_endpoint(request), str(error.status)).inc()
        headers = dict(headers or {})
        if error.status == 429 or (error.status == 503 and error.code != "model_unavailable"):
            headers["Retry-After"] = "1"  # worth retrying soon; a model that is gone is not
        return _AsciiJSON(error.body(), status_code=error.status, headers=headers or None)

    @app.exception_handler(ApiError)
    async def api_error(request: Request, exc: ApiError) -> JSONResponse:
        return answer(request, exc)

    @app.exception_handler(RequestValidationError)
    async def invalid(request: Request, exc: RequestValidationError) -> JSONResponse:
        errors = list(exc.errors())
        first = errors[0] if errors else {}
        if first.get("type") == "json_invalid":
            return answer(
                request, ApiError(400, f"malformed JSON body: {first.get('msg', '')}", code="json_invalid")
            )
        cause = next(
            (e["ctx"]["error"] for e in errors if isinstance(e.get("ctx", {}).get("error"), FieldError)), None
        )
        if cause is not None:  # a check across fields, or of a field it names
            param = where = cause.field
            message = str(cause)
        else:  # a union reports every alternative: the deepest error is the most specific one
            first = max(errors, key=lambda e: len(e.get("loc", ())), default={})
            loc = [p for p in first.get("loc", ()) if p != "body"]
            # a message's role names the alternative of its union (messages[0].user.content)
            path = [
                p
                for i, p in enumerate(loc)
                if not _union_tag(p) and not (i and p in ROLES and isinstance(loc[i - 1], int))
            ]
            where = "".join(f"[{p}]" if isinstance(p, int) else f".{p}" for p in path).lstrip(".")
            param = str(path[0]) if path else None
            message = str(first.get("msg", "invalid request")).removeprefix("Value error, ")
        return answer(request, ApiError(400, f"{where}: {message}" if where else message, param=param))

    @app.exception_handler(StarletteHTTPException)
    async def http_error(request: Request, exc: StarletteHTTPException) -> JSONResponse:
        code = {408: "request_timeout", 413: "body_too_large"}.get(exc.status_code, str(exc.status_code))
        return answer(request, ApiError(exc.status_code, str(exc.detail), code=code), exc.headers)

    @app.exception_handler(Exception)
    async def internal(request: Request, exc: Exception) -> JSONResponse:
        return answer(request, ApiError(500, f"internal error: {type(exc).__name__}: {exc}"))


_TYPE_TAGS = {"str", "int", "float", "bool", "list", "dict", "none", "literal", "model", "nullable"}


def _union_tag(part: object) -> bool:
    """pydantic's name of a union member in an error's location (`constrained-str`, `list[int]`)."""
    return isinstance(part, str) and (part in _TYPE_TAGS or any(c in part for c in "[]-"))


class _AsciiJSON(JSONResponse):
    """Error JSON with non-ASCII characters escaped: a message quoting a client's lone surrogate stays
    encodable (a plain JSONResponse would fail to encode it and drop the connection)."""

    def render(self, content: object) -> bytes:
        return json.dumps(content, ensure_ascii=True, separators=(",", ":")).encode("ascii")


def _endpoint(request: Request) -> str:
    path = request.url.path
    return path if path in ("/v1/completions", "/v1/chat/completions", "/v1/models", "/health") else "other"


class _Api:
    def __init__(
        self,
        served: ServedModel,
        scheduler: Scheduler,
        metrics: Metrics,
        app: FastAPI,
        default_max_tokens: int = DEFAULT_MAX_TOKENS,
    ) -> None:
        self.served, self.scheduler, self.metrics, self.app = served, scheduler, metrics, app
        self.default_max_tokens = default_max_tokens
        self.tokenizer = served.tokenizer
        self.texts = TokenTexts(served.tokenizer)
        # a text longer than this cannot fit the context whatever it holds: refused before tokenizing it
        self.max_chars = 4 * _longest_token(served.tokenizer) * served.max_context

    def _check_chars(self, chars: int, where: str) -> None:
        if self.max_chars and chars > self.max_chars:
            raise ApiError(
                400,
                f"{where} has {chars} characters: more than this model's maximum context length of "
                f"{self.served.max_context} tokens can hold",
                param="messages" if where == "messages" else "prompt",
            )

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

    def completion_prompts(self, body: CompletionRequest) -> list[_Prompt]:
        """Each prompt's ids (checked against the vocabulary) and its echo text."""
        self.check_model(body.model)
        prompts, several = [], len(body.prompts) > 1
        for i, prompt in enumerate(body.prompts):
            text = isinstance(prompt, str)
            if text:
                self._check_chars(len(prompt), f"prompt[{i}]" if several else "prompt")
            ids = list(self.tokenizer(prompt)["input_ids"]) if text else [int(t) for t in prompt]
            self._check_ids(ids, f"prompt[{i}]" if several else "prompt")  # before decoding them
            echo = (prompt if text else self.tokenizer.decode(ids)) if body.echo else ""
            prompts.append(_Prompt(ids, echo))
        return prompts

    def chat_prompts(self, body: ChatRequest) -> list[_Prompt]:
        self.check_model(body.model)
        if not getattr(self.tokenizer, "chat_template", None):
            raise ApiError(400, "this model's tokenizer has no chat template: use /v1/completions")
        messages = [m.for_template() for m in body.messages]
        self._check_chars(sum(len(m["content"]) for m in messages), "messages")
        try:
            ids = self.tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True)
        except Exception as exc:  # noqa: BLE001 - a template that rejects the messages is the client's error
            raise ApiError(
                400, f"the chat template rejects these messages: {exc}", param="messages"
            ) from None
        if isinstance(ids, dict) or hasattr(ids, "input_ids"):
            ids = ids["input_ids"]
        self._check_ids(list(ids), "messages")  # a tokenizer larger than the model
        last = body.messages[-1]
        # vLLM's chat echo: the reply starts with the last message when it is the assistant's own
        echo = last.text() if body.echo and last.role == "assistant" else ""
        return [_Prompt(list(ids), echo)]

    # ------------------------------------------------------------------------------------- generation

    def _check_ids(self, ids: list[int], param: str) -> None:
        vocab = self.served.vocab
        if vocab is not None and not all(0 <= t < vocab for t in ids):
            raise ApiError(400, f"{param}: token ids must lie in 0..{vocab - 1}", param=param.split("[")[0])

    def _limits(self, body: _Generation, prompts: list[_Prompt]) -> int:
        """max_tokens, checked against the context and min_tokens; the stop ids checked against the
        vocabulary; the choices against the queue. All before anything runs (prompt ids are checked as
        they come in)."""
        context, several = self.served.max_context, len(prompts) > 1
        jobs = len(prompts) * body.n
        if jobs > self.scheduler.max_queue:
            raise ApiError(
                400,
                f"{len(prompts)} prompt(s) x n={body.n} make {jobs} sequences; this server queues at most "
                f"{self.scheduler.max_queue} (--max-queue): send fewer",
                param="n" if body.n > 1 else "prompt",
            )
        self._check_ids(body.stop_token_ids, "stop_token_ids")
        wanted = body.token_limit
        longest = max(len(p.ids) for p in prompts)
        if wanted is None:  # as vLLM: the default, capped by what the context leaves (at least a token)
            default = (
                COMPLETION_MAX_TOKENS if isinstance(body, CompletionRequest) else self.default_max_tokens
            )
            wanted = max(1, min(default, context - longest))
        if body.min_tokens > wanted:
            raise ApiError(
                400, f"min_tokens ({body.min_tokens}) exceeds max_tokens ({wanted})", param="min_tokens"
            )
        vocab = self.served.vocab
        ending = set(body.stop_token_ids) | (set() if body.ignore_eos else set(self.served.eos_ids))
        if body.min_tokens and vocab is not None and len(ending) >= vocab:
            raise ApiError(
                400,
                "stop_token_ids (with the end-of-sequence ids) ban every token before min_tokens",
                param="stop_token_ids",
            )
        limit = self.served.max_prompt
        for i, prompt in enumerate(prompts):
            where = f"prompt[{i}]" if several else "prompt"
            if not prompt.ids:
                raise ApiError(400, f"{where}: the prompt is empty", param="prompt")
            if limit is not None and len(prompt.ids) > limit:
                raise ApiError(
                    400,
                    f"{where} has {len(prompt.ids)} tokens; this engine takes at most {limit}",
                    param="prompt",
                )
            if len(prompt.ids) + wanted > context:
                raise ApiError(
                    400,
                    f"this model's maximum context length is {context} tokens; {where} has "
                    f"{len(prompt.ids)} and max_tokens is {wanted}",
                    param="max_tokens",
                )
        return wanted

    def _choices(
        self, body: _Generation, prompts: list[_Prompt], max_tokens: int, emit: Callable[[int], Callable]
    ) -> list[Choice]:
        """One scheduler request per prompt and sample (index = prompt * n + sample)."""
        temperature = 1.0 if body.temperature is None else body.temperature
        top = body.top_logprobs_count
        echo = bool(getattr(body, "echo", False))
        choices = []
        for i, prompt in enumerate(prompts):
            for j in range(body.n):
                index = i * body.n + j
                seed = body.seed if j == 0 or body.seed is None else [body.seed, j]
                sampler = Sampler(
                    temperature,
                    1.0 if body.top_p is None else body.top_p,
                    seed,
                    top_k=body.top_k,
                    min_p=body.min_p,
                    presence_penalty=body.presence_penalty or 0.0,
                    frequency_penalty=body.frequency_penalty or 0.0,
                    repetition_penalty=body.repetition_penalty or 1.0,
                )
                job = GenerationRequest(
                    prompt.ids,
                    max_tokens,
                    sampler,
                    emit=emit(index),
                    eos_ids=frozenset() if body.ignore_eos else self.served.eos_ids,
                    stop_ids=frozenset(body.stop_token_ids),
                    min_tokens=body.min_tokens,
                    logprobs=top,
                    prompt_logprobs=top if echo and isinstance(body, CompletionRequest) else None,
                )
                text = TextStream(self.tokenizer, body.stop)
                choices.append(Choice(index, job, text, echo=prompt.echo, logprobs=top is not None))
        return choices

    async def respond(
        self, kind: str, body: _Generation, prompts: list[_Prompt], request: Request
    ) -> Response:
        max_tokens = self._limits(body, prompts)
        if problem := self.scheduler.problem:
            raise ApiError(503, f"the model is not being served: {problem}", code="model_unavailable")
        if self.app.state.draining:
            raise ApiError(503, f"{SHUTTING_DOWN}; retry on another replica", code="shutting_down")
        loop = asyncio.get_running_loop()
        queue: asyncio.Queue[tuple[int, Event]] = asyncio.Queue()

        def emit(index: int) -> Callable[[Event], None]:
            return lambda event: loop.call_soon_threadsafe(queue.put_nowait, (index, event))

        reply = Reply(kind, self.served.id, sum(len(p.ids) for p in prompts), self.texts)
        reply.choices = self._choices(body, prompts, max_tokens, emit)
        try:
            self.scheduler.submit(*(c.job for c in reply.choices))
        except QueueFull as exc:
            raise ApiError(503, f"the server is busy: {exc}; retry later", code="queue_full") from None
        self.metrics.prompt_tokens.inc(reply.prompt_tokens)
        updates = self._updates(reply.choices, queue)
        endpoint = "/v1/completions" if kind == "completions" else "/v1/chat/completions"
        arrived = reply.choices[0].job.arrived
        if body.stream:
            self.metrics.requests.labels(endpoint, "200").inc()
            return EventSourceResponse(self._events(updates, reply, body.include_usage, arrived), ping=15)
        results = await self._collect(reply.choices, updates, request)
        self.metrics.requests.labels(endpoint, "200").inc()
        self.metrics.request_latency.observe(time.perf_counter() - arrived)
        # a 2000-token echo with logprobs is ~12k token texts and ~300 kB of JSON: built off the event loop,
        # which meanwhile sends the other requests' stream events (it stalled them for ~1 s)
        return await asyncio.to_thread(lambda: JSONResponse(reply.whole(results)))

    async def _updates(
        self, choices: list[Choice], queue: asyncio.Queue
    ) -> AsyncIterator[tuple[Choice, Update]]:
        """Every choice's updates as they come, until each has ended; the requests' slots are freed however
        this ends (a client that leaves, a stop string)."""
        running = len(choices)
        try:
            while running:
                events = [await queue.get()]
                while not queue.empty():
                    events.append(queue.get_nowait())
                # detokenization (and stop strings) in a worker thread: the event loop stays free
                updates = await asyncio.to_thread(_take, choices, events)
                for choice, update in updates:
                    if isinstance(update, GenerationFailed):
                        raise update
                    if update.reason is not None:
                        running -= 1
                        self.scheduler.cancel(choice.job)  # no-op when it has finished
                    yield choice, update
        finally:
            for choice in choices:
                self.scheduler.cancel(choice.job)

    async def _collect(
        self, choices: list[Choice], updates: AsyncIterator, request: Request
    ) -> dict[Choice, tuple[str, list[TokenLogprob]]]:
        async def gather() -> dict[Choice, tuple[str, list[TokenLogprob]]]:
            parts: dict[Choice, tuple[list[str], list[TokenLogprob]]] = {c: ([], []) for c in choices}
            async for choice, update in updates:
                parts[choice][0].append(update.text)
                parts[choice][1].extend(update.entries)
            return {c: ("".join(text), entries) for c, (text, entries) in parts.items()}

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
            raise _failure(exc) from None

    async def _events(
        self, updates: AsyncIterator, reply: Reply, usage: bool, arrived: float
    ) -> AsyncIterator[dict]:
        try:
            for chunk in reply.opening():
                yield {"data": json.dumps(chunk)}
            async for choice, update in updates:
                yield {"data": json.dumps(reply.chunk(choice, update))}
            self.metrics.request_latency.observe(time.perf_counter() - arrived)
            if usage:
                yield {"data": json.dumps(reply.usage_chunk())}
        except GenerationFailed as exc:
            yield {"data": json.dumps(_failure(exc).body())}
        yield {"data": "[DONE]"}


def _longest_token(tokenizer: object) -> int:
    """The most characters one token can cover, bounded by its longest vocabulary entry (byte-level and
    SentencePiece entries are at least as long as their text); 0 when the tokenizer has no vocabulary."""
    try:
        return max((len(k) for k in tokenizer.get_vocab()), default=0)  # type: ignore[attr-defined]
    except Exception:  # noqa: BLE001 - no bound: every prompt is tokenized
        return 0


def _take(
    choices: list[Choice], events: list[tuple[int, Event]]
) -> list[tuple[Choice, Update | GenerationFailed]]:
    """The updates the events make (runs in a worker thread); an error event ends the list."""
    out: list[tuple[Choice, Update | GenerationFailed]] = []
    for index, event in events:
        choice = choices[index]
        if choice.finish is not None:
            continue  # ended by a stop string; its request is being cancelled
        if event.kind == "error":
            out.append((choice, GenerationFailed(event.reason, event.status)))
            break
        update = choice.take(event)
        if update is not None:
            out.append((choice, update))
    return out


def _failure(exc: GenerationFailed) -> ApiError:
    if exc.status == 503:
        code = "shutting_down" if str(exc) == SHUTTING_DOWN else "model_unavailable"
        return ApiError(503, str(exc), code=code)
    if exc.status < 500:
        return ApiError(exc.status, str(exc))
    return ApiError(exc.status, f"generation failed: {exc}")


@dataclass(frozen=True)
class _Prompt:
    ids: list[int]
    echo: str  # the text returned before the completion when the request asks for echo
