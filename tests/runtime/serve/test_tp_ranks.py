"""A TP folder served by one process per rank (runtime/serve/tp_ranks.py, gloo on CPUs): the same text as
one device, shared decode steps, a crashed rank that fails its request and /health but not the server,
and no rank process that outlives the server."""

from __future__ import annotations

import concurrent.futures as cf
import os
import signal
import time

import httpx
import numpy as np
import openai
import psutil
import pytest

from runtime.serve import loading
from runtime.serve.server import ServerThread
from tests import decode_fixtures as fx
from tests import serve_fixtures as sf
from tests.runtime.serve.clients import client, complete, start_cli, streamed
from tests.serve_fixtures import PROMPTS


@pytest.mark.slow
def test_tp_rank_processes_serve_like_one_device_and_stop_with_the_server(server, tp2_folder):
    """tools/serve.py on a TP 2 folder: two rank processes (gloo all-reduces, each holding its share of the
    KV caches), prompts prefilled in chunks of at most 4 tokens (--prefill-chunk 4); greedy text equals the
    single-device ONNX Runtime server's (unchunked), alone and among 8 concurrent clients, streamed or not,
    and so do echoed prompt logprobs; after SIGTERM the server drains, exits 0, and every process it started
    is gone."""
    process, url, _ = start_cli(
        str(tp2_folder),
        "--backend",
        "tp",
        "--model-name",
        "tiny_decode",
        "--log-level",
        "info",
        "--prefill-chunk",
        "4",
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
        # prompt scoring: rank 0 sends each chunk's logits, the server's scorer thread scores them
        scored = [complete(api, PROMPTS[:2], 2, echo=True, logprobs=2) for api in (tp, client(server))]
        for tp_choice, one_choice in zip(*(s.choices for s in scored), strict=True):
            tp_lp, one_lp = tp_choice.logprobs, one_choice.logprobs
            assert tp_lp.tokens == one_lp.tokens and tp_choice.text == one_choice.text
            assert tp_lp.token_logprobs[0] is None
            np.testing.assert_allclose(tp_lp.token_logprobs[1:], one_lp.token_logprobs[1:], atol=1e-4)
        steps_before = _decode_steps(url)
        with cf.ThreadPoolExecutor(8) as pool:
            together = list(pool.map(lambda job: complete(tp, *job).choices[0].text, jobs))
        assert together == alone
        assert _decode_steps(url) - steps_before < sum(lengths) - len(lengths)  # steps were shared
    finally:
        process.terminate()
        process.wait(timeout=60)
    log = process.stderr.read()  # drained, then uvicorn shuts down gracefully (exit 0: issue 37)
    assert process.returncode == 0 and "Application shutdown complete" in log, log
    _, alive = psutil.wait_procs(started, timeout=20)
    assert not alive, f"still running after shutdown: {alive}"


def _decode_steps(url: str) -> float:
    for line in httpx.get(url + "/metrics").text.splitlines():
        if line.startswith("ffn_serve_batch_size_count"):
            return float(line.split()[-1])
    raise AssertionError("no ffn_serve_batch_size_count in /metrics")


@pytest.mark.slow
def test_a_crashed_rank_fails_its_request_and_health_not_the_server(tp2_folder):
    """With --on-fatal serve: a rank that dies mid-request (SIGSTOP so that the step is surely under way,
    then SIGKILL): that request gets a 500 error JSON, /health 503 with the reason, later requests 503
    (no Retry-After: the model is gone); the server answers on, and no rank process outlives it. A rank
    that dies while idle: the same, at once. (--on-fatal exit, the default: test_faults.py.)"""
    served = loading.load(tp2_folder, backend="tp", name="tiny_decode")
    assert served.source.folder == sf.tiny_folder(tp2_folder.parents[1])  # the sharded source's tokenizer
    ranks = served.ranks
    with ServerThread(served, on_fatal="serve") as tp, cf.ThreadPoolExecutor(1) as pool:
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
        assert "retry-after" not in refused.value.response.headers
        assert httpx.get(tp.url + "/v1/models").status_code == 200
    assert all(not p.is_alive() for p in ranks.processes)
    # a rank that dies while nothing runs: /health fails at once, the next request gets 503
    served = loading.load(tp2_folder, backend="tp", name="tiny_decode")
    with ServerThread(served, on_fatal="serve") as tp:
        os.kill(served.ranks.pids[0], signal.SIGKILL)
        served.ranks.processes[0].join(30)
        health = httpx.get(tp.url + "/health")
        assert health.status_code == 503 and "rank 0 exited (signal 9)" in health.json()["status"]
        with pytest.raises(openai.APIStatusError) as refused:
            complete(client(tp), PROMPTS[2], 5)
        assert refused.value.status_code == 503
    assert all(not p.is_alive() for p in served.ranks.processes)
