"""Completions as evaluation harnesses use them (runtime/serve/logprobs.py, responses.py, app.py) through a
real server on the tiny model: prompts in all four forms, echo, logprobs, n, chat logprobs, and the errors
of bad combinations. Logprobs are checked against runtime/evaluate.py's log-softmax of the graph's own
logits (Evaluator, a separate ONNX Runtime session) and greedy tokens against a torch re-run."""

from __future__ import annotations

import concurrent.futures as cf

import httpx
import numpy as np
import pytest

from runtime.evaluate import Evaluator, log_softmax
from runtime.serve.server import ServerThread
from tests import decode_fixtures as fx
from tests import serve_fixtures as sf
from tests.runtime.serve.clients import client, complete, error_of
from tests.serve_fixtures import PROMPTS


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    """The tiny graph's log_softmax for a prompt [len, vocab], as runtime/evaluate.py computes it."""
    path = sf.tiny_folder(tmp_path_factory.getbasetemp()) / "model.onnx"
    evaluator = Evaluator(path, path)
    return lambda ids: log_softmax(evaluator.logits(0, np.asarray([ids], dtype=np.int64)))[0]


def token_text(token: int) -> str:
    return sf.SPECIALS[token] if token < len(sf.SPECIALS) else f"w{token}"


def post(server, body: dict, route: str = "completions") -> httpx.Response:
    return httpx.post(f"{server.url}/v1/{route}", json={"model": "tiny_decode", **body}, timeout=60)


def test_echo_scores_a_prompt_with_the_numbers_of_evaluate(server, reference):
    prompt = PROMPTS[0]
    body = post(server, {"prompt": prompt, "echo": True, "logprobs": 5, "max_tokens": 0}).json()
    (choice,) = body["choices"]
    assert choice["text"] == sf.words(prompt) and choice["finish_reason"] == "length"
    assert body["usage"] == {"prompt_tokens": 6, "completion_tokens": 0, "total_tokens": 6}
    lp, want = choice["logprobs"], reference(prompt)
    assert lp["tokens"] == [f"w{t}" for t in prompt]
    assert lp["token_logprobs"][0] is None and lp["top_logprobs"][0] is None
    expected = [want[k, t] for k, t in enumerate(prompt[1:])]
    # the prompt's are computed in float32 (float64 sums): evaluate's float64 numbers within float32 rounding
    np.testing.assert_allclose(lp["token_logprobs"][1:], expected, rtol=0, atol=1e-6)
    for k, top in enumerate(lp["top_logprobs"][1:]):
        expected_top = {token_text(t): want[k, t] for t in np.argsort(-want[k], kind="stable")[:5]}
        expected_top.setdefault(token_text(prompt[k + 1]), want[k, prompt[k + 1]])  # the token itself, always
        assert top.keys() == expected_top.keys()
        np.testing.assert_allclose([top[w] for w in expected_top], list(expected_top.values()), atol=1e-6)
    assert lp["text_offset"] == [sum(len(f"w{t}") for t in prompt[:k]) for k in range(len(prompt))]


