"""HealedCosts (runtime/heal/costs.py): a candidate group's healed error drives the proposal, in
propose() and in analyze.py --heal."""

from __future__ import annotations

import json

import numpy as np

from exporters.synthetic import SyntheticSpec, build_synthetic
from passes.analysis.propose import propose
from runtime.heal.costs import HealedCosts
from runtime.text_sets import windows

# An attention-free run 1-4 (fusable 1-3) for the healed-cost proposal.
RUN_BLOCKS = [(True, 48), (False, 64), (False, 40), (False, 56), (False, 32), (True, 48)]


def test_healed_costs_drive_the_proposal(folded, tmp_path, tool):
    folder = folded[0]
    model = build_synthetic(SyntheticSpec(hidden=32, blocks=RUN_BLOCKS, seed=7), tmp_path / "run.onnx")
    data = windows(np.load(folder / "calib.npy"), 64)
    costs = HealedCosts(model, data[:24], data[24:], "fold")
    whole = costs(1, 3)
    assert whole.calib_after < 0.5 * whole.calib_before and whole.heldout_after < whole.heldout_before
    attention = [a for a, _ in RUN_BLOCKS]
    widths = [w for _, w in RUN_BLOCKS]
    zeros = np.zeros((len(RUN_BLOCKS), len(RUN_BLOCKS)))

    def proposed(threshold: float) -> list[tuple[int, int]]:
        cost = lambda i, j: costs(i, j).heldout_after  # noqa: E731
        proposal = propose(attention, widths, zeros, threshold=threshold, healed_cost=cost)
        for g in proposal.groups:
            assert g.healed_error == costs(*g.group).heldout_after <= threshold, g.line()
        return [g.group for g in proposal.groups]

    assert proposed(whole.heldout_after * 1.01) == [(1, 3)]
    smaller = proposed(whole.heldout_after * 0.99)
    assert (1, 3) not in smaller and all(costs(*g).heldout_after <= whole.heldout_after for g in smaller)
    out = tmp_path / "analysis"
    result = tool(
        "analyze",
        model,
        "--out",
        out,
        "--tokens",
        folder / "calib.npy",
        "--window",
        64,
        "--heal",
        "--heal-threshold",
        10,
        "--quiet",
        check=True,
    )
    report = json.loads((out / "analysis.json").read_text())
    assert report["plan"]["groups"] == [[1, 3]], result.stdout
    assert {tuple(c["group"]) for c in report["healed_costs"]} >= {(1, 3)}
