"""The decode check block by block (issue 39, passes/run/decode_stream.py), with STREAMING_BYTES forced to 0:
it passes on the tiny decode graph, its fused graph and a Nemotron-NAS export with the numbers of the whole
run, and a tampered weight or a swapped cache wiring still fails."""

from __future__ import annotations

from pathlib import Path

import pytest

from passes.run import block_runner
from runtime.verify import VerifyOptions, verify_artifact
from runtime.verify.decode import verify_decode
from runtime.verify.records import VerifyReport
from tests import decode_fixtures
from tests.exporters.hf_fixtures import puzzle_models
from tests.passes.run.test_decode_stream import swapped_outputs
from tests.runtime.verify.artifacts import tampered

OPTIONS = VerifyOptions()
STREAMED = "decode graph run block by block"


def numbers(report) -> dict[str, float]:
    return {c.name: c.numbers["max_abs_rel_error"] for c in report.checks}


@pytest.fixture
def streamed(monkeypatch):
    monkeypatch.setattr(block_runner, "STREAMING_BYTES", 0)


def decode_check(source: Path, decode: Path) -> VerifyReport:
    """The decode check alone: a fused decode graph is verified as fused (against the decode graph it was
    fused from), so its decode check runs here against the prefill graph fused with the same plan."""
    report = VerifyReport("decode", source, decode)
    verify_decode(report, OPTIONS)
    return report


def _whole_and_streamed(source, decode, monkeypatch, check=verify_artifact):
    monkeypatch.undo()  # the default bound: these models run whole
    whole = check(source, decode) if check is decode_check else check(source, decode, OPTIONS)
    monkeypatch.setattr(block_runner, "STREAMING_BYTES", 0)
    report = check(source, decode) if check is decode_check else check(source, decode, OPTIONS)
    assert whole.ok and report.ok, report.lines()
    assert any(STREAMED in n for n in report.notes) and not any(STREAMED in n for n in whole.notes)
    assert report.notes[0] == whole.notes[0]  # the cache layers
    for name, error in numbers(report).items():
        assert error == pytest.approx(numbers(whole)[name], abs=1e-6)
    return report


def test_tiny_and_fused_decode_streamed_as_whole(tiny, tmp_path_factory, monkeypatch):
    _whole_and_streamed(tiny["prefill"], tiny["decode"], monkeypatch)
    fused = decode_fixtures.decode_models("decode_fused")
    report = _whole_and_streamed(tiny["fused"], fused, monkeypatch, decode_check)
    assert "layers [0, 4]" in report.notes[0]


def test_nemotron_nas_decode_streamed_as_whole(tmp_path_factory, monkeypatch):
    base = tmp_path_factory.getbasetemp()
    _whole_and_streamed(puzzle_models(base, "prefill"), puzzle_models(base, "decode"), monkeypatch)


def test_streamed_decode_fails_on_tampering(tiny, tmp_path, streamed):
    name = "model.layers.4.post_attention_layernorm.weight"
    changed = tampered(tiny["decode"], tmp_path / "w.onnx", name, lambda a: a * 1.01)
    report = verify_artifact(tiny["prefill"], changed, OPTIONS)
    assert [c.name for c in report.failures] == ["prefill vs source"]
    # the keys written where the values go: only cached decoding reads them
    swapped = swapped_outputs(tiny["decode"], tmp_path / "kv.onnx", "present_key_4", "present_value_4")
    report = verify_artifact(tiny["prefill"], swapped, OPTIONS)
    assert [c.name for c in report.failures] == ["cached decoding vs prefill"]
    assert report.failures[0].numbers["max_abs_rel_error"] > 1e-2
    # another layer's cache: named without running it
    crossed = swapped_outputs(tiny["decode"], tmp_path / "x.onnx", "present_key_0", "present_key_4")
    report = verify_artifact(tiny["prefill"], crossed, OPTIONS)
    assert [c.name for c in report.failures] == ["cached decoding vs prefill"]
    assert "'past_key_0' (read by block 0) continues as 'present_key_0', which block 4 writes" in (
        report.failures[0].message
    )