def test_batch_prompts_in_every_form_one_choice_each_in_order(server, reference):
    """A list of token-id lists (lm-eval's form), of strings, one id list: each choice as its prompt alone
    (echoed logprobs of the left-padded batch equal evaluate's within float noise; greedy = torch)."""
    prompts = PROMPTS[:3]
    body = post(server, {"prompt": prompts, "echo": True, "logprobs": 1, "max_tokens": 1, "temperature": 0})
    choices = body.json()["choices"]
    assert [c["index"] for c in choices] == [0, 1, 2]
    for prompt, choice in zip(prompts, choices, strict=True):
        lp, want = choice["logprobs"], reference(prompt)
        first = fx.torch_greedy(prompt, 1)[0]
        assert choice["text"] == sf.words(prompt) + f"w{first}"  # the prompt's text, then the completion
        assert len(lp["token_logprobs"]) == len(prompt) + 1
        expected = [want[k, t] for k, t in enumerate([*prompt[1:], first])]
        np.testing.assert_allclose(lp["token_logprobs"][1:], expected, rtol=0, atol=1e-5)
        # logprobs 1 and a greedy token: the top entry is the token itself (lm-eval's is_greedy)
        assert max(lp["top_logprobs"][-1].values()) == lp["token_logprobs"][-1]
    words = post(server, {"prompt": [sf.words(p) for p in prompts], "max_tokens": 4, "temperature": 0}).json()
    ids = post(server, {"prompt": prompts, "max_tokens": 4, "temperature": 0}).json()
    assert [c["text"] for c in words["choices"]] == [c["text"] for c in ids["choices"]]
    assert [c["text"] for c in ids["choices"]] == [sf.words(fx.torch_greedy(p, 4)) for p in prompts]
    assert ids["usage"]["prompt_tokens"] == sum(map(len, prompts))
    assert ids["usage"]["completion_tokens"] == 12


def test_generated_logprobs_streamed_as_whole_and_n_choices(server, reference):
    api = client(server)
    prompt = PROMPTS[1]
    whole = complete(api, prompt, 5, logprobs=2, echo=True)
    chunks = list(complete(api, prompt, 5, logprobs=2, echo=True, stream=True))
    assert "".join(c.choices[0].text for c in chunks) == whole.choices[0].text
    streamed = [x for c in chunks if c.choices[0].logprobs for x in c.choices[0].logprobs.token_logprobs]
    assert streamed == whole.choices[0].logprobs.token_logprobs
    offsets = [x for c in chunks if c.choices[0].logprobs for x in c.choices[0].logprobs.text_offset]
    assert offsets == whole.choices[0].logprobs.text_offset
    # generated tokens: the model's own log-softmax at each step (the full sequence re-scored)
    tokens = fx.torch_greedy(prompt, 5)
    full = reference([*prompt, *tokens])
    expected = [full[len(prompt) - 1 + k, t] for k, t in enumerate(tokens)]
    np.testing.assert_allclose(whole.choices[0].logprobs.token_logprobs[len(prompt) :], expected, atol=1e-5)
    # n: one choice per sample, prompt-major; greedy samples agree, seeded ones repeat
    greedy = complete(api, [PROMPTS[2], PROMPTS[4]], 4, n=2)
    assert [c.index for c in greedy.choices] == [0, 1, 2, 3]
    texts = [c.text for c in greedy.choices]
    assert texts[0] == texts[1] == sf.words(fx.torch_greedy(PROMPTS[2], 4))
    assert texts[2] == texts[3] == sf.words(fx.torch_greedy(PROMPTS[4], 4))
    sampled = [
        api.completions.create(model="tiny_decode", prompt=[9, 10], max_tokens=8, n=3, temperature=1, seed=5)
        for _ in range(2)
    ]
    assert [c.text for c in sampled[0].choices] == [c.text for c in sampled[1].choices]
    assert len({c.text for c in sampled[0].choices}) > 1  # the samples of one request differ
    stream = list(complete(api, [PROMPTS[2], PROMPTS[4]], 4, n=2, stream=True))
    for index in range(4):
        assert "".join(c.choices[0].text for c in stream if c.choices[0].index == index) == texts[index]


