"""int4 MatMulNBits weights (ONNX Runtime GenAI's int4 form) through fuse: concatenated as packed, checked
in ONNX Runtime against the reference, which dequantizes the original weights itself (numpy)."""

from __future__ import annotations

import logging
from pathlib import Path

import numpy as np
import onnx
import onnx_ir as ir
import onnxruntime as ort
import pytest
from onnx import helper, numpy_helper
from onnxruntime.quantization.matmul_nbits_quantizer import MatMulNBitsQuantizer

from exporters.synthetic import SyntheticSpec, build_synthetic
from passes.errors import PassInputError, UserError
from passes.fuse import FuseFFNGroups
from passes.io.model_io import load_model, load_proto, save_model
from passes.model_map import find_blocks
from passes.pipeline import fuse_file
from passes.plan import Plan

# block_size 32: widths 96 (3 blocks: an odd count, so packed zero points end mid-byte), 128, 64; 80 is
# not a multiple of it.
SPEC = SyntheticSpec(hidden=64, blocks=[(True, 96), (False, 128), (False, 64), (False, 80)])


_built: dict[str, Path] = {}


def _int4(kind: str, tmp_path_factory) -> Path:
    """The synthetic model quantized by ONNX Runtime's MatMulNBitsQuantizer (built once per kind)."""
    if kind not in _built:
        folder = tmp_path_factory.mktemp(f"int4_{kind}")
        source = build_synthetic(SPEC, folder / "float.onnx")
        logging.getLogger().setLevel(logging.WARNING)  # the quantizer logs every node at INFO
        quantizer = MatMulNBitsQuantizer(
            onnx.load(str(source)), bits=4, block_size=32, is_symmetric=kind == "symmetric"
        )
        quantizer.process()
        _built[kind] = folder / "int4.onnx"
        quantizer.model.save_model_to_file(str(_built[kind]), False)
    return _built[kind]


@pytest.fixture(scope="module", params=["asymmetric", "symmetric"])
def int4_model(request, tmp_path_factory) -> Path:
    """Zero points packed as uint8 (asymmetric), or none (symmetric: the default 8)."""
    return _int4(request.param, tmp_path_factory)


def _matmul_nbits(path: Path) -> list[onnx.NodeProto]:
    return [n for n in load_proto(path).graph.node if n.op_type == "MatMulNBits"]


def test_reference_dequantizes_like_onnx_runtime(int4_model):
    """The reference's own dequantization, against ONNX Runtime's kernel on one weight."""
    weight = find_blocks(load_model(int4_model))[0].ffn.down
    q = weight.nbits
    inputs = [weight.source, q.scales] + ([q.zero_points] if q.zero_points is not None else [])
    node = helper.make_node(
        "MatMulNBits", ["x"] + [v.name for v in inputs[1:]], ["y"], domain="com.microsoft",
        K=q.k, N=q.n, bits=q.bits, block_size=q.block_size,
    )  # fmt: skip
    node.input.insert(1, inputs[0].name)
    initializers = [numpy_helper.from_array(v.const_value.numpy(), v.name) for v in inputs]
    graph = helper.make_graph(
        [node], "one", [helper.make_tensor_value_info("x", onnx.TensorProto.FLOAT, [5, q.k])],
        [helper.make_tensor_value_info("y", onnx.TensorProto.FLOAT, None)], initializers,
    )  # fmt: skip
    opsets = [helper.make_opsetid("", 18), helper.make_opsetid("com.microsoft", 1)]
    session = ort.InferenceSession(helper.make_model(graph, opset_imports=opsets).SerializeToString())
    x = np.random.default_rng(0).standard_normal((5, q.k)).astype(np.float32)
    expected = x.astype(np.float64) @ weight.matrix()
    assert weight.matrix().shape == (96, 64)
    np.testing.assert_allclose(
        session.run(None, {"x": x})[0], expected, rtol=0, atol=1e-5 * np.abs(expected).max()
    )


