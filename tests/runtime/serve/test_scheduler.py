"""Continuous batching (runtime/serve/scheduler.py): requests join and leave the running batch between
steps, arrive together and are prefilled together, wait in a bounded queue (503 beyond it), and free their
rows when their client goes away; a long prompt is prefilled in chunks between the running sequences'
decode steps, and its logprobs are scored off the model's thread. Through real servers, and the Scheduler
alone."""

from __future__ import annotations

import concurrent.futures as cf
import dataclasses
import random
import threading
import time

import httpx
import numpy as np
import pytest

from runtime.evaluate import log_softmax
from runtime.generate import DecodeModel, greedy_generate
from runtime.serve import scheduler as scheduler_module
from runtime.serve.batch import CachedRunner, Chunk
from runtime.serve.metrics import Metrics
from runtime.serve.sampling import Sampler
from runtime.serve.scheduler import MAX_UNSCORED, Event, GenerationRequest, Scheduler
from runtime.serve.server import ServerThread
from tests import decode_fixtures as fx
from tests import serve_fixtures as sf
from tests.runtime.serve.clients import client, complete, error_of, streamed
from tests.serve_fixtures import PROMPTS


def test_eight_concurrent_clients_get_what_they_get_alone(server):
    """Greedy results identical alone and among 8 (different prompt lengths, different max_tokens, so rows
    join and leave the running batch at different steps); the decode steps were shared."""
    api = client(server)
    lengths = [24, 12, 30, 18, 24, 9, 27, 15]
    alone = [complete(api, p, n).choices[0].text for p, n in zip(PROMPTS, lengths, strict=True)]
    steps = server.app.state.scheduler.steps
    with cf.ThreadPoolExecutor(8) as pool:
        together = list(
            pool.map(
                lambda a: complete(client(server), *a).choices[0].text, zip(PROMPTS, lengths, strict=True)
            )
        )
    assert together == alone
    assert server.app.state.scheduler.steps - steps < sum(lengths) - len(lengths)  # batched, not one by one
    assert alone[0] == sf.words(fx.torch_greedy(PROMPTS[0], 24))


def test_full_queue_answers_503_and_a_client_that_leaves_frees_its_slot(tiny):
    """max_batch 1, max_queue 1: one running and one waiting request fill the server; the next gets 503.
    Closing the running stream mid-way frees the row: the waiting request then runs."""
    long = dataclasses.replace(tiny, max_context=4096)
    with ServerThread(long, max_batch=1, max_queue=1) as small:
        api, scheduler = client(small), small.app.state.scheduler
        first = api.completions.create(
            model="tiny_decode",
            prompt=[4, 5],
            max_tokens=4000,
            temperature=0,
            stream=True,
            extra_body={"ignore_eos": True},
        )
        next(iter(first))  # it is running
        with cf.ThreadPoolExecutor(1) as pool:
            waiting = pool.submit(complete, api, [6, 7], 3)
            deadline = time.monotonic() + 30
            while len(scheduler.waiting) < 1 and time.monotonic() < deadline:
                time.sleep(0.01)
            response = httpx.post(
                small.url + "/v1/completions", json={"model": "tiny_decode", "prompt": "w4", "max_tokens": 2}
            )
            assert response.status_code == 503 and response.headers["retry-after"] == "1"
            assert error_of(response)["code"] == "queue_full"
            first.close()  # the client goes away after one chunk
            assert waiting.result(timeout=60).choices[0].finish_reason == "length"
        assert not scheduler.running and not scheduler.waiting
        assert scheduler.steps < 3000  # the abandoned request did not run to its 4000 tokens
        assert complete(api, [8], 2).usage.completion_tokens == 2
        # a non-streaming client that gives up (read timeout) frees its row too
        steps = scheduler.steps
        body = {"model": "tiny_decode", "prompt": "w4", "max_tokens": 4000, "ignore_eos": True}
        with pytest.raises(httpx.ReadTimeout):
            httpx.post(small.url + "/v1/completions", json=body, timeout=httpx.Timeout(30, read=0.5))
        deadline = time.monotonic() + 30
        while scheduler.running and time.monotonic() < deadline:
            time.sleep(0.05)
        assert not scheduler.running and scheduler.steps - steps < 3000


