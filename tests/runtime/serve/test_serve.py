"""The OpenAI-compatible service (runtime/serve, tools/serve.py): real servers on 127.0.0.1, the official
`openai` client, httpx for raw HTTP. References: a full torch re-run of the tiny model (decode_fixtures),
Hugging Face transformers for SmolLM2.
"""

from __future__ import annotations

import concurrent.futures as cf
import dataclasses
import json
import os
import random
import socket
import subprocess
import sys
import time
from pathlib import Path

import httpx
import openai
import pytest
import torch

from runtime.generate import DecodeModel, greedy_generate
from runtime.serve import loading
from runtime.serve.batch import CachedRunner, GroupedRunner, RecomputeRunner, runner_for
from runtime.serve.metrics import Metrics
from runtime.serve.protocol import TextStream
from runtime.serve.sampling import Sampler
from runtime.serve.scheduler import Event, GenerationRequest, Scheduler
from runtime.serve.server import ServerThread
from tests import decode_fixtures as fx
from tests import serve_fixtures as sf

ROOT = Path(__file__).resolve().parents[2]
# prompts of different lengths (token ids of the tiny model; 0-3 are special)
PROMPTS = [
    [17, 41, 8, 60, 22, 9],
    [90, 5, 33],
    [12, 13],
    [44, 45, 46, 47, 48, 49, 50, 51],
    [70],
    [8, 8, 8, 8],
    [30, 31, 32, 33, 34],
    [66, 77, 88],
]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def client(server: ServerThread) -> openai.OpenAI:
    return openai.OpenAI(base_url=server.url + "/v1", api_key="none", max_retries=0, timeout=60)


@pytest.fixture(scope="module")
def tiny(tmp_path_factory) -> loading.ServedModel:
    return loading.load(sf.tiny_folder(tmp_path_factory.getbasetemp()))


@pytest.fixture(scope="module")
def server(tiny):
    with ServerThread(tiny, max_batch=8, max_queue=64) as running:
        yield running


def complete(api: openai.OpenAI, prompt, max_tokens: int = 8, **kw) -> openai.types.Completion:
    return api.completions.create(
        model="tiny_decode", prompt=prompt, max_tokens=max_tokens, temperature=0, **kw
    )


def streamed(api: openai.OpenAI, prompt, max_tokens: int = 8, **kw) -> tuple[str, str, list]:
    chunks = list(complete(api, prompt, max_tokens, stream=True, **kw))
    text = "".join(c.choices[0].text for c in chunks if c.choices)
    reasons = [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason]
    return text, reasons[-1], chunks


# ------------------------------------------------------------------------------------ the basics


def test_models_health_and_metrics(server):
    api = client(server)
    assert [m.id for m in api.models.list().data] == ["tiny_decode"]
    assert api.models.retrieve("tiny_decode").id == "tiny_decode"
    assert httpx.get(server.url + "/health").json() == {"status": "ok"}
    complete(api, [5, 6, 7], 3)
    text = httpx.get(server.url + "/metrics").text
    for name in (
        "ffn_serve_requests_total",
        "ffn_serve_generation_tokens_total",
        "ffn_serve_queue_depth",
        "ffn_serve_time_to_first_token_seconds_bucket",
        "ffn_serve_time_per_output_token_seconds_bucket",
    ):
        assert name in text
    assert 'ffn_serve_requests_total{endpoint="/v1/completions",status="200"}' in text


def test_greedy_equals_torch_rerun_streamed_equals_unstreamed(server):
    api = client(server)
    for prompt in PROMPTS[:3]:
        expected = sf.words(fx.torch_greedy(prompt, 10))
        whole = complete(api, prompt, 10)
        assert whole.choices[0].text == expected
        assert whole.choices[0].finish_reason == "length"
        assert (whole.usage.prompt_tokens, whole.usage.completion_tokens) == (len(prompt), 10)
        # the same prompt as text through the folder's tokenizer
        assert complete(api, sf.words(prompt), 10).choices[0].text == expected
        text, reason, chunks = streamed(api, prompt, 10, stream_options={"include_usage": True})
        assert (text, reason) == (expected, "length")
        assert chunks[-1].usage.completion_tokens == 10 and not chunks[-1].choices


