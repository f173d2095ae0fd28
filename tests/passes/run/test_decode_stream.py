"""passes/run/decode_stream.py: a decode graph's forward calls run block by block, layer-major (each block's
weights loaded once, one session alive at a time), give the whole session's logits; on the tiny Llama, the
same fused (a fused group's FFN also from its rows), a Nemotron-NAS export with variable GQA, attention-free
and Linear layers, and a parallel-block decode graph (the group one cut)."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from exporters.hf.checkpoint import export_hf
from passes.error_measures import max_abs_relative_error
from passes.errors import UserError
from passes.io.model_io import load_model, save_model
from passes.pipeline import fuse_file
from passes.plan import parse_plan
from passes.run import decode_stream
from passes.run.decode_stream import DecodeCall, DecodeStreamer
from runtime.generate import DecodeModel
from tests import decode_fixtures
from tests.passes.run.live_sessions import LiveSessions


def calls(vocab: int, length: int = 10) -> list[DecodeCall]:
    """A prefill of the whole prompt; half of it, then one token at a time through the cache; and a second
    chain continuing the half prefill with two tokens at once (a call read by two later calls)."""
    ids = np.random.default_rng(5).integers(0, vocab, (1, length), dtype=np.int64)
    mask = np.ones_like(ids)
    half = length // 2
    out = [DecodeCall(ids, mask), DecodeCall(ids[:, :half], mask[:, :half])]
    for t in range(half, length):
        out.append(DecodeCall(ids[:, t : t + 1], mask[:, : t + 1], len(out) - 1))
    out.append(DecodeCall(ids[:, half : half + 2], mask[:, : half + 2], 1))
    return out


def whole(path: Path, sequence: list[DecodeCall]) -> list[np.ndarray]:
    model = DecodeModel.open(path)
    caches: dict[int, dict] = {}
    results = []
    for k, call in enumerate(sequence):
        cache = model.empty_cache(1) if call.after is None else caches[call.after]
        logits, caches[k] = model.forward(call.ids, call.mask, cache)
        results.append(logits)
    return results


def _assert_same(path: Path, vocab: int, monkeypatch, large_ffn_bytes: int | None = None) -> DecodeStreamer:
    sequence = calls(vocab)
    expected = whole(path, sequence)
    sessions = LiveSessions(monkeypatch, decode_stream)
    streamer = DecodeStreamer(path, large_ffn_bytes=large_ffn_bytes)
    got = streamer.run(sequence)
    assert [g.shape for g in got] == [e.shape for e in expected]
    for g, e in zip(got, expected, strict=True):
        assert max_abs_relative_error(g, e) <= 1e-5
    # layer-major: the prefix, each cut with an ONNX part once, the tail; never two at a time
    assert sessions.peak == 1
    assert sessions.opened == 2 + sum(c.proto is not None for c in streamer.cuts)
    return streamer


def test_tiny_decode_streams_as_the_whole_session(tmp_path_factory, monkeypatch):
    path = decode_fixtures.decode_models("decode")
    streamer = _assert_same(path, decode_fixtures.tiny_spec().vocab, monkeypatch)
    caches = {c.cut.index: c.pasts + c.presents for c in streamer.cuts if c.pasts}
    assert caches == {
        n: [f"past_key_{n}", f"past_value_{n}", f"present_key_{n}", f"present_value_{n}"]
        for n in decode_fixtures.TINY_CACHE_LAYERS
    }
    assert streamer.wiring_errors() == []


@pytest.mark.parametrize("large_ffn_bytes", [None, 0])
def test_fused_decode_streams_with_the_source_layer_caches(tmp_path_factory, monkeypatch, large_ffn_bytes):
    path = decode_fixtures.decode_models("decode_fused")
    streamer = _assert_same(path, decode_fixtures.tiny_spec().vocab, monkeypatch, large_ffn_bytes)
    # fused groups [0, 2] and [4, 6]: three blocks, the caches keep the source's layer numbers
    assert [c.cut.index for c in streamer.cuts] == [0, 1, 2]
    pasts = [["past_key_0", "past_value_0"], [], ["past_key_4", "past_value_4"]]
    assert [c.pasts for c in streamer.cuts] == pasts
    assert [c.rows for c in streamer.cuts] == ([None] * 3 if large_ffn_bytes is None else [0, 1, 2])


def test_nemotron_nas_decode_streams(tmp_path_factory, monkeypatch):
    from tests.exporters.hf_fixtures import PUZZLE_CACHE_HEADS, PUZZLE_VOCAB, puzzle_models  # noqa: PLC0415 (imports torch: only this test needs it)

    path = puzzle_models(tmp_path_factory.getbasetemp(), "decode")
    streamer = _assert_same(path, PUZZLE_VOCAB, monkeypatch)
    cached = {c.cut.index for c in streamer.cuts if c.pasts}
    assert cached == set(PUZZLE_CACHE_HEADS)  # attention-free and Linear-attention layers have no cache


def swapped_outputs(source: Path, target: Path, a: str, b: str) -> Path:
    """A copy of `source` whose graph outputs `a` and `b` trade names (a swapped cache wiring)."""
    model = load_model(source)
    outputs = {v.name: v for v in model.graph.outputs}
    outputs[a].name = "swapping"
    outputs[b].name = a
    outputs[a].name = b
    save_model(model, target, external=True)
    return target


def test_a_cache_another_block_writes_is_named(tmp_path_factory, tmp_path):
    path = decode_fixtures.decode_models("decode")
    bad = swapped_outputs(path, tmp_path / "swapped.onnx", "present_key_0", "present_key_4")
    streamer = DecodeStreamer(bad)
    errors = streamer.wiring_errors()
    assert "'past_key_0' (read by block 0) continues as 'present_key_0', which block 4 writes" in errors
    with pytest.raises(UserError, match="cache wiring"):
        streamer.run(calls(decode_fixtures.tiny_spec().vocab))
    assert len(streamer.run(calls(decode_fixtures.tiny_spec().vocab)[:2])) == 2  # uncached calls still run


@pytest.mark.slow  # a Hugging Face folder saved and exported: 3 s, 11 s when transformers is not imported yet
def test_parallel_group_of_a_decode_graph_streams_as_one_cut(tmp_path, monkeypatch):
    from tests.exporters.hf_fixtures import save_llama_family  # noqa: PLC0415 (imports torch: only this test needs it)

    folder = save_llama_family(tmp_path / "hf", num_hidden_layers=4)
    export_hf(folder, tmp_path / "decode" / "model.onnx", dtype="float32", decode=True)
    plan = parse_plan({"groups": [], "parallel_blocks": [[1, 2]]})
    path = fuse_file(tmp_path / "decode" / "model.onnx", plan, tmp_path / "parallel" / "model.onnx").output
    streamer = _assert_same(path, 128, monkeypatch)
    assert [(c.cut.index, c.cut.group) for c in streamer.cuts] == [(0, None), (1, (1, 2)), (3, None)]
    assert streamer.cuts[1].pasts == ["past_key_1", "past_key_2", "past_value_1", "past_value_2"]
