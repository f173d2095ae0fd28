"""tools/analyze.py as users run it: analysis.json, dependency.png and plan.json, then fusing with the plan;
a bad calibration source is a user error."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from exporters.synthetic import SyntheticSpec, build_synthetic


@pytest.fixture(scope="module")
def model(tmp_path_factory) -> Path:
    blocks = [(True, 48), (False, 64), (False, 40), (False, 56), (False, 32), (True, 32), (False, 48)]
    return build_synthetic(SyntheticSpec(blocks=blocks, seed=7), tmp_path_factory.mktemp("prop") / "m.onnx")


def test_analyze_tool_end_to_end(tool, model, tmp_path):
    out = tmp_path / "analysis"
    run = tool(
        "analyze",
        model,
        "--out",
        out,
        "--num-tokens",
        "24",
        "--window",
        "12",
        "--threshold",
        "2",
        "--max-group",
        "3",
        "--quiet",
    )
    assert run.returncode == 0, run.stderr
    assert "group [1, 3]: 3 FFNs" in run.stdout and "block 4 is the run's final FFN" in run.stdout
    assert "analysis: 7 blocks, 24 tokens, 28 block evaluations in" in run.stdout
    report = json.loads((out / "analysis.json").read_text())
    assert [b["index"] for b in report["blocks"]] == list(range(7))
    assert set(report["blocks"][0]) == {
        "index",
        "attention",
        "ffn_width",
        "io_cosine_distance",
        "residual_norm_ratio",
    }
    assert report["dependency"][3][2] is None and report["dependency"][2][3] > 0
    assert set(report["norm_errors"]) == {"last", "fold"}
    plan = json.loads((out / "plan.json").read_text())
    errors = {m: e["logits_rel_error"] for m, e in report["norm_errors"].items()}
    assert plan == {"groups": [[1, 3]], "norm": min(errors, key=errors.get)}
    assert (out / "dependency.png").stat().st_size > 10_000
    assert sorted(p.name for p in out.iterdir()) == ["analysis.json", "dependency.png", "plan.json"]
    fused = tool("fuse_onnx", model, out / "plan.json", "-o", tmp_path / "f.onnx")
    assert fused.returncode == 0, fused.stderr
    assert "blocks: 7 -> 5" in fused.stdout


def test_analyze_tool_user_errors(tool, model, tmp_path):
    run = tool("analyze", model, "--out", tmp_path, "--text", "/nonexistent.txt")
    assert run.returncode == 2
    assert run.stderr.strip() == "error: text file /nonexistent.txt does not exist"