def test_chat_uses_the_template_and_streams_the_same(server):
    api = client(server)
    messages = [{"role": "user", "content": "w20 w21 w22"}]
    prompt = [1, 20, 21, 22, 5]  # sf.CHAT_TEMPLATE: <bos> content ... w5
    reply = api.chat.completions.create(model="tiny_decode", messages=messages, max_tokens=6, temperature=0)
    assert reply.choices[0].message.role == "assistant"
    assert reply.choices[0].message.content == sf.words(fx.torch_greedy(prompt, 6))
    assert reply.usage.prompt_tokens == len(prompt)
    chunks = list(
        api.chat.completions.create(
            model="tiny_decode", messages=messages, max_tokens=6, temperature=0, stream=True
        )
    )
    assert chunks[0].choices[0].delta.role == "assistant"
    assert "".join(c.choices[0].delta.content or "" for c in chunks) == reply.choices[0].message.content
    assert chunks[-1].choices[0].finish_reason == "length"


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


def test_seeded_sampling_is_reproducible_in_any_batch(server):
    api = client(server)

    def sample(seed: int) -> str:
        return (
            api.completions.create(
                model="tiny_decode", prompt=[9, 10, 11], max_tokens=12, temperature=0.9, top_p=0.9, seed=seed
            )
            .choices[0]
            .text
        )

    first = sample(7)
    with cf.ThreadPoolExecutor(4) as pool:
        runs = list(pool.map(sample, [7, 7, 7, 8]))
    assert runs[:3] == [first] * 3
    assert first != complete(api, [9, 10, 11], 12).choices[0].text or runs[3] != first


def test_stop_strings_and_eos(server, tiny):
    api = client(server)
    tokens = fx.torch_greedy(PROMPTS[1], 10)
    stop = f"w{tokens[3]}"
    cut = sf.words(tokens)[: sf.words(tokens).index(stop)]
    reply = complete(api, PROMPTS[1], 10, stop=[stop, "never"])
    assert (reply.choices[0].text, reply.choices[0].finish_reason) == (cut, "stop")
    assert streamed(api, PROMPTS[1], 10, stop=stop)[:2] == (cut, "stop")
    # an end-of-sequence id (here an ordinary word of the greedy path) ends the request with "stop"
    eos = dataclasses.replace(tiny, eos_ids=frozenset({tokens[4]}))
    with ServerThread(eos) as other:
        reply = complete(client(other), PROMPTS[1], 10)
        assert reply.choices[0].finish_reason == "stop"
        assert reply.usage.completion_tokens == tokens.index(tokens[4]) + 1
        ignored = complete(client(other), PROMPTS[1], 10, extra_body={"ignore_eos": True})
        assert ignored.usage.completion_tokens == 10


def test_text_stream_never_shows_part_of_a_stop_string(tiny):
    stream = TextStream(tiny.tokenizer, ["w9 w10"])
    assert stream.push(20) == ("w20", False)
    assert stream.push(9) == (" ", False)  # "w9" may begin the stop string: held back
    assert stream.push(11) == ("w9 w11", False)
    assert stream.push(9) == (" ", False)
    assert stream.push(10) == ("", True)
    assert stream.text.endswith("w9 w10")


# ---------------------------------------------------------------------------------------- bad input


def error_of(response: httpx.Response) -> dict:
    body = response.json()
    assert set(body) == {"error"} and set(body["error"]) == {"message", "type", "param", "code"}
    return body["error"]


