"""tools/analyze.py --parallel-blocks (paper section 6) as users run it: on a tiny unpruned project export
(the greedy choice, the quality table as groups are added, plan.json accepted by fuse_onnx.py), on a graph
Optimum wrote (FFN groups and parallel groups in one plan), and its one-line refusals."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from exporters.spec import BlockSpec, ModelSpec
from exporters.synthetic import SyntheticSpec, build_synthetic
from runtime.analyze import MAX_REFUSED
from tests.artifacts import spec_export

FAST = ["--num-tokens", "24", "--window", "12", "--eval-tokens", "96", "--quiet"]


@pytest.fixture(scope="module")
def unpruned(tmp_path_factory) -> Path:
    """Nine full blocks (attention and SwiGLU), as an unpruned Llama is."""
    blocks = [BlockSpec(True, 48) for _ in range(9)]
    spec = ModelSpec(hidden=32, heads=4, kv_heads=2, vocab=96, tie_embeddings=False, blocks=blocks)
    path = tmp_path_factory.mktemp("unpruned") / "m.onnx"
    spec_export(spec, path, seed=3)
    return path


def greedy(candidates: list[dict]) -> list[list[int]]:
    """The paper's greedy walk over the ranked candidates, written out again."""
    taken: list[list[int]] = []
    for c in candidates:
        if all(c["group"][1] < i or j < c["group"][0] for i, j in taken):
            taken.append(c["group"])
    return taken


def test_parallel_blocks_on_an_unpruned_model(tool, unpruned, tmp_path) -> None:
    out = tmp_path / "analysis"
    # Any KL allowed: random weights; the paper's greedy choice is what this test checks.
    run = tool("analyze", unpruned, "--out", out, "--parallel-blocks", "--parallel-count", "1",
               "--parallel-max-kl", "1000", *FAST)
    assert run.returncode == 0, run.stderr
    section = json.loads((out / "analysis.json").read_text())["parallel_blocks"]
    candidates, rows = section["candidates"], section["rows"]
    # Default windows of 4 full blocks: [0, 3] .. [5, 8], ranked by (max, sum) inside.
    assert sorted(c["group"] for c in candidates) == [[i, i + 3] for i in range(6)]
    assert [(c["max"], c["sum"]) for c in candidates] == sorted((c["max"], c["sum"]) for c in candidates)
    chosen = [c["group"] for c in section["chosen"]]
    assert chosen == greedy(candidates) and 1 <= len(chosen) <= 2
    plan = json.loads((out / "plan.json").read_text())
    assert plan == {"groups": [], "norm": "last", "parallel_blocks": chosen[:1]}
    # Row 0 is the original (unpruned, no FFN groups); each row adds the next chosen group.
    assert len(rows) == 1 + len(chosen)
    assert [r["parallel"] for r in rows] == [chosen[:k] for k in range(len(rows))]
    assert rows[0]["kl"] == 0 and rows[0]["top1_agreement"] == 1 and rows[0]["added_max_dependency"] is None
    assert rows[0]["perplexity"] == section["ppl_original"]
    assert all(r["kl"] > 0 for r in rows[1:])
    # 2 all-reduces per block; a parallel group of 4 needs 2 instead of 8, and is 1 step instead of 4.
    counts = [(r["allreduces"], r["steps"]) for r in rows]
    assert counts == [(18 - 6 * k, 9 - 3 * k) for k in range(len(rows))]
    assert section["texts"] == {"random": ["random token ids (seed 1; no tokenizer for vocab 96)"]}
    assert "row  parallel group added" in run.stdout and f"+ [{chosen[0][0]}, {chosen[0][1]}]" in run.stdout
    assert sorted(p.name for p in out.iterdir()) == ["analysis.json", "dependency.png", "plan.json"]
    fused = tool("fuse_onnx", unpruned, out / "plan.json", "-o", tmp_path / "p.onnx")
    assert fused.returncode == 0, fused.stderr
    assert "parallel" in fused.stdout and (tmp_path / "p.onnx").is_file()


