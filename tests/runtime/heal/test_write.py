"""Writing the healed model (runtime/heal/write.py): it differs from the fused one only in the groups'
weights, FP8 still works on it, and a written file that differs from the fit is not committed."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import onnx
import pytest
from onnx import numpy_helper

import runtime.heal.distill
from passes.error_measures import l2_relative_error
from passes.io.model_io import load_model, save_model
from passes.metadata import HEAL_METADATA_KEY
from passes.quant.calibrate import calibrate
from passes.quant.fp8 import quantize_fp8
from runtime.heal.distill import heal
from runtime.heal.metadata import HealConfig
from runtime.text_sets import windows
from tests.run_graph import graph_logits
from tests.runtime.heal.synthetic import PLAN_GROUPS, SMALL


def _initializers(path: Path) -> dict[str, np.ndarray]:
    return {t.name: numpy_helper.to_array(t) for t in onnx.load(str(path)).graph.initializer}


def test_only_group_weights_change(synthetic):
    folder, _, fused, report = synthetic
    healed = report.result.output
    assert healed.with_name(healed.name + ".data").is_file()  # external data
    before, after = _initializers(fused), _initializers(healed)
    assert before.keys() == after.keys()
    changed = {name for name in before if not np.array_equal(before[name], after[name])}
    fused_weights = {n for n in before if n.startswith("ffn_fusion.") and n.endswith("_proj.weight")}
    assert fused_weights == {
        f"ffn_fusion.{i}_{j}.{k}_proj.weight" for i, j in PLAN_GROUPS for k in ("gate", "up", "down")
    }
    assert fused_weights <= changed
    assert all(n in fused_weights or after[n].ndim == 1 for n in changed), changed  # else: norm weights
    a, b = onnx.load(str(fused), load_external_data=False), onnx.load(str(healed), load_external_data=False)
    assert [n.op_type for n in a.graph.node] == [n.op_type for n in b.graph.node]
    props = {p.key: p.value for p in b.metadata_props}
    assert json.loads(props["ffn_fusion.plan"])["groups"] == [list(g) for g in PLAN_GROUPS]
    recorded = json.loads(props[HEAL_METADATA_KEY])
    assert recorded["config"]["steps"] == SMALL.steps and len(recorded["groups"]) == 2
    assert not list(folder.glob(".m.healed*"))  # the staging folder is gone


def test_fp8_after_healing(folded, tmp_path):
    folder, *_, report = folded
    healed = report.result.output
    ids = windows(np.load(folder / "held.npy"), 64)[:2]
    scales = calibrate(healed, [ids[:1], ids[1:]], progress=False)
    model = load_model(healed)
    quantize_fp8(model, scales)
    save_model(model, tmp_path / "fp8.onnx", external=True)

    fp32, fp8 = graph_logits(healed, ids), graph_logits(tmp_path / "fp8.onnx", ids)
    assert 0 < l2_relative_error(fp8, fp32) < 0.1


def test_a_written_model_that_differs_from_the_fit_is_not_committed(folded, monkeypatch, tmp_path):
    """check_written reads the saved file back: weights written off by 1% fail it, and nothing is left."""
    folder, original, fused, _ = folded
    write = runtime.heal.distill.write_healed

    def write_off_by_one_percent(pair, saved, result, staged):
        off = {}
        for group, (paths,) in saved.items():
            off[group] = [dict(paths)]
            off[group][0]["down"] = tmp_path / f"down_{group[0]}_{group[1]}.npy"
            np.save(off[group][0]["down"], 1.01 * np.load(paths["down"]))
        write(pair, off, result, staged)

    monkeypatch.setattr(runtime.heal.distill, "write_healed", write_off_by_one_percent)
    calib = windows(np.load(folder / "calib.npy"), 64)
    with pytest.raises(AssertionError, match=r"healed group \[1, 2\]: written model differs from the fit"):
        heal(original, fused, calib[:4], calib[4:6], tmp_path / "h.onnx", HealConfig(steps=1, ridge=0.0))
    assert not list(tmp_path.glob("*.onnx*")) and not list(tmp_path.glob(".h*"))