@pytest.mark.parametrize(
    ("body", "status", "fragment"),
    [
        ("{not json", 400, "malformed JSON"),
        ('["a list"]', 400, ""),
        ('{"model": "tiny_decode"}', 400, "prompt"),
        ('{"model": "tiny_decode", "prompt": "w4", "temperature": 3}', 400, "temperature"),
        ('{"model": "tiny_decode", "prompt": "w4", "top_p": 0}', 400, "top_p"),
        ('{"model": "tiny_decode", "prompt": "w4", "max_tokens": 0}', 400, "max_tokens"),
        ('{"model": "tiny_decode", "prompt": "w4", "max_tokens": "many"}', 400, "max_tokens"),
        ('{"model": "tiny_decode", "prompt": "w4", "n": 2}', 400, "n=1"),
        ('{"model": "tiny_decode", "prompt": "w4", "stop": ["a","b","c","d","e"]}', 400, "stop"),
        ('{"model": "tiny_decode", "prompt": ""}', 400, "empty"),
        ('{"model": "tiny_decode", "prompt": [4, 96]}', 400, "0..95"),
        ('{"model": "tiny_decode", "prompt": ["w4", "w5"]}', 400, "one prompt"),
        ('{"model": "tiny_decode", "prompt": "w4", "max_tokens": 500}', 400, "context length"),
        ('{"model": "gpt-4o", "prompt": "w4"}', 404, "does not exist"),
    ],
)
def test_bad_requests_get_openai_errors(server, body, status, fragment):
    response = httpx.post(
        server.url + "/v1/completions", content=body, headers={"content-type": "application/json"}
    )
    assert response.status_code == status
    assert fragment in error_of(response)["message"]


def test_bad_chat_requests_routes_and_the_client_exceptions(server):
    chat = server.url + "/v1/chat/completions"
    assert httpx.post(chat, json={"model": "tiny_decode", "messages": []}).status_code == 400
    assert httpx.post(chat, json={"model": "tiny_decode", "messages": [{"content": "x"}]}).status_code == 400
    assert error_of(httpx.get(server.url + "/v2/nothing"))["code"] == "404"
    assert httpx.get(server.url + "/v1/models/other").status_code == 404
    api = client(server)
    with pytest.raises(openai.BadRequestError):
        api.completions.create(model="tiny_decode", prompt="w4", temperature=-1)
    with pytest.raises(openai.NotFoundError):
        api.completions.create(model="other", prompt="w4")
    assert complete(api, [4, 5], 2).choices[0].finish_reason == "length"  # still serving
    assert httpx.get(server.url + "/health").status_code == 200


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


# ----------------------------------------------------------------------------- batching, unit level


@pytest.mark.parametrize("runner_class", [CachedRunner, GroupedRunner])
def test_rows_joining_and_leaving_the_batch_decode_as_alone(tmp_path_factory, runner_class):
    """Sequences of different lengths join at different steps (two at once: one batched prefill) and leave
    early; every row's greedy tokens equal its own batch-1 generation."""
    model = DecodeModel.open(fx.decode_models(tmp_path_factory.getbasetemp(), "decode"))
    alone = {k: greedy_generate(model, [p], 12).tokens[0] for k, p in enumerate(PROMPTS[:5])}
    runner, got, nxt = runner_class(model), {}, {}
    schedule = {0: [0, 1], 3: [2], 5: [3, 4]}  # step -> sequences joining then (PROMPTS differ in length)
    for step in range(20):
        joining = {key: PROMPTS[key] for key in schedule.get(step, [])}
        if len(joining) > 1:  # sequences that arrive together are prefilled together
            prefilled = runner.prefill_many(joining)
        else:
            prefilled = {key: runner.prefill(key, prompt) for key, prompt in joining.items()}
        for key, logits in prefilled.items():
            nxt[key] = int(logits.argmax())
            got[key] = [nxt[key]]
        for key in [k for k in nxt if len(got[k]) == 12 or (k == 1 and len(got[k]) == 5)]:
            runner.release(key)
            del nxt[key]
        if nxt:
            out = runner.decode(dict(nxt))
            for key, logits in out.items():
                nxt[key] = int(logits.argmax())
                got[key].append(nxt[key])
    assert len(runner) == 0 and (runner_class is GroupedRunner or runner.mask.shape == (0, 0))
    assert got[1] == alone[1][:5]
    assert all(got[k] == alone[k] for k in (0, 2, 3, 4))


