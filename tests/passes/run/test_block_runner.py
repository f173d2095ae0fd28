"""Streaming BlockRunner (models larger than RAM, issue 13): captures run block by block and at most one
block's weights are loaded at a time; results equal the whole-model runner's."""

from __future__ import annotations

import numpy as np
import pytest

from exporters.synthetic import SyntheticSpec, build_synthetic
from passes import reference
from passes.analysis.dependency import analyze
from passes.pipeline import fuse_file
from passes.plan import Plan
from passes.run import block_runner as runner
from passes.run.block_runner import BlockRunner
from tests.passes.run.live_sessions import LiveSessions

BLOCKS = [(True, 48), (True, 64), (False, 40), (False, 56), (True, 32), (False, 24)]


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    folder = tmp_path_factory.mktemp("streaming")
    return build_synthetic(SyntheticSpec(hidden=32, blocks=BLOCKS, seed=4), folder / "m.onnx", external=True)


def test_streaming_analysis_equals_whole_model(model, monkeypatch):
    tokens = np.random.default_rng(0).integers(0, 64, (2, 16))
    whole = analyze(model, tokens, progress=False, runner=BlockRunner(model, streaming=False))
    sessions = LiveSessions(monkeypatch, runner)
    streaming = BlockRunner(model, streaming=True)
    streamed = analyze(model, tokens, progress=False, runner=streaming)
    assert sessions.peak == 1  # one block (or the prefix) at a time, never the whole model
    np.testing.assert_allclose(streamed.dependency, whole.dependency, rtol=1e-5, atol=1e-7)
    assert streamed.chain_rel_error < 1e-6
    whole_logits = BlockRunner(model, streaming=False)
    whole_logits.capture(tokens)
    np.testing.assert_allclose(
        streaming.logits, whole_logits.logits, rtol=1e-5, atol=1e-5
    )  # through the tail


def test_streaming_logits_of_a_skip_norm_graph(skip_norm_model, monkeypatch):
    """The final SkipSimplifiedLayerNormalization both ends the last block (its sum) and starts the tail
    (its normalized output): the streamed tail splits it and still gives the model's logits."""
    tokens = np.random.default_rng(2).integers(0, 64, (2, 12))
    whole = BlockRunner(skip_norm_model, streaming=False)
    whole.capture(tokens)
    sessions = LiveSessions(monkeypatch, runner)
    assert np.allclose(runner.model_logits(skip_norm_model, tokens), whole.logits, rtol=1e-5, atol=1e-5)
    monkeypatch.setattr(runner, "STREAMING_BYTES", 0)
    streamed = runner.model_logits(skip_norm_model, tokens)
    assert sessions.peak == 1
    np.testing.assert_allclose(streamed, whole.logits, rtol=1e-5, atol=1e-5)


def test_streaming_capture_keeps_what_is_asked(model, monkeypatch):
    tokens = np.random.default_rng(1).integers(0, 64, (3, 8))
    plain, streamed = BlockRunner(model, streaming=False), BlockRunner(model, streaming=True)
    names = [b.ffn_input.name for b in plain.blocks[:4]] + [plain.blocks[3].residual.output.name]
    expected = plain.capture(tokens, extra=names, only=True)
    sessions = LiveSessions(monkeypatch, runner)
    got = streamed.capture(tokens, extra=names, only=True)
    assert sessions.peak == 1
    for name in names:
        np.testing.assert_allclose(got[name], expected[name], rtol=1e-5, atol=1e-6)
    assert streamed.blocks[1].attention and names[1] != streamed.cuts[1].input_name  # after attention


@pytest.mark.parametrize("mode", ["last", "fold"])
def test_streamed_logits_of_a_fused_model_never_load_a_large_block(model, tmp_path, monkeypatch, mode):
    """A fused block holds its whole group's weights: above LARGE_FFN_BYTES, model_logits evaluates it
    from its weights a row block at a time (float64 reference), including after an attention sub-block."""
    fused = fuse_file(model, Plan(((1, 3),), mode), tmp_path / "fused.onnx").output
    tokens = np.random.default_rng(3).integers(0, 64, (2, 9))
    whole = runner.model_logits(fused, tokens)
    referenced = []
    parallel_sum = runner.parallel_sum

    def recorded(x, group, norm_mode):
        referenced.append(group[0])
        return parallel_sum(x, group, norm_mode)

    monkeypatch.setattr(runner, "parallel_sum", recorded)
    monkeypatch.setattr(runner, "STREAMING_BYTES", 0)
    monkeypatch.setattr(runner, "LARGE_FFN_BYTES", 0)
    monkeypatch.setattr(reference, "ACTIVATION_BYTES", 1)  # one token per slice of the FFN reference
    streamed = runner.model_logits(fused, tokens)
    assert len(referenced) == 4 and referenced[1].attention  # every block, the fused one after its attention
    np.testing.assert_allclose(streamed, whole, rtol=1e-4, atol=1e-4)
