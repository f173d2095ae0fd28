"""The model map (passes/model_map.py) and graph-input roles (passes/graph_inputs.py) on small graphs in
the shapes third-party exporters write; the real exports are in tests/corpora/test_third_party.py."""

from __future__ import annotations

import json

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper, numpy_helper

from exporters.synthetic import SyntheticSpec, build_synthetic
from passes.errors import UserError
from passes.graph_inputs import FeedError, Role, Signature
from passes.io.model_io import load_model
from passes.model_map import build_model_map
from passes.pipeline import fuse_file
from passes.plan import Plan

SPEC = SyntheticSpec(blocks=[(True, 48), (False, 64), (False, 40), (True, 32)])
ATTENTION = [True, False, False, True]


def _synthetic(tmp_path, edit, name: str = "m.onnx"):
    path = build_synthetic(SPEC, tmp_path / "base.onnx")
    proto = onnx.load(str(path))
    edit(proto)
    onnx.checker.check_model(proto)
    out = tmp_path / name
    onnx.save(proto, str(out))
    return out


def _embedding(proto: onnx.ModelProto) -> onnx.NodeProto:
    return next(n for n in proto.graph.node if n.op_type == "Gather" and "input_ids" in n.input)


def _reroute(proto: onnx.ModelProto, old: str, new: str, skip: onnx.NodeProto) -> None:
    for node in proto.graph.node:
        if node is not skip:
            node.input[:] = [new if i == old else i for i in node.input]


def _cast_stream(proto: onnx.ModelProto) -> None:
    """Optimum's shape: the stream copied by Cast(float) before its norm and residual add."""
    for node in [n for n in proto.graph.node if n.op_type == "Add" or n is _embedding(proto)]:
        out = node.output[0]
        if not any(out in n.input and n.op_type == "Add" for n in proto.graph.node) and node.op_type == "Add":
            continue  # not a residual add's output that the stream continues from
        cast = helper.make_node("Cast", [out], [out + "_cast"], to=TensorProto.FLOAT)
        _reroute(proto, out, out + "_cast", cast)
        proto.graph.node.insert(list(proto.graph.node).index(node) + 1, cast)


def _transposed_table(proto: onnx.ModelProto) -> None:
    """GenAI's tied embedding: Gather(Transpose(table stored [hidden, vocab]), input_ids)."""
    gather = _embedding(proto)
    table = next(t for t in proto.graph.initializer if t.name == gather.input[0])
    table.CopyFrom(numpy_helper.from_array(numpy_helper.to_array(table).T.copy(), table.name))
    node = helper.make_node("Transpose", [table.name], ["table_t"], perm=[1, 0])
    gather.input[0] = "table_t"
    proto.graph.node.insert(0, node)


def _pipeline_stage(proto: onnx.ModelProto) -> None:
    """A pipeline-parallel stage: no embedding, the stream is a float graph input."""
    gather = _embedding(proto)
    proto.graph.node.remove(gather)
    del proto.graph.input[:]
    proto.graph.input.append(
        helper.make_tensor_value_info(gather.output[0], TensorProto.FLOAT, ["batch", "seq", SPEC.hidden]))


def _static_batch(proto: onnx.ModelProto) -> None:
    for value in (proto.graph.input[0], proto.graph.output[0]):
        value.type.tensor_type.shape.dim[0].Clear()
        value.type.tensor_type.shape.dim[0].dim_value = 1


@pytest.mark.parametrize("edit", [_cast_stream, _transposed_table], ids=["cast-stream", "transposed-table"])
def test_embedding_and_stream_forms(tmp_path, edit):
    model_map = build_model_map(load_model(_synthetic(tmp_path, edit)))
    assert [b.attention for b in model_map.blocks] == ATTENTION
    assert model_map.vocab_size == SPEC.vocab
    assert model_map.embedding.transposed == (edit is _transposed_table)
    assert model_map.final_norm is not None and model_map.lm_head is not None
    assert [a.index for a in model_map.attention] == [0, 3]


def test_cast_stream_fuses_exactly(tmp_path):
    path = _synthetic(tmp_path, _cast_stream)
    result = fuse_file(path, Plan(((0, 2),), "fold"), tmp_path / "fused.onnx")
    assert result.report.ok and result.blocks_after == 2