def test_requests_that_arrive_together_are_prefilled_together(tmp_path_factory):
    """The scheduler admits the waiting requests of one step together and prefills them in one batch
    (left-padded: the prompts differ in length); each request still gets what it gets alone."""
    model = DecodeModel.open(fx.decode_models(tmp_path_factory.getbasetemp(), "decode"))
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


def test_graph_without_cache_serves_by_recomputing(tmp_path_factory):
    served = loading.load(sf.tiny_folder(tmp_path_factory.getbasetemp(), "prefill"))
    assert isinstance(runner_for(served.model), RecomputeRunner)
    with ServerThread(served) as other, cf.ThreadPoolExecutor(3) as pool:
        api = client(other)
        texts = list(
            pool.map(
                lambda p: (
                    api.completions.create(model="tiny_prefill", prompt=p, max_tokens=6, temperature=0)
                    .choices[0]
                    .text
                ),
                PROMPTS[:3],
            )
        )
    assert texts == [sf.words(fx.torch_greedy(p, 6)) for p in PROMPTS[:3]]


# ------------------------------------------------------------------- tensor parallel: one process per rank


@pytest.fixture(scope="module")
def tp2_folder(tmp_path_factory) -> Path:
    """The tiny decode model's folder sharded at TP 2 (rank graphs + tp.json, no tokenizer of its own)."""
    from passes.shard import shard_file

    base = tmp_path_factory.getbasetemp()
    folder = base / "serve_models" / "tiny_decode_tp2"
    if not (folder / "tp.json").is_file():
        shard_file(sf.tiny_folder(base) / "model.onnx", 2, folder, progress=False)
    return folder


def start_cli(*args: str) -> tuple[subprocess.Popen, str, list[str]]:
    """tools/serve.py as a user starts it, once /health answers 200: (process, base URL, command)."""
    port = free_port()
    command = [sys.executable, str(ROOT / "tools" / "serve.py"), *args, "--port", str(port)]
    process = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 180
    while time.monotonic() < deadline:
        assert process.poll() is None, process.communicate()
        try:
            if httpx.get(url + "/health").status_code == 200:
                return process, url, command
        except httpx.TransportError:
            time.sleep(0.2)
    process.kill()
    raise AssertionError(f"{command} did not become healthy")


@pytest.mark.slow
def test_tp_rank_processes_serve_like_one_device_and_stop_with_the_server(server, tp2_folder):
    """tools/serve.py on a TP 2 folder: two rank processes (gloo all-reduces, each holding its share of the
    KV caches); greedy text equals the single-device ONNX Runtime server's, alone and among 8 concurrent
    clients, streamed or not; after SIGTERM the server and every process it started are gone."""
    import psutil

    process, url, _ = start_cli(
        str(tp2_folder), "--backend", "tp", "--model-name", "tiny_decode", "--log-level", "info"
    )
    try:
        started = psutil.Process(process.pid).children(recursive=True)  # the ranks (and their forkserver)
        assert len(started) >= 3
        assert httpx.get(url + "/v1/models").json()["data"][0]["backend"] == "tp"
        tp = openai.OpenAI(base_url=url + "/v1", api_key="none", max_retries=0, timeout=60)
        lengths = [12, 6, 15, 9, 12, 5, 14, 8]
        jobs = list(zip(PROMPTS, lengths, strict=True))
        one_device = [complete(client(server), p, n).choices[0].text for p, n in jobs]
        alone = [complete(tp, p, n).choices[0].text for p, n in jobs]
        assert alone == one_device
        assert alone[0] == sf.words(fx.torch_greedy(PROMPTS[0], 12))
        assert streamed(tp, PROMPTS[1], 6)[0] == alone[1]
        steps_before = _decode_steps(url)
        with cf.ThreadPoolExecutor(8) as pool:
            together = list(pool.map(lambda job: complete(tp, *job).choices[0].text, jobs))
        assert together == alone
        assert _decode_steps(url) - steps_before < sum(lengths) - len(lengths)  # steps were shared
    finally:
        process.terminate()
        process.wait(timeout=60)
    log = process.stderr.read()  # uvicorn shuts down gracefully, then re-raises SIGTERM
    assert process.returncode == -15 and "Application shutdown complete" in log, log
    _, alive = psutil.wait_procs(started, timeout=20)
    assert not alive, f"still running after shutdown: {alive}"


