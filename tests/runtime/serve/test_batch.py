"""Step-level batching of running sequences (runtime/serve/batch.py): rows that join and leave the
batch decode as they do alone (one left-padded cache, or grouped by length), a prompt prefilled in chunks
gives the unchunked prefill's logits, and a graph without a KV cache serves by recomputing."""

from __future__ import annotations

import concurrent.futures as cf

import numpy as np
import pytest

from runtime.generate import DecodeModel, greedy_generate
from runtime.serve import loading
from runtime.serve.batch import CachedRunner, Chunk, GroupedRunner, RecomputeRunner, runner_for
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


@pytest.mark.parametrize("runner_class", [CachedRunner, GroupedRunner])
def test_a_prompt_prefilled_in_chunks_equals_the_unchunked_prefill(runner_class):
    """Issue 48: a 40-token prompt prefilled in chunks of 1, 3, 7 and 16 tokens while two other sequences
    decode between the chunks: every position's logits (prompt scoring) and the last position's equal the
    unchunked prefill's within float32 rounding, and the greedy tokens after it are the same."""
    model = DecodeModel.open(fx.decode_models("decode"))
    prompt = [4 + (7 * i) % 90 for i in range(40)]
    whole = runner_class(model).prefill({"p": Chunk(prompt, positions=True)})["p"]
    alone = greedy_generate(model, [prompt], 6).tokens[0]
    for size in (1, 3, 7, 16):
        runner = runner_class(model)
        others = {
            k: int(out.logits.argmax())
            for k, out in runner.prefill_many({0: PROMPTS[0], 1: PROMPTS[3]}).items()
        }
        positions, last = [], None
        for start in range(0, len(prompt), size):
            end = min(start + size, len(prompt))
            out = runner.prefill({"p": Chunk(prompt[start:end], last=end == len(prompt), positions=True)})[
                "p"
            ]
            positions.append(out.positions)
            last = out.logits
            assert (last is None) == (end < len(prompt)) and len(runner) == 3
            if last is None:  # the running rows decode between the chunks
                others = {k: int(v.argmax()) for k, v in runner.decode(others).items()}
        np.testing.assert_allclose(np.concatenate(positions), whole.positions, rtol=1e-5, atol=1e-5)
        np.testing.assert_allclose(last, whole.logits, rtol=1e-5, atol=1e-5)
        tokens = [int(last.argmax())]
        runner.release(0)
        runner.release(1)
        for _ in range(5):
            tokens.append(int(runner.decode({"p": tokens[-1]})["p"].argmax()))
        assert tokens == alone, size
        runner.release("p")
        assert len(runner) == 0


def test_a_sequence_that_ends_at_its_prompt_never_joins_the_decode_batch():
    """A scoring request (max_tokens 0 or 1) is released right after its prefill: its 100-token row never
    pads the running rows to its length (which cost a copy of every row's cache, twice)."""
    model = DecodeModel.open(fx.decode_models("decode"))
    runner = CachedRunner(model)
    first = {
        k: int(out.logits.argmax()) for k, out in runner.prefill_many({0: PROMPTS[0], 1: PROMPTS[1]}).items()
    }
    runner.decode(first)
    width = runner.mask.shape[1]
    runner.prefill({"score": Chunk([5] * 60, last=False)})
    runner.prefill({"score": Chunk([6] * 40, positions=True)})
    assert len(runner) == 3
    runner.release("score")
    assert runner.mask.shape[1] == width and len(runner) == 2
