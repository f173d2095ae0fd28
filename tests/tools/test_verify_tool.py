"""`fuse_onnx.py --verify ORIGINAL ARTIFACT` on every artifact kind (issue 39): exit 0 with each check
printed, exit 1 naming what was tampered with, --json and --junit for CI, exit 2 with one line on bad
input."""

from __future__ import annotations

import json
import xml.etree.ElementTree as ET

import pytest

from passes.io.model_io import load_model
from passes.metadata import HEAL_METADATA_KEY
from runtime.heal.metadata import TENSOR_HASHES_KEY
from tests.runtime.verify.artifacts import healed_artifacts, tampered, tiny_artifacts, with_metadata

pytestmark = pytest.mark.slow  # each --verify is a subprocess of a few seconds


@pytest.fixture(scope="module")
def healed(tmp_path_factory):
    return healed_artifacts(tmp_path_factory)


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    return tiny_artifacts(tmp_path_factory)


def first_healed_tensor(path) -> str:
    return sorted(json.loads(load_model(path).metadata_props[HEAL_METADATA_KEY])[TENSOR_HASHES_KEY])[0]


def test_healed_verifies_and_a_changed_weight_exits_1_naming_it(tool, healed, tmp_path):
    ok = tool("fuse_onnx", "--verify", healed["original"], healed["healed"], "--max-kl", "0.5")
    assert ok.returncode == 0, ok.stderr
    lines = ok.stdout.strip().splitlines()
    assert lines[-1] == "verified"
    for name in ("structure", "healed weights", "unchanged weights", "quality vs original"):
        assert any(line.startswith(f"ok  {name}: ") for line in lines), (name, lines)
    name = first_healed_tensor(healed["healed"])
    bad = tampered(healed["healed"], tmp_path / "bad.onnx", name, lambda a: (a * 1.01).astype(a.dtype))
    junit = tmp_path / "verify.xml"
    result = tool("fuse_onnx", "--verify", healed["original"], bad, "--max-kl", "0.5", "--junit", junit)
    assert result.returncode == 1, result.stderr
    assert result.stdout.strip().endswith("MISMATCH")
    assert any(
        line.startswith("FAIL  healed weights") and repr(name) in line for line in result.stdout.splitlines()
    )
    suite = ET.parse(junit).getroot().find("testsuite")
    assert suite.get("failures") == "1" and int(suite.get("tests")) == 4
    [failure] = [case for case in suite.iter("testcase") if case.find("failure") is not None]
    assert failure.get("name") == "healed weights" and repr(name) in failure.find("failure").get("message")


def test_json_of_fp8_and_tp_folder(tool, tiny):
    for artifact, kind, check in (
        (tiny["fp8"], "fp8", "float8 weights"),
        (tiny["tp2"], "tp", "ranks vs source"),
    ):
        result = tool("fuse_onnx", "--verify", tiny["fused"], artifact, "--json")
        assert result.returncode == 0, result.stderr
        report = json.loads(result.stdout)
        assert report["ok"] and report["kind"] == kind
        assert check in [c["name"] for c in report["checks"]] and all(c["ok"] for c in report["checks"])


def test_bad_input_is_one_line_and_writes_nothing(tool, healed, tmp_path):
    def old(record: dict) -> dict:
        return {k: v for k, v in record.items() if k != TENSOR_HASHES_KEY}

    stale = with_metadata(healed["healed"], tmp_path / "old.onnx", HEAL_METADATA_KEY, old)
    junit = tmp_path / "verify.xml"
    cases = {
        "old heal": ([healed["original"], stale, "--junit", junit], "heal it again"),
        "no stage": ([healed["original"], healed["original"], "--junit", junit], "records no stage"),
        "no folder": (
            [healed["original"], healed["healed"], "--junit", tmp_path / "no" / "v.xml"],
            "does not exist",
        ),
    }
    for name, (args, message) in cases.items():
        result = tool("fuse_onnx", "--verify", *args)
        assert result.returncode == 2, (name, result.stderr)
        lines = result.stderr.strip().splitlines()
        assert len(lines) == 1 and lines[0].startswith("error: ") and message in lines[0], (name, lines)
        assert not junit.exists(), name
    usage = tool("fuse_onnx", healed["original"], "--max-kl", "0.1")
    assert usage.returncode == 2 and "--max-kl, --text and --junit go with --verify" in usage.stderr
