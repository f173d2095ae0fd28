"""tools/fuse_onnx.py as users run it: the main job, --show-blocks, --verify, and every bad input."""

from __future__ import annotations

import hashlib
import json
import shutil

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper, numpy_helper

from exporters.synthetic import SyntheticSpec, build_synthetic

SPEC = SyntheticSpec(blocks=[(True, 16), (False, 24), (False, 16), (False, 8)])


@pytest.fixture
def model(tmp_path):
    return build_synthetic(SPEC, tmp_path / "model.onnx", external=True)


def write_plan(folder, data, name: str = "plan.json") -> str:
    path = folder / name
    path.write_text(data if isinstance(data, str) else json.dumps(data))
    return str(path)


def folder_digest(folder) -> dict[str, str]:
    return {
        p.name: hashlib.sha256(p.read_bytes()).hexdigest() for p in sorted(folder.iterdir()) if p.is_file()
    }


def test_fuses_validates_and_verifies(tool, model, tmp_path):
    result = tool("fuse_onnx", model, write_plan(tmp_path, {"groups": [[0, 2]], "norm": "fold"}), check=True)
    assert "blocks: 4 -> 2" in result.stdout and "relative error" in result.stdout
    fused = tmp_path / "model.fused.onnx"
    assert fused.exists() and (tmp_path / "model.fused.onnx.data").exists()
    verified = tool("fuse_onnx", model, "--verify", fused, check=True)
    assert "verified" in verified.stdout


def test_show_blocks_table_and_json(tool, model):
    table = tool("fuse_onnx", model, "--show-blocks", check=True).stdout
    assert "stream: A---" in table and "attention-free runs: 1-3 (3 blocks)" in table
    rows = json.loads(tool("fuse_onnx", model, "--show-blocks", "--json", check=True).stdout)["blocks"]
    assert [(r["attention"], r["ffn_width"]) for r in rows] == [
        (True, 16),
        (False, 24),
        (False, 16),
        (False, 8),
    ]


def test_verify_fails_on_a_model_that_is_not_what_the_plan_says(tool, model, tmp_path):
    tool("fuse_onnx", model, write_plan(tmp_path, {"groups": [[0, 2]], "norm": "fold"}), check=True)
    fused = tmp_path / "model.fused.onnx"
    proto = onnx.load(str(fused), load_external_data=False)
    proto.metadata_props[0].value = json.dumps({"groups": [[0, 2]], "norm": "last"})  # wrong mode recorded
    onnx.save(proto, str(fused))
    result = tool("fuse_onnx", model, "--verify", fused)
    assert result.returncode == 1 and "MISMATCH" in result.stdout


def _bad_cases(tmp_path, model):
    folder = model.parent
    good_plan = write_plan(tmp_path, {"groups": [[1, 2]]})
    not_onnx = tmp_path / "notes.onnx"
    not_onnx.write_text("hello, not a model\n")
    no_data = tmp_path / "nodata"
    no_data.mkdir()
    shutil.copy(model, no_data / "model.onnx")
    traversal = tmp_path / "traversal"
    traversal.mkdir()
    proto = onnx.load(str(model), load_external_data=False)
    for tensor in proto.graph.initializer:
        for entry in tensor.external_data:
            if entry.key == "location":
                entry.value = "../model.onnx.data"
    onnx.save(proto, str(traversal / "model.onnx"))
    gelu = tmp_path / "gelu"
    gelu.mkdir()
    _gelu_model(gelu / "model.onnx")

    plans = tmp_path / "plans"
    plans.mkdir()

    def plan(data):
        return write_plan(plans, data, f"plan{len(list(plans.iterdir()))}.json")

    return {
        "missing model": ([tmp_path / "nope.onnx", good_plan], "does not exist"),
        "not onnx": ([not_onnx, good_plan], "is not an ONNX model"),
        "missing external data": ([no_data / "model.onnx", good_plan], "is missing"),
        "path traversal": ([traversal / "model.onnx", good_plan], "leaves the model's folder"),
        "plan not json": ([model, plan("{groups: [[1, 2]]")], "not valid JSON"),
        "unknown key": ([model, plan({"groups": [[1, 2]], "extra": 1})], "unknown key"),
        "overlap": ([model, plan({"groups": [[1, 2], [2, 3]]})], "overlap"),
        "reversed": ([model, plan({"groups": [[2, 1]]})], "reversed"),
        "out of range": ([model, plan({"groups": [[1, 9]]})], "out of range"),
        "single block": ([model, plan({"groups": [[2, 2]]})], "single block"),
        "unknown norm": ([model, plan({"groups": [[1, 2]], "norm": "mean"})], "unknown norm mode"),
        "no blocks": ([gelu / "model.onnx", good_plan], "LayerNorm -> GELU"),
        "output is input": ([model, good_plan, "-o", model], "is the input model"),
        "missing plan": ([model, tmp_path / "nope.json"], "does not exist"),
        "negative file size": ([model, good_plan, "--max-data-file-gb", "-1"], "give 0 (one file)"),
        "file size nan": ([model, good_plan, "--max-data-file-gb", "nan"], "give 0 (one file)"),
    }, folder


