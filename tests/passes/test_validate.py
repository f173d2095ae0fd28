"""passes/validate.py's contribution_error: the one measure fuse validation and heal's written-model check
use (what a group adds to the stream, against what the reference adds)."""

from __future__ import annotations

import numpy as np
import pytest

from passes.validate import contribution_error


def test_contribution_error_measures_what_the_group_adds_not_the_stream():
    rng = np.random.default_rng(0)
    x = 100.0 * rng.standard_normal((2, 5, 8))  # a large stream ...
    added = rng.standard_normal((2, 5, 8))  # ... and a small contribution
    wrong = 0.01 * rng.standard_normal((2, 5, 8))
    error = contribution_error(x, x + added + wrong, x + added)
    assert error == pytest.approx(np.linalg.norm(wrong) / np.linalg.norm(added))
    assert error > 1e-3 and contribution_error(x, x + added, x + added) == 0.0
    assert contribution_error(x, x + wrong, x) > 1e20  # nothing to add: any difference is huge
