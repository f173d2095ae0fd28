"""Full-block parallelization (paper section 6) down the whole user's path with the tools, on a Puzzle-style
checkpoint whose first four layers are full blocks of three different KV-head counts, then three
attention-free layers and two more full blocks: export (prefill and decode) -> analyze --parallel-blocks
(one 4-block parallel group beside the FFN group) -> fuse -> show-blocks -> evaluate -> heal (and the decode
graph takes the healed weights) -> FP8 engine (sm89) -> shard TP 2 (2 all-reduces per group) -> serve from
the healed decode graph and from its TP 2 ranks, both the greedy tokens of the healed prefill graph."""

from __future__ import annotations

import json

import numpy as np
import openai
import pytest

from exporters.hf.synthetic import deci_block, nemotron_config, write_nemotron
from passes.io.model_io import load_model
from passes.model_map import walk_stream
from tests import fp8_fixtures as fx
from tests import serve_fixtures as sf
from tests.runtime.serve.clients import start_cli
from tests.tools.test_heal_deploy import SHAPES, greedy_by_rerun

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
    for graph in ("prefill", "decode"):
        p[f"{graph}_fused"] = p[graph].with_name("model.fused.onnx")
        tool("fuse_onnx", p[graph], p["plan"], "-o", p[f"{graph}_fused"], check=True)
    common = ["--calib", ids, "--heldout", ids, "--window", 64, "--steps", 4, "--eval-tokens", 0]
    p["prefill_healed"] = p["prefill"].with_name("model.healed.onnx")
    tool("heal", p["prefill"], p["prefill_fused"], *common, "-o", p["prefill_healed"], check=True)
    served = work / "served"  # the folder a user serves: the healed decode graph as model.onnx, tokenizer
    served.mkdir()
    for name in ("tokenizer.json", "tokenizer_config.json", "config.json", "generation_config.json"):
        (served / name).write_bytes((p["decode"].parent / name).read_bytes())
    p["decode_healed"] = served / "model.onnx"
    tool("heal", p["decode"], p["decode_fused"], "--weights-from", p["prefill_healed"], *common,
         "-o", p["decode_healed"], check=True)
    p["ids"] = ids
    return p


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
    expected = greedy_by_rerun(path["prefill_healed"], PROMPT, STEPS)
    served = path["decode_healed"].parent
    tp2 = served.parent / "tp2"
    tool("shard_tp", path["decode_healed"], "--tp", 2, "--out", tp2, check=True)
    for target in (served, tp2):
        process, url, _ = start_cli(str(target), "--model-name", "parallel", "--log-level", "warning")
        try:
            api = openai.OpenAI(base_url=url + "/v1", api_key="none", max_retries=0, timeout=60)
            reply = api.completions.create(model="parallel", prompt=PROMPT, max_tokens=STEPS, temperature=0)
        finally:
            process.terminate()
            process.wait(timeout=60)
        generated = [t for t in expected if t != sf.EOS]
        assert reply.choices[0].text.split()[: len(generated)] == sf.words(generated).split(), target