def _decode_steps(url: str) -> float:
    for line in httpx.get(url + "/metrics").text.splitlines():
        if line.startswith("ffn_serve_batch_size_count"):
            return float(line.split()[-1])
    raise AssertionError("no ffn_serve_batch_size_count in /metrics")


@pytest.mark.slow
def test_a_crashed_rank_fails_its_request_and_health_not_the_server(tp2_folder):
    """A rank that dies mid-request (SIGSTOP so that the step is surely under way, then SIGKILL): that
    request gets a 500 error JSON, /health 503 with the reason, later requests 503; the server answers
    on, and no rank process outlives it. A rank that dies while idle: the same, at once."""
    import signal

    served = loading.load(tp2_folder, backend="tp", name="tiny_decode")
    assert served.source.folder == sf.tiny_folder(tp2_folder.parents[1])  # the sharded source's tokenizer
    ranks = served.ranks
    with ServerThread(served) as tp, cf.ThreadPoolExecutor(1) as pool:
        api = client(tp)
        assert complete(api, PROMPTS[2], 5).choices[0].text == sf.words(fx.torch_greedy(PROMPTS[2], 5))
        victim = ranks.pids[1]
        os.kill(victim, signal.SIGSTOP)
        pending = pool.submit(complete, api, PROMPTS[0], 8)
        deadline = time.monotonic() + 60
        while not ranks.in_call and time.monotonic() < deadline:  # rank 0 waits in the first all-reduce
            time.sleep(0.02)
        assert ranks.in_call
        os.kill(victim, signal.SIGKILL)
        with pytest.raises(openai.InternalServerError) as failed:
            pending.result(timeout=60)
        assert failed.value.status_code == 500 and "rank 1 exited (signal 9)" in failed.value.message
        health = httpx.get(tp.url + "/health")
        assert health.status_code == 503 and "rank 1 exited" in health.json()["status"]
        with pytest.raises(openai.APIStatusError) as refused:
            complete(api, PROMPTS[2], 5)
        assert refused.value.status_code == 503 and refused.value.body["code"] == "model_unavailable"
        assert httpx.get(tp.url + "/v1/models").status_code == 200
    assert all(not p.is_alive() for p in ranks.processes)
    # a rank that dies while nothing runs: /health fails at once, the next request gets 503
    served = loading.load(tp2_folder, backend="tp", name="tiny_decode")
    with ServerThread(served) as tp:
        os.kill(served.ranks.pids[0], signal.SIGKILL)
        served.ranks.processes[0].join(30)
        health = httpx.get(tp.url + "/health")
        assert health.status_code == 503 and "rank 0 exited (signal 9)" in health.json()["status"]
        with pytest.raises(openai.APIStatusError) as refused:
            complete(client(tp), PROMPTS[2], 5)
        assert refused.value.status_code == 503
    assert all(not p.is_alive() for p in served.ranks.processes)


