"""heal (runtime/heal/distill.py): group inputs from the original model, measuring without writing, the
streaming block runner, and a group ending at the last block of a Skip*Normalization graph."""

from __future__ import annotations

import numpy as np
import pytest

from passes.pipeline import fuse_file
from passes.plan import Plan
from passes.run import block_runner as runner
from runtime.heal.costs import HealedCosts
from runtime.heal.distill import heal
from runtime.heal.metadata import HealConfig
from runtime.text_sets import windows
from tests.corpora.third_party import drop_attention


def test_original_inputs_mode_and_measure_only(synthetic):
    folder, original, fused, report = synthetic
    calib = windows(np.load(folder / "calib.npy"), 64)
    held = windows(np.load(folder / "held.npy"), 64)
    result = heal(original, fused, calib, held, None, HealConfig(steps=0, ridge=0.0, inputs="original"))
    assert result.output is None
    first = report.result.groups[0]  # the first group's input is the same in both modes
    assert result.groups[0].calib_before == pytest.approx(first.calib_before, rel=1e-5)
    assert result.groups[0].calib_after == pytest.approx(result.groups[0].calib_before, rel=1e-6)


def test_streaming_runner_heals_the_same(folded, monkeypatch):
    """Models above passes.run.block_runner.STREAMING_BYTES run block by block (issue 13): same streams,
    same fit."""
    folder, original, fused, _ = folded
    calib = windows(np.load(folder / "calib.npy"), 64)[:8]
    held = windows(np.load(folder / "held.npy"), 64)
    config = HealConfig(steps=0)
    plain = heal(original, fused, calib, held, None, config)
    monkeypatch.setattr(runner, "STREAMING_BYTES", 0)
    streamed = heal(original, fused, calib, held, None, config)
    for a, b in zip(plain.groups, streamed.groups, strict=True):
        assert b.heldout_after == pytest.approx(a.heldout_after, rel=1e-4)
        assert b.calib_before == pytest.approx(a.calib_before, rel=1e-5)


@pytest.mark.slow
def test_heal_a_group_ending_at_the_last_block_of_a_skip_norm_graph(third_party_corpus, tmp_path):
    """ONNX Runtime's optimizer fuses the last residual add into the final SkipSimplifiedLayerNormalization,
    whose sum (output 3) is unnamed: the last block's stream out comes from BlockRunner's cut (issue 9).
    The corpus entry with attention also dropped from 23-29, so that a group can end at block 29."""
    original = drop_attention(third_party_corpus["ort-optimizer"], tmp_path / "m.onnx", range(23, 30))
    fused = fuse_file(original, Plan(((27, 29),), "last"), tmp_path / "f.onnx", validate_output=False).output
    ids = np.random.default_rng(3).integers(0, 49152, size=(4, 16))
    # writing the healed model also checks it (check_written reads the last block's stream out)
    result = heal(original, fused, ids[:3], ids[3:], tmp_path / "healed.onnx", HealConfig())
    (group,) = result.groups
    assert group.group == (27, 29) and group.calib_after < group.calib_before, group.line()
    cost = HealedCosts(original, ids[:3], ids[3:], mode="last")(28, 29)
    assert cost.calib_after < cost.calib_before
