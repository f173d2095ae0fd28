"""A Puzzle (Nemotron-NAS) decode graph, KV caches of per-layer head counts, through the generation stack:
runtime/generate.py, and one request served by tools/serve.py on the folder export_hf wrote (graph,
tokenizer, config.json, generation_config.json), answered with the tokens greedy_generate gives."""

from __future__ import annotations

import numpy as np
import openai
import pytest

from runtime.generate import DecodeModel, greedy_generate
from tests.exporters.hf_fixtures import PUZZLE_CACHE_HEADS, puzzle_models
from tests.runtime.serve.clients import start_cli
from tests.serve_fixtures import EOS, words

PROMPT = [17, 41, 8, 60, 22, 9]


@pytest.fixture(scope="module")
def decode_path(tmp_path_factory: pytest.TempPathFactory):
    return puzzle_models(tmp_path_factory.getbasetemp(), "decode")


def test_empty_cache_takes_each_layers_kv_heads(decode_path) -> None:
    model = DecodeModel.open(decode_path)
    cache = model.empty_cache(3)
    heads = {f"past_{k}_{layer}": kv for layer, kv in PUZZLE_CACHE_HEADS.items() for k in ("key", "value")}
    assert {name: a.shape for name, a in cache.items()} == {n: (3, kv, 0, 16) for n, kv in heads.items()}
    logits, grown = model.forward(np.array([PROMPT] * 3), np.ones((3, len(PROMPT)), np.int64), cache)
    assert logits.shape == (3, len(PROMPT), 96)
    assert {n: a.shape for n, a in grown.items()} == {n: (3, kv, len(PROMPT), 16) for n, kv in heads.items()}


def test_served_request_equals_greedy_generate(decode_path) -> None:
    expected = greedy_generate(DecodeModel.open(decode_path), [PROMPT], 10, eos_token_id=EOS).tokens[0]
    process, url, _ = start_cli(str(decode_path.parent), "--model-name", "puzzle")
    try:
        api = openai.OpenAI(base_url=url + "/v1", api_key="none", max_retries=0, timeout=60)
        response = api.completions.create(model="puzzle", prompt=PROMPT, max_tokens=10, temperature=0)
    finally:
        process.terminate()
        process.wait(timeout=60)
    generated = [t for t in expected if t != EOS]
    assert response.choices[0].text == words(generated)
    assert response.usage.completion_tokens == len(expected)
