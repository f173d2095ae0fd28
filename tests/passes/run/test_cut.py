"""The graph cut: one subgraph per block, chained stream to stream; a norm shared across blocks is split."""

from __future__ import annotations

import numpy as np
import onnx

from exporters.synthetic import SyntheticSpec, build_synthetic
from passes.analysis.dependency import analyze
from passes.io.model_io import load_model
from passes.model_map import find_blocks
from passes.run.cut import cut_blocks


def _tokens(vocab: int = 64, shape=(2, 12), seed: int = 1) -> np.ndarray:
    return np.random.default_rng(seed).integers(0, vocab, size=shape, dtype=np.int64)


def test_cuts_chain_stream_to_stream(tmp_path):
    path = build_synthetic(
        SyntheticSpec(blocks=[(True, 16), (False, 24), (True, 20)], seed=2), tmp_path / "m.onnx"
    )
    proto = onnx.shape_inference.infer_shapes(onnx.load(str(path)))
    cuts = cut_blocks(find_blocks(load_model(path)), proto)
    assert [c.index for c in cuts] == [0, 1, 2]
    for cut, following in zip(cuts, cuts[1:], strict=False):
        assert following.input_name == cut.output_name
    for cut in cuts:
        assert [v.name for v in cut.proto.graph.input] == [cut.input_name, *cut.side_inputs]
        assert [v.name for v in cut.proto.graph.output] == [cut.output_name]


def test_shared_norm_graph_is_split(tmp_path):
    """SkipSimplifiedLayerNormalization computes block k+1's norm in the node that ends block k: the
    analysis gives block k+1 its own norm of the stream, so skipping block k changes what block k+1 sees."""
    path = build_synthetic(
        SyntheticSpec(norm="skip_simplified_ln", blocks=[(False, 16), (False, 24), (False, 20)]),
        tmp_path / "skip.onnx",
    )
    result = analyze(path, _tokens(), progress=False)
    assert np.isfinite(result.dependency[0, 1:]).all() and np.isfinite(result.dependency[1, 2])
    assert result.dependency[0, 1] > 1e-4  # 0 if block 1's norm were captured as a fixed side input