def _gelu_model(path):
    """A tiny LayerNorm -> GELU decoder: not what FFN Fusion handles."""
    rng = np.random.default_rng(0)
    w = lambda *s: numpy_helper.from_array(rng.standard_normal(s).astype(np.float32))  # noqa: E731
    inits = [w(16, 8), w(8), w(8), w(8, 32), w(32, 8)]
    for t, n in zip(inits, ["emb", "g", "b", "up", "down"], strict=True):
        t.name = n
    nodes = [
        helper.make_node("Gather", ["emb", "input_ids"], ["x"]),
        helper.make_node("LayerNormalization", ["x", "g", "b"], ["n"]),
        helper.make_node("MatMul", ["n", "up"], ["u"]),
        helper.make_node("Gelu", ["u"], ["a"]),
        helper.make_node("MatMul", ["a", "down"], ["d"]),
        helper.make_node("Add", ["x", "d"], ["logits"]),
    ]
    graph = helper.make_graph(
        nodes,
        "gelu",
        [helper.make_tensor_value_info("input_ids", TensorProto.INT64, [1, 4])],
        [helper.make_tensor_value_info("logits", TensorProto.FLOAT, [1, 4, 8])],
        initializer=inits,
    )
    onnx.save(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 20)]), str(path))


def test_every_bad_input_gets_one_line_error_and_leaves_nothing(tool, model, tmp_path):
    cases, folder = _bad_cases(tmp_path, model)
    cases["spans attention"] = (
        [model, write_plan(tmp_path / "plans", {"groups": [[0, 1]], "norm": "last"})],
        None,
    )
    cases["spans attention"] = ([model, write_plan(tmp_path / "plans", {"groups": [[1, 3]]})], None)
    del cases["spans attention"]  # SPEC's only attention is block 0; covered below with a model that has more
    before = folder_digest(folder)
    for name, (args, message) in cases.items():
        result = tool("fuse_onnx", *args)
        assert result.returncode == 2, (name, result.stdout, result.stderr)
        lines = result.stderr.strip().splitlines()
        assert len(lines) == 1 and lines[0].startswith("error: "), (name, result.stderr)
        assert message in lines[0], (name, lines[0])
        assert "Traceback" not in result.stderr
        assert not (folder / "model.fused.onnx").exists(), name
        assert not [p for p in folder.iterdir() if p.name.startswith(".")], name
    assert folder_digest(folder) == before


def test_group_spanning_attention_names_the_block(tool, tmp_path):
    model = build_synthetic(
        SyntheticSpec(blocks=[(True, 8), (False, 8), (True, 8), (False, 8)]), tmp_path / "m.onnx"
    )
    result = tool("fuse_onnx", model, write_plan(tmp_path, {"groups": [[0, 3]]}))
    assert result.returncode == 2
    assert "error: group [0, 3] spans attention: block 2 has attention" in result.stderr
    assert not (tmp_path / "m.fused.onnx").exists()
