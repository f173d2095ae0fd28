"""tools/prune_attention.py: bad input (one `error:` line, exit 2, nothing written, input untouched), and a
pruned tiny Llama down the whole user's path as tests/tools/test_puzzle_path.py takes a Puzzle checkpoint:
export (prefill and decode) -> analyze -> fuse -> heal (the decode graph takes the healed weights) -> FP8
engine -> TP 2 shards -> serve from the healed decode graph and its TP 2 ranks."""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

import numpy as np
import pytest

from tests import serve_fixtures as sf
from tests.runtime.prune.fixtures import VOCAB, write_tiny_llama, write_tiny_nemotron
from tests.tools.test_heal_deploy import SHAPES
from tests.tools.test_puzzle_path import PROMPT, STEPS, fuse_and_heal, serve_healed_and_tp2

REMOVED = "2-4"


def digest(folder: Path) -> str:
    h = hashlib.sha256()
    for path in sorted(folder.rglob("*")):
        if path.is_file():
            h.update(path.name.encode() + path.read_bytes())
    return h.hexdigest()


@pytest.fixture(scope="module")
def sources(tmp_path_factory) -> dict[str, Path]:
    work = tmp_path_factory.mktemp("prune_sources")
    llama = write_tiny_llama(work / "llama")
    sf.save_tokenizer(llama, VOCAB)
    (llama / "generation_config.json").write_text(json.dumps({"eos_token_id": sf.EOS}))
    ids = work / "ids.npy"
    np.save(ids, np.random.default_rng(1).integers(4, VOCAB, size=(1, 2048)))
    gpt2 = work / "gpt2"
    gpt2.mkdir()
    gpt2_config = {"architectures": ["GPT2LMHeadModel"], "model_type": "gpt2"}
    (gpt2 / "config.json").write_text(json.dumps(gpt2_config))
    return {"llama": llama, "nemotron": write_tiny_nemotron(work / "nemotron"), "gpt2": gpt2, "ids": ids}


@pytest.mark.parametrize(
    ("source", "args", "message"),
    [
        ("llama", ["--layers", "4-6"], "layer 6 is out of range: the model has layers 0-5"),
        ("nemotron", ["--layers", "1-2"], "layer 2 already has no attention"),
        ("llama", ["--layers", "0-5"], "would remove every attention layer"),
        ("llama", ["--remove", "6"], "would remove every attention layer"),
        ("gpt2", ["--layers", "1"], "'GPT2LMHeadModel', which this exporter does not know"),
        ("llama", ["--layers", "1-x"], "expected numbers and ranges"),
        ("llama", [], "nothing to do"),
    ],
)
def test_bad_input(sources, tool, tmp_path, source, args, message) -> None:
    before = digest(sources[source])
    out = tmp_path / "out"
    result = tool("prune_attention", sources[source], *args, "-o", out)
    assert result.returncode == 2, result.stderr
    assert result.stderr.splitlines() == [result.stderr.strip()] and result.stderr.startswith("error: ")
    assert message in result.stderr
    assert not out.exists() and list(tmp_path.iterdir()) == []
    assert digest(sources[source]) == before


def test_existing_output_is_refused(sources, tool, tmp_path) -> None:
    out = tmp_path / "out"
    out.mkdir()
    result = tool("prune_attention", sources["llama"], "--layers", "2", "-o", out)
    assert result.returncode == 2 and "exists" in result.stderr and list(out.iterdir()) == []


@pytest.fixture(scope="module")
def path(sources, tmp_path_factory, tool) -> dict:
    work = tmp_path_factory.mktemp("prune_path")
    ids = sources["ids"]
    pruned = work / "pruned"
    data = ["--calib", ids, "--heldout", ids, "--window", 64, "--tokens", 1024, "--eval-tokens", 256]
    result = tool("prune_attention", sources["llama"], "--layers", REMOVED, *data, "--json", "-o", pruned,
                  check=True)
    record = json.loads(result.stdout[result.stdout.index("{"):])
    p = {"pruned": pruned, "record": record, "prefill": work / "prefill" / "model.onnx",
         "decode": work / "decode" / "model.onnx"}
    tool("export_model", "--hf", pruned, "-o", p["prefill"], check=True)
    tool("export_model", "--hf", pruned, "--decode", "-o", p["decode"], check=True)
    analysis = work / "analysis"
    tool("analyze", p["prefill"], "--tokens", ids, "--window", 64, "--num-tokens", 512, "--threshold", 100,
         "--out", analysis, check=True)
    p["plan"] = analysis / "plan.json"
    return fuse_and_heal(p, ids, work / "served", tool)


@pytest.mark.slow
def test_pruned_checkpoint_and_report(path) -> None:
    config = json.loads((path["pruned"] / "config.json").read_text())
    no_op = [b["attention"]["no_op"] for b in config["block_configs"]]
    assert no_op == [False, False, True, True, True, False]
    assert all((path["pruned"] / n).is_file() for n in ("tokenizer.json", "generation_config.json"))
    record = path["record"]
    assert record["removed_attention"] == [2, 3, 4] and len(record["fits"]) == 3
    quality = {row["name"]: row for row in record["quality"]}
    assert quality["distilled"]["kl"] < quality["surgery"]["kl"]


@pytest.mark.slow
def test_blocks_plan_fp8_and_tp(path, tool, tmp_path) -> None:
    for graph in ("prefill", "decode"):
        table = tool("fuse_onnx", path[graph], "--show-blocks", "--json", check=True).stdout
        rows = json.loads(table)["blocks"]
        assert [r["attention"] for r in rows] == [True, True, False, False, False, True], graph
    assert json.loads(path["plan"].read_text())["groups"] == [[2, 3]]  # the run 2-4 less its final FFN
    rows = tmp_path / "rows.npy"
    np.save(rows, np.load(path["ids"])[0, :512].reshape(8, 64))
    out = tmp_path / "engines"
    tool("build_engines", path["decode_healed"], "--fp8", "--calib", rows, *SHAPES, "--out", out, check=True)
    assert (out / "model_fp8.engine").stat().st_size > 0


@pytest.mark.slow
def test_served_healed_decode_graph_and_tp2(path, tool) -> None:
    serve_healed_and_tp2(path, tool, PROMPT, STEPS)
