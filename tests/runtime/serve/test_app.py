"""The HTTP API (runtime/serve/app.py) through a real server on 127.0.0.1: the official `openai` client,
httpx for raw HTTP. Greedy text is checked against a full torch re-run of the tiny model (decode_fixtures).
"""

from __future__ import annotations

import dataclasses

import httpx
import openai
import pytest

from runtime.serve.server import ServerThread
from tests import decode_fixtures as fx
from tests import serve_fixtures as sf
from tests.runtime.serve.clients import client, complete, error_of, streamed
from tests.serve_fixtures import PROMPTS


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


def test_a_request_without_a_token_limit_gets_the_default(tiny):
    """Issue 48: a chat request without max_tokens ran to the end of the context (8192 tokens on SmolLM2,
    minutes per request); now it stops at --default-max-tokens (capped by what the context leaves), and a
    completion at OpenAI's 16, capped the same way (was a 400 when fewer than 16 were left)."""
    with ServerThread(tiny, default_max_tokens=5) as other:
        api = client(other)
        messages = [{"role": "user", "content": "w20 w21"}]
        extra = {"ignore_eos": True}
        reply = api.chat.completions.create(model="tiny_decode", messages=messages, extra_body=extra)
        assert (reply.usage.completion_tokens, reply.choices[0].finish_reason) == (5, "length")
        reply = api.completions.create(model="tiny_decode", prompt="w4", extra_body=extra)
        assert reply.usage.completion_tokens == 16
        near_end = [4] * (sf.CONTEXT - 3)
        reply = api.completions.create(model="tiny_decode", prompt=near_end, extra_body=extra)
        assert (reply.usage.completion_tokens, reply.choices[0].finish_reason) == (3, "length")
        full = httpx.post(
            other.url + "/v1/completions", json={"model": "tiny_decode", "prompt": [4] * sf.CONTEXT}
        )
        assert full.status_code == 400 and "context length" in error_of(full)["message"]
        schema = httpx.get(other.url + "/openapi.json").json()["components"]["schemas"]["ChatRequest"]
        assert "default 5 (--default-max-tokens)" in schema["properties"]["max_tokens"]["description"]


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
        ('{"model": "tiny_decode", "prompt": "w4", "stop": ["a","b","c","d","e"]}', 400, "stop"),
        ('{"model": "tiny_decode", "prompt": ""}', 400, "empty"),
        ('{"model": "tiny_decode", "prompt": [4, 96]}', 400, "0..95"),
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
