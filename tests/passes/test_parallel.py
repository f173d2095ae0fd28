"""Full-block parallelization (passes/parallel.py, design §10) on tiny project exports: the plan key, the
rewrite with its validation against the block-by-block reference of the original, the logits against an
independent torch implementation of the formula, one-line refusals, and generation from a decode graph."""

from __future__ import annotations

import json

import numpy as np
import onnx
import pytest
import torch

from exporters.llama import build_model
from exporters.spec import BlockSpec, ModelSpec
from passes.block_table import format_block_table
from passes.error_measures import l2_relative_error
from passes.errors import UserError
from passes.io.model_io import load_model
from passes.metadata import PLAN_METADATA_KEY
from passes.model_map import build_model_map, find_blocks
from passes.parallel import ParallelizeBlocks
from passes.pipeline import fuse_file
from passes.plan import Plan, parse_plan, validate_plan
from passes.run.block_runner import BlockRunner
from passes.shard import count_allreduces
from passes.validate import plan_from_metadata
from runtime.generate import DecodeModel, greedy_generate
from tests.artifacts import spec_export
from tests.run_graph import graph_logits
from tests.runtime.heal.test_graphs import fix_dims
from tests.torch_reference import parallel_blocks_model, parallel_model

SEED = 2
# Blocks 0-3 full (attention + SwiGLU), 4-5 FFN only: parallel [0, 2] and FFN group [4, 5] fit together.
PLAN = {"groups": [[4, 5]], "parallel_blocks": [[0, 2]], "norm": "last"}
IDS = np.random.default_rng(0).integers(0, 96, size=(2, 9))


def spec() -> ModelSpec:
    widths = [96, 64, 80, 48, 72, 56]
    attention = [True, True, True, True, False, False]
    blocks = [BlockSpec(a, w) for a, w in zip(attention, widths, strict=True)]
    return ModelSpec(hidden=64, heads=4, kv_heads=2, vocab=96, tie_embeddings=False, blocks=blocks)


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    folder = tmp_path_factory.mktemp("parallel")
    prefill, decode = folder / "prefill.onnx", folder / "decode.onnx"
    spec_export(spec(), prefill, seed=SEED)
    spec_export(spec(), decode, seed=SEED, decode=True)
    return prefill, decode


def torch_logits(parallel, groups=(), ids: np.ndarray = IDS) -> np.ndarray:
    model = build_model(spec(), SEED)
    parallel_model(model, groups, "last")
    parallel_blocks_model(model, parallel)
    with torch.no_grad():
        return model(torch.from_numpy(ids)).numpy()


def test_plan_key_round_trips() -> None:
    plan = parse_plan(PLAN)
    assert plan.parallel == ((0, 2),) and plan.groups == ((4, 5),)
    assert parse_plan(json.loads(plan.to_json())) == plan
    assert "parallel_blocks" not in Plan(((1, 2),)).to_json()  # FFN-only plans keep their form
    assert parse_plan({"groups": [], "parallel_blocks": [[1, 3]]}).parallel == ((1, 3),)


def test_parallel_and_ffn_groups_validate_and_match_torch(tiny, tmp_path) -> None:
    out = tmp_path / "model.fused.onnx"
    result = fuse_file(tiny[0], parse_plan(PLAN), out)
    report = result.report
    assert report.ok and [(g.kind, g.group) for g in report.groups] == [("parallel", (0, 2)), ("ffn", (4, 5))]
    assert all(g.rel_error < 1e-5 for g in report.groups)
    assert report.logits_rel_error is not None and report.logits_rel_error > 1e-3  # it changes the model
    assert plan_from_metadata(out) == parse_plan(PLAN)
    fused = graph_logits(out, IDS)
    assert l2_relative_error(fused, torch_logits([(0, 2)], [(4, 5)])) < 1e-4
    # the torch reference tells the two apart
    assert l2_relative_error(fused, torch_logits([], [(4, 5)])) > 1e-3
    # The rewrite moved only stream inputs: every attention core (Softmax) is still there.
    softmax = [n for n in load_model(out).graph if n.op_type == "Softmax"]
    assert len(softmax) == 4


def test_model_map_reads_a_parallel_graph(tiny, tmp_path) -> None:
    out = tmp_path / "model.fused.onnx"
    fuse_file(tiny[0], parse_plan(PLAN), out)
    model_map = build_model_map(load_model(out))
    blocks = model_map.blocks
    # Layer numbers survive both rewrites: blocks 0-3 and the fused FFN group at 4.
    assert [b.index for b in blocks] == [0, 1, 2, 3, 4]
    assert [b.parallel for b in blocks] == [(0, 2)] * 3 + [None, None]
    (group,) = model_map.parallel
    assert group.size == 3 and group.input is blocks[0].block_input
    assert all(b.block_input is group.input and b.output is group.residual.output for b in blocks[:3])
    # Each member's FFN reads its own h = x + a, and the group's sums read every member's branch.
    assert [b.ffn_input for b in blocks[:3]] == [a.residual.output for a in group.attention]
    assert [f.output for f in group.ffns] == [b.ffn.output for b in blocks[:3]]
    assert blocks[3].block_input is group.residual.output
    table = format_block_table(list(blocks))
    assert "parallel groups: [0, 2]" in table and table.count("parallel [0, 2]") == 3
    # A plan for the original does not apply to the rewritten graph, and block-by-block runs refuse it.
    with pytest.raises(UserError, match=r"parallel group \[0, 2\] already; write the plan for the original"):
        validate_plan(parse_plan({"groups": [[2, 3]]}), list(blocks))
    with pytest.raises(UserError, match="run block-by-block analysis on the original model"):
        BlockRunner(out)


