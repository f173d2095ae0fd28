"""The analysis pipeline called as a library: the report it returns is analysis.json, the plan plan.json,
and its results go to `say`."""

from __future__ import annotations

import json

import numpy as np

from exporters.synthetic import SyntheticSpec, build_synthetic
from runtime.analyze import AnalyzeOptions, analyze_and_plan


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