@pytest.mark.slow
def test_bounded_load_loses_nothing(server):
    """64 mixed requests from 16 threads (more than max_batch: some wait): all answered and well-formed."""
    rng = random.Random(0)
    jobs = [
        (i, rng.choice(["completion", "chat"]), rng.random() < 0.5, rng.randint(1, 16)) for i in range(64)
    ]

    def run(job) -> tuple[int, str, str, int]:
        index, kind, stream, max_tokens = job
        api = client(server)
        prompt = sf.words([4 + index % 90, 5 + index % 80])
        if kind == "chat":
            args = dict(
                model="tiny_decode",
                messages=[{"role": "user", "content": prompt}],
                max_tokens=max_tokens,
                temperature=0,
            )
            if stream:
                chunks = list(
                    api.chat.completions.create(**args, stream=True, stream_options={"include_usage": True})
                )
                text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
                reason = next(c.choices[0].finish_reason for c in chunks[::-1] if c.choices)
                return index, text, reason, chunks[-1].usage.completion_tokens
            reply = api.chat.completions.create(**args)
            return (
                index,
                reply.choices[0].message.content,
                reply.choices[0].finish_reason,
                reply.usage.completion_tokens,
            )
        if stream:
            text, reason, chunks = streamed(api, prompt, max_tokens, stream_options={"include_usage": True})
            return index, text, reason, chunks[-1].usage.completion_tokens
        reply = complete(api, prompt, max_tokens)
        return index, reply.choices[0].text, reply.choices[0].finish_reason, reply.usage.completion_tokens

    start = time.monotonic()
    with cf.ThreadPoolExecutor(16) as pool:
        results = list(pool.map(run, jobs, timeout=240))
    assert time.monotonic() - start < 240
    assert sorted(r[0] for r in results) == list(range(64))
    for (index, text, reason, count), (_, _, _, max_tokens) in zip(results, jobs, strict=True):
        assert isinstance(text, str) and reason in ("stop", "length"), index
        assert 1 <= count <= max_tokens and (reason == "stop" or count == max_tokens)
        assert all(w.startswith("w") for w in text.split())
    assert httpx.get(server.url + "/health").status_code == 200
    metrics = httpx.get(server.url + "/metrics").text
    assert "ffn_serve_queue_depth 0.0" in metrics and "ffn_serve_running 0.0" in metrics


def test_requests_that_arrive_together_are_prefilled_together(tmp_path_factory):
    """The scheduler admits the waiting requests of one step together and prefills them in one batch
    (left-padded: the prompts differ in length); each request still gets what it gets alone."""
    model = DecodeModel.open(fx.decode_models("decode"))
    prompts = PROMPTS[:4]
    alone = [greedy_generate(model, [p], 6).tokens[0] for p in prompts]
    metrics = Metrics()
    scheduler = Scheduler(CachedRunner(model), max_batch=8, metrics=metrics)
    tokens: dict[int, list[int]] = {k: [] for k in range(len(prompts))}
    events: list[tuple[int, Event]] = []  # appended on the worker thread

    def emitter(k: int):
        return lambda event: events.append((k, event))

    for k, prompt in enumerate(prompts):  # all waiting before the worker starts: admitted in one step
        scheduler.submit(GenerationRequest(prompt, 6, Sampler(0.0), emit=emitter(k)))
    scheduler.start()
    deadline = time.monotonic() + 60
    while sum(e.kind == "done" for _, e in events) < len(prompts) and time.monotonic() < deadline:
        time.sleep(0.01)
    scheduler.stop()
    for k, event in events:
        assert event.kind != "error", event.reason
        if event.kind == "token":
            tokens[k].append(event.token)
    assert [tokens[k] for k in range(len(prompts))] == alone
    rendered = metrics.render().decode()
    assert "ffn_serve_prefill_batch_size_count 1.0" in rendered
    assert "ffn_serve_prefill_batch_size_sum 4.0" in rendered


