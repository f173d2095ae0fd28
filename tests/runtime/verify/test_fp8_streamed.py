"""Logits checks above block_runner.STREAMING_BYTES of weights (here forced to 0): the FP8 check runs both
graphs block by block, the FP8 graph cut between its source's stream names, and measures what the whole runs
measure; a tampered weight scale still fails, its logits too. Half-precision graphs stream block by block in
their float32 view, equal to the whole float32 view."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from exporters.synthetic import SyntheticSpec, build_synthetic
from passes.io.model_io import load_model, save_model
from passes.quant.calibrate import calibrate
from passes.run import block_runner
from runtime.deploy import quantize_file
from runtime.verify import VerifyOptions, verify_artifact
from runtime.verify import fp8 as fp8_check
from runtime.verify.common import logits
from tests.runtime.verify.artifacts import tampered

OPTIONS = VerifyOptions(max_error=0.15)


def logits_check(report):
    return next(c for c in report.checks if c.name == "logits vs source")


def recorded_runners(monkeypatch) -> list[tuple[str, bool, bool, bool]]:
    """(file name, streaming, another model's blocks, a view) of every BlockRunner the FP8 check makes."""
    made = []

    class Recorded(block_runner.BlockRunner):
        def __init__(self, path, *args, **kwargs) -> None:
            blocks, view = kwargs.get("blocks"), kwargs.get("view")
            made.append((Path(path).name, kwargs.get("streaming"), blocks is not None, view is not None))
            super().__init__(path, *args, **kwargs)

    monkeypatch.setattr(fp8_check, "BlockRunner", Recorded)
    return made


def times(factor: float):
    return lambda array: (array.astype(np.float32) * factor).astype(array.dtype)


def test_fp8_logits_block_by_block_equal_the_whole_runs(tiny, tmp_path, monkeypatch):
    scale = next(n for n in load_model(tiny["fp8"]).graph.initializers if n.endswith("_fp8_scale"))
    bad = tampered(tiny["fp8"], tmp_path / "s.onnx", scale, times(32))
    whole = [verify_artifact(tiny["fused"], path, OPTIONS) for path in (tiny["fp8"], bad)]
    runners = recorded_runners(monkeypatch)
    monkeypatch.setattr(block_runner, "STREAMING_BYTES", 0)
    streamed = [verify_artifact(tiny["fused"], path, OPTIONS) for path in (tiny["fp8"], bad)]
    fused, fp8 = tiny["fused"].name, tiny["fp8"].name
    want = [(fused, True, False, False), (fp8, True, True, False), (fused, True, False, False)]
    assert runners == [*want, ("s.onnx", True, True, False)]
    for one, other in zip(whole, streamed, strict=True):
        a, b = logits_check(one), logits_check(other)
        assert b.message.endswith("; block by block") and not a.message.endswith("block by block")
        assert abs(a.numbers["rel_error"] - b.numbers["rel_error"]) <= 1e-6 * a.numbers["rel_error"]
    assert streamed[0].ok, streamed[0].lines()
    # the scale no longer matches its weight, the float8 values are no longer Q(source, scale), logits move
    failed = {c.name: c.message for c in streamed[1].failures}
    assert set(failed) == {"weight scales", "float8 weights", "logits vs source"}
    assert repr(scale) in failed["weight scales"]


@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
def test_half_graph_logits_block_by_block_equal_the_whole_float32_view(dtype, tmp_path, monkeypatch):
    blocks = [(True, 48), (False, 64), (True, 40)]
    spec = SyntheticSpec(hidden=32, dtype=dtype, norm="cast_fp32", blocks=blocks)
    path = build_synthetic(spec, tmp_path / "m.onnx", external=True)
    tokens = np.random.default_rng(0).integers(0, spec.vocab, (2, 16))
    whole = logits(path, tokens)
    made = []
    original = block_runner.BlockRunner

    class Recorded(original):
        def __init__(self, *args, **kwargs) -> None:
            made.append(kwargs.get("view") is not None)
            super().__init__(*args, **kwargs)

    monkeypatch.setattr(block_runner, "BlockRunner", Recorded)
    monkeypatch.setattr(block_runner, "STREAMING_BYTES", 0)
    streamed = logits(path, tokens)
    assert made == [True] and streamed.dtype == whole.dtype == np.float32
    np.testing.assert_allclose(streamed, whole, rtol=0, atol=1e-6 * float(np.abs(whole).max()))


def test_fp8_graph_of_a_float16_model_streams_in_float32_views(tmp_path, monkeypatch):
    """Both graphs hold float16 weights (the FP8 graph its unquantized ones): each block runs in its float32
    view, as the whole runs do. (A bfloat16 model cannot be calibrated on ONNX Runtime's CPU provider.)"""
    blocks = [(True, 48), (False, 64), (True, 40)]
    spec = SyntheticSpec(hidden=32, dtype="float16", norm="cast_fp32", blocks=blocks)
    path = build_synthetic(spec, tmp_path / "m.onnx", external=True)
    ids = np.random.default_rng(1).integers(0, spec.vocab, (2, 16))
    fp8 = quantize_file(path, calibrate(path, [ids], progress=False), tmp_path, False, lambda m: None)
    options = VerifyOptions(max_error=0.1)
    whole = verify_artifact(path, fp8, options)
    runners = recorded_runners(monkeypatch)
    monkeypatch.setattr(block_runner, "STREAMING_BYTES", 0)
    streamed = verify_artifact(path, fp8, options)
    assert whole.ok and streamed.ok, streamed.lines()
    assert runners == [("m.onnx", True, False, True), (fp8.name, True, True, True)]
    a, b = logits_check(whole).numbers["rel_error"], logits_check(streamed).numbers["rel_error"]
    assert abs(a - b) <= 1e-6 * a


def test_fp8_graph_without_a_source_stream_name_runs_whole(tiny, tmp_path, monkeypatch):
    """A graph whose streams another tool renamed cannot be cut by its source's names: whole, with a note."""
    stream = block_runner.BlockRunner(tiny["fused"]).cuts[1].input_name
    model = load_model(tiny["fp8"])
    value = next(v for node in model.graph for v in node.outputs if v.name == stream)
    value.name = "renamed_stream"
    save_model(model, tmp_path / "renamed.onnx", external=True)
    runners = recorded_runners(monkeypatch)
    monkeypatch.setattr(block_runner, "STREAMING_BYTES", 0)
    report = verify_artifact(tiny["fused"], tmp_path / "renamed.onnx", OPTIONS)
    assert report.ok, report.lines()
    assert [r[0] for r in runners] == [tiny["fused"].name]  # the source's cuts only: no FP8 runner
    assert f"no stream {stream!r} of the source: the logits check runs whole" in " ".join(report.notes)
    assert not logits_check(report).message.endswith("block by block")