def test_model_resolution(tmp_path_factory, tmp_path):
    folder = sf.tiny_folder(tmp_path_factory.getbasetemp())
    assert loading.resolve(folder) == loading.ModelSource("ort", folder / "model.onnx", folder)
    assert loading.resolve(folder / "model.onnx").backend == "ort"
    engines = tmp_path / "engines"
    engines.mkdir()
    (engines / "model.engine").write_bytes(b"")
    profile = {
        "input_ids": {"min": [1, 1], "opt": [4, 64], "max": [4, 256]},
        "attention_mask": {"min": [1, 1], "opt": [4, 128], "max": [4, 1024]},
    }
    (engines / "model.engine.json").write_text(json.dumps({"profile": profile}))
    assert loading.resolve(engines) == loading.ModelSource("tensorrt", engines / "model.engine", engines)
    assert loading.engine_limits(engines / "model.engine") == loading.EngineLimits(4, 256, 1024)
    if not torch.cuda.is_available():  # TensorRT runs on GPUs only: one clear error, no traceback
        with pytest.raises(loading.UserError):
            loading.load(engines)
    (engines / "model_fp8.onnx").write_bytes(b"")
    assert loading.resolve(engines, "tensorrt").backend == "tensorrt"
    assert loading.resolve(engines, "ort").target == engines / "model_fp8.onnx"
    for target, backend, message in [
        (tmp_path / "none", "auto", "does not exist"),
        (folder, "tp", "tp.json"),
        (folder / "model.onnx", "tensorrt", "engine"),
        (tmp_path, "auto", "no model.onnx"),
    ]:
        with pytest.raises(loading.UserError, match=message):
            loading.resolve(target, backend)


# ------------------------------------------------------------------------------------ the command


def test_serve_command_line(tmp_path_factory, tmp_path, tp2_folder):
    folder = sf.tiny_folder(tmp_path_factory.getbasetemp())
    process, url, command = start_cli(
        str(folder), "--max-batch", "4", "--model-name", "tiny", "--log-level", "warning"
    )
    try:
        api = openai.OpenAI(base_url=url + "/v1", api_key="none", max_retries=0)
        reply = api.completions.create(model="tiny", prompt=PROMPTS[2], max_tokens=5, temperature=0)
        assert reply.choices[0].text == sf.words(fx.torch_greedy(PROMPTS[2], 5))
        # the port is taken now: a second server says so in one line
        again = subprocess.run(command, capture_output=True, text=True, timeout=120)
        assert again.returncode == 2 and again.stderr.startswith("error: cannot listen")
    finally:
        process.terminate()
        process.wait(timeout=30)
    for args, message in [
        ([str(tmp_path / "missing")], "does not exist"),
        ([str(folder), "--backend", "tp"], "tp.json"),
        ([str(folder), "--max-batch", "0"], "--max-batch"),
        # NCCL needs a GPU per rank: without them, one line before any rank process starts
        *([([str(tp2_folder), "--tp-comm", "nccl"], "2 GPUs")] if torch.cuda.device_count() < 2 else []),
    ]:
        result = subprocess.run(
            [sys.executable, str(ROOT / "tools" / "serve.py"), *args],
            capture_output=True,
            text=True,
            timeout=120,
        )
        assert result.returncode == 2 and message in result.stderr and "Traceback" not in result.stderr


# ------------------------------------------------------------------------------------------ SmolLM2


