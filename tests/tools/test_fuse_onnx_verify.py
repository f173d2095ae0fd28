"""`fuse_onnx.py --verify original.onnx fused.onnx`, exactly as README and --help show it (issue 9)."""

from __future__ import annotations

import json

from exporters.synthetic import SyntheticSpec, build_synthetic

SPEC = SyntheticSpec(blocks=[(True, 16), (False, 24), (False, 16), (False, 8)])


def test_verify_as_readme_writes_it(tool, tmp_path):
    model = build_synthetic(SPEC, tmp_path / "model.onnx")
    plan = tmp_path / "plan.json"
    plan.write_text(json.dumps({"groups": [[1, 3]], "norm": "last"}))
    tool("fuse_onnx", model, plan, check=True)
    fused = tmp_path / "model.fused.onnx"
    result = tool("fuse_onnx", "--verify", model, fused)
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip().endswith("verified")
    as_json = json.loads(tool("fuse_onnx", "--verify", model, fused, "--json", check=True).stdout)
    assert as_json["ok"] and as_json["plan"]["groups"] == [[1, 3]]


def test_verify_needs_two_models(tool, tmp_path):
    model = build_synthetic(SPEC, tmp_path / "model.onnx")
    result = tool("fuse_onnx", "--verify", model)
    assert result.returncode == 2 and "--verify needs two models" in result.stderr
    missing = tool("fuse_onnx", "--verify", model, tmp_path / "nope.onnx")
    assert missing.returncode == 2
    assert missing.stderr.strip() == f"error: model {tmp_path / 'nope.onnx'} does not exist"