class Recording:
    """A runner that records its calls in order: ("prefill", {key: chunk tokens}, decode rows) and
    ("decode", rows)."""

    def __init__(self, inner: CachedRunner) -> None:
        self.inner, self.calls = inner, []

    def __getattr__(self, name: str):
        return getattr(self.inner, name)

    def prefill(self, chunks: dict) -> dict:
        self.calls.append(("prefill", {k: len(c.tokens) for k, c in chunks.items()}, len(self.inner.keys)))
        return self.inner.prefill(chunks)

    def decode(self, tokens: dict, isolate: bool = True) -> dict:
        self.calls.append(("decode", len(tokens), len(self.inner.keys)))
        return self.inner.decode(tokens, isolate)


class PoisonedPrefill(Recording):
    """A runner whose prefill fails for any call that holds a chunk with POISON (a prompt that breaks the
    model), recording the calls."""

    POISON = 93

    def prefill(self, chunks: dict) -> dict:
        self.calls.append(("prefill", {k: len(c.tokens) for k, c in chunks.items()}, len(self.inner.keys)))
        if any(self.POISON in c.tokens for c in chunks.values()):
            raise RuntimeError("injected prefill fault")
        return self.inner.prefill(chunks)


def test_a_prompt_that_breaks_a_batched_prefill_fails_alone():
    """Three requests admitted in one step share one prefill call; it fails because one prompt breaks the
    model. The scheduler prefills them again one at a time: that request gets an error, the two others
    what they get alone."""
    model = DecodeModel.open(fx.decode_models("decode"))
    good = PROMPTS[:2]
    alone = [greedy_generate(model, [p], 5).tokens[0] for p in good]
    runner = PoisonedPrefill(CachedRunner(model))
    scheduler = Scheduler(runner, max_batch=8)
    clients = [Client() for _ in range(3)]
    prompts = [good[0], [4, PoisonedPrefill.POISON, 6], good[1]]
    for prompt, listener in zip(prompts, clients, strict=True):  # all waiting: admitted in one step
        scheduler.submit(GenerationRequest(prompt, 5, Sampler(0.0), emit=listener))
    scheduler.start()
    try:
        assert all(c.done.wait(60) for c in clients)
    finally:
        scheduler.stop()
    prefills = [sorted(keys.values()) for kind, keys, _ in runner.calls if kind == "prefill"]
    assert len(prefills[0]) == 3 and all(len(p) == 1 for p in prefills[1:4])  # together, then one by one
    (error,) = [e for e in clients[1].events if e.kind == "error"]
    assert "injected prefill fault" in error.reason and not clients[1].tokens()
    assert [clients[0].tokens(), clients[2].tokens()] == alone


class Client:
    """A request's events as the scheduler emits them, with a signal for its first token and its end."""

    def __init__(self) -> None:
        self.events: list[Event] = []
        self.first, self.done = threading.Event(), threading.Event()

    def __call__(self, event: Event) -> None:
        self.events.append(event)
        if event.kind == "token":
            self.first.set()
        if event.kind in ("done", "error"):
            self.done.set()

    def tokens(self) -> list[int]:
        return [e.token for e in self.events if e.kind == "token"]

    def prompt(self) -> list:
        return [entry for e in self.events if e.kind == "prompt" for entry in e.prompt]


LONG = [4 + (7 * i) % 90 for i in range(60)]


