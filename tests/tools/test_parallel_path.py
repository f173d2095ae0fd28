"""Full-block parallelization (paper section 6) down the whole user's path with the tools, on a Puzzle-style
checkpoint whose first four layers are full blocks of three different KV-head counts, then three
attention-free layers and two more full blocks: export (prefill and decode) -> analyze --parallel-blocks
(one 4-block parallel group beside the FFN group) -> fuse -> show-blocks -> evaluate -> heal (and the decode
graph takes the healed weights) -> FP8 engine (sm89) -> shard TP 2 (2 all-reduces per group) -> serve from
the healed decode graph and from its TP 2 ranks, both the greedy tokens of the healed prefill graph."""

from __future__ import annotations

import json

import numpy as np
import pytest

from exporters.hf.synthetic import deci_block, nemotron_config, write_nemotron
from passes.io.model_io import load_model
from passes.model_map import walk_stream
from tests import fp8_fixtures as fx
from tests import serve_fixtures as sf
from tests.tools.test_heal_deploy import SHAPES
from tests.tools.test_puzzle_path import fuse_and_heal, serve_healed_and_tp2

VOCAB = 96
# Layers 0-3 full (KV heads 2, 4, 1, 2), 4-6 attention-free (Puzzle no_op attention), 7-8 full.
BLOCKS = [deci_block(2, 1.0), deci_block(1, 1.0), deci_block(4, 1.0), deci_block(2, 1.0),
          deci_block("no_op", 1.0), deci_block("no_op", 2.0), deci_block("no_op", 1.0),
          deci_block(1, 1.0), deci_block(2, 1.0)]
PROMPT = [17, 41, 8, 60, 22, 9]
STEPS = 6


@pytest.fixture(scope="module")
def path(tmp_path_factory, tool) -> dict:
    """Every artifact of the path, made once: {name: Path}."""
    work = tmp_path_factory.mktemp("parallel_path")
    config = nemotron_config(BLOCKS, hidden=64, heads=4, vocab=VOCAB)
    ckpt = write_nemotron(work / "ckpt", config, shards=2, seed=3)
    sf.save_tokenizer(ckpt, VOCAB)
    (ckpt / "generation_config.json").write_text(json.dumps({"eos_token_id": sf.EOS}))
    p = {"prefill": work / "prefill" / "model.onnx", "decode": work / "decode" / "model.onnx"}
    tool("export_model", "--hf", ckpt, "--dtype", "float32", "-o", p["prefill"], check=True)
    tool("export_model", "--hf", ckpt, "--dtype", "float32", "--decode", "-o", p["decode"], check=True)
    ids = work / "ids.npy"
    np.save(ids, np.random.default_rng(1).integers(4, VOCAB, size=(1, 2048)))
    analysis = work / "analysis"
    # any dependency and KL allowed (random weights)
    tool("analyze", p["prefill"], "--tokens", ids, "--window", 64, "--num-tokens", 512, "--threshold", 100,
         "--parallel-blocks", "--parallel-count", 1, "--parallel-max-kl", 1000, "--eval-tokens", 256,
         "--out", analysis, check=True)
    p["analysis"] = analysis
    p["plan"] = analysis / "plan.json"
    return fuse_and_heal(p, ids, work / "served", tool)


def test_plan_blocks_and_evaluation(path, tool) -> None:
    plan = json.loads(path["plan"].read_text())
    assert plan["parallel_blocks"] == [[0, 3]] and plan["groups"] == [[4, 5]]
    report = json.loads((path["analysis"] / "analysis.json").read_text())["parallel_blocks"]
    assert [c["group"] for c in report["chosen"]] == report["plan"] == [[0, 3]]
    for graph in ("prefill_fused", "decode_fused", "decode_healed"):
        table = tool("fuse_onnx", path[graph], "--show-blocks", "--json", check=True).stdout
        rows = json.loads(table)["blocks"]
        assert [r["parallel"] for r in rows[:5]] == [[0, 3]] * 4 + [None], graph
        assert [r["kv_heads"] for r in rows[:4]] == [2, 4, 1, 2], graph
    result = tool("evaluate", path["prefill"], path["prefill_fused"], "--tokens", path["ids"], "--max-tokens",
                  512, "--window", 64, "--json", check=True)
    (row,) = json.loads(result.stdout)["results"]
    assert row["kl"] > 0 and 0 < row["top1_agreement"] <= 1


def test_fp8_engine_of_the_parallel_graph(path, tool, tmp_path) -> None:
    rows = tmp_path / "rows.npy"
    np.save(rows, np.load(path["ids"])[0, :512].reshape(8, 64))
    out = tmp_path / "engines"
    tool("build_engines", path["prefill_fused"], "--fp8", "--calib", rows, *SHAPES, "--out", out, check=True)
    assert (out / "model.fused_fp8.engine").stat().st_size > 0
    quantized = out / "model.fused_fp8.onnx"
    # The group survives Q/DQ insertion: the stream walk (the sharder's) reads it, its FFNs Q/DQ branches.
    (group,) = walk_stream(load_model(quantized)).parallel
    assert group.size == 4 and {b.kind for b in group.ffns} == {"other"}
    ids = np.load(path["ids"])[:, :48]
    fp32 = fx.run_logits(path["prefill_fused"], ids)
    rel, mean_cos, _ = fx.logits_metrics(fx.run_logits(quantized, ids), fp32)
    assert 1e-4 < rel < 0.1 and mean_cos > 0.99  # it ran in FP8, close to the fp32 parallel graph


def test_tp2_counts_two_all_reduces_per_group(path, tool) -> None:
    count = tool("shard_tp", path["decode"], path["decode_fused"], "--count", check=True).stdout
    # 6 attention parts + 9 FFNs = 15 all-reduces; the FFN group [4, 5] saves 1, the parallel group 8 - 2.
    original, fused = count.splitlines()
    assert original.endswith(": 15 all-reduces per forward pass"), count
    assert ": 8 all-reduces per forward pass" in fused and "6 removed" in fused, count


def test_healed_decode_graph_and_its_tp2_ranks_serve_the_prefill_tokens(path, tool) -> None:
    serve_healed_and_tp2(path, tool, PROMPT, STEPS)