def test_pipeline_stage_blocks_numbered_from_the_float_input(tmp_path):
    path = _synthetic(tmp_path, _pipeline_stage)
    model_map = build_model_map(load_model(path))
    assert model_map.is_pipeline_stage and model_map.stream_start.name == model_map.signature.stream.name
    assert [b.index for b in model_map.blocks] == [0, 1, 2, 3]
    assert [b.attention for b in model_map.blocks] == ATTENTION
    result = fuse_file(path, Plan(((0, 2),), "last"), tmp_path / "fused.onnx")
    assert result.report.ok and result.report.groups[0].rel_error < 1e-5


def test_no_blocks_and_no_embedding_is_one_line(tmp_path):
    proto = helper.make_model(helper.make_graph(
        [helper.make_node("Relu", ["ids"], ["y"])], "g",
        [helper.make_tensor_value_info("ids", TensorProto.INT64, [1, 4])],
        [helper.make_tensor_value_info("y", TensorProto.INT64, [1, 4])]))
    path = tmp_path / "relu.onnx"
    onnx.save(proto, str(path))
    with pytest.raises(UserError, match="no token embedding found"):
        build_model_map(load_model(path))


def test_static_batch_model_evaluates(tool, tmp_path):
    """issue 9: evaluate on a model whose batch dim is a static 1 (it asked ONNX Runtime for batch 4)."""
    path = _synthetic(tmp_path, _static_batch)
    assert Signature.of(onnx.load(str(path))).batch == 1
    fused = fuse_file(path, Plan(((1, 2),), "last"), tmp_path / "fused.onnx").output
    ids = np.random.default_rng(0).integers(0, SPEC.vocab, size=300)
    np.save(tmp_path / "ids.npy", ids)
    result = tool("evaluate", path, fused, "--tokens", tmp_path / "ids.npy", "--window", "16", "--json",
                  "--quiet")
    assert result.returncode == 0, result.stderr
    assert json.loads(result.stdout)["results"][0]["tokens"] > 0


def _decoder_signature(names: list[tuple[str, int, list]], outputs: list[tuple[str, int, list]]) -> Signature:
    graph = helper.make_graph(
        [], "g", [helper.make_tensor_value_info(n, t, d) for n, t, d in names],
        [helper.make_tensor_value_info(n, t, d) for n, t, d in outputs])
    return Signature.of(helper.make_model(graph))


def test_signature_reads_optimum_and_project_cache_names():
    f, i = TensorProto.FLOAT, TensorProto.INT64
    cache = ["batch", 3, "past", 64]
    sig = _decoder_signature(
        [("input_ids", i, ["batch", "seq"]), ("attention_mask", i, ["batch", "total"]),
         ("position_ids", i, ["batch", "seq"]), ("past_key_values.0.key", f, cache),
         ("past_key_values.0.value", f, cache), ("past_key_5", f, cache)],
        [("logits", f, ["batch", "seq", 100]), ("present.0.key", f, cache), ("present.0.value", f, cache),
         ("present_key_5", f, cache)])
    roles = [g.role for g in sig.inputs]
    assert roles == [Role.IDS, Role.MASK, Role.POSITIONS, Role.PAST, Role.PAST, Role.PAST]
    assert sig.cache_layers == [0, 5] and sig.batch is None
    assert sig.present_for("past_key_values.0.value") == "present.0.value"
    assert sig.present_for("past_key_5") == "present_key_5"
    feeds = sig.feeds(np.arange(14).reshape(2, 7), past_length=3)
    assert feeds["attention_mask"].shape == (2, 10) and feeds["past_key_5"].shape == (2, 3, 3, 64)
    assert feeds["position_ids"][1].tolist() == list(range(3, 10))


def test_signature_static_dims_and_unfeedable_inputs():
    i, f = TensorProto.INT64, TensorProto.FLOAT
    sig = _decoder_signature(
        [("input_ids", i, [1, 16]), ("temperature", f, [1])], [("logits", f, [1, 16, 8])])
    assert sig.batch == 1 and sig.fixed_seq == 16 and sig.batch_size(4) == 1
    with pytest.raises(FeedError, match="temperature"):
        sig.feeds(np.zeros((1, 16), np.int64))