def test_a_long_prompt_is_prefilled_in_chunks_between_decode_steps():
    """Issue 48, finding 1: a 60-token prompt with echo logprobs arrives while a greedy stream runs, with a
    budget of 8 tokens per step: its prompt goes in chunks of 7 (the running row's decode takes one), each
    followed by the stream's decode step; the stream's tokens are what it gets alone, and the scoring
    request's prompt logprobs (chunk by chunk, in order, before its token) equal the unchunked prefill's."""
    model = DecodeModel.open(fx.decode_models("decode"))
    runner = Recording(CachedRunner(model))
    scheduler = Scheduler(runner, max_batch=4, prefill_chunk=8)
    stream, scoring = Client(), Client()
    scheduler.start()
    try:
        scheduler.submit(GenerationRequest(PROMPTS[0], 40, Sampler(0.0), emit=stream))
        assert stream.first.wait(30)  # it runs: the long prompt arrives beside a decoding sequence
        scheduler.submit(GenerationRequest(LONG, 1, Sampler(0.0), emit=scoring, prompt_logprobs=2))
        assert scoring.done.wait(60) and stream.done.wait(60)
    finally:
        scheduler.stop()
    assert stream.tokens() == greedy_generate(model, [PROMPTS[0]], 40).tokens[0]
    assert scoring.tokens() == greedy_generate(model, [LONG], 1).tokens[0]
    kinds = [e.kind for e in scoring.events]
    assert kinds == ["prompt"] * kinds.count("prompt") + ["token", "done"] and kinds.count("prompt") >= 9
    long_calls = [i for i, call in enumerate(runner.calls) if call[0] == "prefill" and call[1] != {}]
    sizes = [runner.calls[i][1][next(iter(runner.calls[i][1]))] for i in long_calls[1:]]
    assert sum(sizes) == len(LONG) and max(sizes) <= 7 and len(sizes) >= 9
    for before, after in zip(long_calls[1:], long_calls[2:], strict=False):  # a decode step between chunks
        assert any(call[0] == "decode" for call in runner.calls[before:after])
    whole = CachedRunner(model).prefill({"x": Chunk(LONG, positions=True)})["x"].positions
    reference = log_softmax(whole[:-1])
    entries = scoring.prompt()
    assert [e.token for e in entries] == LONG[1:]
    expected = [reference[t, token] for t, token in enumerate(LONG[1:])]
    np.testing.assert_allclose([e.logprob for e in entries], expected, rtol=0, atol=1e-5)
    assert all(e.top[0][0] == int(reference[t].argmax()) for t, e in enumerate(entries))


def test_prompt_scoring_runs_off_the_models_thread(monkeypatch):
    """While the scorer is held up (its first chunk blocks), the running stream keeps decoding and the
    scoring request prefills only MAX_UNSCORED chunks ahead (their logits wait); once it goes on, the
    request's prompt events come in order, then its token."""
    gate, scoring_started = threading.Event(), threading.Event()
    score_chunk = scheduler_module.score_chunk

    def held(logits, tokens, top):
        scoring_started.set()
        assert gate.wait(60)
        return score_chunk(logits, tokens, top)

    monkeypatch.setattr(scheduler_module, "score_chunk", held)
    model = DecodeModel.open(fx.decode_models("decode"))
    runner = Recording(CachedRunner(model))
    scheduler = Scheduler(runner, max_batch=4, prefill_chunk=8)
    stream, scoring = Client(), Client()
    scheduler.start()
    try:
        scheduler.submit(GenerationRequest(PROMPTS[0], 60, Sampler(0.0), emit=stream))
        assert stream.first.wait(30)
        scheduler.submit(GenerationRequest(LONG, 1, Sampler(0.0), emit=scoring, prompt_logprobs=1))
        assert scoring_started.wait(30)
        tokens = len(stream.tokens())
        deadline = time.monotonic() + 60
        while len(stream.tokens()) < tokens + 8 and time.monotonic() < deadline:  # decoding goes on
            time.sleep(0.01)
        assert len(stream.tokens()) >= tokens + 8 and not scoring.events
        chunks = [call for call in runner.calls if call[0] == "prefill" and call[2] == 1]
        assert len(chunks) == MAX_UNSCORED  # then it waits for the scorer
        gate.set()
        assert scoring.done.wait(60) and stream.done.wait(60)
    finally:
        gate.set()
        scheduler.stop()
    kinds = [e.kind for e in scoring.events]
    assert kinds == ["prompt"] * kinds.count("prompt") + ["token", "done"]
    assert [e.token for e in scoring.prompt()] == LONG[1:]
    assert stream.tokens() == greedy_generate(model, [PROMPTS[0]], 60).tokens[0]
