"""A Puzzle checkpoint with every Nemotron-NAS layer kind (exporters.hf.synthetic.ALL_KINDS_BLOCKS: variable
GQA, no-op and Linear attention, no-op and Linear FFN, a layer with neither part) down the whole user's path
with the tools, as `make demo` takes SmolLM2: export (prefill and decode) -> show-blocks -> analyze -> fuse
-> evaluate -> heal (and the decode graph takes the healed weights) -> FP8 engine -> shard TP 2 -> serve one
request from the healed decode graph and from its TP 2 ranks, both the greedy tokens of the healed prefill
graph."""

from __future__ import annotations

import json
import re

import numpy as np
import openai
import pytest

from exporters.hf.synthetic import write_all_kinds
from tests import serve_fixtures as sf
from tests.runtime.serve.clients import start_cli
from tests.tools.test_heal_deploy import SHAPES, greedy_by_rerun

VOCAB = 96
PROMPT = [17, 41, 8, 60, 22, 9]
STEPS = 6


@pytest.fixture(scope="module")
def path(tmp_path_factory, tool) -> dict:
    """Every artifact of the path, made once: {name: Path}."""
    work = tmp_path_factory.mktemp("puzzle_path")
    ckpt = write_all_kinds(work / "ckpt", seed=7, vocab=VOCAB)
    sf.save_tokenizer(ckpt, VOCAB)
    (ckpt / "generation_config.json").write_text(json.dumps({"eos_token_id": sf.EOS}))
    p = {"prefill": work / "prefill" / "model.onnx", "decode": work / "decode" / "model.onnx"}
    tool("export_model", "--hf", ckpt, "--dtype", "float32", "-o", p["prefill"], check=True)
    tool("export_model", "--hf", ckpt, "--dtype", "float32", "--decode", "-o", p["decode"], check=True)
    ids = work / "ids.npy"
    np.save(ids, np.random.default_rng(1).integers(4, VOCAB, size=(1, 2048)))
    analysis = work / "analysis"
    # any dependency allowed (random weights): the proposal is the attention-free run less its final FFN
    tool("analyze", p["prefill"], "--tokens", ids, "--window", 64, "--num-tokens", 512, "--threshold", 100,
         "--out", analysis, check=True)
    p["plan"] = analysis / "plan.json"
    return fuse_and_heal(p, ids, work / "served", tool)


def fuse_and_heal(p: dict, ids, served, tool) -> dict:
    """The rest of the path from p["plan"]: both graphs fused, the prefill graph healed, and `served` (the
    folder a user serves: the healed decode graph as model.onnx, the tokenizer files) filled by heal.py
    --weights-from. Adds the paths to `p` and returns it."""
    for graph in ("prefill", "decode"):
        p[f"{graph}_fused"] = p[graph].with_name("model.fused.onnx")
        tool("fuse_onnx", p[graph], p["plan"], "-o", p[f"{graph}_fused"], check=True)
    common = ["--calib", ids, "--heldout", ids, "--window", 64, "--steps", 4, "--eval-tokens", 0]
    p["prefill_healed"] = p["prefill"].with_name("model.healed.onnx")
    tool("heal", p["prefill"], p["prefill_fused"], *common, "-o", p["prefill_healed"], check=True)
    served.mkdir()
    for name in ("tokenizer.json", "tokenizer_config.json", "config.json", "generation_config.json"):
        (served / name).write_bytes((p["decode"].parent / name).read_bytes())
    p["decode_healed"] = served / "model.onnx"
    tool("heal", p["decode"], p["decode_fused"], "--weights-from", p["prefill_healed"], *common,
         "-o", p["decode_healed"], check=True)
    p["ids"] = ids
    return p


def test_blocks_plan_and_evaluation(path, tool) -> None:
    for graph in ("prefill", "decode"):  # one block table for both graphs: every layer, both parts
        table = tool("fuse_onnx", path[graph], "--show-blocks", "--json", check=True).stdout
        rows = json.loads(table)["blocks"]
        assert [r["ffn"] for r in rows] == ["swiglu", "swiglu", "none", "swiglu", "swiglu", "none", "swiglu",
                                            "swiglu", "linear", "swiglu", "swiglu"], graph
        assert [r["kv_heads"] for r in rows if r["attention"]] == [2, 1, 4], graph
    assert json.loads(path["plan"].read_text())["groups"] == [[1, 3]]  # across the identity layer 2
    result = tool("evaluate", path["prefill"], path["prefill_fused"], "--tokens", path["ids"], "--max-tokens",
                  512, "--window", 64, "--json", check=True)
    (row,) = json.loads(result.stdout)["results"]
    assert row["kl"] > 0 and 0 < row["top1_agreement"] <= 1


def test_fp8_engine_and_tp2_shards(path, tool, tmp_path) -> None:
    rows = tmp_path / "rows.npy"
    np.save(rows, np.load(path["ids"])[0, :512].reshape(8, 64))
    out = tmp_path / "engines"
    tool("build_engines", path["decode_healed"], "--fp8", "--calib", rows, *SHAPES, "--out", out, check=True)
    assert (out / "model_fp8.engine").stat().st_size > 0
    count = tool("shard_tp", path["decode"], path["decode_healed"], "--count", check=True).stdout
    before, after = (int(re.search(r": (\d+) all-reduces", line)[1]) for line in count.splitlines()[:2])
    removed = int(re.search(r"fused: 1 group\(s\), (\d+) FFN all-reduce\(s\) removed", count)[1])
    # [1, 3] fuses the FFNs of blocks 1 and 3 (block 2 is an identity layer): one all-reduce fewer
    assert before - after == removed == 1, count


def test_healed_decode_graph_and_its_tp2_ranks_serve_the_prefill_tokens(path, tool) -> None:
    serve_healed_and_tp2(path, tool, PROMPT, STEPS)


def serve_healed_and_tp2(path: dict, tool, prompt: list[int], steps: int) -> None:
    """The healed decode graph and its TP 2 ranks, each served by tools/serve.py, answer the openai client
    with the greedy tokens of the healed prefill graph (re-run at every step, no cache)."""
    expected = greedy_by_rerun(path["prefill_healed"], prompt, steps)
    generated = [t for t in expected if t != sf.EOS]
    served = path["decode_healed"].parent
    tp2 = served.parent / "tp2"
    tool("shard_tp", path["decode_healed"], "--tp", 2, "--out", tp2, check=True)
    for target in (served, tp2):
        process, url, _ = start_cli(str(target), "--model-name", "path", "--log-level", "warning")
        try:
            api = openai.OpenAI(base_url=url + "/v1", api_key="none", max_retries=0, timeout=60)
            reply = api.completions.create(model="path", prompt=prompt, max_tokens=steps, temperature=0)
        finally:
            process.terminate()
            process.wait(timeout=60)
        assert reply.choices[0].text.split()[: len(generated)] == sf.words(generated).split(), target
