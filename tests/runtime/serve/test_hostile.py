"""What a hostile client sends (issue 37): bodies over the limit, huge stop strings and prompts, a lone
surrogate, values the schema refuses, wrong methods; Schemathesis against the app's own OpenAPI document;
and a bounded load test under faults (malformed requests, clients that leave mid-stream)."""

from __future__ import annotations

import asyncio
import dataclasses
import json
import os
import random
import re
import subprocess
import sys
import time
from pathlib import Path

import httpx
import jsonschema_rs
import psutil
import pytest

from runtime.serve.app import DEFAULT_MAX_TOKENS
from runtime.serve.protocol import MAX_STOP_CHARS, TextStream
from runtime.serve.server import ServerThread
from tests import serve_fixtures as sf
from tests.runtime.serve.clients import ROOT, error_of, launch_cli, stream_outcome, wait_healthy

ROUTE = "/v1/completions"


def raw(url: str, content: bytes | str, route: str = ROUTE, **kw) -> httpx.Response:
    return httpx.post(
        url + route, content=content, headers={"content-type": "application/json"}, timeout=60, **kw
    )


def test_a_body_over_the_limit_is_413_before_it_is_parsed(tiny):
    """Finding 3: --max-request-bytes, from Content-Length and from a chunked body's bytes as they come."""
    with ServerThread(tiny, max_request_bytes=65536) as small:
        big = json.dumps({"model": "tiny_decode", "prompt": "w4 " * 30000})
        response = raw(small.url, big)
        assert response.status_code == 413 and error_of(response)["code"] == "body_too_large"

        def chunks():
            for _ in range(10):
                yield b" " * 10000  # JSON may begin with whitespace: nothing is refused until the limit

        response = raw(small.url, chunks())
        assert response.status_code == 413 and "65536 bytes" in error_of(response)["message"]
        assert response.headers["connection"] == "close"  # the rest of the body is not read
        ok = raw(small.url, json.dumps({"model": "tiny_decode", "prompt": "w4", "max_tokens": 2}))
        assert ok.status_code == 200


