"""Greedy generation with a KV cache (runtime/generate.py) over the backends of runtime/backends.py."""

from __future__ import annotations

import numpy as np
import pytest

from passes.errors import UserError
from passes.io.model_io import load_model
from passes.io.sessions import providers_for
from passes.model_map import find_blocks
from passes.pipeline import fuse_file
from passes.plan import Plan
from passes.shard import shard_file
from runtime.backends import OrtBackend, TpThreadsBackend, TrtBackend
from runtime.generate import DecodeModel, generate_text, greedy_generate, left_pad
from tests import decode_fixtures as fx

PROMPTS = [[3, 17, 41, 8, 60, 22], [90, 5, 33]]  # different lengths: the batch is left-padded


@pytest.fixture(scope="module")
def expected() -> list[list[int]]:
    return [fx.torch_greedy(p, 8) for p in PROMPTS]


def test_greedy_with_cache_equals_argmax_of_full_rerun(tiny_models, expected):
    model = DecodeModel.open(tiny_models("decode"))
    assert model.cached and model.cache_layers == list(fx.TINY_CACHE_LAYERS)
    result = greedy_generate(model, PROMPTS, 8)
    assert result.tokens == expected
    assert len(set(expected[0])) > 1  # the tiny model does not just repeat one token
    stats = result.stats
    assert (stats.batch, stats.prompt_len, stats.new_tokens, len(stats.step_s)) == (2, 6, 8, 7)
    assert stats.ttft_s > 0 and stats.decode_tokens_per_s > 0
    # 2 attention layers x (K, V) x batch 2 x 2 KV heads x (6 + 7) positions x 16 dims x 4 bytes
    assert stats.cache_bytes == 2 * 2 * 2 * 2 * 13 * 16 * 4


def test_each_row_of_a_padded_batch_generates_what_it_would_alone(tiny_models, expected):
    model = DecodeModel.open(tiny_models("decode"))
    alone = [greedy_generate(model, [p], 8).tokens[0] for p in PROMPTS]
    assert alone == expected


def test_eos_stops_rows_and_the_loop(tiny_models, expected):
    model = DecodeModel.open(tiny_models("decode"))
    eos = expected[0][2]
    result = greedy_generate(model, [PROMPTS[0]], 8, eos_token_id=eos)
    assert result.tokens == [expected[0][: expected[0].index(eos) + 1]]
    assert result.stats.new_tokens == expected[0].index(eos) + 1


def test_prefill_only_graph_recomputes_without_cache(tiny_models, expected):
    model = DecodeModel.open(tiny_models("prefill"))
    assert not model.cached
    assert greedy_generate(model, [PROMPTS[0]], 8).tokens == [expected[0]]
    with pytest.raises(UserError, match="equal length"):
        greedy_generate(model, PROMPTS, 2)


def test_fused_decode_graph_generates_like_fused_prefill_model(tiny_models):
    cached = greedy_generate(DecodeModel.open(tiny_models("decode_fused")), [PROMPTS[0]], 8).tokens
    rerun = greedy_generate(DecodeModel.open(tiny_models("prefill_fused")), [PROMPTS[0]], 8).tokens
    assert cached == rerun


def test_tp2_threads_backend_generates_like_one_device(tiny_models, tmp_path, expected):
    """Sharded rank graphs in one process (one thread per rank, all-reduces between them)."""
    report = shard_file(tiny_models("prefill_fused"), 2, tmp_path / "tp2", progress=False)
    backend = TpThreadsBackend(tmp_path / "tp2")
    one = greedy_generate(DecodeModel.open(tiny_models("prefill_fused")), [PROMPTS[0]], 5).tokens
    assert greedy_generate(DecodeModel(backend), [PROMPTS[0]], 5).tokens == one
    # fused: 3 FFN sub-blocks + 2 attention sub-blocks, one all-reduce each per forward
    assert backend.allreduces == report.allreduces_per_forward == 5


def test_left_pad():
    ids, mask = left_pad([[1, 2, 3], [4]], pad_token_id=9)
    assert ids.tolist() == [[1, 2, 3], [9, 9, 4]]
    assert mask.tolist() == [[1, 1, 1], [0, 0, 1]]
    with pytest.raises(UserError):
        left_pad([[1], []])


def test_backends_without_gpu_say_what_is_missing(tiny_models, tmp_path):
    assert providers_for("cpu") == ["CPUExecutionProvider"]
    assert OrtBackend(tiny_models("decode"), device="auto").name.startswith("onnxruntime:")
    if "CUDAExecutionProvider" not in __import__("onnxruntime").get_available_providers():
        with pytest.raises(UserError, match="onnxruntime-gpu"):
            OrtBackend(tiny_models("decode"), device="cuda")
        engine = tmp_path / "missing.engine"
        engine.write_bytes(b"")
        with pytest.raises(UserError):
            TrtBackend(engine)


# ------------------------------------------------------------------------------------------ SmolLM2


def test_smollm2_decode_steps_equal_one_prefill_and_fuse(smollm2_decode_onnx, tmp_path):
    """The real model's decode graph (equal to transformers: tests/exporters/hf/test_decode_graph.py): a
    prefill and 3 cached steps through DecodeModel give the logits of one prefill of the whole sequence, the
    block table is SmolLM2's, the project plan fuses it, and the fused model generates text."""
    ids = np.array([[1, 504, 3458, 314, 253, 1345, 28, 940, 9, 216]], dtype=np.int64)
    model = DecodeModel.open(smollm2_decode_onnx)
    assert len(model.cache_layers) == 20  # 30 layers less the 10 attention-free ones
    reference, _ = model.forward(ids, np.ones((1, 10), np.int64), model.empty_cache(1))
    logits, cache = model.forward(ids[:, :7], np.ones((1, 7), np.int64), model.empty_cache(1))
    parts = [logits]
    for t in range(7, 10):
        logits, cache = model.forward(ids[:, t : t + 1], np.ones((1, t + 1), np.int64), cache)
        parts.append(logits)
    got = np.concatenate(parts, axis=1)
    assert np.abs(got - reference).max() / np.abs(reference).max() < 1e-4

    blocks = find_blocks(load_model(smollm2_decode_onnx))
    assert [b.attention for b in blocks] == [not 13 <= i <= 22 for i in range(30)]
    fused = tmp_path / "fused.onnx"
    fuse_file(smollm2_decode_onnx, Plan(((13, 17), (18, 21)), "fold"), fused, validate_output=False)
    assert len(find_blocks(load_model(fused))) == 30 - 4 - 3
    text, stats = generate_text(fused, "What is the capital of France?", 12)
    assert stats.new_tokens >= 1 and isinstance(text, str) and text.strip()