@pytest.mark.slow
def test_smollm2_greedy_text_equals_transformers(smollm2_decode_onnx):
    """The pruned SmolLM2 decode graph served as a bare ONNX file (the GGUF tokenizer, found by vocabulary):
    greedy completions and chat replies equal transformers' greedy generation of the same model, alone,
    streamed, and among 8 concurrent clients."""
    from exporters import smollm2

    hf, tokenizer = smollm2.load_pruned(), smollm2.load_tokenizer()
    prompts = [
        "The capital of France is",
        "def fibonacci(n):",
        "Once upon a time",
        "1, 2, 3, 4,",
        "The quick brown fox",
        "import numpy as np",
        "Water boils at",
        "My favourite colour is",
    ]

    def reference(ids: list[int], steps: int) -> str:
        with torch.no_grad():
            out = hf.generate(
                torch.tensor([ids]),
                attention_mask=torch.ones(1, len(ids), dtype=torch.long),
                max_new_tokens=steps,
                do_sample=False,
                eos_token_id=tokenizer.eos_token_id,
                pad_token_id=tokenizer.pad_token_id or 0,
            )
        return tokenizer.decode(out[0, len(ids) :], skip_special_tokens=True)

    served = loading.load(smollm2_decode_onnx)
    with ServerThread(served) as smol:
        api = openai.OpenAI(base_url=smol.url + "/v1", api_key="none", max_retries=0, timeout=120)
        model = served.id

        def run(prompt: str) -> str:
            return (
                api.completions.create(model=model, prompt=prompt, max_tokens=10, temperature=0)
                .choices[0]
                .text
            )

        alone = [run(p) for p in prompts]
        assert alone[:4] == [reference(list(tokenizer(p)["input_ids"]), 10) for p in prompts[:4]]
        with cf.ThreadPoolExecutor(8) as pool:
            assert list(pool.map(run, prompts)) == alone
        chunks = api.completions.create(
            model=model, prompt=prompts[0], max_tokens=10, temperature=0, stream=True
        )
        assert "".join(c.choices[0].text for c in chunks) == alone[0]
        messages = [{"role": "user", "content": "What is the capital of France?"}]
        chat = api.chat.completions.create(model=model, messages=messages, max_tokens=12, temperature=0)
        ids = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True)
        ids = list(ids["input_ids"] if isinstance(ids, dict) or hasattr(ids, "input_ids") else ids)
        assert chat.choices[0].message.content == reference(ids, 12)
        assert chat.usage.prompt_tokens == len(ids)


@pytest.fixture(scope="module")
def corpus_reference(corpus_hf):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model = AutoModelForCausalLM.from_pretrained(corpus_hf, dtype=torch.float32).eval()
    return model, AutoTokenizer.from_pretrained(corpus_hf)


@pytest.mark.slow
@pytest.mark.parametrize("entry", ["optimum", "optimum-nopast", "genai-fp32"])
def test_third_party_export_folders_serve_like_transformers(third_party_corpus, corpus_reference, entry):
    """Optimum's (with and without past) and ONNX Runtime GenAI's export folders of SmolLM2 (attention
    dropped from 13-22; tests/corpora/third_party.py), served as folders: greedy text equals transformers'
    greedy generation of the Hugging Face folder they came from, alone and among concurrent requests."""
    hf, tokenizer = corpus_reference
    served = loading.load(third_party_corpus[entry].parent)
    assert served.model.cached == (entry != "optimum-nopast")
    prompts = ["The capital of France is", "def fibonacci(n):", "1, 2, 3, 4,"]

    def reference(prompt: str) -> str:
        ids = torch.tensor([tokenizer(prompt)["input_ids"]])
        with torch.no_grad():
            out = hf.generate(
                ids,
                attention_mask=torch.ones_like(ids),
                max_new_tokens=8,
                do_sample=False,
                eos_token_id=tokenizer.eos_token_id,
                pad_token_id=tokenizer.eos_token_id,
            )
        return tokenizer.decode(out[0, ids.shape[1] :], skip_special_tokens=True)

    with ServerThread(served) as other:
        api = openai.OpenAI(base_url=other.url + "/v1", api_key="none", max_retries=0, timeout=300)

        def run(prompt: str) -> str:
            reply = api.completions.create(model=served.id, prompt=prompt, max_tokens=8, temperature=0)
            return reply.choices[0].text

        alone = [run(p) for p in prompts]
        assert alone == [reference(p) for p in prompts]
        with cf.ThreadPoolExecutor(3) as pool:
            assert list(pool.map(run, prompts)) == alone
