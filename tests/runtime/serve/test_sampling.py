"""Per-request seeded sampling (runtime/serve/sampling.py) through a real server: a seed fixes the tokens
whatever else shares the batch."""

from __future__ import annotations

import concurrent.futures as cf

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
