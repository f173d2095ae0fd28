"""Fixtures shared by tests/passes modules."""

from __future__ import annotations

import onnx
import pytest

from exporters.synthetic import SyntheticSpec, build_synthetic
from passes.io.model_io import load_model
from passes.model_map import find_blocks

SKIP_NORM_BLOCKS = [(False, 12), (False, 16), (False, 24), (False, 20)]


@pytest.fixture(scope="module")
def skip_norm_model(tmp_path_factory):
    """A Skip*Norm decoder whose final SkipSimplifiedLayerNormalization has only its normalized output,
    as ONNX Runtime's optimizer writes it."""
    path = tmp_path_factory.mktemp("skip") / "model.onnx"
    spec = SyntheticSpec(norm="skip_simplified_ln", blocks=SKIP_NORM_BLOCKS, seed=3)
    build_synthetic(spec, path, external=True)
    proto = onnx.load(str(path), load_external_data=False)
    final = [n for n in proto.graph.node if n.op_type == "SkipSimplifiedLayerNormalization"][-1]
    del final.output[1:]
    onnx.save(proto, str(path))
    assert find_blocks(load_model(path))[-1].residual.output is None
    return path