@pytest.mark.slow  # 1-2 minutes: the real SmolLM2's 465 block evaluations and four fused variants
def test_parallel_blocks_on_an_optimum_export(tool, third_party_corpus, tmp_path) -> None:
    """SmolLM2 as Optimum exports it, attention dropped from blocks 13-22 (full blocks 0-12 and 23-29): the
    FFN groups proposed in 13-22 stay in every row, and the parallel groups of 2 lie outside them."""
    out = tmp_path / "analysis"
    args = ["--block-group", "2", "--parallel-count", "1", "--norm", "last", "--num-tokens", "16"]
    args += ["--window", "16", "--eval-tokens", "32", "--parallel-max-kl", "1000", "--quiet"]
    run = tool("analyze", third_party_corpus["optimum"], "--out", out, "--parallel-blocks", *args)
    assert run.returncode == 0, run.stderr
    report = json.loads((out / "analysis.json").read_text())
    section, ffn_groups = report["parallel_blocks"], report["plan"]["groups"]
    assert ffn_groups and all(13 <= i < j <= 22 for i, j in ffn_groups)
    assert all(c["group"][1] <= 12 or c["group"][0] >= 23 for c in section["candidates"])
    assert len(section["candidates"]) == 12 + 6  # [0, 1] .. [11, 12] and [23, 24] .. [28, 29]
    chosen = [c["group"] for c in section["chosen"]]
    assert chosen == greedy(section["candidates"]) and len(section["rows"]) == 4
    assert report["plan"]["parallel_blocks"] == chosen[:1]
    assert section["texts"].keys() == {"prose", "code"}
    # 20 attention and 30 FFN all-reduces, less one per FFN fused away, less 2 per parallel group of 2.
    fused_away = sum(j - i for i, j in ffn_groups)
    assert [r["allreduces"] for r in section["rows"]] == [50 - fused_away - 2 * k for k in range(4)]
    assert [r["steps"] for r in section["rows"]] == [30 - fused_away - k for k in range(4)]
    assert section["rows"][0]["kl"] > 0  # the FFN groups alone already change the model
    fused = tool("fuse_onnx", third_party_corpus["optimum"], out / "plan.json", "-o", tmp_path / "f.onnx")
    assert fused.returncode == 0, fused.stderr


def test_groups_raising_the_kl_too_much_are_refused(tool, unpruned, tmp_path) -> None:
    """--parallel-max-kl 0 refuses every group (each changes the model): MAX_REFUSED candidates are tried in
    the paper's order, overlapping ones included (a refused group leaves its blocks free), and the plan
    takes none."""
    out = tmp_path / "analysis"
    run = tool("analyze", unpruned, "--out", out, "--parallel-blocks", "--parallel-max-kl", "0", *FAST)
    assert run.returncode == 0, run.stderr
    section = json.loads((out / "analysis.json").read_text())["parallel_blocks"]
    rows = section["rows"]
    assert len(rows) == 1 + MAX_REFUSED and not any(r["accepted"] for r in rows[1:])
    assert [r["parallel"] for r in rows[1:]] == [[c["group"]] for c in section["candidates"][:MAX_REFUSED]]
    assert section["accepted"] == section["plan"] == []
    assert "parallel_blocks" not in json.loads((out / "plan.json").read_text())
    assert run.stdout.count("refused: KL rises > 0") == MAX_REFUSED


@pytest.mark.parametrize(
    ("flags", "message"),
    [
        (["--block-group", "1"], "error: --block-group 1: a parallel group holds at least 2 blocks"),
        (["--parallel-count", "0"], "error: --parallel-count 0: the plan takes at least 1 parallel group"),
        (["--block-group", "10"], "no 10 consecutive full blocks (softmax attention and a SwiGLU FFN)"),
        (["--parallel-max-kl", "-1"], "error: --parallel-max-kl -1.0: a KL bound is 0 or more nats"),
    ],
)
def test_parallel_blocks_refusals(tool, unpruned, tmp_path, flags, message) -> None:
    out = tmp_path / "analysis"
    run = tool("analyze", unpruned, "--out", out, "--parallel-blocks", *flags, *FAST)
    assert run.returncode == 2 and run.stderr.count("\n") == 1 and run.stderr.startswith("error:")
    assert message in run.stderr and not out.exists()


def test_a_pruned_model_without_full_windows_is_refused(tool, tmp_path) -> None:
    blocks = [(True, 48), (False, 64), (True, 40), (False, 56)]  # no two full blocks in a row
    model = build_synthetic(SyntheticSpec(blocks=blocks, seed=7), tmp_path / "m.onnx")
    run = tool("analyze", model, "--out", tmp_path / "a", "--parallel-blocks", "--block-group", "2", *FAST)
    assert run.returncode == 2 and "no 2 consecutive full blocks" in run.stderr
    assert not (tmp_path / "a").exists()
