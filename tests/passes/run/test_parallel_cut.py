"""A parallel-block graph (passes/parallel.py) cut with whole_groups: each parallel group is one cut from its
members' shared input to the group's output, so captures and model_logits stream it group by group; the
single-block uses refuse its members, and without whole_groups the graph is refused as before."""

from __future__ import annotations

import numpy as np
import pytest

from exporters.hf.checkpoint import export_hf
from exporters.hf.synthetic import deci_block, nemotron_config, write_nemotron
from passes.errors import UserError
from passes.io.model_io import load_typed_proto
from passes.pipeline import fuse_file
from passes.plan import parse_plan
from passes.run import block_runner as runner
from passes.run.block_runner import BlockRunner
from passes.run.cut import cut_blocks
from tests.passes.run.live_sessions import LiveSessions

# Blocks 0-3 full (GQA + SwiGLU: rotary tables and the mask are side inputs), 4-5 FFN only.
PLAN = {"groups": [[4, 5]], "parallel_blocks": [[1, 3]], "norm": "last"}


@pytest.fixture(scope="module")
def parallel(tmp_path_factory):
    folder = tmp_path_factory.mktemp("parallel_cut")
    config = nemotron_config([deci_block(2, 1.0)] * 4 + [deci_block("no_op", 1.0)] * 2)
    graph = folder / "onnx" / "model.onnx"
    export_hf(write_nemotron(folder / "ckpt", config, seed=3), graph, dtype="float32")
    return fuse_file(graph, parse_plan(PLAN), folder / "model.parallel.onnx").output


def _tokens(seed: int = 0) -> np.ndarray:
    return np.random.default_rng(seed).integers(0, 96, (2, 9))


def test_a_parallel_group_is_one_cut(parallel):
    cut = BlockRunner(parallel, whole_groups=True)
    blocks = cut.blocks
    assert [b.parallel for b in blocks] == [None, (1, 3), (1, 3), (1, 3), None]
    assert cut.units == [[0], [1, 2, 3], [4]] and cut.unit_of == {0: 0, 1: 1, 2: 1, 3: 1, 4: 2}
    assert [(c.index, c.group) for c in cut.cuts] == [(0, None), (1, (1, 3)), (4, None)]
    group = cut.cuts[1]
    assert group.input_name == blocks[1].block_input.name and group.output_name == blocks[3].output.name
    assert group.attention and group.width == sum(b.width for b in blocks[1:4])
    assert group.side_inputs  # the rotary tables and the mask, read by every member's attention
    for before, after in zip(cut.cuts, cut.cuts[1:], strict=False):
        assert after.input_name == before.output_name
    for c in cut.cuts:
        assert [v.name for v in c.proto.graph.input] == [c.input_name, *c.side_inputs]
        assert [v.name for v in c.proto.graph.output] == [c.output_name]
    # every member's attention and FFN weights are in the group's subgraph
    weights = {t.name for t in group.proto.graph.initializer}
    assert all({w.source.name for w in (b.ffn.gate, b.ffn.up, b.ffn.down)} <= weights for b in blocks[1:4])

    x = np.zeros((2, 9, 64), np.float32)
    single = r"block [12] runs in parallel with blocks 1\.\.3 .* needs a single block"
    for use in (lambda: cut.run_attention(2, x), lambda: cut.run_branches(1, x)):
        with pytest.raises(UserError, match=single):
            use()
    with pytest.raises(UserError, match="an FFN from its rows needs a single block"):
        BlockRunner(parallel, whole_groups=True, from_rows={3: lambda h: h})
    with pytest.raises(UserError, match="run block-by-block analysis on the original model"):
        BlockRunner(parallel)  # the analyses' runner: single blocks only
    with pytest.raises(UserError, match=r"block 2 does not start where block 1 ends \(a parallel group"):
        cut_blocks(blocks, load_typed_proto(parallel))  # the cut itself, without groups


def test_streamed_capture_and_logits_equal_the_whole_run(parallel, monkeypatch):
    tokens = _tokens()
    whole = BlockRunner(parallel, streaming=False, whole_groups=True)
    captured = whole.capture(tokens)
    assert np.allclose(runner.model_logits(parallel, tokens), whole.logits, rtol=1e-5, atol=1e-5)
    sessions = LiveSessions(monkeypatch, runner)
    streaming = BlockRunner(parallel, streaming=True, whole_groups=True)
    streamed = streaming.capture(tokens)
    assert sessions.peak == 1  # the prefix, one block or one whole group, the tail: one at a time
    scale = np.abs(whole.logits).max()
    assert np.abs(streaming.logits - whole.logits).max() <= 1e-5 * scale
    for c in streaming.cuts:
        np.testing.assert_allclose(streamed[c.output_name], captured[c.output_name], rtol=1e-5, atol=1e-5)
    with pytest.raises(UserError, match="keeps block streams only"):  # a member's h = x + a has no cut
        streaming.capture(tokens, extra=[streaming.blocks[2].ffn_input.name], only=True)

    monkeypatch.setattr(runner, "STREAMING_BYTES", 0)
    logits = runner.model_logits(parallel, tokens)
    assert np.abs(logits - whole.logits).max() <= 1e-5 * scale
    assert sessions.peak == 1


def test_large_blocks_from_rows_but_the_group_in_one_session(parallel, monkeypatch):
    """With every FFN above LARGE_FFN_BYTES, the blocks of their own run from their rows (float64) and the
    parallel group still runs as one session (its members have no stream of their own)."""
    tokens = _tokens(1)
    whole = runner.model_logits(parallel, tokens)
    referenced = []
    parallel_sum = runner.parallel_sum

    def recorded(x, group, norm_mode):
        referenced.append(group[0].index)
        return parallel_sum(x, group, norm_mode)

    monkeypatch.setattr(runner, "parallel_sum", recorded)
    monkeypatch.setattr(runner, "STREAMING_BYTES", 0)
    monkeypatch.setattr(runner, "LARGE_FFN_BYTES", 0)
    streamed = runner.model_logits(parallel, tokens)
    assert referenced == [0, 4]
    assert np.abs(streamed - whole).max() <= 1e-4 * np.abs(whole).max()
