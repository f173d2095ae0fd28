"""runtime/verify: each artifact kind recognized and checked against its source; tampering with a weight, a
scale or the structure fails the check that names it."""

from __future__ import annotations

import json
import xml.etree.ElementTree as ET
from pathlib import Path

import numpy as np
import pytest

from passes.errors import UserError
from passes.io.model_io import load_model
from passes.metadata import HEAL_METADATA_KEY, PLAN_METADATA_KEY
from passes.model_map import find_blocks
from passes.plan import Plan
from passes.run import block_runner
from runtime.heal.metadata import TENSOR_HASHES_KEY
from runtime.verify import VerifyOptions, artifact_kind, verify_artifact
from runtime.verify import healed as healed_check
from runtime.verify.fused import fused_group_blocks, group_tensors
from tests.runtime.verify.artifacts import parallel_artifacts, tampered, tampered_folder, with_metadata

OPTIONS = VerifyOptions(max_kl=0.5, eval_tokens=512)


def checks(report) -> dict[str, object]:
    return {c.name: c for c in report.checks}


def healed_hashes(path: Path) -> dict[str, str]:
    return json.loads(load_model(path).metadata_props[HEAL_METADATA_KEY])[TENSOR_HASHES_KEY]


def scaled(factor: float):
    return lambda array: (array.astype(np.float32) * factor).astype(array.dtype)


def test_kinds_told_from_metadata(healed, tiny):
    assert artifact_kind(healed["fused"]) == "fused"
    assert artifact_kind(healed["healed"]) == "healed"
    assert artifact_kind(tiny["fp8"]) == "fp8"
    assert artifact_kind(tiny["tp2"]) == "tp"
    assert artifact_kind(tiny["decode"]) == "decode"
    with pytest.raises(UserError, match="records no stage"):
        artifact_kind(healed["original"])


def test_fused_passes_and_a_changed_weight_outside_the_groups_is_named(healed, tmp_path):
    report = verify_artifact(healed["original"], healed["fused"], OPTIONS)
    assert report.ok and report.kind == "fused" and report.plan["groups"] == [[1, 2], [4, 6]]
    assert {"structure", "group [1, 2] exact", "group [4, 6] exact", "unchanged weights"} <= set(
        checks(report)
    )
    model = load_model(healed["fused"])
    plan = Plan(((1, 2), (4, 6)), "last")
    rewritten = group_tensors(fused_group_blocks(plan, find_blocks(model)))
    original = load_model(healed["original"]).graph.initializers
    name = next(
        n
        for n, v in model.graph.initializers.items()
        if n in original and n not in rewritten and len(v.shape) == 2
    )
    bad = verify_artifact(
        healed["original"], tampered(healed["fused"], tmp_path / "t.onnx", name, scaled(1.01))
    )
    assert not bad.ok
    [failure] = bad.failures
    assert failure.name == "unchanged weights" and repr(name) in failure.message


def test_fused_group_weight_changed_fails_exactness(healed, tmp_path):
    model = load_model(healed["fused"])
    block = fused_group_blocks(Plan(((1, 2), (4, 6)), "last"), find_blocks(model))[1]
    name = block.ffn.down.source.name
    bad = verify_artifact(
        healed["original"], tampered(healed["fused"], tmp_path / "t.onnx", name, scaled(1.01))
    )
    assert [c.name for c in bad.failures] == ["group [4, 6] exact"]


def test_healed_passes_with_every_check(healed):
    report = verify_artifact(healed["original"], healed["healed"], OPTIONS)
    assert report.ok, report.lines()
    found = checks(report)
    assert set(found) == {"structure", "healed weights", "unchanged weights", "quality vs original"}
    quality = found["quality vs original"]
    assert 0 <= quality.numbers["kl"] <= 0.5 and quality.numbers["max_kl"] == 0.5
    assert quality.numbers["tokens"] > 0 and 0 < quality.numbers["top1"] <= 1
    assert found["healed weights"].numbers["tensors"] == len(healed_hashes(healed["healed"])) > 0


