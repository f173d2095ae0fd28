"""Step-level batching of running sequences (runtime/serve/batch.py): rows that join and leave the
batch decode as they do alone (one left-padded cache, or grouped by length), and a graph without a KV
cache serves by recomputing."""

from __future__ import annotations

import concurrent.futures as cf

import pytest

from runtime.generate import DecodeModel, greedy_generate
from runtime.serve import loading
from runtime.serve.batch import CachedRunner, GroupedRunner, RecomputeRunner, runner_for
from runtime.serve.server import ServerThread
from tests import decode_fixtures as fx
from tests import serve_fixtures as sf
from tests.runtime.serve.clients import client
from tests.serve_fixtures import PROMPTS


@pytest.mark.parametrize("runner_class", [CachedRunner, GroupedRunner])
def test_rows_joining_and_leaving_the_batch_decode_as_alone(tmp_path_factory, runner_class):
    """Sequences of different lengths join at different steps (two at once: one batched prefill) and leave
    early; every row's greedy tokens equal its own batch-1 generation."""
    model = DecodeModel.open(fx.decode_models("decode"))
    alone = {k: greedy_generate(model, [p], 12).tokens[0] for k, p in enumerate(PROMPTS[:5])}
    runner, got, nxt = runner_class(model), {}, {}
    schedule = {0: [0, 1], 3: [2], 5: [3, 4]}  # step -> sequences joining then (PROMPTS differ in length)
    for step in range(20):
        joining = {key: PROMPTS[key] for key in schedule.get(step, [])}
        # sequences that arrive together are prefilled together
        prefilled = {key: out.logits for key, out in runner.prefill_many(joining).items()} if joining else {}
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