@pytest.mark.parametrize("external", [False, True])
def test_int4_group_fuses_exactly(int4_model, tmp_path, external):
    source = int4_model
    if external:
        source = tmp_path / "external" / "int4.onnx"
        source.parent.mkdir()
        save_model(load_model(int4_model), source, external=True)
    blocks = find_blocks(load_model(source))
    assert all(w.nbits is not None for b in blocks for w in (b.ffn.gate, b.ffn.up, b.ffn.down))
    result = fuse_file(source, Plan(((0, 2),), "last"), tmp_path / "fused.onnx")
    assert result.report.ok and result.report.groups[0].rel_error < 1e-5, result.report.lines()
    fused = find_blocks(load_model(result.output))
    assert [b.width for b in fused] == [96 + 128 + 64, 80]
    nodes = _matmul_nbits(result.output)
    assert len(nodes) == 2 * 3 + 4 + 1  # two FFNs, q/k/v/o of block 0's attention, lm_head
    down = fused[0].ffn.down.nbits
    assert (down.k, down.n, down.block_size) == (288, 64, 32)
    assert (fused[0].ffn.gate.nbits.k, fused[0].ffn.gate.nbits.n) == (64, 288)


def test_a_part_without_zero_points_gets_the_default(tmp_path_factory, tmp_path):
    int4_model = _int4("asymmetric", tmp_path_factory)
    proto = load_proto(int4_model)
    nodes = [n for n in proto.graph.node if n.op_type == "MatMulNBits" and len(n.input) > 3]
    downs = {b.ffn.down.source.name for b in find_blocks(load_model(int4_model))[:3]}
    gates = {b.ffn.gate.source.name for b in find_blocks(load_model(int4_model))[:3]}
    assert len(nodes) == 4 * 3 + 4 + 1
    for node in nodes:  # block 1's down and gate lose theirs: the model changes, fused and reference alike
        if node.input[1] in (sorted(downs)[1], sorted(gates)[1]):
            del node.input[3]
    path = tmp_path / "mixed.onnx"
    onnx.save(proto, str(path))
    result = fuse_file(path, Plan(((0, 2),), "last"), tmp_path / "fused.onnx")
    assert result.report.ok and result.report.groups[0].rel_error < 1e-5, result.report.lines()


def test_block_size_must_divide_each_down_k(int4_model, tmp_path):
    with pytest.raises(UserError, match=r"block_size 32 does not divide the down projections' K \[80\]"):
        fuse_file(int4_model, Plan(((1, 3),), "last"), tmp_path / "fused.onnx")
    assert not (tmp_path / "fused.onnx").exists()


def test_fold_is_refused_for_int4(int4_model, tmp_path):
    with pytest.raises(UserError, match='"fold" cannot fold norm weights into int4'):
        fuse_file(int4_model, Plan(((1, 2),), "fold"), tmp_path / "fused.onnx")


def test_a_plan_refused_by_requires_leaves_the_model_untouched(int4_model):
    """Group [0, 1] would fuse; [2, 3] cannot (K 80). The pass refuses in `requires`, before group [0, 1]."""
    model = load_model(int4_model)
    before = ir.to_proto(model).SerializeToString()
    with pytest.raises(PassInputError, match=r"block_size 32 does not divide the down projections' K \[80\]"):
        FuseFFNGroups(Plan(((0, 1), (2, 3)), "last"))(model)
    assert ir.to_proto(model).SerializeToString() == before


def test_fuse_onnx_refuses_such_a_plan_in_one_line_and_writes_nothing(tool, int4_model, tmp_path):
    plan = tmp_path / "plan.json"
    plan.write_text('{"groups": [[0, 1], [2, 3]], "norm": "last"}')
    result = tool("fuse_onnx", int4_model, plan, "-o", tmp_path / "out" / "fused.onnx")
    assert result.returncode == 2, result.stderr
    assert "Traceback" not in result.stderr
    assert [line for line in result.stderr.splitlines() if line.startswith("error")] == [
        "error: ffn_fusion.2_3.down_proj: block_size 32 does not divide the down projections' K [80]: "
        "their int4 blocks cannot be concatenated exactly along K; re-quantize with a block size that "
        "divides every FFN width"
    ]
    assert not (tmp_path / "out").exists() or not any((tmp_path / "out").iterdir())