@pytest.mark.serial  # asserts latencies: run alone (Makefile)
def test_huge_stop_strings_and_prompts_do_not_block_the_event_loop(server):
    """Finding 3: stop strings are bounded (count and length), and a 3.9 MB prompt (under the 4 MiB limit)
    is refused before it is tokenized (it cannot fit the context): /health answers within 100 ms
    meanwhile."""
    long_stop = raw(server.url, json.dumps({"model": "tiny_decode", "prompt": "w4", "stop": ["x" * 250_000]}))
    assert long_stop.status_code == 400 and error_of(long_stop)["param"] == "stop"
    edge = {"model": "tiny_decode", "prompt": "w4", "max_tokens": 3, "stop": ["w" * MAX_STOP_CHARS] * 4}
    assert raw(server.url, json.dumps(edge)).status_code == 200
    # the body comes from another process: a client in this one would hold the GIL while it sends
    sender = subprocess.Popen(
        [sys.executable, "-c", BIG_CLIENT, server.url + ROUTE], stdout=subprocess.PIPE, text=True
    )
    latencies: list[float] = []
    with httpx.Client() as poller:
        while sender.poll() is None:
            start = time.perf_counter()
            assert poller.get(server.url + "/health").status_code == 200
            latencies.append(time.perf_counter() - start)
            time.sleep(0.005)
    status, message = sender.communicate(timeout=60)[0].split(" ", 1)
    assert sender.returncode == 0 and status == "400" and "context length" in message, message
    # before: a multi-second stall; the median within 100 ms, the tail bounded (2 shared cores)
    latencies.sort()
    assert latencies and latencies[len(latencies) // 2] < 0.1 and latencies[-1] < 0.5, latencies


BIG_CLIENT = """
import json, sys, httpx
body = json.dumps({"model": "tiny_decode", "prompt": "w5 " * 1_300_000})
assert len(body) < 4 * 1024 * 1024
response = httpx.post(sys.argv[1], content=body, headers={"content-type": "application/json"}, timeout=60)
print(response.status_code, response.json()["error"]["message"])
"""


def test_stop_matching_equals_a_naive_reference(tiny):
    """The KMP stop matcher and the incremental detokenizer give what the whole text, searched afresh after
    every token, gives (random words, stop strings that overlap themselves and each other)."""
    rng = random.Random(0)
    for _ in range(200):
        tokens = [rng.choice([9, 10, 11, 19, 90]) for _ in range(rng.randint(1, 25))]
        words = [
            sf.words([rng.choice([9, 10, 11, 19, 90]) for _ in range(rng.randint(1, 3))]) for _ in range(3)
        ]
        stops = [w[rng.randint(0, 1) : len(w) - rng.randint(0, 1)] or "w" for w in words][: rng.randint(1, 3)]
        stream = TextStream(tiny.tokenizer, stops)
        shown, stopped = "", False
        for token in tokens:
            piece, stopped = stream.push(token)
            shown += piece
            if stopped:
                break
        if not stopped:
            shown += stream.flush()
        text = sf.words(tokens[: len(stream.tokens)])
        cuts = [i for i in (text.find(s) for s in stops) if i >= 0]
        assert shown == (text[: min(cuts)] if cuts else text), (tokens, stops)
        assert stopped == bool(cuts)


def test_a_lone_surrogate_is_a_400_not_a_dropped_connection(server):
    """Finding 4: "\\ud800" in a prompt, a message or a stop string."""
    with httpx.Client(timeout=60) as keep_alive:
        for route, body in [
            (ROUTE, '{"model": "tiny_decode", "prompt": "w4 \\ud800"}'),
            (ROUTE, '{"model": "tiny_decode", "prompt": ["w4", "\\udfff"]}'),
            (ROUTE, '{"model": "tiny_decode", "prompt": "w4", "stop": ["\\ud800"]}'),
            (
                "/v1/chat/completions",
                '{"model": "tiny_decode", "messages": [{"role": "user", "content": "\\ud800"}]}',
            ),
        ]:
            response = keep_alive.post(
                server.url + route, content=body, headers={"content-type": "application/json"}
            )
            assert response.status_code == 400 and "surrogate" in error_of(response)["message"], response.text
        again = keep_alive.post(
            server.url + ROUTE, json={"model": "tiny_decode", "prompt": "w4", "max_tokens": 1}
        )
        assert again.status_code == 200  # the same connection serves on


def _validator(schema: dict, name: str):
    return jsonschema_rs.validator_for(
        {"$ref": f"#/components/schemas/{name}", "components": schema["components"]}
    )


TOOL_CALL = {"id": "call_1", "type": "function", "function": {"name": "f", "arguments": "{}"}}


def test_the_schema_states_what_the_server_answers_and_accepts(server, tiny):
    """Finding 6: every status and content type is documented (no 422: validation errors are 400), and a
    body is valid for the schema exactly when the server accepts it: an empty prompt, top_logprobs without
    logprobs, echo 0 and an unknown role are refused by both; 2.0 as an integer is accepted by both. A
    wrong method is 405 with Allow."""
    schema = httpx.get(server.url + "/openapi.json").json()
    for route in ("/v1/completions", "/v1/chat/completions"):
        responses = schema["paths"][route]["post"]["responses"]
        assert set(responses) == {"200", "400", "404", "408", "413", "500", "503"}
        assert set(responses["200"]["content"]) == {"application/json", "text/event-stream"}
    assert set(schema["paths"]["/health"]["get"]["responses"]) == {"200", "503"}
    completion, chat = _validator(schema, "CompletionRequest"), _validator(schema, "ChatRequest")
    user = [{"role": "user", "content": "w4"}]
    cases = [
        (completion, ROUTE, {"prompt": ""}),
        (completion, ROUTE, {"prompt": []}),
        (completion, ROUTE, {"prompt": ["w4", ""]}),
        (completion, ROUTE, {"prompt": "w4", "echo": 0}),
        (completion, ROUTE, {"prompt": "w4", "max_tokens": "2"}),
        (completion, ROUTE, {"prompt": "w4", "max_tokens": True}),
        (completion, ROUTE, {"prompt": [4, tiny.vocab]}),
        (completion, ROUTE, {"prompt": "w4", "stop": ["x" * (MAX_STOP_CHARS + 1)]}),
        (completion, ROUTE, {"prompt": "w4", "max_tokens": 2.0}),
        (completion, ROUTE, {"prompt": [4, 5.0], "max_tokens": 1}),
        (chat, "/v1/chat/completions", {"messages": user, "top_logprobs": 2}),
        (
            chat,
            "/v1/chat/completions",
            {"messages": user, "top_logprobs": 2, "logprobs": True, "max_tokens": 1},
        ),
        (chat, "/v1/chat/completions", {"messages": [{"role": "wizard", "content": "w4"}]}),
        (chat, "/v1/chat/completions", {"messages": user, "echo": True, "stream": True}),
        (chat, "/v1/chat/completions", {"messages": [{"role": "user", "content": [{"type": "image_url"}]}]}),
        (chat, "/v1/chat/completions", {"messages": user, "max_tokens": 1}),
        # issue 48: bounds the document dropped (pydantic's ge/le) and the combinations it did not state
        (completion, ROUTE, {"prompt": "w4", "max_tokens": -1}),
        (completion, ROUTE, {"prompt": "w4", "logprobs": 1000000}),
        (completion, ROUTE, {"prompt": [-1, 5]}),
        (completion, ROUTE, {"prompt": "w4", "stop_token_ids": [-1]}),
        (completion, ROUTE, {"prompt": "w4", "max_tokens": 0}),
        (completion, ROUTE, {"prompt": "w4", "max_tokens": 0, "echo": True}),
        (completion, ROUTE, {"prompt": "w4", "max_tokens": sf.CONTEXT}),
        (completion, ROUTE, {"prompt": "w4", "min_tokens": sf.CONTEXT}),
        (completion, ROUTE, {"prompt": [4] * (sf.CONTEXT + 1), "max_tokens": 0, "echo": True}),
        (completion, ROUTE, {"prompt": "w4", "n": 65}),
        (completion, ROUTE, {"prompt": ["w4"] * 65}),
        (chat, "/v1/chat/completions", {"messages": user, "logprobs": True, "top_logprobs": 1000}),
        (chat, "/v1/chat/completions", {"messages": user, "max_completion_tokens": sf.CONTEXT}),
        # issue 48, finding 4: chat messages as OpenAI validates them
        *[
            (chat, "/v1/chat/completions", {"messages": [message], "max_tokens": 1})
            for message in [
                {"role": "user"},
                {"role": "user", "content": None},
                {"role": "user", "content": ""},
                {"role": "user", "content": []},
                {"role": "system", "content": ""},
                {"role": "tool", "content": "w4"},
                {"role": "tool", "content": "w4", "tool_call_id": "call_1"},
                {"role": "assistant", "content": None},
                {"role": "assistant"},
                {"role": "assistant", "content": ""},
                {"role": "assistant", "content": None, "tool_calls": [TOOL_CALL]},
                {"role": "assistant", "content": None, "tool_calls": []},
                {"role": "assistant", "tool_calls": [{**TOOL_CALL, "type": "code"}]},
            ]
        ],
    ]
    for validator, route, body in cases:
        body = {"model": "tiny_decode", **body}
        response = httpx.post(server.url + route, json=body, timeout=60)
        assert response.status_code in (200, 400), response.text
        assert validator.is_valid(body) == (response.status_code == 200), (body, response.text)
    wrong = httpx.delete(server.url + ROUTE)
    assert wrong.status_code == 405 and wrong.headers["allow"] == "POST"
    assert error_of(wrong)["code"] == "405"


def test_every_bound_is_stated_as_json_schema(server, tiny):
    """Issue 48, finding 3: pydantic wrote the bounds of optional integers as `ge`/`le`, which JSON Schema
    does not read. Now no such key is left anywhere, and the integer fields carry minimum/maximum: the
    protocol's own bounds and the served model's (context, queue, vocabulary)."""
    schema = httpx.get(server.url + "/openapi.json").json()
    unread = []

    def walk(node: object, where: str) -> None:
        if isinstance(node, dict):
            unread.extend(f"{where}.{k}" for k in ("ge", "le", "gt", "lt", "x-token-id") if k in node)
            for key, value in node.items():
                walk(value, f"{where}.{key}")
        elif isinstance(node, list):
            for i, value in enumerate(node):
                walk(value, f"{where}[{i}]")

    walk(schema, "")
    assert not unread, unread
    fields = {
        name: schema["components"]["schemas"][name]["properties"]
        for name in ("CompletionRequest", "ChatRequest")
    }

    def integer(node: dict) -> dict:
        return next(a for a in node.get("anyOf", [node]) if a.get("type") == "integer")

    completion, chat = fields["CompletionRequest"], fields["ChatRequest"]
    top = sf.CONTEXT - 1
    assert integer(completion["max_tokens"]) == {"type": "integer", "minimum": 0, "maximum": top}
    assert integer(completion["logprobs"]) == {"type": "integer", "minimum": 0, "maximum": 5}
    assert integer(chat["max_tokens"]) == {"type": "integer", "minimum": 1, "maximum": top}
    assert integer(chat["max_completion_tokens"]) == {"type": "integer", "minimum": 1, "maximum": top}
    assert integer(chat["top_logprobs"]) == {"type": "integer", "minimum": 0, "maximum": 20}
    for node in fields.values():
        assert (node["n"]["minimum"], node["n"]["maximum"]) == (1, 64)
        assert (node["min_tokens"]["minimum"], node["min_tokens"]["maximum"]) == (0, top)
        assert node["top_k"]["minimum"] == -1
        assert node["stop_token_ids"]["items"] == {"type": "integer", "minimum": 0, "maximum": tiny.vocab - 1}
    token = {"type": "integer", "minimum": 0, "maximum": tiny.vocab - 1}
    ids = {"type": "array", "items": token, "minItems": 1, "maxItems": sf.CONTEXT}
    assert ids in completion["prompt"]["anyOf"]  # a prompt of token ids, up to the context
    assert {"type": "array", "items": ids, "minItems": 1, "maxItems": 64} in completion["prompt"]["anyOf"]


@pytest.mark.slow
def test_schemathesis_finds_no_5xx_and_no_schema_violation(tiny, tmp_path):
    """Schemathesis (every check) against the app's own OpenAPI document, bounded: a fixed seed, a context
    of 24 tokens (generation capped at a few tokens), about a minute. Every schema-valid body must be
    accepted (2xx: no 400 allowed, issue 48). What JSON Schema cannot state (a prompt plus max_tokens beyond
    the context, min_tokens above max_tokens, prompts x n above the queue: the documented 400s) is kept out
    of the positive cases by tests/runtime/serve/schemathesis_hooks.py, which counts tokens with the
    server's own tokenizer."""
    config = tmp_path / "schemathesis.toml"
    config.write_text('[checks.positive_data_acceptance]\nexpected-statuses = ["2xx"]\n')
    small = dataclasses.replace(tiny, max_context=24)
    limits = {
        "context": small.max_context,
        "queue": 64,
        "vocab": tiny.vocab,
        "eos": sorted(tiny.eos_ids),
        "default_chat": DEFAULT_MAX_TOKENS,
    }
    with ServerThread(small, max_batch=8, max_queue=64) as running:
        prompt = running.app.openapi()["components"]["schemas"]["CompletionRequest"]["properties"]["prompt"]
        limits["chars"] = next(a["maxLength"] for a in prompt["anyOf"] if a["type"] == "string")
        env = {
            **os.environ,
            "SCHEMATHESIS_HOOKS": "tests.runtime.serve.schemathesis_hooks",
            "PYTHONPATH": str(ROOT),
            "SERVE_HOOK_FOLDER": str(tiny.source.folder),
            "SERVE_HOOK_LIMITS": json.dumps(limits),
            "TOKENIZERS_PARALLELISM": "false",
        }
        result = subprocess.run(
            [
                str(Path(sys.executable).with_name("schemathesis")),
                "--config-file",
                str(config),
                "run",
                running.url + "/openapi.json",
                "--checks",
                "all",
                "--seed",
                "37",
                "--max-examples",
                "40",
                "--max-time",
                "60",
                "--request-timeout",
                "20",
                "--no-color",
                "--workers",  # one request at a time: two could together overfill the queue (n up to 64
                "1",  # each), a 503 the load test covers; here the schema is what is tested
            ],
            capture_output=True,
            text=True,
            timeout=240,
            cwd=tmp_path,
            env=env,
        )
        assert httpx.get(running.url + "/health").status_code == 200
    summary = result.stdout[-3000:]
    assert result.returncode == 0, summary
    counts = re.search(r"(\d+) generated", summary)  # "Test cases: 1833 generated, 1833 passed"
    assert counts is not None, summary
    generated = int(counts.group(1))
    assert generated >= 300 and "failures" not in summary.splitlines()[-1], summary


@pytest.mark.slow
@pytest.mark.serial  # asserts /health latencies: run alone (Makefile)
def test_load_under_faults(tmp_path_factory):
    """64 concurrent streaming clients through tools/serve.py while one request in ten is malformed and one
    client in ten leaves mid-stream: every well-formed request ends with [DONE] (and a finish reason),
    every malformed one gets a 4xx, /health answers within 100 ms throughout, and the server's memory after
    the run is within 10% of before (after a warm-up round of the same load)."""
    folder = sf.tiny_folder(tmp_path_factory.getbasetemp())
    process, url, _ = wait_healthy(
        *launch_cli(str(folder), "--max-batch", "16", "--max-queue", "128", "--log-level", "warning")
    )
    try:
        server = psutil.Process(process.pid)
        _load_round(url, seed=0)  # warm-up: thread pools, caches, allocator arenas
        before = server.memory_info().rss
        latencies, outcomes = _load_round(url, seed=1)
        time.sleep(1.0)
        after = server.memory_info().rss
        assert outcomes["malformed"] == outcomes["4xx"] and outcomes["malformed"] >= 6
        assert outcomes["done"] == 64 - outcomes["malformed"] - outcomes["left"]
        assert outcomes["left"] >= 6
        # Measured on 2 quiet cores: every poll under 100 ms (worst 0.095 s in 80 rounds; docs/serving.md).
        # Asserted with twice that margin for the worst poll on a shared CI machine; a full garbage
        # collection of what loading left (0.3 s holding the GIL, before the server froze it) fails it.
        tail = sorted(latencies)
        assert len(tail) >= 10 and tail[int(0.95 * len(tail)) - 1] < 0.1 and tail[-1] < 0.2, tail[-5:]
        assert abs(after - before) <= 0.1 * before, (before, after)
        assert httpx.get(url + "/health").status_code == 200
    finally:
        process.terminate()
        process.wait(timeout=60)


def _load_round(url: str, seed: int) -> tuple[list[float], dict[str, int]]:
    """One round: the 64 clients on one asyncio loop here, /health polled by another process (a poller
    in this process would measure this process's own GIL contention) until its stdin closes. Every /health
    answer that is not 200 fails the round with what it said."""
    kinds = ["malformed"] * 7 + ["leave"] * 7 + ["ok"] * 50
    random.Random(seed).shuffle(kinds)
    poller = subprocess.Popen(
        [sys.executable, "-c", POLLER, url], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True
    )
    assert poller.stdout.readline() == "polling\n"
    try:
        outcomes = asyncio.run(_clients(url, kinds))
    finally:
        # stdin closed ends the poller (a signal could land inside the HTTP client: CI 2026-12-07 saw one
        # poller outlive its SIGINT by 30 s)
        polled = json.loads(poller.communicate(input="", timeout=60)[0])
    assert not polled["bad"], polled["bad"][:5]
    return polled["latencies"], outcomes


POLLER = """
import json, select, sys, time, httpx
latencies, bad = [], []
with httpx.Client(timeout=10) as client:
    print("polling", flush=True)
    while not select.select([sys.stdin], [], [], 0.05)[0]:  # until the test closes stdin
        start = time.perf_counter()
        try:
            response = client.get(sys.argv[1] + "/health")
            if response.status_code != 200:
                bad.append(f"{response.status_code} {response.text}")
        except httpx.HTTPError as exc:
            bad.append(repr(exc))
        latencies.append(time.perf_counter() - start)
print(json.dumps({"latencies": latencies, "bad": bad}))
"""

MALFORMED = [
    "{not json",
    json.dumps({"model": "tiny_decode", "prompt": "w4", "temperature": "hot"}),
    json.dumps({"model": "tiny_decode", "prompt": ""}),
    json.dumps({"model": "tiny_decode", "prompt": "w4", "stop": ["x" * 100_000]}),
    json.dumps({"model": "tiny_decode", "prompt": "w4 \ud800"}),
    json.dumps({"model": "tiny_decode", "prompt": [4, 10**6]}),
    json.dumps({"model": "tiny_decode", "prompt": "w4", "echo": 0}),
]


async def _clients(url: str, kinds: list[str]) -> dict[str, int]:
    outcomes = {"malformed": kinds.count("malformed"), "4xx": 0, "done": 0, "left": kinds.count("leave")}

    async def one(api: httpx.AsyncClient, index: int) -> None:
        kind = kinds[index]
        if kind == "malformed":
            headers = {"content-type": "application/json"}
            response = await api.post(url + ROUTE, content=MALFORMED[index % 7], headers=headers)
            outcomes["4xx"] += 400 <= response.status_code < 500
            return
        body = {
            "model": "tiny_decode",
            "prompt": [4 + index % 90, 5],
            "max_tokens": 24,
            "stream": True,
            "ignore_eos": True,
        }
        payloads = []
        async with api.stream("POST", url + ROUTE, json=body) as response:
            async for line in response.aiter_lines():
                if line.startswith("data:"):
                    payloads.append(line[5:].strip())
                    if kind == "leave" and len(payloads) == 3:
                        return  # closes the connection mid-stream
        reason, error = stream_outcome(payloads)
        outcomes["done"] += reason == "length" and error is None

    limits = httpx.Limits(max_connections=100)
    async with httpx.AsyncClient(timeout=60, limits=limits) as api:
        await asyncio.wait_for(asyncio.gather(*(one(api, i) for i in range(64))), timeout=120)
    return outcomes