@pytest.mark.parametrize(("batch", "seq"), [(2, 9), (None, 9)], ids=["static-batch-and-seq", "static-seq"])
def test_a_graph_with_static_dims(tiny, tmp_path, batch, seq) -> None:
    """A graph that fixes its batch and/or sequence length (as tracing exporters write them): validation
    feeds tokens of those dims, and the result equals the torch formula and shards with 2 all-reduces a
    group."""
    static = fix_dims(tiny[0], tmp_path / "static.onnx", batch=batch, seq=seq)
    out = tmp_path / "static.fused.onnx"
    report = fuse_file(static, parse_plan(PLAN), out).report
    assert report.ok and all(g.rel_error < 1e-5 for g in report.groups)
    assert l2_relative_error(graph_logits(out, IDS), torch_logits([(0, 2)], [(4, 5)])) < 1e-4
    assert count_allreduces(out) == 5 and len(build_model_map(load_model(out)).parallel) == 1


def test_decode_graph_generates_like_its_prefill_graph(tiny, tmp_path) -> None:
    plan = parse_plan({"parallel_blocks": [[1, 3]]})
    prefill, decode = tmp_path / "prefill.onnx", tmp_path / "decode.onnx"
    fuse_file(tiny[0], plan, prefill)
    report = fuse_file(tiny[1], plan, decode).report
    assert report.ok and report.groups[0].rel_error < 1e-5
    source = onnx.load(str(tiny[1]), load_external_data=False)
    rewritten = onnx.load(str(decode), load_external_data=False)
    # One KV cache per attention block, as a generator expects: inputs and outputs unchanged.
    assert [v.name for v in rewritten.graph.input] == [v.name for v in source.graph.input]
    assert [v.name for v in rewritten.graph.output] == [v.name for v in source.graph.output]
    prompt = [5, 17, 3, 42, 8]
    cached = greedy_generate(DecodeModel.open(decode), [prompt], 8).tokens
    rerun = greedy_generate(DecodeModel.open(prefill), [prompt], 8).tokens
    original = greedy_generate(DecodeModel.open(tiny[1]), [prompt], 8).tokens
    assert cached == rerun
    ids = np.array([prompt + cached[0][:-1]])
    expected = torch_logits([(1, 3)], ids=ids)[0, len(prompt) - 1 :].argmax(-1).tolist()
    assert cached[0] == expected
    print("original tokens", original, "parallel", cached)


REFUSALS = [
    ({"parallel_blocks": [[1, 1]]}, "parallel group [1, 1] has a single block"),
    ({"parallel_blocks": [[0, 2], [2, 3]]}, "parallel group [2, 3] overlaps parallel group [0, 2]"),
    ({"groups": [[4, 5]], "parallel_blocks": [[2, 4]]}, "parallel group [2, 4] overlaps FFN group [4, 5]"),
    ({"parallel_blocks": [[3, 6]]}, "parallel group [3, 6] is out of range: the model has blocks 0..5"),
    ({"parallel_blocks": [[2, 4]]}, "parallel group [2, 4]: block 4 (layer model.layers.4) has no attention"),
]


@pytest.mark.parametrize(("plan", "message"), REFUSALS)
def test_tool_refuses_in_one_line(tool, tiny, tmp_path, plan, message) -> None:
    path = tmp_path / "plan.json"
    path.write_text(json.dumps(plan))
    out = tmp_path / "out.onnx"
    result = tool("fuse_onnx", tiny[0], path, "-o", out)
    lines = result.stderr.strip().splitlines()
    assert result.returncode == 2 and not out.exists(), result.stderr
    assert len(lines) == 1 and lines[0].startswith("error: ") and message in lines[0], lines


def test_validate_plan_refuses_before_touching(tiny) -> None:
    blocks = find_blocks(load_model(tiny[0]))
    with pytest.raises(UserError, match=r"block 4 .*has no attention part"):
        validate_plan(parse_plan({"parallel_blocks": [[3, 4]]}), blocks)
    model = load_model(tiny[0])
    before = len(model.graph)
    with pytest.raises(UserError, match="has no attention part"):
        ParallelizeBlocks(parse_plan({"parallel_blocks": [[3, 4]]}))(model)
    assert len(model.graph) == before and PLAN_METADATA_KEY not in model.metadata_props


def test_tool_applies_and_verifies(tool, tiny, tmp_path) -> None:
    plan = tmp_path / "plan.json"
    plan.write_text(json.dumps(PLAN))
    out = tmp_path / "model.fused.onnx"
    result = tool("fuse_onnx", tiny[0], plan, "-o", out, check=True)
    assert "parallel groups: [0, 2] (3 blocks read one stream)" in result.stdout
    assert "parallel group [0, 2] vs block-sum reference (per group)" in result.stdout
    verified = tool("fuse_onnx", "--verify", tiny[0], out, check=True)
    assert verified.stdout.strip().endswith("verified")
