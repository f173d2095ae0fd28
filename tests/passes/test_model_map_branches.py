"""Every residual branch in the model map (passes/model_map.py): kinds in stream order, one block per source
layer derived from them, and a Linear-replaced attention or FFN (nemotron-nas replace_with_linear) as a
fusion barrier."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import onnx
import pytest

from exporters.hf.checkpoint import export_hf
from passes.error_measures import max_abs_relative_error
from passes.errors import UserError
from passes.io.model_io import load_model
from passes.io.sessions import open_session
from passes.model_map import build_model_map
from passes.patterns.attention import is_linear
from passes.plan import parse_plan, validate_plan
from passes.shard import shard_file
from passes.shard.roles import find_structure
from runtime.tp.ort import run_simulated
from tests.exporters.hf_fixtures import deci_block, nemotron_config, write_nemotron

# Layers: 0 attention + FFN, 1 FFN, 2 Linear attention + FFN, 3 Linear FFN only, 4 FFN, 5 attention + FFN,
# 6 FFN, 7 FFN.
LAYERS = [
    deci_block(2, 1.0),
    deci_block("no_op", 1.0),
    deci_block("linear", 1.0),
    deci_block("no_op", "linear"),
    deci_block("no_op", 2.0),
    deci_block(4, 1.0),
    deci_block("no_op", 1.0),
    deci_block("no_op", 1.0),
]
KINDS = ["attention", "ffn", "ffn", "linear", "ffn", "linear", "ffn", "attention", "ffn", "ffn", "ffn"]
VOCAB = 64


@pytest.fixture(scope="module")
def linear_nemotron(tmp_path_factory) -> tuple[Path, Path]:
    config = nemotron_config(LAYERS, hidden=64, heads=4, vocab=VOCAB)
    base = tmp_path_factory.mktemp("nemotron_linear")
    folder = write_nemotron(base / "ckpt", config, shards=1, seed=5)
    path = base / "onnx" / "model.onnx"
    export_hf(folder, path, dtype="float32")
    return folder, path


def test_every_branch_in_stream_order(linear_nemotron) -> None:
    model_map = build_model_map(load_model(linear_nemotron[1]))
    assert [b.kind for b in model_map.branches] == KINDS
    for branch in model_map.branches:
        assert branch.projection in branch.nodes  # the body (branch_nodes) ends in its projection
        linears = [n for n in branch.nodes if is_linear(n)]
        assert len(linears) == {"attention": 4, "ffn": 3, "linear": 1}[branch.kind]
    # One block per source layer (numbered as the checkpoint numbers its layers), each starting where the
    # previous one ends; layer 3's Linear FFN is block 3's FFN part, not a barrier before block 4.
    blocks = model_map.blocks
    assert [b.index for b in blocks] == list(range(len(LAYERS)))
    assert [b.layer_name for b in blocks] == [f"model.layers.{i}" for i in range(len(LAYERS))]
    ffns = [b.residual.node for b in model_map.branches if b.kind == "ffn"]
    assert [b.residual.node for b in blocks if b.ffn is not None] == ffns
    assert [b.attention_kind for b in blocks] == ["attention", "none", "linear", "none", "none", "attention",
                                                  "none", "none"]
    assert [b.ffn_kind for b in blocks] == ["swiglu"] * 3 + ["linear"] + ["swiglu"] * 4
    assert [b.kv_heads for b in blocks if b.attention] == [2, 1]
    assert "model.layers.2" in blocks[2].barrier and "one-Linear" in blocks[2].barrier
    assert "model.layers.3" in blocks[3].ffn_what and blocks[3].barrier is None
    for k in range(1, len(blocks)):
        assert blocks[k].block_input is blocks[k - 1].output


@pytest.mark.parametrize("group", [[1, 2], [2, 3], [1, 4]])
def test_plan_may_not_span_a_linear_branch(linear_nemotron, group) -> None:
    blocks = build_model_map(load_model(linear_nemotron[1])).blocks
    refused = r"spans a branch fusion cannot cross: block [23](?: follows|'s FFN is) residual branch "
    with pytest.raises(UserError, match=refused + r"\d+ \[linear\] \(model\.layers\.[23]\), a one-Linear "):
        validate_plan(parse_plan({"groups": [group]}), list(blocks))
    validate_plan(parse_plan({"groups": [[6, 7]]}), list(blocks))  # attention-free, barrier-free: fine


def test_cli_refuses_a_group_across_a_linear_branch(tool, linear_nemotron, tmp_path) -> None:
    plan = tmp_path / "plan.json"
    plan.write_text(json.dumps({"groups": [[1, 2]]}))
    out = tmp_path / "fused.onnx"
    result = tool("fuse_onnx", linear_nemotron[1], plan, "-o", out)
    assert result.returncode == 2 and not out.exists()
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: group [1, 2] spans a branch fusion cannot cross")


def _tokens(seed: int = 0) -> np.ndarray:
    return np.random.default_rng(seed).integers(0, VOCAB, size=(2, 9)).astype(np.int64)


@pytest.mark.parametrize("tp", [2, 4])
def test_linear_branch_shards_row_parallel(linear_nemotron, tmp_path, tp) -> None:
    """A one-Linear branch (attention and FFN replace_with_linear) shards row-parallel: each rank gathers
    its share of the replicated input features and multiplies by its rows; the all-reduce sums them."""
    source = linear_nemotron[1]
    structure = find_structure(load_model(source))
    assert [b.kind for b in structure.branches] == KINDS
    linear = [b for b in structure.branches if b.kind == "linear"]
    assert [b.width for b in linear] == [64, 64] and all(not b.columns for b in linear)

    shard_file(source, tp, tmp_path / "tp", progress=False)
    rank0 = onnx.load(str(tmp_path / "tp" / "rank0" / "model.onnx"), load_external_data=False)
    names = {b.row.source.name for b in linear}
    shapes = [list(t.dims) for t in rank0.graph.initializer if t.name in names]
    assert sorted(shapes) == [[64, 64 // tp]] * 2  # stored [out, in] (Transpose): its input rows split
    ids = _tokens()
    expected = open_session(source, threads=1).run(None, {"input_ids": ids})[0]
    assert max_abs_relative_error(run_simulated(tmp_path / "tp", ids), expected) <= 1e-5


def test_show_blocks_marks_linear_barriers(tool, linear_nemotron) -> None:
    result = tool("fuse_onnx", linear_nemotron[1], "--show-blocks", check=True)
    assert "stream: A-L--A--" in result.stdout and "ffns:   FFFLFFFF" in result.stdout
    assert "attention-free runs: 6-7 (2 blocks)" in result.stdout  # 1-4 would cross the Linear branches


def test_analyze_never_proposes_across_a_linear_branch(tool, linear_nemotron, tmp_path) -> None:
    """Proposal runs stop at Linear branches as at attention: with every dependency allowed, the old
    attention-only runs would propose [1, 2] across the Linear attention of block 2."""
    ids = tmp_path / "ids.npy"
    np.save(ids, _tokens(1).reshape(-1))
    out = tmp_path / "analysis"
    args = ("--tokens", ids, "--num-tokens", 18, "--window", 9, "--threshold", 100, "--norm", "last")
    result = tool("analyze", linear_nemotron[1], "--out", out, *args, check=True)
    groups = json.loads((out / "plan.json").read_text())["groups"]
    # Block 2 has a Linear attention, block 3 a Linear FFN (in no group at all), 0 and 5 have attention.
    assert all(not {0, 2, 3, 5} & set(range(i + 1, j + 1)) and i != 3 for i, j in groups), result.stdout