def test_healed_weight_changed_by_one_percent_is_named(healed, tmp_path):
    name = sorted(healed_hashes(healed["healed"]))[0]
    bad = verify_artifact(
        healed["original"], tampered(healed["healed"], tmp_path / "t.onnx", name, scaled(1.01))
    )
    failed = {c.name: c for c in bad.failures}
    assert "healed weights" in failed and repr(name) in failed["healed weights"].message


def test_kl_bound_and_unbounded_quality(healed):
    tight = verify_artifact(
        healed["original"], healed["healed"], VerifyOptions(max_kl=1e-12, eval_tokens=512)
    )
    assert [c.name for c in tight.failures] == ["quality vs original"]
    free = verify_artifact(healed["original"], healed["healed"], VerifyOptions(eval_tokens=512))
    assert free.ok and "unbounded" in checks(free)["quality vs original"].message


def test_healed_structure_against_another_plan_fails(healed, tmp_path):
    def other_plan(plan: dict) -> dict:
        return {**plan, "groups": [[1, 2], [4, 5]]}

    edited = with_metadata(healed["healed"], tmp_path / "t.onnx", PLAN_METADATA_KEY, other_plan)
    bad = verify_artifact(healed["original"], edited, OPTIONS)
    assert [c.name for c in bad.failures] == ["structure"] and "blocks" in bad.failures[0].message


def test_healed_parallel_plan_gets_its_structure_checked(tmp_path):
    found = parallel_artifacts(tmp_path)
    report = verify_artifact(found["original"], found["healed"], VerifyOptions(eval_tokens=256))
    assert report.ok, report.lines()
    structure = checks(report)["structure"].message
    assert "fused widths [1, 2] 104" in structure
    assert "parallel groups [3, 4] (2 blocks in parallel)" in structure
    assert checks(report)["healed weights"].numbers["tensors"] == 6

    def parallel(groups):
        return lambda plan: {**plan, "parallel_blocks": groups}

    # beside the group; the group's graph numbering (the original's blocks 2-3 are another width)
    for groups, says in (([[4, 5]], "is not one group"), ([[2, 3]], "member 2 has FFN width 32")):
        edited = with_metadata(found["healed"], tmp_path / "e.onnx", PLAN_METADATA_KEY, parallel(groups))
        bad = verify_artifact(found["original"], edited, VerifyOptions(eval_tokens=256))
        assert [c.name for c in bad.failures] == ["structure"]
        assert f"parallel group {groups[0]} {says}" in bad.failures[0].message


def test_old_healed_file_without_hashes_is_refused_in_one_line(healed, tmp_path):
    def old(record: dict) -> dict:
        return {k: v for k, v in record.items() if k != TENSOR_HASHES_KEY}

    edited = with_metadata(healed["healed"], tmp_path / "old.onnx", HEAL_METADATA_KEY, old)
    with pytest.raises(UserError, match="heal it again") as caught:
        verify_artifact(healed["original"], edited, OPTIONS)
    assert "\n" not in str(caught.value)


def test_fp8_passes_and_a_tampered_scale_or_weight_is_named(tiny, tmp_path):
    report = verify_artifact(tiny["fused"], tiny["fp8"], OPTIONS)
    assert report.ok, report.lines()
    assert {"weight scales", "float8 weights", "unchanged weights", "logits vs source"} <= set(checks(report))
    names = list(load_model(tiny["fp8"]).graph.initializers)
    scale = next(n for n in names if n.endswith("_fp8_scale"))
    bad = verify_artifact(tiny["fused"], tampered(tiny["fp8"], tmp_path / "s.onnx", scale, scaled(1.05)))
    failed = {c.name: c.message for c in bad.failures}
    assert "weight scales" in failed and repr(scale) in failed["weight scales"]
    weight = next(n for n in names if n.endswith("_fp8"))

    def flip(array: np.ndarray) -> np.ndarray:
        array = array.copy()
        array.flat[0] = -array.flat[0] if array.flat[0] != 0 else array.flat[1]
        return array

    bad = verify_artifact(tiny["fused"], tampered(tiny["fp8"], tmp_path / "w.onnx", weight, flip))
    failed = {c.name: c.message for c in bad.failures}
    assert list(failed) == ["float8 weights"] and repr(weight) in failed["float8 weights"]
    assert "row 0, column 0" in failed["float8 weights"]


