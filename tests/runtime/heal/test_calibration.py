"""Calibration windows (runtime/text_sets.py calibration_windows): heal.py given an empty calibration text
says so in one line and writes nothing."""

from __future__ import annotations

from tests.runtime.heal.synthetic import assert_one_line_error


def test_empty_calibration_text_is_one_line(folded, tool, tmp_path):
    folder, original, fused, _ = folded
    empty = tmp_path / "empty.txt"
    empty.write_text("\n")
    cases = {"empty text": ([original, fused, "--calib", empty], "is empty")}
    assert_one_line_error(tool, folder, tmp_path, cases)
