"""The analysis pipeline called as a library: the report it returns is analysis.json, the plan plan.json,
and its results go to `say`."""

from __future__ import annotations

import json
from dataclasses import replace

import numpy as np
import pytest

from exporters.synthetic import SyntheticSpec, build_synthetic
from passes.errors import UserError
from passes.plan import Plan
from runtime.analyze import AnalyzeOptions, analyze_and_plan, tp_counts
from runtime.latency.predict import LayerShape


def test_analyze_and_plan_writes_what_it_returns(tmp_path):
    blocks = [(True, 16), (False, 24), (False, 16), (False, 8), (True, 16)]
    model = build_synthetic(SyntheticSpec(blocks=blocks, seed=1), tmp_path / "m.onnx")
    ids = tmp_path / "ids.npy"
    np.save(ids, np.random.default_rng(0).integers(0, 64, 40))
    options = AnalyzeOptions(tokens=ids, num_tokens=40, window=10, threshold=2.0, norm="last")
    said: list[str] = []
    out = tmp_path / "analysis"
    report = analyze_and_plan(model, out, options, progress=False, say=said.append)
    assert json.loads((out / "analysis.json").read_text()) == report
    assert (
        json.loads((out / "plan.json").read_text()) == report["plan"] == {"groups": [[1, 2]], "norm": "last"}
    )
    assert report["tokens"] == 40 and report["norm_errors"] == {}  # a given norm mode is not measured
    assert said[0].startswith(f"calibration: token file {ids}") and said[0].endswith("(4 x 10)")
    assert said[-2] == f"wrote {out / 'analysis.json'}, {out / 'dependency.png'}, {out / 'plan.json'}"
    assert (out / "dependency.png").is_file()


def test_tp_counts_follow_the_latency_model():
    """All-reduces and sequential steps: 2 per full block, 1 per one-part block; an FFN group of n FFNs
    saves n - 1 all-reduces and steps, a parallel group of n blocks 2(n - 1) all-reduces and n - 1 steps."""
    shapes = [LayerShape(True, 8), LayerShape(False, 8), LayerShape(False, 8), LayerShape(False, 8)]
    shapes += [LayerShape(True, 8)] * 4
    assert tp_counts(shapes, Plan()) == (13, 8)
    assert tp_counts(shapes, Plan(((1, 3),))) == (11, 6)
    assert tp_counts(shapes, Plan(((1, 2),), parallel=((4, 7),))) == (6, 4)


def test_a_graph_with_static_dims_is_analyzed_as_its_dynamic_original(tmp_path):
    """A copy that fixes batch 1 and 10 tokens (as exporters that trace one example write it): the window is
    the graph's length without --window, the 4 windows run one at a time (BlockRunner chunks a fixed batch),
    and the dependency matrix, the plan and the norm errors are those of the dynamic original; a window the
    graph does not take is refused in one line."""
    from tests.runtime.heal.test_graphs import fix_dims  # noqa: PLC0415 (imports torch: only this test needs it)

    blocks = [(True, 16), (False, 24), (False, 16), (False, 8), (True, 16)]
    model = build_synthetic(SyntheticSpec(blocks=blocks, seed=1), tmp_path / "m.onnx")
    static = fix_dims(model, tmp_path / "static.onnx", batch=1, seq=10)
    ids = tmp_path / "ids.npy"
    np.save(ids, np.random.default_rng(0).integers(0, 64, 40))
    options = AnalyzeOptions(tokens=ids, num_tokens=40, threshold=2.0)
    dynamic = analyze_and_plan(model, tmp_path / "a", replace(options, window=10), progress=False, say=print)
    fixed = analyze_and_plan(static, tmp_path / "b", options, progress=False, say=print)
    assert fixed["plan"] == dynamic["plan"] and fixed["tokens"] == dynamic["tokens"] == 40
    np.testing.assert_allclose(
        np.array(fixed["dependency"], dtype=float), np.array(dynamic["dependency"], dtype=float), rtol=1e-5
    )
    for mode, errors in dynamic["norm_errors"].items():
        assert abs(fixed["norm_errors"][mode]["logits_rel_error"] - errors["logits_rel_error"]) < 1e-6
    with pytest.raises(UserError, match="takes exactly 10 tokens per sequence"):
        analyze_and_plan(static, tmp_path / "c", replace(options, window=16), progress=False, say=print)