def test_tp_folder_passes_and_a_changed_rank_weight_fails(tiny, tmp_path):
    report = verify_artifact(tiny["fused"], tiny["tp2"], OPTIONS)
    assert report.ok, report.lines()
    error = checks(report)["ranks vs source"].numbers["max_abs_rel_error"]
    assert error <= 1e-5
    rank1 = load_model(tiny["tp2"] / "rank1" / "model.onnx").graph.initializers
    name = next(n for n, v in rank1.items() if len(v.shape) == 2 and "embed" not in n)
    bad = verify_artifact(
        tiny["fused"], tampered_folder(tiny["tp2"], tmp_path / "tp2", "rank1", name, scaled(1.1))
    )
    assert [c.name for c in bad.failures] == ["ranks vs source"]


def test_decode_graph_matches_its_prefill_and_the_source(tiny):
    report = verify_artifact(tiny["prefill"], tiny["decode"], OPTIONS)
    assert report.ok, report.lines()
    assert set(checks(report)) == {"cached decoding vs prefill", "prefill vs source"}
    against_fused = verify_artifact(tiny["fused"], tiny["decode"], OPTIONS)
    assert [c.name for c in against_fused.failures] == ["prefill vs source"]


def test_junit_and_json_forms(healed, tmp_path):
    name = sorted(healed_hashes(healed["healed"]))[0]
    bad = verify_artifact(
        healed["original"], tampered(healed["healed"], tmp_path / "t.onnx", name, scaled(1.01))
    )
    bad.write_junit(tmp_path / "verify.xml")
    root = ET.parse(tmp_path / "verify.xml").getroot()
    [suite] = root.findall("testsuite")
    cases = suite.findall("testcase")
    assert len(cases) == len(bad.checks) == int(suite.get("tests"))
    failed = [c for c in cases if c.find("failure") is not None]
    assert [c.get("name") for c in failed] == [c.name for c in bad.failures]
    assert repr(name) in failed[0].find("failure").get("message")
    as_json = json.loads(json.dumps(bad.to_json()))
    assert as_json["ok"] is False and as_json["kind"] == "healed"
    assert [c["name"] for c in as_json["checks"] if not c["ok"]] == ["healed weights"]


def test_healed_quality_runs_block_by_block_above_the_streaming_bound(healed, monkeypatch):
    """Above block_runner.STREAMING_BYTES of weights (here: any) both models of the quality check stream one
    block at a time, a few windows' logits at once (here: one), and measure what the whole models measure."""
    whole = checks(verify_artifact(healed["original"], healed["healed"], OPTIONS))["quality vs original"]
    streamed = []

    class Recorded(block_runner.BlockRunner):
        def __init__(self, path, *args, **kwargs) -> None:
            streamed.append((Path(path).name, kwargs.get("streaming")))
            super().__init__(path, *args, **kwargs)

    monkeypatch.setattr(healed_check, "BlockRunner", Recorded)
    monkeypatch.setattr(block_runner, "STREAMING_BYTES", 0)
    monkeypatch.setattr(healed_check, "STREAMED_LOGITS_BYTES", 1)
    report = verify_artifact(healed["original"], healed["healed"], OPTIONS)
    assert report.ok, report.lines()
    quality = checks(report)["quality vs original"]
    assert quality.message.endswith("; block by block)") and not whole.message.endswith("block by block)")
    assert streamed == [("m.onnx", True), ("m.healed.onnx", True)]
    assert quality.numbers["tokens"] == whole.numbers["tokens"]
    assert quality.numbers["top1"] == whole.numbers["top1"]
    assert abs(quality.numbers["kl"] - whole.numbers["kl"]) <= 1e-6 * whole.numbers["kl"]
