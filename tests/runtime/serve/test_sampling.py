"""Sampling (runtime/serve/sampling.py): through a real server, a seed fixes the tokens whatever else shares
the batch; alone, vLLM's penalties, bans (min_tokens) and filters (top_k, min_p, top_p) by their numbers."""

from __future__ import annotations

import concurrent.futures as cf

import numpy as np

from runtime.serve.sampling import Sampler
from tests.runtime.serve.clients import client, complete


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


def test_penalties_bans_and_filters_as_vllm_defines_them():
    logits = np.array([2.0, -1.0, 1.0, 0.5])
    sampler = Sampler(0.0, repetition_penalty=2.0, frequency_penalty=0.5, presence_penalty=0.25)
    # repetition (prompt or output: 2 -> 1, -1 -> -2, 1 -> 0.5), then 0.5 per use and 0.25 once if used
    np.testing.assert_allclose(sampler._penalize(logits.copy(), [0], [1, 1, 2]), [1.0, -3.25, -0.25, 0.5])
    assert sampler(logits, [0], [1, 1, 2]) == 0
    assert sampler(logits, [0], [1, 1, 2], banned={0}) == 3  # e.g. eos before min_tokens
    peaked = np.array([0.0, 0.0, 5.0, 4.9, -1.0])
    for kind in ({"top_k": 2}, {"min_p": 0.5}, {"top_p": 0.9}):
        draws = {Sampler(1.0, seed=s, **kind)(peaked) for s in range(40)}
        assert draws == {2, 3}, kind
    assert {Sampler(1.0, seed=s)(peaked) for s in range(400)} > {2, 3}