def test_echo_of_a_prompt_prefilled_in_chunks(tiny, server):
    """Issue 48: a server with a budget of 3 tokens per step prefills a 17-token prompt in chunks (echoed
    logprobs scored chunk by chunk): the same text, text offsets and logprobs (within float32 rounding) as
    the unchunked server, whole and streamed, beside a greedy stream; a one-token prompt too."""
    prompt = [*PROMPTS[0], *PROMPTS[3], *PROMPTS[1]]
    body = {"prompt": prompt, "echo": True, "logprobs": 3, "max_tokens": 3, "temperature": 0}
    unchunked = post(server, body).json()["choices"][0]
    with ServerThread(tiny, prefill_chunk=3) as chunked, cf.ThreadPoolExecutor(2) as pool:
        beside = pool.submit(complete, client(chunked), PROMPTS[2], 20)
        whole = post(chunked, body).json()["choices"][0]
        parts = list(complete(client(chunked), prompt, 3, echo=True, logprobs=3, stream=True))
        one = post(chunked, {"prompt": [7], "echo": True, "logprobs": 1, "max_tokens": 0}).json()["choices"][
            0
        ]
        assert beside.result(timeout=60).choices[0].text == sf.words(fx.torch_greedy(PROMPTS[2], 20))
    assert whole["text"] == unchunked["text"] == "".join(c.choices[0].text for c in parts)
    got, want = whole["logprobs"], unchunked["logprobs"]
    assert got["tokens"] == want["tokens"] and got["text_offset"] == want["text_offset"]
    assert got["token_logprobs"][0] is None
    np.testing.assert_allclose(got["token_logprobs"][1:], want["token_logprobs"][1:], rtol=0, atol=1e-5)
    assert [list(t) for t in got["top_logprobs"][1:]] == [list(t) for t in want["top_logprobs"][1:]]
    streamed = [x for c in parts if c.choices[0].logprobs for x in c.choices[0].logprobs.token_logprobs]
    assert streamed == got["token_logprobs"]
    offsets = [x for c in parts if c.choices[0].logprobs for x in c.choices[0].logprobs.text_offset]
    assert offsets == got["text_offset"]
    assert one["text"] == "w7" and one["logprobs"]["token_logprobs"] == [None]


def test_chat_logprobs(server):
    api = client(server)
    messages = [{"role": "user", "content": "w20 w21 w22"}]
    reply = api.chat.completions.create(
        model="tiny_decode", messages=messages, max_tokens=4, temperature=0, logprobs=True, top_logprobs=3
    )
    content = reply.choices[0].logprobs.content
    assert [c.token for c in content] == reply.choices[0].message.content.split()
    assert all(len(c.top_logprobs) == 3 and c.top_logprobs[0].logprob >= c.logprob for c in content)
    assert all(c.bytes == list(c.token.encode()) for c in content)
    # the same numbers as the completions endpoint gives the same prompt ids (sf.CHAT_TEMPLATE)
    same = complete(api, [1, 20, 21, 22, 5], 4, logprobs=3)
    assert [c.logprob for c in content] == same.choices[0].logprobs.token_logprobs
    chunks = list(
        api.chat.completions.create(
            model="tiny_decode", messages=messages, max_tokens=4, temperature=0, logprobs=True, stream=True
        )
    )
    streamed = [x.logprob for c in chunks if c.choices[0].logprobs for x in c.choices[0].logprobs.content]
    assert streamed == [c.logprob for c in content]
    assert reply.choices[0].logprobs is not None and reply.choices[0].logprobs.content[0].top_logprobs


def test_vllm_sampling_parameters(server):
    api = client(server)
    prompt = PROMPTS[1]
    greedy = fx.torch_greedy(prompt, 8)
    # top_k 1 and min_p 1 leave only the most likely token: sampling is greedy
    for extra in ({"top_k": 1}, {"min_p": 1.0}):
        reply = api.completions.create(
            model="tiny_decode", prompt=prompt, max_tokens=8, temperature=1.0, seed=3, extra_body=extra
        )
        assert reply.choices[0].text == sf.words(greedy), extra
    negative = [
        api.completions.create(model="tiny_decode", prompt=prompt, max_tokens=6, seed=-3) for _ in "ab"
    ]
    assert negative[0].choices[0].text == negative[1].choices[0].text  # any int64 seed (as OpenAI's)
    # stop_token_ids end the request (finish "stop"; the stop token is counted, its text left out)
    stop = complete(api, prompt, 8, extra_body={"stop_token_ids": [greedy[3]]})
    assert stop.choices[0].finish_reason == "stop" and stop.usage.completion_tokens == 4
    assert stop.choices[0].text == sf.words(greedy[:3])
    # min_tokens: the stop token is banned before it, so the request goes on past it
    late = complete(api, prompt, 8, extra_body={"stop_token_ids": [greedy[0]], "min_tokens": 2})
    assert late.usage.completion_tokens >= 2 and late.choices[0].text.split()[0] != f"w{greedy[0]}"
    # a strong repetition penalty changes the greedy path of a prompt whose greedy path repeats itself
    looping = next(p for p in PROMPTS if len(set(fx.torch_greedy(p, 12))) < 12)
    plain = complete(api, looping, 12).choices[0].text
    penalized = complete(api, looping, 12, extra_body={"repetition_penalty": 2.0}).choices[0].text
    assert len(set(penalized.split())) > len(set(plain.split()))
    assert complete(api, looping, 12, frequency_penalty=2.0, presence_penalty=2.0).choices[0].text != plain


