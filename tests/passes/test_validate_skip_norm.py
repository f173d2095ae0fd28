"""Validation of fused groups in graphs whose residual stream runs through SkipSimplifiedLayerNormalization
(ONNX Runtime's transformers optimizer and GenAI exports): the sum that ends the last block is output 3 of
the final norm, which those exporters leave unnamed, and a block's FFN reads output 0 of the node whose
output 3 is the stream entering it."""

from __future__ import annotations

import pytest

import passes.fuse
import passes.validate
from passes.pipeline import fuse_file
from passes.plan import Plan


@pytest.mark.parametrize("whole_model", [True, False], ids=["whole-model", "per-group"])
@pytest.mark.parametrize("group", [(2, 3), (1, 2)], ids=["ends-at-last-block", "inner"])
@pytest.mark.parametrize("mode", ["last", "fold"])
def test_groups_of_a_skip_norm_graph_validate(
    skip_norm_model, tmp_path, monkeypatch, whole_model, group, mode
):
    if not whole_model:
        monkeypatch.setattr(passes.validate, "WHOLE_MODEL_LIMIT", 0)
    report = fuse_file(skip_norm_model, Plan((group,), mode), tmp_path / "fused.onnx").report
    assert report.mode == ("whole model" if whole_model else "per group")
    assert report.ok and len(report.groups) == 1 and report.groups[0].rel_error < 1e-6, report.lines()
    assert (report.logits_rel_error is not None) == whole_model


def test_a_wrong_last_group_is_caught_per_group(skip_norm_model, tmp_path, monkeypatch):
    """The per-group check on the last block still compares numbers: "fold" without its scaling fails."""
    monkeypatch.setattr(passes.validate, "WHOLE_MODEL_LIMIT", 0)
    float_part = passes.fuse._float_part
    monkeypatch.setattr(passes.fuse, "_float_part", lambda w, t, scale: float_part(w, t, None))
    with pytest.raises(passes.validate.ValidationError, match="MISMATCH"):
        fuse_file(skip_norm_model, Plan(((2, 3),), "fold"), tmp_path / "fused.onnx")
    assert not (tmp_path / "fused.onnx").exists()
