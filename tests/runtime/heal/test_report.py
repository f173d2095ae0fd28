"""run_heal (runtime/heal/report.py, tools/heal.py): each group's error drops and the whole model's
held-out KL drops, on the synthetic model and on the pruned SmolLM2."""

from __future__ import annotations

import pytest

from passes.pipeline import fuse_file
from passes.plan import Plan
from runtime.heal.metadata import HealConfig
from runtime.heal.report import run_heal
from tests.runtime.heal.synthetic import PLAN_GROUPS


def test_group_errors_drop(synthetic):
    *_, report = synthetic
    assert [g.group for g in report.result.groups] == list(PLAN_GROUPS)
    for g in report.result.groups:
        assert g.calib_after < 0.5 * g.calib_before, g.line()
        assert g.heldout_after < 0.7 * g.heldout_before, g.line()
    assert report.after[-1].kl < 0.5 * report.before[-1].kl


@pytest.mark.slow
def test_heal_smollm2_lowers_heldout_kl(smollm2_pruned_onnx, tmp_path):
    """The goal plan of issue 11 with a small healing (1024 calibration tokens, 4 Adam steps, closed-form
    down refit): group errors and the held-out KL drop (measured 1.19 -> 0.53; docs/heal.md)."""
    fused = fuse_file(
        smollm2_pruned_onnx,
        Plan(((13, 17), (18, 21)), "fold"),
        tmp_path / "fused.onnx",
        validate_output=False,
    ).output
    config = HealConfig(steps=4, batch_tokens=512, lr=1e-3)
    report = run_heal(
        smollm2_pruned_onnx,
        fused,
        tmp_path / "healed.onnx",
        config,
        tokens=1024,
        heldout_tokens=256,
        eval_tokens=256,
    )
    print("\n".join(report.lines()))
    for g in report.result.groups:
        assert g.calib_after < 0.5 * g.calib_before, g.line()
        assert g.heldout_after < 0.8 * g.heldout_before, g.line()
    before, after = report.before[-1], report.after[-1]
    assert after.kl < 0.8 * before.kl
    assert after.top1_agreement > before.top1_agreement
