"""Sharding parallel groups of blocks (passes/parallel.py, paper section 6): two all-reduces per group, one
of the members' stacked attention outputs (Concat -> all_reduce -> Split) and one of the sum of their FFN
outputs, instead of two per member block. The tiny project model with tests/passes/test_parallel.py's PLAN
(parallel group [0, 2], FFN group [4, 5]) runs in one process here (runtime.tp.ort.run_simulated);
tests/runtime/tp/test_parallel_groups.py runs it over gloo. Slow: a third-party export from the corpus
(Optimum, GenAI fp32) with one parallel group and the real SmolLM2-135M with two, over gloo at TP 2."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import onnx
import onnx_ir as ir
import pytest

from passes.error_measures import max_abs_relative_error
from passes.io.model_io import load_model
from passes.model_map import build_model_map
from passes.pipeline import fuse_file
from passes.plan import parse_plan
from passes.shard import ShardRank, count_allreduces, shard_file
from passes.shard.collectives import collective_op, collectives
from runtime.tp.ort import run_simulated
from tests.artifacts import artifact, spec_export
from tests.corpora.fixtures import third_party_corpus  # noqa: F401
from tests.passes.shard.test_corpus import IDS as CORPUS_IDS
from tests.passes.shard.test_corpus import _torchrun
from tests.passes.shard.test_corpus import single_device as corpus_single_device
from tests.passes.test_parallel import IDS, PLAN, SEED, spec
from tests.run_graph import graph_logits

TOLERANCE = 1e-5
# 4 full blocks and the fused FFN group [4, 5] are 9 branches; the parallel group [0, 2] needs 2, not 6.
ALLREDUCES = {"original": 10, "fused": 9, "parallel": 5}


def parallel_models() -> dict[str, Path]:
    """The tiny prefill and decode graphs, both with PLAN applied, and the decode graph with PLAN's FFN group
    only, built once (tests/artifacts.py; this file, tests/runtime/tp/test_parallel_groups.py and
    tests/tools/test_bench.py read them)."""
    folder = artifact("parallel_tp", _build_parallel_models)
    return {name: folder / f"{name}.onnx" for name in PARALLEL_MODELS}


PARALLEL_MODELS = ("prefill", "decode", "prefill_plan", "decode_plan", "decode_fused")


def _build_parallel_models(folder: Path) -> None:
    paths = {name: folder / f"{name}.onnx" for name in PARALLEL_MODELS}
    spec_export(spec(), paths["prefill"], seed=SEED)
    spec_export(spec(), paths["decode"], seed=SEED, decode=True)
    for graph in ("prefill", "decode"):
        fuse_file(paths[graph], parse_plan(PLAN), paths[f"{graph}_plan"])
    fuse_file(paths["decode"], parse_plan({"groups": PLAN["groups"]}), paths["decode_fused"])


@pytest.fixture(scope="session")
def parallel_tiny() -> dict[str, Path]:
    return parallel_models()


def test_counts_two_allreduces_per_group(parallel_tiny) -> None:
    assert count_allreduces(parallel_tiny["prefill"]) == ALLREDUCES["original"]
    assert count_allreduces(parallel_tiny["prefill_plan"]) == ALLREDUCES["parallel"]
    assert count_allreduces(parallel_tiny["decode_plan"]) == ALLREDUCES["parallel"]


@pytest.mark.parametrize("graph", ["prefill_plan", "decode_plan"])
def test_rank_graph_reduces_each_group_twice(parallel_tiny, graph: str) -> None:
    model = load_model(parallel_tiny[graph])
    (group,) = build_model_map(model).parallel
    o_proj = [b.projection for b in group.attention]
    down = [b.projection for b in group.ffns]
    shard = ShardRank(4, 1)
    shard(model)  # ensures: 5 all-reduces, each reading a projection, a group's Concat or its FFN sum
    reduces = [n for n in collectives(model) if collective_op(n) == "all_reduce"]
    assert len(reduces) == ALLREDUCES["parallel"] == shard.info.allreduces
    read = {node.inputs[0].producer(): node for node in reduces}
    # The members' o_proj outputs stacked on the last axis, reduced once, split back into a_0, a_1, a_2.
    (stack,) = [n for n in read if n.op_type == "Concat"]
    assert [v.producer() for v in stack.inputs] == o_proj
    (split,) = [use.node for use in read[stack].outputs[0].uses()]
    assert split.op_type == "Split" and split.inputs[1].const_value.numpy().tolist() == [64, 64, 64]
    for a, part in zip(group.attention, split.outputs, strict=True):
        assert {use.node for use in part.uses()} >= {a.residual.node}  # h_k = x + reduced a_k
    # The FFN outputs f_k are not reduced alone: their sum is, once.
    assert not any(node in read for node in down)
    assert group.ffn_sum.producer() in read
    proto = ir.serde.serialize_model(model)
    onnx.checker.check_model(proto)


@pytest.mark.parametrize("tp", [2, 4, 8])
def test_prefill_ranks_equal_one_device(parallel_tiny, tmp_path: Path, tp: int) -> None:
    report = shard_file(parallel_tiny["prefill_plan"], tp, tmp_path / "tp", progress=False)
    assert report.allreduces_per_forward == ALLREDUCES["parallel"]
    expected = graph_logits(parallel_tiny["prefill_plan"], IDS)
    error = max_abs_relative_error(run_simulated(report.rank_files, IDS), expected)
    assert error <= TOLERANCE


def test_cli_names_the_groups_saving(tool, parallel_tiny, tmp_path: Path) -> None:
    count = tool("shard_tp", parallel_tiny["prefill"], parallel_tiny["prefill_plan"], "--count", check=True)
    lines = count.stdout.strip().splitlines()
    assert lines[0].endswith("prefill.onnx: 10 all-reduces per forward pass")
    assert lines[1].endswith(
        "prefill_plan.onnx: 5 all-reduces per forward pass (fused: 1 group(s), 1 FFN all-reduce(s) removed; "
        "parallel blocks [0, 2]: 2 all-reduces per group, 4 removed)"
    )
    run = tool("shard_tp", parallel_tiny["prefill_plan"], "--tp", "2", "--out", tmp_path / "tp2", check=True)
    expected = (
        "all-reduces per forward: 5 (1 attention + 2 FFN + 1 x 2 in parallel groups of 3 blocks, 4 saved)"
    )
    assert expected in run.stdout
    manifest = json.loads((tmp_path / "tp2" / "tp.json").read_text())
    assert manifest["allreduces_per_forward"] == 5
    assert [b["group"] for b in manifest["branches"]] == [0] * 6 + [None] * 3


# ----------------------------------------------------------------------------- real models (slow)


def _over_gloo(sources: dict[str, Path], tmp_path: Path, ids: np.ndarray) -> dict[str, np.ndarray]:
    """Shard each source at TP 2 and run all of them in one torchrun launch (tools/run_tp.py, gloo)."""
    np.save(tmp_path / "ids.npy", ids)
    dirs = {name: tmp_path / name for name in sources}
    for name, source in sources.items():
        shard_file(source, 2, dirs[name], progress=False)
    outs = {name: d.with_suffix(".npy") for name, d in dirs.items()}
    run = _torchrun(2, list(dirs.values()), list(outs.values()), tmp_path / "ids.npy")
    assert run.returncode == 0, run.stdout[-2000:] + run.stderr[-4000:]
    return {name: np.load(out) for name, out in outs.items()}


@pytest.mark.slow
def test_third_party_parallel_group_tp2(third_party_corpus, tmp_path: Path) -> None:  # noqa: F811
    """Optimum (Cast copies of the stream, past_key_values inputs) and GenAI fp32 (Skip*Norm residual chain,
    GroupQueryAttention with packed QKV): one parallel group of 4 full blocks, TP 2 equals one device."""
    plan = parse_plan({"parallel_blocks": [[2, 5]]})
    sources = {}
    for name in ("optimum", "genai-fp32"):
        sources[name] = tmp_path / f"{name}.parallel.onnx"
        fuse_file(third_party_corpus[name], plan, sources[name], validate_output=False)
        assert count_allreduces(third_party_corpus[name]) == 50
        assert count_allreduces(sources[name]) == 50 - 6
    got = _over_gloo(sources, tmp_path, CORPUS_IDS)
    for name, source in sources.items():
        error = max_abs_relative_error(got[name], corpus_single_device(source))
        print(f"{name} parallel [2, 5] tp=2: max rel error {error:.2e}")
        assert error <= TOLERANCE, f"{name}: {error:.2e}"
