"""Dependency analysis against independent computations: edited ONNX graphs run whole, and the torch
model with layers skipped by hand."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import onnx
import onnxruntime as ort
import pytest
from onnx import numpy_helper

from exporters.spec import BlockSpec, ModelSpec
from exporters.synthetic import SyntheticSpec, build_synthetic
from passes.analysis.dependency import analyze, cosine_distance
from passes.errors import UserError
from passes.io.model_io import load_model
from passes.model_map import find_blocks
from passes.run.block_runner import BlockRunner
from tests.artifacts import spec_export

BLOCKS = [(True, 48), (False, 64), (False, 40), (False, 56), (True, 32), (False, 48)]


@pytest.fixture(scope="session")
def synthetic(tmp_path_factory) -> Path:
    return build_synthetic(SyntheticSpec(blocks=BLOCKS, seed=3), tmp_path_factory.mktemp("ana") / "m.onnx")


def _tokens(vocab: int = 64, shape=(2, 12), seed: int = 1) -> np.ndarray:
    return np.random.default_rng(seed).integers(0, vocab, size=shape, dtype=np.int64)


def _run_with_outputs(proto: onnx.ModelProto, names: list[str], tokens: np.ndarray) -> dict[str, np.ndarray]:
    """Run a whole (possibly edited) model with extra float outputs, by plain ORT."""
    proto.graph.output.extend(
        onnx.helper.make_tensor_value_info(n, onnx.TensorProto.FLOAT, None) for n in names
    )
    sess = ort.InferenceSession(proto.SerializeToString(), providers=["CPUExecutionProvider"])
    values = sess.run(None, {proto.graph.input[0].name: tokens})
    return dict(zip([o.name for o in proto.graph.output], values, strict=True))


def _per_token_distance(a: np.ndarray, b: np.ndarray) -> float:
    a, b = a.reshape(-1, a.shape[-1]).astype(np.float64), b.reshape(-1, b.shape[-1]).astype(np.float64)
    cos = (a * b).sum(1) / (np.linalg.norm(a, axis=1) * np.linalg.norm(b, axis=1))
    return float(np.mean(1 - cos))


def _reference_by_graph_edit(path: Path, tokens: np.ndarray) -> np.ndarray:
    """D[i][j] from whole-model runs of graphs where block i is bypassed (its output's consumers read its
    input instead)."""
    blocks = find_blocks(load_model(path))
    ins = [b.block_input.name for b in blocks]
    outs = [b.residual.output.name for b in blocks]
    n = len(blocks)
    base = _run_with_outputs(onnx.load(str(path)), ins + outs, tokens)
    h = [base[outs[j]] - base[ins[j]] for j in range(n)]
    reference = np.full((n, n), np.nan)
    for i in range(n - 1):
        proto = onnx.load(str(path))
        for node in proto.graph.node:
            node.input[:] = [ins[i] if name == outs[i] else name for name in node.input]
        run = _run_with_outputs(proto, outs[i + 1 :], tokens)
        previous = base[ins[i]]
        for j in range(i + 1, n):
            reference[i, j] = _per_token_distance(h[j], run[outs[j]] - previous)
            previous = run[outs[j]]
    return reference


def test_dependency_matches_graph_edit(synthetic):
    tokens = _tokens()
    result = analyze(synthetic, tokens, progress=False)
    reference = _reference_by_graph_edit(synthetic, tokens)
    n = len(BLOCKS)
    assert result.dependency.shape == (n, n)
    lower = np.tril_indices(n)
    assert np.isnan(result.dependency[lower]).all()
    upper = np.triu_indices(n, k=1)
    np.testing.assert_allclose(result.dependency[upper], reference[upper], rtol=1e-3, atol=1e-6)
    assert reference[upper].min() > 1e-4  # the blocks do depend on each other: the check can fail
    assert result.block_evaluations == n + n * (n - 1) // 2
    assert result.chain_rel_error < 1e-5


def test_block_stats_match_whole_run(synthetic):
    tokens = _tokens(shape=(1, 9))
    result = analyze(synthetic, tokens, progress=False)
    blocks = find_blocks(load_model(synthetic))
    names = [b.block_input.name for b in blocks] + [b.residual.output.name for b in blocks]
    run = _run_with_outputs(onnx.load(str(synthetic)), names, tokens)
    for stats, block in zip(result.blocks, blocks, strict=True):
        x = run[block.block_input.name].reshape(-1, 32).astype(np.float64)
        y = run[block.residual.output.name].reshape(-1, 32).astype(np.float64)
        cos = (x * y).sum(1) / (np.linalg.norm(x, axis=1) * np.linalg.norm(y, axis=1))
        ratio = np.linalg.norm(y - x, axis=1) / np.linalg.norm(x, axis=1)
        assert stats.io_cosine_distance == pytest.approx(np.mean(1 - cos), rel=1e-4, abs=1e-7)
        assert stats.residual_norm_ratio == pytest.approx(np.mean(ratio), rel=1e-4)
        assert (stats.attention, stats.ffn_width) == (block.attention, block.width)


def test_zero_down_projection_gives_zero_row(synthetic, tmp_path):
    """Block 2 with zero down weights adds nothing: removing it changes nothing downstream."""
    down = find_blocks(load_model(synthetic))[2].ffn.down.source.name
    proto = onnx.load(str(synthetic))
    for k, tensor in enumerate(proto.graph.initializer):
        if tensor.name == down:
            zero = np.zeros(numpy_helper.to_array(tensor).shape, dtype=np.float32)
            proto.graph.initializer[k].CopyFrom(numpy_helper.from_array(zero, down))
    path = tmp_path / "zero.onnx"
    onnx.save(proto, str(path))
    result = analyze(path, _tokens(), progress=False)
    np.testing.assert_allclose(result.dependency[2, 3:], 0.0, atol=1e-12)
    assert np.nanmin(result.dependency[1, 3:]) > 1e-4  # other rows are not zero
    assert result.dependency[1, 2] == 0.0  # block 2 adds zero with or without block 1
    assert result.blocks[2].residual_norm_ratio == 0.0


def test_rows_subset_and_bad_tokens(synthetic):
    result = analyze(synthetic, _tokens(), rows=[3], progress=False)
    assert np.isnan(result.dependency[:3]).all() and np.isfinite(result.dependency[3, 4:]).all()
    assert result.block_evaluations == len(BLOCKS) + 2
    with pytest.raises(UserError, match="vocabulary"):
        analyze(synthetic, np.array([[0, 64]]), progress=False)


def test_cosine_distance_zero_vectors():
    zero = np.zeros((3, 4))
    assert cosine_distance(zero, zero) == 0.0
    x = np.array([[1.0, 0.0], [0.0, 1.0]])
    assert cosine_distance(x, -x) == pytest.approx(2.0)
    assert cosine_distance(x, x[::-1]) == pytest.approx(1.0)


# ------------------------------------------------------------------ dynamo-exported model vs torch


@pytest.fixture(scope="session")
def exported(tmp_path_factory):
    torch = pytest.importorskip("torch")
    from exporters.llama import build_model  # noqa: PLC0415 (imports torch: only this fixture needs it)

    spec = ModelSpec(
        hidden=32,
        heads=4,
        kv_heads=2,
        vocab=97,
        blocks=[BlockSpec(True, 48), BlockSpec(False, 40), BlockSpec(False, 56), BlockSpec(True, 32)],
    )
    path = tmp_path_factory.mktemp("exported") / "spec.onnx"
    spec_export(spec, path, seed=5)
    return path, build_model(spec, seed=5), torch


def _torch_streams(model, torch, ids: np.ndarray, skip: int | None):
    """Every layer's (input, output) from the torch model, with layer `skip` left out."""
    backbone = model.model
    with torch.no_grad():
        tokens = torch.from_numpy(ids)
        x = backbone.embed_tokens(tokens)
        seq = tokens.shape[1]
        freqs = torch.arange(seq, dtype=torch.float32)[:, None] * backbone.inv_freq[None, :]
        angles = torch.cat((freqs, freqs), dim=-1)
        cos, sin = angles.cos()[None, None], angles.sin()[None, None]
        mask = torch.full((seq, seq), float("-inf")).triu(1)[None, None]
        streams = []
        for k, layer in enumerate(backbone.layers):
            y = x if k == skip else layer(x, cos, sin, mask)
            streams.append((x.double().numpy(), y.double().numpy()))
            x = y
    return streams


@pytest.mark.slow
def test_dependency_matches_torch_layer_skip(exported):
    """The real exporter's graph (rotary cos/sin and the causal mask are side tensors of the blocks)."""
    path, model, torch = exported
    ids = _tokens(vocab=97, shape=(2, 10), seed=4)
    result = analyze(path, ids, progress=False)
    n = len(model.model.layers)
    base = _torch_streams(model, torch, ids, None)
    for i in range(n - 1):
        skipped = _torch_streams(model, torch, ids, i)
        for j in range(i + 1, n):
            expected = _per_token_distance(base[j][1] - base[j][0], skipped[j][1] - skipped[j][0])
            assert result.dependency[i, j] == pytest.approx(expected, rel=2e-3, abs=1e-5), (i, j)
    x, y = base[1]
    ratio = np.mean(
        np.linalg.norm((y - x).reshape(-1, 32), axis=1) / np.linalg.norm(x.reshape(-1, 32), axis=1)
    )
    assert result.blocks[1].residual_norm_ratio == pytest.approx(ratio, rel=1e-4)
    # The attention blocks read side tensors captured from the full run.
    runner = BlockRunner(path)
    assert runner.cuts[0].side_inputs and runner.cuts[3].side_inputs