@pytest.mark.parametrize(
    ("body", "param", "fragment"),
    [
        ({"prompt": "w4", "logprobs": 6}, "logprobs", "less than or equal to 5"),
        ({"prompt": [[4, 5], [6, 96]]}, "prompt", "prompt[1]: token ids must lie in 0..95"),
        ({"prompt": [[4, 5], [6, 7]], "n": 40}, "n", "make 80 sequences"),
        ({"prompt": [[4]] * 65}, "prompt", "queues at most 64"),
        ({"prompt": "w4", "logit_bias": {"5": 1}}, "logit_bias", "not supported"),
        ({"prompt": "w4", "best_of": 3}, "best_of", "not supported"),
        ({"prompt": "w4", "max_tokens": 2, "min_tokens": 3}, "min_tokens", "exceeds max_tokens"),
        ({"prompt": "w4", "stop_token_ids": [200]}, "stop_token_ids", "0..95"),
        ({"prompt": "w4", "max_tokens": 0}, "max_tokens", "needs echo"),
        ({"prompt": "w4", "top_k": -2}, "top_k", "greater than or equal to -1"),
    ],
)
def test_bad_combinations_name_the_field(server, body, param, fragment):
    error = error_of(post(server, body))
    assert error["param"] == param and fragment in error["message"], error
    assert error["type"] == "invalid_request_error"


@pytest.mark.parametrize(
    ("body", "param"),
    [
        ({"echo": True, "stream": True}, "echo"),
        ({"logprobs": True, "top_logprobs": 21}, "top_logprobs"),
        ({"top_logprobs": 2}, "top_logprobs"),
        ({"tools": [{"type": "function"}]}, "tools"),
    ],
)
def test_bad_chat_combinations_name_the_field(server, body, param):
    response = post(server, {"messages": [{"role": "user", "content": "w4"}], **body}, "chat/completions")
    assert response.status_code == 400 and error_of(response)["param"] == param


def test_a_bad_prompt_in_a_batch_affects_nothing_else(server):
    """A request with a token outside the vocabulary is refused whole, before anything runs; requests
    running meanwhile finish as they would alone."""
    api = client(server)
    alone = complete(api, PROMPTS[3], 20).choices[0].text
    with cf.ThreadPoolExecutor(2) as pool:
        running = pool.submit(lambda: complete(client(server), PROMPTS[3], 20).choices[0].text)
        bad = post(server, {"prompt": [PROMPTS[0], [5, -1]], "echo": True, "logprobs": 1, "max_tokens": 1})
        assert bad.status_code == 400 and error_of(bad)["param"] == "prompt"
        assert running.result(timeout=60) == alone
    chat = api.chat.completions.create(
        model="tiny_decode",
        messages=[{"role": "user", "content": "w20"}, {"role": "assistant", "content": "w7 w8"}],
        max_tokens=3,
        temperature=0,
        extra_body={"echo": True},
    )
    assert chat.choices[0].message.content.startswith("w7 w8")  # vLLM's chat echo: the last message first
