"""The dependency heatmap: a PNG, also for a matrix with exact zeros (log scale)."""

from __future__ import annotations

import numpy as np

from passes.analysis.heatmap import plot_dependency


def test_plot_dependency(tmp_path):
    d = np.triu(np.random.default_rng(0).uniform(0.01, 0.9, (6, 6)), k=1)
    d[np.tril_indices(6)] = np.nan
    d[0, 1] = 0.0  # an exactly independent pair must not break the log scale
    out = plot_dependency(d, [True, False, False, False, True, False], [(1, 2)], tmp_path / "d.png", "t")
    assert out.stat().st_size > 10_000
    assert out.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
