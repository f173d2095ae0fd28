"""The quality check of a parallel-block healed graph above block_runner.STREAMING_BYTES (here forced to 0)
streams group by group (the parallel group one cut, BlockRunner whole_groups) and measures what the whole
models measure; a tampered healed tensor still fails, and the streamed KL reads the tampered weight."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from passes.io.model_io import load_model
from passes.metadata import HEAL_METADATA_KEY
from passes.run import block_runner
from runtime.heal.metadata import TENSOR_HASHES_KEY
from runtime.verify import VerifyOptions, verify_artifact
from runtime.verify import healed as healed_check
from tests.runtime.verify.artifacts import parallel_artifacts, tampered

OPTIONS = VerifyOptions(eval_tokens=256)


@pytest.fixture(scope="module")
def found(tmp_path_factory) -> dict[str, Path]:
    return parallel_artifacts(tmp_path_factory.mktemp("healed_parallel"))


def _quality(report):
    return next(c for c in report.checks if c.name == "quality vs original")


def _streamed(monkeypatch, cuts: list) -> None:
    """Every model streams; the cuts of each BlockRunner made are recorded in `cuts`."""

    class Recorded(block_runner.BlockRunner):
        def __init__(self, path, *args, **kwargs) -> None:
            super().__init__(path, *args, **kwargs)
            cuts.append((Path(path).name, self.streaming, [c.group for c in self.cuts]))

    monkeypatch.setattr(healed_check, "BlockRunner", Recorded)
    monkeypatch.setattr(block_runner, "STREAMING_BYTES", 0)
    monkeypatch.setattr(healed_check, "STREAMED_LOGITS_BYTES", 1)  # one window's logits at a time


def _same(streamed, whole) -> None:
    assert streamed.numbers["tokens"] == whole.numbers["tokens"]
    assert streamed.numbers["top1"] == whole.numbers["top1"]
    assert abs(streamed.numbers["kl"] - whole.numbers["kl"]) <= 1e-6 * whole.numbers["kl"]


def test_parallel_healed_quality_streams_group_by_group(found, monkeypatch):
    whole = verify_artifact(found["original"], found["healed"], OPTIONS)
    assert whole.ok and not _quality(whole).message.endswith("block by block)")
    cuts: list = []
    _streamed(monkeypatch, cuts)
    report = verify_artifact(found["original"], found["healed"], OPTIONS)
    assert report.ok, report.lines()
    assert not any("whole" in note for note in report.notes), report.notes
    assert _quality(report).message.endswith("; block by block)")
    # the original's 7 blocks one by one; the healed graph's FFN group one block, its parallel group one cut
    assert cuts == [("m.onnx", True, [None] * 7), ("m.healed.onnx", True, [None, None, (2, 3), None, None])]
    _same(_quality(report), _quality(whole))


def test_tampered_healed_tensor_fails_when_streamed(found, tmp_path, monkeypatch):
    hashes = json.loads(load_model(found["healed"]).metadata_props[HEAL_METADATA_KEY])[TENSOR_HASHES_KEY]
    name = sorted(hashes)[0]  # a parallel member's FFN weight
    scaled = tampered(found["healed"], tmp_path / "t.onnx", name, lambda a: (a * 1.01).astype(a.dtype))
    whole = verify_artifact(found["original"], scaled, OPTIONS)
    clean = _quality(verify_artifact(found["original"], found["healed"], OPTIONS))
    _streamed(monkeypatch, [])
    bad = verify_artifact(found["original"], scaled, OPTIONS)
    assert [c.name for c in bad.failures] == ["healed weights"] and repr(name) in bad.failures[0].message
    quality = _quality(bad)
    assert quality.message.endswith("; block by block)")
    _same(quality, _quality(whole))
    assert not np.isclose(quality.numbers["kl"], clean.numbers["kl"], rtol=1e-3)  # it ran the changed weight
