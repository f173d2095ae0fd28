"""The pair's checks (runtime/heal/pair.py): heal.py given a model without a plan, an original that was
not the one fused, or a model already healed says so in one line and writes nothing."""

from __future__ import annotations

from exporters.synthetic import SyntheticSpec, build_synthetic
from tests.runtime.heal.synthetic import BLOCKS, assert_one_line_error


def test_bad_input_is_one_line(folded, tool, tmp_path):
    folder, original, fused, report = folded
    other = build_synthetic(SyntheticSpec(hidden=32, blocks=BLOCKS, seed=6), tmp_path / "other.onnx")
    calib = folder / "calib.npy"
    cases = {
        "no plan": ([original, original, "--calib", calib], "no ffn_fusion.plan metadata"),
        "wrong original": ([other, fused, "--calib", calib], "does not match the fused model"),
        "already healed": ([original, report.result.output, "--calib", calib], "already healed"),
    }
    assert_one_line_error(tool, folder, tmp_path, cases)
